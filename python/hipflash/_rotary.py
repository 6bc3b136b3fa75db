"""Rotary embedding on append (FlashAttention's rotary_cos / rotary_sin of flash_attn_with_kvcache):
q and the new k rotated by PyTorch ops before the KV-cache call, in float32, rounded to q's dtype.
"""
import torch


def _positions(base, rows, per_row, device):
    """[B, rows] int64 positions: base[b] + i (per_row) or base[b]."""
    offsets = torch.arange(rows, device=device) if per_row else torch.zeros(rows, device=device,
                                                                              dtype=torch.long)
    return base[:, None] + offsets[None, :]


def rotate(x, cos, sin, pos, interleaved):
    """x [B, S, H, D] with its first 2 * cos.shape[1] dims rotated at positions pos [B, S]
    (>= 0); a position past the table's rows is not rotated (cos 1, sin 0: FlashAttention's
    rotary kernel masks those loads to these values), nor is a negative one."""
    half = cos.shape[1]
    inside = ((pos >= 0) & (pos < cos.shape[0]))[:, :, None, None]
    at = pos.clamp(min=0, max=max(cos.shape[0] - 1, 0))
    c = cos.float()[at][:, :, None, :]  # [B, S, 1, half]
    s = sin.float()[at][:, :, None, :]
    c = torch.where(inside, c, torch.ones_like(c))
    s = torch.where(inside, s, torch.zeros_like(s))
    xr = x[..., :2 * half].float()
    if interleaved:  # pairs (0, 1), (2, 3), ...
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:  # halves
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def check_tables(q, k, cos, sin, need_k=True):
    """rotary_cos / rotary_sin for rotating q and the new keys k (any rank, head dim last):
    ValueError / TypeError, before anything is written (both kvcache paths; need_k: the new
    keys must be given, as flash_attn_with_kvcache's dense path requires)."""
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None and need_k:
        raise ValueError("rotary_cos / rotary_sin rotate the new keys: k and v must be given "
                         "(as FlashAttention requires)")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a (seqlen_ro, rotary_dim / 2) tensor")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have one shape, got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim == 0 or rotary_dim > q.shape[-1]:
        raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be in "
                         f"[2, head_dim = {q.shape[-1]}]")


def on_append(q, k, k_cache, block_table, cache_seqlens, rotary_seqlens, cos, sin, interleaved,
              q_per_row):
    """(q, k) rotated for flash_attn_with_kvcache; validated first (ValueError), nothing written."""
    check_tables(q, k, cos, sin)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError("q and k must have rank 4 ([batch, seqlen, heads, head_dim]) with rotary")
    batch = q.shape[0]
    if rotary_seqlens is not None:
        base = rotary_seqlens
        name = "rotary_seqlens"
    elif cache_seqlens is not None:
        base = cache_seqlens
        name = "cache_seqlens"
    else:  # a full cache: its capacity
        cap = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
        base = torch.full((batch,), cap, dtype=torch.int32, device=q.device)
        name = "the cache's capacity"
    if not isinstance(base, torch.Tensor) or base.shape != (batch,) or base.dtype != torch.int32:
        raise ValueError(f"{name} must be an int32 tensor of shape ({batch},) with rotary")
    if base.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device})")
    base = base.long()  # FlashAttention's: the absolute cache row, whatever cache_leftpad is
    s_new = k.shape[1] if k is not None else 0
    rows = max(q.shape[1], s_new)
    if batch and rows:
        lo = int(base.min())
        if lo < 0:
            raise ValueError(f"rotary positions must be >= 0, got {name} down to {lo}")
    q = rotate(q, cos, sin, _positions(base, q.shape[1], q_per_row, q.device), interleaved)
    if k is not None:
        k = rotate(k, cos, sin, _positions(base, s_new, True, q.device), interleaved)
    return q, k
