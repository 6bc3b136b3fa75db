"""hipflash: flash-attention forward kernels (CPU, NVIDIA, AMD) that can also return the LSE.

    import hipflash
    out = hipflash.flash_attn_func(q, k, v, causal=True)
    out, lse = hipflash.flash_attn_func(q, k, v, return_lse=True)
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                               max_seqlen_q, max_seqlen_k, return_lse=True)

Gradients: the attention functions are differentiable on the CPU and on the GPU (the backward
recomputes P from the saved LSE: torch.ops.hipflash.bwd / varlen_bwd); with out=, inputs that
require grad under grad mode raise RuntimeError (never a silently detached result): use
torch.no_grad() or detached tensors. Inputs are bf16 or f16 CPU
tensors (the CPU backend) or CUDA/HIP tensors (the GPU kernels, when this build has them; see
:func:`build_info`). Argument errors raise ValueError / TypeError before anything is written;
a combination this build does not implement raises NotImplementedError; Ctrl-C interrupts a
long CPU call (KeyboardInterrupt).

The functions are thin wrappers over the registered operators torch.ops.hipflash.fwd,
fwd_out, varlen_fwd and varlen_fwd_out, so torch.compile (fullgraph, dynamic shapes),
torch.jit.trace and CUDA graph capture see real operators.
"""

import numbers

import torch

from . import _C
from . import _chunks
from . import _ops
from . import _rotary
from . import _varlen_kv

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "merge_attn_states",
    "gpu_available",
    "build_info",
    "last_kernel_name",
    "resolve_num_splits",
    "__version__",
]

__version__ = getattr(_C, "__version__", "0.0.0")

_LSE_LAYOUTS = ("padded", "packed")
_MAX_SPLITS = 256  # hipflash::kMaxSplits


def gpu_available():
    """True when this build has GPU kernels and a GPU is visible."""
    return _C.gpu_available()


def build_info():
    """What this build can run, e.g. ``"cpu (built with HIPFLASH_GPU=none)"``."""
    return _C.build_info()


def last_kernel_name():
    """Name of the kernel the last call on this thread ran (``"cpu_reference"``,
    ``"fwd_generic_bf16_hd128_causal_lse_sm90"``, ...)."""
    return _C.last_kernel_name()


# ---- Python-side argument checks (the rest is validated in C++) ------------------------------


# Where the operators run: cpu and cuda (ROCm torch's HIP devices too), and meta tensors'
# shapes through the fake kernels (hipflash/_ops.py: torch 2.4 and later).
_DEVICE_TYPES = ("cpu", "cuda") + (("meta",) if _ops.HAS_FAKE_KERNELS else ())


def _check_tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    # Sparse, quantized, MPS, XLA ... (and meta tensors where torch has no fake kernels to run:
    # before 2.4): a one-line refusal by name (SPEC §4), not the dispatcher's list of every
    # backend the operators lack.
    if x.device.type not in _DEVICE_TYPES or x.layout != torch.strided or x.is_quantized:
        raise NotImplementedError(
            f"{name} is a {x.layout}{' quantized' if x.is_quantized else ''} tensor on "
            f"'{x.device}'; hipflash runs on dense (strided) tensors on "
            f"{', '.join(_DEVICE_TYPES)} devices")


def _check_same_device(q, named, first="q"):
    """Every tensor on q's device: checked here, before any data pointer is taken."""
    for name, t in named:
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but {first} is on {q.device}; "
                "all tensors must be on the same device"
            )


def _window_int(v, window_size):
    """One bound of a window as a Python int: an int, or a one-element integer tensor (FA3's own
    tests pass ``torch.randint(0, seqlen_k, (2,))`` as the pair)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point() \
            and not v.is_complex() and v.dtype != torch.bool:
        return int(v.item())
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    return int(v)


def _window(window_size):
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") \
            or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (_window_int(v, window_size) for v in window_size)
    for v in (left, right):
        if v < -1:
            raise ValueError("window_size must be (left, right) with -1 (unbounded) or values "
                             f">= 0, got ({int(left)}, {int(right)})")
    return _window_arg(int(left)), _window_arg(int(right))


def _scale(softmax_scale):
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    return float(softmax_scale)


def _softcap(softcap):
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    return float(softcap)


def _int(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1
_INTERRUPTED = "hipflash: the call was interrupted"


def _window_arg(v):
    """A window bound for the int64 schema: anything past int64 saturates (a bound at or beyond
    the sequence length is the same as -1, SPEC §3)."""
    return min(v, _INT64_MAX)


def _bounded(value, name, lo, hi):
    """An int option checked here, so that the operator never sees a value its int64 schema
    cannot hold (a short ValueError instead of an overflow error)."""
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def _call(op, *args):
    """Runs a hipflash operator; a CPU call interrupted by Ctrl-C raises KeyboardInterrupt.
    (Under torch.compile the op is traced as is: there is nothing to interrupt.)"""
    if _is_compiling():
        return op(*args)
    try:
        return op(*args)
    except RuntimeError as e:
        if str(e).startswith(_INTERRUPTED):
            _C.take_pending_signal_error()  # what the signal handler raised, if it raised
            raise KeyboardInterrupt(str(e)) from None
        raise


_NO_DOUBLE_BACKWARD = (
    "hipflash: the attention backward is not differentiable (no double backward): the "
    "gradients of a backward run with create_graph=True cannot be differentiated again"
)


class _SecondOrderRefused(torch.autograd.Function):
    """Identity on the gradients of a backward run under create_graph=True: they carry a graph
    (as any differentiable result does), and differentiating through them raises the error
    above instead of silently treating the attention as a constant. PyTorch's
    once_differentiable does the same only when the incoming gradient itself requires grad."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(_NO_DOUBLE_BACKWARD)


def _first_order(*grads):
    """The gradients as returned to autograd: as they are, or behind _SecondOrderRefused when
    the backward runs under create_graph=True (grad mode on)."""
    if not torch.is_grad_enabled():
        return grads
    return _SecondOrderRefused.apply(*(g.detach().requires_grad_() for g in grads))


