"""The registered operators (torch.ops.hipflash.*) and their fake kernels for torch.compile.

The operators are defined and implemented in C++ (python/src/binding.cpp, TORCH_LIBRARY); the
fake kernels here tell torch.compile / FakeTensor what they return without running them: the
shapes, dtypes and devices the C++ kernels allocate, with symbolic sizes under dynamic=True.
Registered with torch.library.register_fake where this torch has it (2.4 and later); older
torch (Debian's 1.13) has no torch.compile to serve and traces the operators with
torch.jit.trace as they are.
"""

import re

import torch

from . import _C  # noqa: F401  (loading the extension registers torch.ops.hipflash)

# PyTorch's schema matcher answers an argument of the wrong type with its whole value ("Value:
# [0, 1, 2, ...]": tens of thousands of characters for a long list) and the declaration. A call
# of torch.ops.hipflash.<op> gets a TypeError of one line instead, naming the argument; every
# other error passes through unchanged (hipflash's own errors are short already).
_WRONG_TYPE = re.compile(r"(\w+::\w+)\(\) Expected a value of type '([^']*)' for argument "
                         r"'(\w+)' but instead found type '([^']*)'")
_SCHEMA_MISMATCH = ("Expected a value of type", "missing value for argument",
                    "failed to match any schema", "expected at most", "Unknown keyword argument")
_MAX_MESSAGE = 240


def _short_schema_error(message):
    """The one-line TypeError message of a schema mismatch, or None for any other error."""
    if not any(s in message for s in _SCHEMA_MISMATCH):
        return None
    m = _WRONG_TYPE.search(message)
    if m:
        op, want, arg, got = m.groups()
        return f"{op}: argument '{arg}' must be {want}, got {got}"
    first = next((line for line in message.splitlines() if "hipflash::" in line),
                 message.splitlines()[0] if message else message)
    return first.split(" Declaration:")[0][:_MAX_MESSAGE]


def _with_short_schema_errors(packet):
    """Gives one torch.ops.hipflash.<op> packet the short schema errors above (its class
    becomes a subclass of PyTorch's that only wraps __call__; the overloads, e.g. .default,
    which hipflash's own functions call, are PyTorch's objects as they are)."""
    base = type(packet)

    class _Packet(base):
        def __call__(self, *args, **kwargs):
            try:
                return base.__call__(self, *args, **kwargs)
            except RuntimeError as e:
                short = _short_schema_error(str(e))
                if short is None:
                    raise
                raise TypeError(short) from None

    _Packet.__name__ = _Packet.__qualname__ = base.__name__
    packet.__class__ = _Packet

fwd = torch.ops.hipflash.fwd.default
fwd_out = torch.ops.hipflash.fwd_out.default
varlen_fwd = torch.ops.hipflash.varlen_fwd.default
varlen_fwd_out = torch.ops.hipflash.varlen_fwd_out.default
varlen_fwd_paged = torch.ops.hipflash.varlen_fwd_paged.default

merge_attn_states = torch.ops.hipflash.merge_attn_states.default
fwd_kvcache = torch.ops.hipflash.fwd_kvcache.default
bwd = torch.ops.hipflash.bwd.default
varlen_bwd = torch.ops.hipflash.varlen_bwd.default

OPS = (fwd, fwd_out, varlen_fwd, varlen_fwd_out, varlen_fwd_paged, merge_attn_states, fwd_kvcache,
       bwd, varlen_bwd)

for _op in OPS:
    _with_short_schema_errors(_op.overloadpacket)


def _lse_like(q, shape):
    return q.new_empty(shape, dtype=torch.float32)


def _out_dtype(q):
    """The dtype of the out a call allocates: q's, bfloat16 for fp8 (float8_e4m3fn) inputs."""
    return torch.bfloat16 if q.dtype == getattr(torch, "float8_e4m3fn", None) else q.dtype


def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, num_splits, return_lse,
              softcap=0.0, alibi_slopes=None, q_descale=None, k_descale=None, v_descale=None):
    out = q.new_empty(q.shape, dtype=_out_dtype(q))
    lse = _lse_like(q, (q.shape[0], q.shape[2], q.shape[1]) if return_lse and q.dim() == 4 else (0,))
    return out, lse


def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_left, window_right, num_splits, return_lse,
                     lse_layout, softcap=0.0, alibi_slopes=None, seqused_q=None,
                     seqused_k=None, q_descale=None, k_descale=None, v_descale=None):
    out = q.new_empty(q.shape, dtype=_out_dtype(q))
    shape = (0,)
    if return_lse and q.dim() == 3:
        if lse_layout == "packed":
            shape = (q.shape[1], q.shape[0])
        elif lse_layout == "padded" and cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] >= 1 \
                and 0 <= max_seqlen_q <= q.shape[0]:  # as the real kernel: otherwise it
            # allocates nothing (the launcher refuses the call)
            shape = (cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q)
    return out, _lse_like(q, shape)


def _varlen_paged_fake(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, *args):
    max_seqlen_q, _, _, _, _, _, _, return_lse, lse_layout = args[:9]
    return _varlen_fwd_fake(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, 0,
                            None, False, -1, -1, 0, return_lse, lse_layout)


def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                  window_left, window_right, num_splits, return_lse, softcap=0.0,
                  alibi_slopes=None, k_scale=None, v_scale=None, cache_batch_idx=None,
                  cache_leftpad=None):
    # The caches are mutated in place (declared in the schema); the outputs are new.
    return _fwd_fake(q, None, None, softmax_scale, causal, window_left, window_right, num_splits,
                     return_lse)


def _out_fake(*args):
    return None


def _merge_fake(outs, lses):
    out = outs.new_empty(outs.shape[1:] if outs.dim() == 4 else (0,))
    return out, lses.new_empty(lses.shape[1:] if lses.dim() >= 2 else (0,), dtype=torch.float32)


_register_fake = getattr(torch.library, "register_fake", None)
HAS_FAKE_KERNELS = _register_fake is not None  # meta tensors run through them too
if _register_fake is not None:
    _register_fake("hipflash::fwd")(_fwd_fake)
    _register_fake("hipflash::fwd_out")(_out_fake)
    _register_fake("hipflash::varlen_fwd")(_varlen_fwd_fake)
    _register_fake("hipflash::varlen_fwd_out")(_out_fake)
    _register_fake("hipflash::varlen_fwd_paged")(_varlen_paged_fake)
    _register_fake("hipflash::merge_attn_states")(_merge_fake)
    _register_fake("hipflash::fwd_kvcache")(_kvcache_fake)
    _register_fake("hipflash::varlen_bwd")(
        lambda dout, q, k, v, *args: (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)))
    _register_fake("hipflash::bwd")(
        lambda dout, q, k, v, *args: (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)))
