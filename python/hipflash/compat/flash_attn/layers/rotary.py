"""flash_attn.layers.rotary.apply_rotary_emb with flash-attn 2.8.3's arguments and results, on
PyTorch ops in float32 (the rotation flash_attn_with_kvcache applies on append: hipflash's
_rotary.rotate), differentiable."""
import numbers

import torch

from .... import _rotary

__all__ = ["apply_rotary_emb"]


def _offsets(seqlen_offsets, batch, rows, seqlen_ro, device):
    """seqlen_offsets (an int, or a [batch] integer tensor) as a [batch] int64 tensor; an int
    must keep the rows (the longest sequence's, when known) inside the table, as flash-attn
    asserts. A tensor is not read on the host (no synchronisation): its positions past the
    table, or below 0, are not rotated."""
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.is_floating_point() or \
                seqlen_offsets.dtype == torch.bool:
            raise ValueError(f"seqlen_offsets must be an int or an integer tensor of shape "
                             f"({batch},), got {seqlen_offsets.dtype} "
                             f"{tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != device:
            raise ValueError(f"seqlen_offsets must be on x's device ({device})")
        return seqlen_offsets.long()
    if not isinstance(seqlen_offsets, numbers.Integral) or isinstance(seqlen_offsets, bool):
        raise TypeError(f"seqlen_offsets must be an int or a tensor, got "
                        f"{type(seqlen_offsets).__name__}")
    offset = int(seqlen_offsets)
    if offset < 0 or (rows is not None and offset + rows > seqlen_ro):
        raise ValueError(f"seqlen_offsets = {offset} with {rows} rows needs positions up to "
                         f"{offset + (rows or 0)}, past rotary_cos's {seqlen_ro} rows (or below 0)")
    return torch.full((batch,), offset, dtype=torch.long, device=device)


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

    An int offset must keep every row inside cos's rows (with cu_seqlens, max_seqlen rows when
    given), as flash-attn asserts; per-sequence tensor offsets are not read on the host, and a
    position they put past the table is not rotated, as flash-attn's kernel reads cos 1, sin 0
    there. cu_seqlens is checked when it is on the host (a GPU one is not read: no
    synchronisation, CUDA graphs work).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != (3 if cu_seqlens is not None else 4):
        want = "[total, nheads, headdim] with cu_seqlens" if cu_seqlens is not None else \
            "[batch, seqlen, nheads, headdim]"
        raise ValueError(f"x must be {want}, got {getattr(x, 'shape', type(x).__name__)}")
    _rotary.check_tables(x, None, cos, sin, need_k=False)
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        offsets = _offsets(seqlen_offsets, batch, seqlen, cos.shape[0], x.device)
        pos = offsets[:, None] + torch.arange(seqlen, device=x.device)[None, :]
        out = _rotary.rotate(x, cos, sin, pos, interleaved)
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
                cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be a 1-d integer tensor of batch + 1 prefix sums")
        cu = cu_seqlens.to(x.device, torch.long)
        if cu_seqlens.device.type == "cpu":  # checked where that costs no synchronisation
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != x.shape[0] or \
                    bool((lengths < 0).any()):
                raise ValueError(f"cu_seqlens must rise from 0 to x's {x.shape[0]} rows")
        batch = cu.numel() - 1
        offsets = _offsets(seqlen_offsets, batch, max_seqlen, cos.shape[0], x.device)
        # Each packed row's sequence, and its position in it, without reading cu on the host.
        rows = torch.arange(x.shape[0], device=x.device)
        seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=max(batch - 1, 0))
        pos = offsets[seq] + rows - cu[seq] if batch else rows
        out = _rotary.rotate(x[None], cos, sin, pos[None], interleaved)[0]
    return x.copy_(out) if inplace else out