class _FlashAttnFunc(torch.autograd.Function):
    """flash_attn_func with gradients: the forward saves (q, k, v, out, lse), the backward
    recomputes P from that LSE (torch.ops.hipflash.bwd). The LSE output is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, left, right, num_splits, deterministic, softcap,
                alibi_slopes):
        out, lse = _ops.fwd(q, k, v, scale, causal, left, right, num_splits, True, softcap,
                            alibi_slopes)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, left, right, deterministic, softcap, alibi_slopes)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad():
            dq, dk, dv = _ops.bwd(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return _first_order(dq, dk, dv) + (None,) * 8


class _FlashAttnVarlenFunc(torch.autograd.Function):
    """flash_attn_varlen_func with gradients: as _FlashAttnFunc, per sequence."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right, num_splits,
                lse_layout, deterministic, softcap, alibi_slopes, seqused_q, seqused_k):
        out, lse = _ops.varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left,
                                   right, num_splits, True, lse_layout, softcap, alibi_slopes,
                                   seqused_q, seqused_k)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, causal, left, right, deterministic, lse_layout, softcap,
                    alibi_slopes, seqused_q, seqused_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        with torch.no_grad():
            dq, dk, dv = _ops.varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k,
                                         *ctx.args)
        return _first_order(dq, dk, dv) + (None,) * 15


def _check_sinks(sinks, q):
    """Attention sinks (``sinks``): a floating-point tensor [nheads], a logit per query head."""
    _check_tensor(sinks, "sinks")
    heads = q.shape[-2] if q.dim() >= 2 else -1
    if not sinks.is_floating_point() or sinks.dim() != 1 or sinks.shape[0] != heads:
        raise ValueError(f"sinks must be a floating-point tensor [nheads] = [{heads}] (a logit "
                         f"per query head), got {sinks.dtype} {list(sinks.shape)}")


def _refuse_with_sinks(*features):
    """NotImplementedError naming the first (name, given) option that sinks do not run with."""
    for name, given in features:
        if given:
            raise NotImplementedError(f"sinks with {name} are not supported by hipflash yet")


def _sink_output(out, rows, sinks):
    """The sink-free call's out [..., H, D] and LSE in out's row order [..., H] -> (out, LSE)
    with a sink logit per head: f = sigmoid(lse - sink), out f, logaddexp(lse, sink); and f.
    A row without keys keeps out 0 whatever its sink (f = 0: sigmoid(-inf - -inf) is NaN)."""
    f = torch.sigmoid(rows - sinks.float()).masked_fill(rows == float("-inf"), 0.0)
    return (out.float() * f[..., None]).to(out.dtype), torch.logaddexp(rows, sinks.float()), f


class _DenseCall:
    """_SinkAttention's dense attention: the forward and backward operators with one call's
    options; LSE [B, H, S] (rows: its view in out's order [B, S, H])."""

    def __init__(self, *args):
        self.scale, self.causal, self.left, self.right, self.num_splits, self.deterministic, \
            self.softcap, self.alibi = args

    def forward(self, q, k, v):
        return _ops.fwd(q, k, v, self.scale, self.causal, self.left, self.right, self.num_splits,
                        True, self.softcap, self.alibi)

    def backward(self, dout, q, k, v, out, lse):
        return _ops.bwd(dout, q, k, v, out, lse, self.scale, self.causal, self.left, self.right,
                        self.deterministic, self.softcap, self.alibi)

    @staticmethod
    def rows(lse):
        return lse.transpose(1, 2)


class _VarlenCall:
    """_SinkAttention's varlen attention (packed LSE [H, T]; rows: [T, H])."""

    def __init__(self, cu_q, cu_k, max_q, max_k, scale, causal, left, right, num_splits,
                 deterministic, softcap, alibi, seqused_q, seqused_k):
        self.cu = (cu_q, cu_k)
        self.head = (max_q, max_k, scale, causal, left, right)  # both calls' arguments, in order
        self.tail = ("packed", softcap, alibi, seqused_q, seqused_k)
        self.num_splits, self.deterministic = num_splits, deterministic

    def forward(self, q, k, v):
        return _ops.varlen_fwd(q, k, v, *self.cu, *self.head, self.num_splits, True, *self.tail)

    def backward(self, dout, q, k, v, out, lse):
        return _ops.varlen_bwd(dout, q, k, v, out, lse, *self.cu, *self.head,
                               self.deterministic, *self.tail)

    @staticmethod
    def rows(lse):
        return lse.t()


class _SinkAttention(torch.autograd.Function):
    """Attention with sinks (gpt-oss's): each row's softmax runs over its keys and a sink logit
    of its head, which attends to nothing. From the sink-free call's (out, lse), f = sigmoid(lse
    - sink): out f and LSE logaddexp(lse, sink). Gradients without a kernel of their own: the
    sink-free backward with dout f and out f in out's place — its row term rowsum(dout f . out
    f) is f^2 rowsum(dout . out), the one the sink's softmax has — and d sink = -sum over rows
    of (1 - f) rowsum(dout . out f). `call`: _DenseCall or _VarlenCall."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call):
        out, lse = call.forward(q, k, v)
        out_s, lse_rows, f = _sink_output(out, call.rows(lse), sinks)
        ctx.save_for_backward(q, k, v, out_s, lse, f)
        ctx.call, ctx.sinks_dtype = call, sinks.dtype
        lse_s = call.rows(lse_rows).contiguous()  # rows is its own inverse: a transpose
        ctx.mark_non_differentiable(lse_s)
        return out_s, lse_s

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out_s, lse, f = ctx.saved_tensors
        with torch.no_grad():
            d = dout.float()
            dq, dk, dv = ctx.call.backward((d * f[..., None]).to(dout.dtype).contiguous(), q, k,
                                           v, out_s, lse)
            dsinks = -((1 - f) * (d * out_s.float()).sum(-1)).reshape(-1, f.shape[-1]).sum(0)
        return _first_order(dq, dk, dv, dsinks.to(ctx.sinks_dtype)) + (None,)


_E4M3 = getattr(torch, "float8_e4m3fn", None)  # None on PyTorch < 2.1


def _fp8(q, descales):
    """An fp8 call: float8_e4m3fn q, or descales given (refused by the launcher for others)."""
    return q.dtype == _E4M3 or any(d is not None for d in descales)


def _check_chunk_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k):
    """What the varlen call checks of its bounds and the chunk pieces, each a call of its own
    with bounds of its own, would not: int32 prefix sums, and maxima no sequence exceeds and
    the tensors' rows can hold (the varlen launcher's rules, before anything is allocated)."""
    for name, cu, most, t in (("q", cu_seqlens_q, max_seqlen_q, q),
                              ("k", cu_seqlens_k, max_seqlen_k, k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
            raise ValueError(f"cu_seqlens_{name} must be a 1-D tensor of dtype int32, got "
                             f"{getattr(cu, 'dtype', type(cu).__name__)}")
        if t.dim() >= 1 and most > t.shape[0]:
            raise ValueError(f"max_seqlen_{name} = {most} exceeds the rows of {name} "
                             f"(total_{name} = {t.shape[0]}): no sequence can be that long")
        longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        if longest > most:
            raise ValueError(f"max_seqlen_{name} = {most} is too small: a sequence has length "
                             f"{longest}")


def _chunk(attention_chunk):
    """attention_chunk as an int >= 0 (0: off)."""
    return _bounded(_int(attention_chunk, "attention_chunk"), "attention_chunk", 0, _INT64_MAX)


def _per_sequence(alibi_slopes, descales):
    """The arguments an attention_chunk call's pieces take per sequence (_chunks.per_piece)."""
    return dict(alibi_slopes=alibi_slopes, q_descale=descales[0], k_descale=descales[1],
                v_descale=descales[2])


