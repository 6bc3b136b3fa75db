"""ring-flash-attn's Python API (zhuzilin/ring-flash-attention, the ``ring_flash_attn`` package),
run by hipflash.distributed:

    import hipflash.compat.ring_flash_attn as ring_flash_attn
    out = ring_flash_attn.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group)

The same function names, argument names, defaults, shard layouts and return conventions:
``ring_flash_attn_*`` take contiguous shards (rank r holds chunk r of the sequence, or of each
sequence in the varlen functions), ``zigzag_ring_flash_attn_*`` zigzag ones (chunks r and
2 world - 1 - r of 2 world), both by ring passes of K / V. hipflash.distributed's own functions
share the first name but take a ``layout`` argument (default "zigzag") and ``group`` fourth:
code written for ring-flash-attn imports this module, so that contiguous shards are never read
as zigzag ones. With ``return_attn_probs=True``: ``(out, softmax_lse, None)``, the LSE
[batch, nheads, seqlen_local] dense and, as ring-flash-attn's varlen functions return it, padded
[batch, nheads, max_seqlen] varlen (-inf past each sequence's length: hipflash's padded layout).
Windows apply by global position, as hipflash.distributed's (ring-flash-attn passes them to each
block's call as they are); any negative bound is unbounded, as FlashAttention reads it. Refused
with NotImplementedError: dropout_p > 0 and alibi_slopes (ring-flash-attn asserts them away too).
The stripe layout and llama3_flash_attn_varlen_func are not provided.
"""

from .. import _chunks, distributed as _distributed
from ._common import refuse, refuse_dropout, split_kv, split_qkv, window

__all__ = ["ring_flash_attn_func", "ring_flash_attn_kvpacked_func",
           "ring_flash_attn_qkvpacked_func", "ring_flash_attn_varlen_func",
           "ring_flash_attn_varlen_kvpacked_func", "ring_flash_attn_varlen_qkvpacked_func",
           "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func", "zigzag_ring_flash_attn_varlen_func",
           "zigzag_ring_flash_attn_varlen_kvpacked_func",
           "zigzag_ring_flash_attn_varlen_qkvpacked_func"]


def _dense(layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
           deterministic, return_attn_probs, group):
    refuse_dropout(dropout_p)
    refuse("alibi_slopes", alibi_slopes, None)
    res = _distributed.ring_flash_attn_func(
        q, k, v, group=group, softmax_scale=softmax_scale, causal=causal,
        window_size=window(window_size), return_lse=bool(return_attn_probs), layout=layout,
        deterministic=deterministic)
    return (res[0], res[1], None) if return_attn_probs else res


def _varlen(layout, q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
            window_size, alibi_slopes, deterministic, return_attn_probs, group):
    refuse_dropout(dropout_p)
    refuse("alibi_slopes", alibi_slopes, None)
    res = _distributed.ring_flash_attn_varlen_func(
        q, k, v, cu_seqlens, max_seqlen, group=group, softmax_scale=softmax_scale, causal=causal,
        window_size=window(window_size), return_lse=bool(return_attn_probs), layout=layout,
        deterministic=deterministic)
    if not return_attn_probs:
        return res
    out, lse = res
    bounds = cu_seqlens.tolist()
    longest = max([b - a for a, b in zip(bounds, bounds[1:])] + [int(max_seqlen)])
    return out, _chunks.padded_lse(lse, bounds, longest), None


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                         return_attn_probs=False, group=None):
    """q (batch, seqlen_local, nheads, headdim), k, v (batch, seqlen_local, nheads_k, headdim):
    this rank's contiguous shard."""
    return _dense("contiguous", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None):
    """kv (batch, seqlen_local, 2, nheads_k, headdim)."""
    k, v = split_kv(kv, 2)
    return _dense("contiguous", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                   window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                   return_attn_probs=False, group=None):
    """qkv (batch, seqlen_local, 3, nheads, headdim)."""
    q, k, v = split_qkv(qkv, 2)
    return _dense("contiguous", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None):
    """q (total_local, nheads, headdim), k, v (total_local, nheads_k, headdim): each sequence's
    contiguous shard; cu_seqlens the local prefix sums (the global ones // world size)."""
    return _varlen("contiguous", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                   causal, window_size, alibi_slopes, deterministic, return_attn_probs, group)


def ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                         softmax_scale=None, causal=False, window_size=(-1, -1),
                                         alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None):
    """kv (total_local, 2, nheads_k, headdim)."""
    k, v = split_kv(kv, 1)
    return _varlen("contiguous", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                   causal, window_size, alibi_slopes, deterministic, return_attn_probs, group)


def ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                          softmax_scale=None, causal=False, window_size=(-1, -1),
                                          alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None):
    """qkv (total_local, 3, nheads, headdim)."""
    q, k, v = split_qkv(qkv, 1)
    return _varlen("contiguous", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                   causal, window_size, alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None):
    """ring_flash_attn_func on zigzag shards (hipflash.distributed.shard(..., "zigzag"))."""
    return _dense("zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False,
                                         group=None):
    k, v = split_kv(kv, 2)
    return _dense("zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), alibi_slopes=None,
                                          deterministic=False, return_attn_probs=False,
                                          group=None):
    q, k, v = split_qkv(qkv, 2)
    return _dense("zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0,
                                       softmax_scale=None, causal=False, window_size=(-1, -1),
                                       alibi_slopes=None, deterministic=False,
                                       return_attn_probs=False, group=None):
    """ring_flash_attn_varlen_func on each sequence's zigzag shard (shard_varlen)."""
    return _varlen("zigzag", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                   window_size, alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                                softmax_scale=None, causal=False,
                                                window_size=(-1, -1), alibi_slopes=None,
                                                deterministic=False, return_attn_probs=False,
                                                group=None):
    k, v = split_kv(kv, 1)
    return _varlen("zigzag", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                   window_size, alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                                 softmax_scale=None, causal=False,
                                                 window_size=(-1, -1), alibi_slopes=None,
                                                 deterministic=False, return_attn_probs=False,
                                                 group=None):
    q, k, v = split_qkv(qkv, 1)
    return _varlen("zigzag", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                   window_size, alibi_slopes, deterministic, return_attn_probs, group)
