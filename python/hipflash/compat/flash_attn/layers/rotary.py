"""flash_attn.layers.rotary.apply_rotary_emb with flash-attn 2.8.3's arguments and results, on
PyTorch ops in float32 (the rotation flash_attn_with_kvcache applies on append: hipflash's
_rotary.rotate), differentiable."""
import numbers

import torch

from .... import _rotary

__all__ = ["apply_rotary_emb"]


def _offsets(seqlen_offsets, batch, device):
    """seqlen_offsets (an int, or a [batch] integer tensor) as a [batch] int64 tensor."""
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.is_floating_point():
            raise ValueError(f"seqlen_offsets must be an int or an integer tensor of shape "
                             f"({batch},), got {seqlen_offsets.dtype} "
                             f"{tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != device:
            raise ValueError(f"seqlen_offsets must be on x's device ({device})")
        offsets = seqlen_offsets.long()
    elif isinstance(seqlen_offsets, numbers.Integral) and not isinstance(seqlen_offsets, bool):
        offsets = torch.full((batch,), int(seqlen_offsets), dtype=torch.long, device=device)
    else:
        raise TypeError(f"seqlen_offsets must be an int or a tensor, got "
                        f"{type(seqlen_offsets).__name__}")
    if batch and int(offsets.min()) < 0:
        raise ValueError("seqlen_offsets must be >= 0")
    return offsets


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """x rotated: its first rotary_dim = 2 * cos.shape[1] dims of row i of sequence b at position
    seqlen_offsets[b] + i (cos, sin: [seqlen_ro, rotary_dim / 2]); the other dims as they are.

    Arguments:
        x: [batch, seqlen, nheads, headdim], or [total, nheads, headdim] with cu_seqlens
            ([batch + 1] int32 prefix sums; max_seqlen is accepted and not needed).
        interleaved: rotate pairs (0, 1), (2, 3), ... (GPT-J) instead of the two halves
            (GPT-NeoX).
        inplace: write the result into x and return x.
        seqlen_offsets: an int, or a [batch] integer tensor (each sequence's first position: the
            cached length when decoding).

    A position past cos's rows is not rotated, as flash-attn's kernel reads cos 1, sin 0 there.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != (3 if cu_seqlens is not None else 4):
        want = "[total, nheads, headdim] with cu_seqlens" if cu_seqlens is not None else \
            "[batch, seqlen, nheads, headdim]"
        raise ValueError(f"x must be {want}, got {getattr(x, 'shape', type(x).__name__)}")
    _rotary.check_tables(x, None, cos, sin, need_k=False)
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        offsets = _offsets(seqlen_offsets, batch, x.device)
        pos = offsets[:, None] + torch.arange(seqlen, device=x.device)[None, :]
        out = _rotary.rotate(x, cos, sin, pos, interleaved)
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
                cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be a 1-d integer tensor of batch + 1 prefix sums")
        cu = cu_seqlens.to(x.device, torch.long)
        lengths = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != x.shape[0] or (lengths < 0).any():
            raise ValueError(f"cu_seqlens must rise from 0 to x's {x.shape[0]} rows")
        batch = lengths.numel()
        offsets = _offsets(seqlen_offsets, batch, x.device)
        seq = torch.repeat_interleave(torch.arange(batch, device=x.device), lengths)
        pos = offsets[seq] + torch.arange(x.shape[0], device=x.device) - cu[:-1][seq]
        out = _rotary.rotate(x[None], cos, sin, pos[None], interleaved)[0]
    return x.copy_(out) if inplace else out