def _chunk_kw(scale, causal, left, right, num_splits, deterministic, softcap):
    """The arguments every piece of an attention_chunk call takes (see _chunks)."""
    return dict(softmax_scale=scale, causal=causal, window_size=(left, right),
                num_splits=num_splits, deterministic=deterministic, softcap=softcap)


def _forward_only(op, *args):
    """An fp8 call (forward only, FlashAttention 3's): inputs that require grad are read as
    they are, out carries no gradient (a backward through it raises PyTorch's error)."""
    with torch.no_grad():
        return _call(op, *args)


def _wants_grad(*tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---- Public API ------------------------------------------------------------------------------


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                    num_splits=0, return_lse=False, out=None, deterministic=False, softcap=0.0,
                    alibi_slopes=None, q_descale=None, k_descale=None, v_descale=None,
                    attention_chunk=0, sinks=None):
    """Dense attention forward: ``softmax(q @ k^T * softmax_scale) @ v`` per (batch, head).

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim), bfloat16 or float16. The last dimension
            must be contiguous (stride 1); other strides are free (views, packed QKV). On the
            GPU the kernels move 16-byte vectors, so data pointers must be 16-byte aligned and
            the other strides multiples of 8 elements (true of any view that starts on a head
            boundary); anything else raises ValueError: pass ``.contiguous()``.
        k: (batch_size, seqlen_k, nheads_k, headdim), same dtype and device as q.
        v: (batch_size, seqlen_k, nheads_k, headdim). nheads_k must divide nheads (MHA, GQA,
            MQA): query head h reads k/v head h // (nheads // nheads_k).
        softmax_scale: float. The scaling of q @ k^T before the softmax; default
            1 / sqrt(headdim).
        causal: bool. Causal mask aligned to the bottom-right corner of the attention matrix
            (FlashAttention >= 2.1): query i sees key j iff j <= i + seqlen_k - seqlen_q.
            With seqlen_q > seqlen_k the first rows see no key: their output is 0 and their
            LSE -inf.
        window_size: (left, right). Sliding-window (local) attention: query i sees keys in
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]; -1 means
            unbounded on that side. causal is window (left, 0).
        num_splits: int. Split the key range into this many chunks reduced by a combine pass
            (split-K, for small batch * heads). 0 picks a count by heuristic (bitwise the
            same result as passing that count, see :func:`resolve_num_splits`); 1 disables it.
        return_lse: bool. Also return the log-sum-exp of each row's scaled scores.
        out: optional (batch_size, seqlen_q, nheads, headdim) tensor of q's dtype and device to
            write the output into; must not overlap q, k or v. Returned as is.
        deterministic: bool. Bitwise-repeatable gradients. The GPU backward's dk / dv always
            are; dq then comes from a separate pass summing in a fixed order instead of fp32
            atomics from the dk / dv pass (False, the default as in FlashAttention: faster,
            run-to-run differences in the last bits of dq). The CPU backward always is.
        softcap: float >= 0. Logit soft-capping (Gemma 2, FlashAttention 2's softcap): each
            scaled score s = softmax_scale * q_i . k_j becomes softcap * tanh(s / softcap)
            before the softmax; the LSE is that of the capped scores. 0 (the default) is off.
            The forward runs on the CPU and NVIDIA GPUs, the gradients on the CPU and the GPU
            (there by the portable backward kernels: correct, not yet fast).
        alibi_slopes: optional (nheads,) or (batch_size, nheads) float32 tensor on q's device.
            ALiBi (BLOOM, MPT; FlashAttention 2's alibi_slopes): the bias
            ``-alibi_slopes[b, h] * |i + seqlen_k - seqlen_q - j|`` is added to each (capped)
            score; the LSE includes it. No gradient flows to the slopes. The forward runs on the
            CPU and NVIDIA GPUs, the gradients on the CPU and the GPU (as the softcap's).
        q_descale, k_descale, v_descale: fp8 (FlashAttention 3's): with torch.float8_e4m3fn
            q, k and v, optional float32 descale factors, each () / (1,) (the tensor's) or
            (batch_size, nheads_k) (a query head takes its kv head's): the scores are
            q_i . k_j * q_descale * k_descale * softmax_scale (the LSE is theirs) and out is
            softmax . v * v_descale, in bfloat16. None: 1. Descales must be positive and finite
            (not checked on the GPU). Forward only; the CPU backend (it dequantises: the
            reference), NVIDIA Hopper (head dims up to 128, no ALiBi) and AMD
            gfx94x / gfx950 (dense calls; compile-checked only); other GPU calls raise
            NotImplementedError.
        attention_chunk: int >= 0 (FlashAttention 3's; Llama 4's chunked attention). C > 0:
            query i, at key position p = i + seqlen_k - seqlen_q, sees only keys in
            [p - p mod C, p - p mod C + C), besides what causal / window_size allow. 0 (the
            default) is off. Runs as varlen attention over the chunks (packed views, no
            copies; the varlen kernels' speed), gradients included (fp8: forward only).
        sinks: optional floating-point (nheads,) tensor on q's device: attention sinks
            (gpt-oss's), a logit per query head in every row's softmax (in the scaled scores'
            units) that attends to nothing. out is then f * the sink-free out with
            f = sigmoid(lse - sink), and the LSE logaddexp(lse, sink) (a row without keys: out 0,
            LSE the sink). Gradients flow to q, k, v and sinks (the sink-free backward with
            dout * f and out * f, no kernel of its own). Not with out=, fp8 inputs or
            attention_chunk (NotImplementedError).

    Gradients: when q, k or v require grad (under grad mode) the result is differentiable
    with respect to them, on the CPU and on the GPU (the backward recomputes P from the saved
    LSE; the LSE output itself has no gradient); flash_attn_varlen_func likewise. With out=,
    inputs that require grad raise RuntimeError: no backward there. The backward is not itself
    differentiable: gradients taken with create_graph=True carry a graph whose backward raises
    RuntimeError naming hipflash (never silently constant).

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim), q's dtype (bfloat16 for fp8 inputs).
        lse (only when return_lse): (batch_size, nheads, seqlen_q), float32, natural log with
            the scale folded in: ``lse[b, h, i] = log(sum_j exp(softmax_scale * q_i . k_j))``
            over the keys row i may see; -inf for a row that sees no key.

    Raises:
        ValueError: bad shapes, ranks, strides, head dim, window, num_splits, devices, or out
            overlapping an input. TypeError: a non-tensor argument or a dtype other than
            bfloat16/float16/float8_e4m3fn (or dtypes that differ). NotImplementedError: tensors on a device
            this build has no backend for. Nothing is written when an error is raised.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(t, name)
    if out is not None:
        _check_tensor(out, "out")
    extras = [(n, t) for n, t in (("alibi_slopes", alibi_slopes), ("q_descale", q_descale),
                                  ("k_descale", k_descale), ("v_descale", v_descale),
                                  ("sinks", sinks))
              if t is not None]
    for name, t in extras:
        _check_tensor(t, name)
    _check_same_device(q, [("k", k), ("v", v)] + ([("out", out)] if out is not None else [])
                       + extras)
    left, right = _window(window_size)
    scale = _scale(softmax_scale)
    num_splits = _bounded(_int(num_splits, "num_splits"), "num_splits", 0, _MAX_SPLITS)
    causal, return_lse = bool(causal), bool(return_lse)
    softcap = _softcap(softcap)
    descales = (q_descale, k_descale, v_descale)
    fp8 = _fp8(q, descales)
    chunk = _chunk(attention_chunk)
    if sinks is not None:
        _check_sinks(sinks, q)
        _refuse_with_sinks(("out=", out is not None), ("fp8 inputs", fp8),
                           ("attention_chunk", chunk))
        out, lse = _call(_SinkAttention.apply, q, k, v, sinks,
                         _DenseCall(scale, causal, left, right, num_splits, bool(deterministic),
                                    softcap, alibi_slopes))
        return (out, lse) if return_lse else out
    if chunk:
        out, lse = _chunks.dense(flash_attn_varlen_func, q, k, v, chunk, out,
                                 _per_sequence(alibi_slopes, descales),
                                 _chunk_kw(scale, causal, left, right, num_splits,
                                           bool(deterministic), softcap))
        return (out, lse) if return_lse else out

    if fp8:  # forward only (FlashAttention 3's): no autograd path.
        if out is None:
            out, lse = _forward_only(_ops.fwd, q, k, v, scale, causal, left, right, num_splits,
                                     return_lse, softcap, alibi_slopes, *descales)
            return (out, lse) if return_lse else out
        lse = (torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32,
                           device=q.device) if return_lse and q.dim() == 4 else None)
        _forward_only(_ops.fwd_out, q, k, v, out, lse, scale, causal, left, right, num_splits,
                      return_lse, softcap, alibi_slopes, *descales)
        return (out, lse) if return_lse else out
    if out is None and _wants_grad(q, k, v):
        out, lse = _call(_FlashAttnFunc.apply, q, k, v, scale, causal, left, right, num_splits,
                         bool(deterministic), softcap, alibi_slopes)
        return (out, lse) if return_lse else out
    if out is None:
        out, lse = _call(_ops.fwd, q, k, v, scale, causal, left, right, num_splits, return_lse,
                         softcap, alibi_slopes)
        return (out, lse) if return_lse else out
    lse = None
    if return_lse and q.dim() == 4:
        # A q of the wrong rank gets no buffer: the C++ rank check reports it.
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32,
                          device=q.device)
    _call(_ops.fwd_out, q, k, v, out, lse, scale, causal, left, right, num_splits, return_lse,
          softcap, alibi_slopes)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1), num_splits=0,
                           return_lse=False, lse_layout="padded", out=None, deterministic=False,
                           block_table=None, softcap=0.0, alibi_slopes=None, seqused_q=None,
                           seqused_k=None, attention_chunk=0, q_descale=None, k_descale=None,
                           v_descale=None, k_scale=None, v_scale=None, sinks=None):
    """Variable-length (packed) attention forward: a batch of sequences of different lengths.

    Sequence b holds query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and v; masks (causal, window) apply within each
    sequence with its own lengths, bottom-right aligned. Sequences may be empty.

    Arguments:
        q: (total_q, nheads, headdim), bfloat16 or float16, last dimension contiguous.
        k: (total_k, nheads_k, headdim), same dtype and device as q.
        v: (total_k, nheads_k, headdim).
        cu_seqlens_q: (batch_size + 1,), int32, on q's device: non-decreasing prefix sums of the
            query lengths.
        cu_seqlens_k: (batch_size + 1,), int32, on q's device: likewise for the keys.
        max_seqlen_q: int >= every query length and <= total_q (sizes the padded LSE and the
            launch; no sequence can be longer than q, so a larger value raises ValueError).
        max_seqlen_k: int >= every key length and <= total_k.
        softmax_scale, causal, window_size, num_splits, return_lse, out, softcap,
            alibi_slopes: as for :func:`flash_attn_func` (ALiBi with each sequence's lengths).
        seqused_q, seqused_k: optional (batch_size,) int32 tensors on q's device (FlashAttention
            3's): sequence b uses only its first seqused_q[b] query rows and seqused_k[b] keys
            (each at most its cu_seqlens length; masks bottom-right aligned on the used
            lengths). Its other rows get out = 0 and LSE -inf, and zero gradients. CPU and
            NVIDIA GPU tensors, forward and backward; not with a block_table.
        lse_layout: "padded" (default) for a (batch_size, nheads, max_seqlen_q) LSE whose rows
            past a sequence's length are -inf, or "packed" for (nheads, total_q), the layout of
            FlashAttention-2/3 and PyTorch.
        deterministic: bool. As for :func:`flash_attn_func` (the gradients).
        block_table: optional (batch_size, max_blocks_per_seq) int32. Chunked prefill, as in
            FlashAttention-2: k and v are then paged KV caches (num_blocks, page_size,
            nheads_k, headdim), any page_size >= 1, and sequence b attends
            to the first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` rows of its cache, row j in
            page ``block_table[b, j // page_size]`` (append the chunk's keys first, e.g. with
            :func:`flash_attn_with_kvcache`). The same out and LSE, bitwise, as the call on
            those keys gathered contiguously. CPU and NVIDIA GPU tensors; no out=, no
            gradients.
        attention_chunk: as for :func:`flash_attn_func`, within each sequence (the sequences'
            bounds, and seqused_q / seqused_k, are copied to the host once); not with a
            block_table.
        q_descale, k_descale, v_descale: fp8, as for :func:`flash_attn_func` (float8_e4m3fn
            q, k, v; per (batch, kv head) is per (sequence, kv head)): forward only, out
            bfloat16; the CPU backend and NVIDIA Hopper (head dims up to 128, no ALiBi); not
            with a block_table.
        k_scale, v_scale: with a block_table, an fp8 paged cache (float8_e4m3fn k and v,
            bfloat16 / float16 q), as for :func:`flash_attn_with_kvcache`: float32 () or (1,)
            scales (None: 1); the CPU backend and NVIDIA GPUs running sm_89+ code of the build.
        sinks: as for :func:`flash_attn_func` (a logit per query head, every sequence's rows);
            not with out=, fp8 inputs, attention_chunk or a block_table.

    Returns:
        out: (total_q, nheads, headdim), q's dtype. Rows past ``cu_seqlens_q[-1]`` are not
            written.
        lse (only when return_lse): float32, in the layout chosen by lse_layout; -inf for a row
            that sees no key.

    Raises:
        As :func:`flash_attn_func`; also ValueError for cu_seqlens that are not int32, have the
        wrong length, decrease, or hold a sequence longer than max_seqlen_q / max_seqlen_k, and
        for an unknown lse_layout.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(t, name)
    if out is not None:
        _check_tensor(out, "out")
    if block_table is not None:
        _check_tensor(block_table, "block_table")
    if alibi_slopes is not None:
        _check_tensor(alibi_slopes, "alibi_slopes")
    used = [(n, t) for n, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k),
                                ("q_descale", q_descale), ("k_descale", k_descale),
                                ("v_descale", v_descale), ("sinks", sinks))
            if t is not None]
    for name, t in used:
        _check_tensor(t, name)
    if used and block_table is not None:
        raise NotImplementedError(f"{used[0][0]} with a block_table (chunked prefill) is not "
                                  "supported by hipflash yet")
    scales = [(n, t) for n, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is not None]
    for name, t in scales:
        _check_tensor(t, name)
        if block_table is None:
            raise ValueError(f"{name} applies to an fp8 paged cache (with a block_table); fp8 "
                             "q, k, v take q_descale / k_descale / v_descale")
    used += scales
    if lse_layout not in _LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be 'padded' or 'packed', got {lse_layout!r}")
    _check_same_device(q, [("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                           ("cu_seqlens_k", cu_seqlens_k)]
                       + ([("out", out)] if out is not None else [])
                       + ([("block_table", block_table)] if block_table is not None else [])
                       + ([("alibi_slopes", alibi_slopes)] if alibi_slopes is not None else [])
                       + used)
    left, right = _window(window_size)
    scale = _scale(softmax_scale)
    num_splits = _bounded(_int(num_splits, "num_splits"), "num_splits", 0, _MAX_SPLITS)
    # Negative maxima reach the C++ checks; only what int64 cannot hold stops here.
    max_seqlen_q = _bounded(_int(max_seqlen_q, "max_seqlen_q"), "max_seqlen_q", -_INT64_MAX, _INT64_MAX)
    max_seqlen_k = _bounded(_int(max_seqlen_k, "max_seqlen_k"), "max_seqlen_k", -_INT64_MAX, _INT64_MAX)
    causal, return_lse = bool(causal), bool(return_lse)
    softcap = _softcap(softcap)
    chunk = _chunk(attention_chunk)
    descales = (q_descale, k_descale, v_descale)
    fp8 = _fp8(q, descales)
    if sinks is not None:
        _check_sinks(sinks, q)
        _refuse_with_sinks(("out=", out is not None), ("fp8 inputs", fp8),
                           ("attention_chunk", chunk), ("a block_table", block_table is not None))
        res = _call(_SinkAttention.apply, q, k, v, sinks,
                    _VarlenCall(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                causal, left, right, num_splits, bool(deterministic), softcap,
                                alibi_slopes, seqused_q, seqused_k))
        out, lse = res
        if return_lse and lse_layout == "padded":
            lse = _chunks.padded_lse(lse, cu_seqlens_q.tolist(), max_seqlen_q)
        return (out, lse) if return_lse else out
    if chunk:
        if block_table is not None:
            raise NotImplementedError("attention_chunk with a block_table is not supported by "
                                      "hipflash yet")
        _check_chunk_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
        kw = _chunk_kw(scale, causal, left, right, num_splits, bool(deterministic), softcap)
        if out is not None:
            kw["out"] = out
        out, lse = _chunks.varlen(flash_attn_varlen_func, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, chunk, lse_layout,
                                  _per_sequence(alibi_slopes, descales), kw, seqused_q, seqused_k)
        return (out, lse) if return_lse else out

    if block_table is not None:  # chunked prefill: k and v are paged caches
        if out is not None:
            raise ValueError("out= is not supported with a block_table")
        out, lse = _call(_ops.varlen_fwd_paged, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table,
                         max_seqlen_q, max_seqlen_k, scale, causal, left, right, num_splits,
                         return_lse, lse_layout, softcap, alibi_slopes, k_scale, v_scale)
        return (out, lse) if return_lse else out
    if out is None and _wants_grad(q, k, v) and not fp8:  # fp8 is forward only (FA3's)
        out, lse = _call(_FlashAttnVarlenFunc.apply, q, k, v, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, scale, causal, left, right, num_splits,
                         lse_layout, bool(deterministic), softcap, alibi_slopes, seqused_q,
                         seqused_k)
        return (out, lse) if return_lse else out
    call = _forward_only if fp8 else _call
    if out is None:
        out, lse = call(_ops.varlen_fwd, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, scale, causal, left, right, num_splits, return_lse,
                        lse_layout, softcap, alibi_slopes, seqused_q, seqused_k, *descales)
        return (out, lse) if return_lse else out
    lse = None
    if return_lse and q.dim() == 3:
        # Buffers only for shapes that make sense; anything else is reported by the C++ checks.
        if lse_layout == "packed":
            lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        elif cu_seqlens_q.dim() == 1 and cu_seqlens_q.numel() >= 1 and \
                0 <= max_seqlen_q <= q.shape[0]:
            lse = torch.empty((cu_seqlens_q.numel() - 1, q.shape[1], max_seqlen_q),
                              dtype=torch.float32, device=q.device)
    call(_ops.varlen_fwd_out, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
         out, lse, scale, causal, left, right, num_splits, return_lse, lse_layout, softcap,
         alibi_slopes, seqused_q, seqused_k, *descales)
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), num_splits=0, return_lse=False, softcap=0.0,
                            alibi_slopes=None, k_scale=None, v_scale=None, cache_batch_idx=None,
                            cache_leftpad=None, rotary_cos=None, rotary_sin=None,
                            rotary_interleaved=True, rotary_seqlens=None, attention_chunk=0,
                            sinks=None):
    """Attention of q against a KV cache, contiguous or paged, after appending k / v in place.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim), bfloat16 or float16.
        k_cache, v_cache: (batch_size, seqlen_cache, nheads_k, headdim) without a block table,
            or (num_blocks, page_size, nheads_k, headdim) with one (a paged cache; any
            page_size >= 1). q's dtype and device.
        k, v: optional (batch_size, seqlen_new, nheads_k, headdim): written into the caches at
            rows cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence b (in place)
            before attending. Needs cache_seqlens.
        cache_seqlens: int, or (batch_size,) int32 tensor on q's device: the keys each sequence
            holds before the append. None: every sequence fills its cache (seqlen_cache, or
            max_blocks_per_seq * page_size). A GPU call copies the tensor back to check its
            values, which waits for the GPU's queued work; an int, or a CPU tensor with GPU
            q (uploaded here, without waiting), is checked on the host: a decode loop keeps
            running ahead of the GPU.
        block_table: optional (batch_size, max_blocks_per_seq) int32 on q's device: row j of
            sequence b lives in page block_table[b, j // page_size]. Entries past what a
            sequence uses are never read.
        softmax_scale, causal, window_size, num_splits, return_lse, softcap, alibi_slopes: as for
            :func:`flash_attn_func`, with seqlen_k = cache_seqlens[b] + seqlen_new per sequence
            (causal is bottom-right aligned against it).
        k_scale, v_scale: an fp8 cache (vLLM's kv_cache_dtype="fp8"): torch.float8_e4m3fn
            k_cache / v_cache holding K / k_scale and V / v_scale, with bfloat16 / float16 q,
            k and v; optional float32 () or (1,) scales (None: 1). The scores are
            q . (k_cache * k_scale), out is softmax . (v_cache * v_scale) in q's dtype; k / v
            are appended as k / k_scale (v / v_scale) rounded to float8_e4m3fn, saturated to
            +-448. On NVIDIA GPUs running sm_89+ code of the build (Hopper by default; others
            with HIPFLASH_CUDA_ARCHS listing them): the decode kernel reads an fp8 cache in
            calls with up to 16 query rows per kv head (seqlen_q, or the GQA group with one
            query row), the generic kernel in longer ones (chunked prefill; K / V widened to
            q's dtype in shared memory).
        cache_batch_idx: optional (batch_size,) int32 on q's device (FlashAttention's): with a
            contiguous cache of any batch size, sequence b reads and appends to cache entry
            cache_batch_idx[b]; with a block_table of any number of rows, through row
            cache_batch_idx[b] of it (FlashAttention 3's rule). CPU tensors and NVIDIA GPUs; on
            the GPU the entries are copied back for their range check, as cache_seqlens are.
            Appending, no entry may be named twice.
        cache_leftpad: optional (batch_size,) int32 on q's device (FlashAttention's): sequence
            b's keys start at row cache_leftpad[b] of its cache (in [0, cache_seqlens[b]]): it
            attends to rows cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1, causal and
            windows aligned to those keys; k / v are still appended at cache_seqlens[b].
            Contiguous and paged caches, on CPU tensors and NVIDIA GPUs (the GPU reads each
            row through the block table from the leftpad row). A CPU tensor with GPU q is
            checked on the host and uploaded, as cache_seqlens.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2) on q's device
            (FlashAttention's rotary embedding on append; k and v must be given): the first
            rotary_dim (even, <= headdim) dims of k are rotated at positions cache_seqlens[b] + j
            (the cache row, whatever cache_leftpad is; rotary_seqlens[b] instead of
            cache_seqlens[b] when given) before the append, and
            those of q at the same base + i when causal or windowed, at the base alone
            otherwise; rotary_interleaved: pairs (0, 1), (2, 3), ... (GPT-J) or the two halves
            (GPT-NeoX). A position past rotary_cos's rows is not rotated (FlashAttention's
            rotary kernel reads cos 1 and sin 0 there). Computed in float32 and rounded to q's
            dtype by PyTorch ops before the call (not fused into the kernels).
        attention_chunk: as for :func:`flash_attn_func`, against each sequence's keys (from
            its cache_leftpad row). Runs as the varlen kvcache path (the append by PyTorch ops,
            then chunked prefill over the chunks' rows; the sequences' lengths copied to the
            host); with an fp8 cache too (the new rows quantised by PyTorch as the call without
            chunks stores them).
        sinks: as for :func:`flash_attn_func` (this call has no gradients); not with
            attention_chunk.

    Returns:
        out (batch_size, seqlen_q, nheads, headdim), and with return_lse the LSE
        (batch_size, nheads, seqlen_q), float32, -inf for a row that sees no key.

    A paged and a contiguous cache holding the same rows give bitwise the same result. CPU
    tensors run on the CPU backend, CUDA tensors on the decode / generic kernels (the append
    first, on the current stream). Bad block tables (a page size of 0, too few entries for a
    length; on CPU tensors also the entries a sequence uses
    out of range — on the GPU those are not checked) raise ValueError before anything is
    written.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(t, name)
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values) must be given together")
    named = [("k_cache", k_cache), ("v_cache", v_cache)]
    if k is not None:
        _check_tensor(k, "k")
        _check_tensor(v, "v")
        named += [("k", k), ("v", v)]
    seqlens_host = leftpad_host = None  # the values the host holds (KvCacheOptions::*_host)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        n = _bounded(_int(cache_seqlens, "cache_seqlens"), "cache_seqlens", 0, _INT32_MAX)
        cache_seqlens, seqlens_host = _held_lengths(n, q.shape[0] if q.dim() >= 1 else 0,
                                                    q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens, seqlens_host = _held_upload(cache_seqlens, q.device)
    if isinstance(cache_leftpad, torch.Tensor):
        cache_leftpad, leftpad_host = _held_upload(cache_leftpad, q.device)
    if cache_seqlens is not None:
        named.append(("cache_seqlens", cache_seqlens))
    if block_table is not None:
        _check_tensor(block_table, "block_table")
        named.append(("block_table", block_table))
    for name, t in (("alibi_slopes", alibi_slopes), ("k_scale", k_scale), ("v_scale", v_scale),
                    ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                    ("sinks", sinks)):
        if t is not None:
            _check_tensor(t, name)
            named.append((name, t))
    _check_same_device(q, named)
    if sinks is not None:
        _check_sinks(sinks, q)
    left, right = _window(window_size)
    scale = _scale(softmax_scale)
    num_splits = _bounded(_int(num_splits, "num_splits"), "num_splits", 0, _MAX_SPLITS)
    chunk = _chunk(attention_chunk)
    if sinks is not None:
        _refuse_with_sinks(("attention_chunk", chunk))
    if chunk:
        if q.dtype == _E4M3:  # as the call without chunks (the C++ check)
            raise NotImplementedError("float8_e4m3fn queries with a KV cache are not "
                                      "implemented: an fp8 cache takes bfloat16 or float16 "
                                      "queries")
        return _kvcache_chunked(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale,
                                bool(causal), (left, right), num_splits, bool(return_lse),
                                _softcap(softcap), alibi_slopes, cache_batch_idx, cache_leftpad,
                                rotary_cos, rotary_sin, rotary_interleaved, rotary_seqlens,
                                chunk, k_scale, v_scale)
    if rotary_cos is not None or rotary_sin is not None:
        # The rotation copies q and k: the launcher then sees the copies, so the caches the
        # append writes are checked against the caller's tensors here (SPEC §4).
        if k is not None:
            _varlen_kv.check_append(k_cache, v_cache, named[2:] + [
                ("q", q), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                ("rotary_seqlens", rotary_seqlens)])
        q, k = _rotary.on_append(q, k, k_cache, block_table, cache_seqlens, rotary_seqlens,
                                 rotary_cos, rotary_sin, bool(rotary_interleaved),
                                 causal or left >= 0 or right >= 0)
    elif rotary_seqlens is not None:
        raise ValueError("rotary_seqlens needs rotary_cos and rotary_sin")
    out, lse = _call(_ops.fwd_kvcache, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                     scale, bool(causal), left, right, num_splits,
                     bool(return_lse) or sinks is not None, _softcap(softcap), alibi_slopes,
                     k_scale, v_scale, cache_batch_idx, cache_leftpad, seqlens_host, leftpad_host)
    if sinks is not None:  # the call is forward only: out and LSE with the sinks
        out, lse_rows, _ = _sink_output(out, lse.transpose(1, 2), sinks)
        lse = lse_rows.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out


def _kvcache_read(q, k_cache, v_cache, cache_seqlens, seqlens_host, cache_leftpad, leftpad_host,
                  softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  sinks=None):
    """flash_attn_with_kvcache's read of a contiguous cache (no append) for a decode loop that
    built the device lengths once from host values it passes too (seqlens_host, leftpad_host:
    lists equal to cache_seqlens / cache_leftpad): each layer's call then uploads nothing and
    waits for nothing. The launcher checks every argument, as for the public call. sinks: as
    flash_attn_func's (no gradients: this read has none)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("cache_seqlens", cache_seqlens), ("cache_leftpad", cache_leftpad)):
        _check_tensor(t, name)
    left, right = _window(window_size)
    if sinks is not None:
        _check_sinks(sinks, q)
    out, lse = _call(_ops.fwd_kvcache, q, k_cache, v_cache, None, None, cache_seqlens, None,
                     _scale(softmax_scale), bool(causal), left, right, 0, sinks is not None,
                     _softcap(softcap), None, None, None, None, cache_leftpad, seqlens_host,
                     leftpad_host)
    if sinks is not None:  # forward only, as the whole read
        out = _sink_output(out, lse.transpose(1, 2), sinks)[0]
    return out


def _held_lengths(n, batch, device):
    """cache_seqlens given as an int: (the int32 [batch] tensor on device, its host values)."""
    return torch.full((batch,), n, dtype=torch.int32, device=device), [n] * batch


def _held_upload(t, device):
    """An index tensor (cache_seqlens, cache_leftpad) of a call on device: a CPU tensor of a GPU
    call is uploaded without waiting for the GPU and its values kept for the host-side checks
    -> (the tensor the launcher reads, its host values or None)."""
    if t.device.type != "cpu" or device.type == "cpu":
        return t, None
    held = t.tolist() if t.dtype == torch.int32 and t.dim() == 1 else None
    return t.pin_memory().to(device, non_blocking=True), held


def _kvcache_chunked(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, causal,
                     window, num_splits, return_lse, softcap, alibi_slopes, cache_batch_idx,
                     cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved, rotary_seqlens,
                     chunk, k_scale=None, v_scale=None):
    """flash_attn_with_kvcache with attention_chunk: the batch as varlen queries (and packed
    new keys) through hipflash/_varlen_kv.py, which cuts each sequence into its chunks (an fp8
    cache with its scales too)."""
    if q.dim() != 4 or k_cache.dim() != 4 or (k is not None and k.dim() != 4):
        raise ValueError(f"q must be [batch, seqlen_q, nheads, headdim], k_cache / v_cache 4-D "
                         f"and k / v [batch, seqlen_new, nheads_k, headdim], got q "
                         f"{list(q.shape)}, k_cache {list(k_cache.shape)}"
                         + (f", k {list(k.shape)}" if k is not None else ""))
    batch, seqlen_q, heads, dim = q.shape
    if (rotary_cos is not None or rotary_sin is not None) and k is None:
        raise ValueError("rotary_cos / rotary_sin rotate on append: give k and v")
    if cache_seqlens is None:  # every sequence fills its cache
        rows = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        cache_seqlens = torch.full((batch,), rows, dtype=torch.int32, device=q.device)
    dev = q.device
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev) * seqlen_q
    cu_new = None
    if k is not None:
        if k.shape[0] != batch or v is None or v.shape != k.shape:
            raise ValueError(f"k and v must be [batch={batch}, seqlen_new, nheads_k, headdim] "
                             f"alike, got {list(k.shape)}, "
                             f"{list(v.shape) if v is not None else None}")
        cu_new = torch.arange(batch + 1, dtype=torch.int32, device=dev) * k.shape[1]
        k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
    out, lse = _varlen_kv.with_kvcache(
        q.reshape(-1, heads, dim), k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
        block_table, cu_q, cu_new, seqlen_q, rotary_cos, rotary_sin, rotary_seqlens,
        bool(rotary_interleaved), scale, causal, window, num_splits, True, softcap,
        cache_leftpad, chunk, alibi_slopes, k_scale, v_scale, table_name="block_table")
    out = out.view(batch, seqlen_q, heads, dim)
    lse = lse.view(heads, batch, seqlen_q).transpose(0, 1).contiguous()
    return (out, lse) if return_lse else out


def merge_attn_states(out_a, lse_a, out_b=None, lse_b=None):
    """Merges attention over disjoint key sets by their LSEs (the split-K combine's math).

        out, lse = hipflash.merge_attn_states(out_a, lse_a, out_b, lse_b)   # two parts
        out, lse = hipflash.merge_attn_states(outs, lses)                   # N stacked parts

    Layouts are hipflash's (and FlashAttention's): dense parts out [B, S, H, D] with lse
    [B, H, S], or packed (varlen) parts out [T, H, D] with lse [H, T] (the layout of vLLM's
    merge_attn_states); stacked along a new first dimension for the N-way form. The LSEs are
    natural log, fp32 (FlashInfer's base-2 LSE: multiply by ln 2 first). out = sum_i w_i out_i,
    w_i = exp(lse_i - lse), lse = log(sum_i exp(lse_i)): a part with lse -inf contributes
    nothing, all -inf gives out 0 and lse -inf, NaN reaches the rows it touches. CPU tensors
    run on the host, CUDA/HIP tensors on the GPU merge kernel (on the current stream); a build
    without GPU kernels raises NotImplementedError for GPU tensors.

    Returns:
        (out, lse): out like one part (dtype of the parts), lse float32 like one part's LSE.
    """
    if (out_b is None) != (lse_b is None):
        raise ValueError("merge_attn_states takes (out_a, lse_a, out_b, lse_b) or stacked (outs, lses)")
    for name, t in (("out_a", out_a), ("lse_a", lse_a)) + (
            (("out_b", out_b), ("lse_b", lse_b)) if out_b is not None else ()):
        _check_tensor(t, name)
    _check_same_device(out_a, [("lse_a", lse_a)] + (
        [("out_b", out_b), ("lse_b", lse_b)] if out_b is not None else []), first="out_a")
    if out_b is not None:
        if out_a.dtype != out_b.dtype or lse_a.dtype != lse_b.dtype:
            raise TypeError("the two parts must have one dtype: out "
                            f"{out_a.dtype}/{out_b.dtype}, lse {lse_a.dtype}/{lse_b.dtype}")
        if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
            raise ValueError(f"the parts' shapes differ: out {tuple(out_a.shape)} vs "
                             f"{tuple(out_b.shape)}, lse {tuple(lse_a.shape)} vs {tuple(lse_b.shape)}")
        outs, lses = torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b])
    else:
        outs, lses = out_a, lse_a
    dense = outs.dim() == 5  # [N, B, S, H, D]
    if dense:
        n, b, s, h, d = outs.shape
        if tuple(lses.shape) != (n, b, h, s):
            raise ValueError(f"lses must have shape [parts, batch, heads, seqlen] = {[n, b, h, s]} "
                             f"for outs {list(outs.shape)}, got {list(lses.shape)}")
        outs = outs.reshape(n, b * s, h, d)
    out, lse = _call(_ops.merge_attn_states, outs, lses)
    return (out.view(b, s, h, d) if dense else out), lse


def resolve_num_splits(q, k, causal=False, window_size=(-1, -1), num_splits=0):
    """The split count a :func:`flash_attn_func` call with these q, k and options runs with.

    num_splits=0 resolves by heuristic (from the problem size and the device); passing the
    returned count explicitly gives bitwise the same output. A positive count is clamped to the
    number of key blocks.
    """
    _check_tensor(q, "q")
    _check_tensor(k, "k")
    _check_same_device(q, [("k", k)])
    left, right = _window(window_size)
    num_splits = _bounded(_int(num_splits, "num_splits"), "num_splits", 0, _MAX_SPLITS)
    return _C.resolve_num_splits(q, k, bool(causal), left, right, num_splits)
