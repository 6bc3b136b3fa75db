"""What the FlashAttention 2 and 3 compatibility modules share: the refusals of what hipflash
cannot honour yet, the head dims it runs by padding, and the packed-input splits."""
import numbers

import torch


def refuse(name, value, default, why=""):
    """NotImplementedError for an argument hipflash does not implement, unless it has the value
    that means "off" (default)."""
    off = value is None if default is None else (
        not isinstance(value, torch.Tensor) and value == default)
    if not off:
        raise NotImplementedError(
            f"hipflash.compat: {name}={_short(value)} is not supported by hipflash yet"
            + (f" ({why})" if why else "") + f"; pass {name}={default!r}")


# The head dims hipflash runs (include/hipflash/detail/kernels.def: each padded dim and the one
# it also serves); FlashAttention 3 takes any multiple of 8 up to 256.
HEAD_DIMS = (32, 64, 96, 128, 256)


def refuse_headdim(q, where="in this call"):
    """NotImplementedError for a head dim FlashAttention takes and hipflash does not run `where`
    (a KV cache is written and read in place: padding it would copy it every call): a missing
    feature, not a bad argument (hipflash's own API raises ValueError for it)."""
    if isinstance(q, torch.Tensor) and q.dim() >= 1:
        d = q.shape[-1]
        if d not in HEAD_DIMS and 0 < d <= 256:
            raise NotImplementedError(
                f"hipflash.compat: head dim {d} is not supported by hipflash {where} yet (it "
                f"runs {', '.join(map(str, HEAD_DIMS))})")


def window(window_size):
    """FlashAttention's window: any negative bound is "unbounded" (hipflash's -1, which refuses
    other negatives); anything not a pair of integers as it is (hipflash's checks speak)."""
    def integer(w):
        if isinstance(w, torch.Tensor):
            return w.numel() == 1 and not w.is_floating_point() and not w.is_complex() and \
                w.dtype != torch.bool
        return isinstance(w, numbers.Integral) and not isinstance(w, bool)

    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or \
            len(window_size) != 2 or not all(integer(w) for w in window_size):
        return window_size
    return tuple(max(int(w), -1) for w in window_size)


def contiguous_last(*tensors):
    """The tensors with a contiguous last dimension, copied where they have none (as
    FlashAttention's maybe_contiguous)."""
    return [t.contiguous() if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.stride(-1) != 1
            else t for t in tensors]


def pad_head_dim(q, k, v, softmax_scale):
    """FlashAttention runs every head dim up to 256 (FlashAttention 2 pads the others to a
    multiple of 8 itself); hipflash's kernels run HEAD_DIMS. q, k and v of another head dim
    d <= 256 run zero-padded to the next one: q.k, the softmax and the LSE are unchanged, the
    output's extra columns are zero and cut off (a view, as FlashAttention 2 returns its padded
    calls' out), gradients flow back through the padding, and the default softmax scale stays
    d^-0.5. fp8 inputs are not padded (refused by name). Returns (q, k, v, softmax_scale, cut):
    cut(out) keeps the output's first d columns."""
    d = q.shape[-1]
    to = next((h for h in HEAD_DIMS if h >= d), None)
    if d in HEAD_DIMS or to is None or d == 0 or k.shape[-1] != d or v.shape[-1] != d or \
            q.dtype not in (torch.float16, torch.bfloat16, getattr(torch, "float8_e4m3fn", None)):
        return q, k, v, softmax_scale, lambda out: out  # hipflash's own checks speak
    if q.dtype not in (torch.float16, torch.bfloat16):
        refuse_headdim(q, f"for {q.dtype} inputs")
    pad = [0, to - d]
    q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    return q, k, v, scale, lambda out: out[..., :d]


def refuse_headdim_v(q, v):
    """FlashAttention 3 takes a value head dim other than the query's (headdim_v, MLA's 192 /
    128 and its 64 / 256, 512): hipflash does not yet."""
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() >= 1 and \
            v.dim() >= 1 and v.shape[-1] != q.shape[-1]:
        raise NotImplementedError(
            f"hipflash.compat: v's head dim {v.shape[-1]} differs from q's {q.shape[-1]} "
            "(headdim_v): hipflash needs them equal for now")


def _short(value):
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    return repr(value)


def softcap_value(softcap):
    """FlashAttention's softcap as hipflash takes it: None and 0.0 are off; a tensor is refused
    (never compared)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, torch.Tensor):
        refuse("softcap", softcap, 0.0, "a float is expected")
    return softcap


def refuse_dropout(dropout_p):
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"hipflash.compat: dropout_p={dropout_p!r}: hipflash has no attention dropout "
            "(FlashAttention's dropout_p must be 0.0, as in evaluation)")


def split_qkv(qkv, dim):
    """q, k, v of a packed (..., 3, nheads, headdim) tensor (views: gradients flow back)."""
    if qkv.dim() < 3 or qkv.shape[dim] != 3:
        raise ValueError(f"qkv must have size 3 in dimension {dim}, got shape {tuple(qkv.shape)}")
    return qkv.unbind(dim)


def split_kv(kv, dim):
    if kv.dim() < 3 or kv.shape[dim] != 2:
        raise ValueError(f"kv must have size 2 in dimension {dim}, got shape {tuple(kv.shape)}")
    return kv.unbind(dim)
