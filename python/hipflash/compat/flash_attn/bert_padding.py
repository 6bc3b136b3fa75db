"""flash_attn.bert_padding: moving a padded batch [batch, seqlen, ...] to the packed rows of the
varlen functions [total, ...] and back, with flash-attn 2.8.3's names, arguments and returns.
Plain PyTorch indexing (differentiable as it is; hipflash's kernels are not involved):

    x_packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out_padded = pad_input(out, indices, batch, seqlen)       # zeros at the padding
"""
import torch

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def index_first_axis(input, indices):
    """The rows `indices` (1-d, int64) of input's first axis: input[indices]."""
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    """A zero tensor of first_axis_dim rows (values' other dims and dtype) holding values[i] at
    row indices[i]."""
    out = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    out[indices.long()] = values  # any integer indices, on values' device or the host
    return out


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The rows of hidden_states [batch, seqlen, ...] that attention_mask [batch, seqlen] (bool
    or 0/1) keeps, packed sequence after sequence.

    unused_mask [batch, seqlen] marks rows that are packed too (allocated, e.g. for tokens to
    come) but not used: a sequence's length counts them, its used length does not (the varlen
    functions' seqused_q / seqused_k).

    Returns (packed [total, ...], indices [total] int64 into the flattened batch, cu_seqlens
    [batch + 1] int32, max_seqlen (int), seqused [batch] int32: the rows attention_mask keeps).
    """
    keep = attention_mask.bool()
    if unused_mask is not None:
        keep = keep | unused_mask.bool()
    lengths = keep.sum(-1, dtype=torch.int32)
    used = attention_mask.bool().sum(-1, dtype=torch.int32)
    indices = keep.flatten().nonzero().flatten()
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    rows = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
    return index_first_axis(rows, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: packed rows [total, ...] back to [batch, seqlen, ...], zeros
    where no row was packed."""
    rows = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return rows.reshape((batch, seqlen) + tuple(hidden_states.shape[1:]))
