"""The backends the benchmark times, each on its own native layout, and the inputs they share.

A backend's ``prepare(cell, inputs)`` returns ``(run, extract)``: ``run(i)`` calls the backend on
input set ``i`` (this is what is timed: no copies, no transposes inside), and ``extract(result)``
turns its result into ``(out, lse)`` in the reference's layout for the correctness check
(outside the timed region). A backend that cannot serve a cell raises ``Unavailable(reason)``;
any other exception is caught by the runner and recorded as "n/a: <error>".

Layouts: hipflash and FlashAttention-2's own entry point (``aten._flash_attention_forward``) take
[B, S, H, D]; the SDPA ops and FlexAttention take [B, H, S, D], given as contiguous copies made
when the cell's inputs are built. The decode suite's layout-for-layout pair reads the other
side's memory through views: hipflash+lse-bhsd the [B, H, S, D] copies, cudnn-sdpa-gqa-bshd the
[B, S, H, D] tensors.
"""

import glob
import os
import re
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


class Unavailable(Exception):
    """This backend does not serve this cell (the reason goes into the table)."""


# ---- Inputs ----------------------------------------------------------------------------------


def _randn(shape, dtype, device, gen):
    # Standard normal, drawn in fp32 then rounded (never zeros; FlashAttention's convention).
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


class Inputs:
    """``nsets`` independent random input sets for one cell, rotated while timing so that the
    inputs a call reads are not left in L2 by the call before it."""

    def __init__(self, cell, nsets, device, seed):
        self.cell = cell
        self.device = device
        self.nsets = nsets
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        dt = cell.torch_dtype
        c = cell
        self.q, self.k, self.v = [], [], []
        for _ in range(nsets):
            if c.kind == "varlen":
                qs, ks = (c.total_q, c.Hq, c.D), (c.total_k, c.Hkv, c.D)
            else:
                qs, ks = (c.B, c.Sq, c.Hq, c.D), (c.B, c.Sk, c.Hkv, c.D)
            self.q.append(_randn(qs, dt, device, gen))
            self.k.append(_randn(ks, dt, device, gen))
            self.v.append(_randn(ks, dt, device, gen))
            if c.extra.get("e4m3_kv") or c.extra.get("e4m3_qkv"):
                # K/V (and Q) an fp8 cache / fp8 call holds exactly (HipflashFp8Kv, HipflashFp8)
                exact = (self.k[-1], self.v[-1]) + ((self.q[-1],) if c.extra.get("e4m3_qkv") else ())
                for x in exact:
                    x.copy_((x * E4M3_KV_INV_SCALE).to(torch.float8_e4m3fn).to(dt)
                            .mul_(1.0 / E4M3_KV_INV_SCALE))
        self.cu_q = self.cu_k = None
        if c.kind == "varlen":
            self.cu_q = torch.tensor(c.cu_q, dtype=torch.int32, device=device)
            self.cu_k = torch.tensor(c.cu_k, dtype=torch.int32, device=device)
        self._bhsd = None

    def bhsd(self):
        """Contiguous [B, H, S, D] copies (the SDPA / Flex layout), made once per cell."""
        if self._bhsd is None:
            t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
            self._bhsd = ([t(x) for x in self.q], [t(x) for x in self.k], [t(x) for x in self.v])
        return self._bhsd

    def nbytes_per_set(self, with_bhsd):
        n = sum(x.numel() * x.element_size() for x in (self.q[0], self.k[0], self.v[0]))
        return n * (2 if with_bhsd else 1)


def inputs_bytes(cell):
    """Bytes of one set of q, k, v and out, before allocating anything."""
    el = 2
    if cell.kind == "varlen":
        return el * cell.D * (2 * cell.total_q * cell.Hq + 2 * cell.total_k * cell.Hkv)
    return el * cell.B * cell.D * (2 * cell.Sq * cell.Hq + 2 * cell.Sk * cell.Hkv)


# ---- Base ------------------------------------------------------------------------------------


class Backend:
    name = "?"
    lse = False          # returns the LSE (compared against LSE-returning peers only)
    peer = True          # False for hipflash itself
    kinds = ("dense",)   # cell kinds served
    layout = "bshd"      # "bshd" or "bhsd"
    devices = ("cuda",)
    kv_fraction = 1.0    # bytes of K/V it reads over the cell's (0.5: an fp8 cache)
    fp8 = False          # judged by SPEC §6's fp8 rule (e4m3 probabilities: attn_ref.check)

    def available(self, device):
        """(ok, reason) for the whole run; checked once."""
        return True, ""

    def prepare(self, cell, inp):
        raise NotImplementedError


def _bhsd_to_bshd(x):
    return x.transpose(1, 2)


def _dense_extract(cell, out_layout):
    from attn_ref import normalize_lse

    def extract(res):
        out, lse = res if isinstance(res, tuple) else (res, None)
        if out_layout == "bhsd":
            out = _bhsd_to_bshd(out)
        return out, normalize_lse(lse, cell.B, cell.Hq, cell.Sq)
    return extract


def _no_top_left_causal(cell):
    # SDPA's is_causal is aligned to the top-left corner; hipflash's (SPEC §3) to the
    # bottom-right. They agree only when Sq == Sk.
    if cell.causal and cell.Sq != cell.Sk:
        raise Unavailable("SDPA causal is top-left aligned; differs from bottom-right when Sq != Sk")


# ---- hipflash --------------------------------------------------------------------------------

_HF = None
_HF_ERR = None


def select_cells(cells, pattern, label, what):
    """The cells whose label(cell) matches the --cells regex `pattern` (all when it is empty);
    exits naming the labels when it matches none, so a typo never passes for an empty,
    successful run."""
    if not pattern:
        return cells
    labels = [label(c) for c in cells]
    kept = [c for c, name in zip(cells, labels) if re.search(pattern, name)]
    if not kept:
        more = ", ..." if len(labels) > 6 else ""
        sys.exit(f"--cells {pattern!r} matches no cell of the {what} suite "
                 f"(labels: {', '.join(labels[:6])}{more})")
    return kept


def import_hipflash(extra_path=None):
    """The hipflash module, or raises ImportError with the reason. Tries a plain import, then
    --hipflash-path, then <repo>/python."""
    global _HF, _HF_ERR
    if _HF is not None:
        return _HF
    if _HF_ERR is not None:
        raise ImportError(_HF_ERR)
    errors = []
    # The extension lands in <build>/python (HIPFLASH_BUILD_PYTHON=ON) or next to the package.
    builds = sorted(glob.glob(os.path.join(REPO, "build*", "python")))
    candidates = [None] + ([extra_path] if extra_path else []) + builds + \
        [os.path.join(REPO, "python")]
    for path in candidates:
        if path is not None and path not in sys.path:
            sys.path.insert(0, path)
        try:
            import hipflash  # noqa: F401
            _HF = sys.modules["hipflash"]
            return _HF
        except Exception as e:  # ImportError, or a missing _C extension
            errors.append(f"{path or 'sys.path'}: {type(e).__name__}: {e}")
            sys.modules.pop("hipflash", None)
            sys.modules.pop("hipflash._C", None)
    _HF_ERR = "cannot import hipflash (" + " | ".join(errors) + ")"
    raise ImportError(_HF_ERR)


class Hipflash(Backend):
    peer = False
    kinds = ("dense", "varlen")
    devices = ("cuda", "cpu")

    def __init__(self, return_lse, hipflash_path=None):
        self.lse = return_lse
        self.name = "hipflash+lse" if return_lse else "hipflash"
        self.path = hipflash_path

    def available(self, device):
        try:
            hf = import_hipflash(self.path)
        except ImportError as e:
            return False, str(e)
        if device == "cuda":
            try:
                if not hf.gpu_available():
                    info = getattr(hf, "build_info", lambda: "?")()
                    return False, f"hipflash has no GPU kernels here (build_info: {info})"
            except Exception as e:
                return False, f"hipflash.gpu_available() failed: {e}"
        return True, ""

    def prepare(self, cell, inp):
        hf = import_hipflash(self.path)
        L = self.lse
        if cell.kind == "varlen":
            from attn_ref import normalize_varlen_lse

            # Packed LSE: the layout FlashAttention-2 and PyTorch return, so the peers compare.
            def run(i, out=None):
                return hf.flash_attn_varlen_func(
                    inp.q[i], inp.k[i], inp.v[i], inp.cu_q, inp.cu_k, cell.max_q, cell.max_k,
                    softmax_scale=cell.scale, causal=cell.causal, return_lse=L,
                    lse_layout="packed", out=out)

            def extract(res):
                out, lse = res if L else (res, None)
                return out, normalize_varlen_lse(lse, cell.Hq, cell.cu_q)
            return run, extract

        from attn_ref import normalize_lse

        k, v = self.dense_kv(inp)

        def run(i, out=None):
            return hf.flash_attn_func(inp.q[i], k[i], v[i], softmax_scale=cell.scale,
                                      causal=cell.causal, return_lse=L, out=out)

        def extract(res):
            out, lse = res if L else (res, None)
            return out, normalize_lse(lse, cell.B, cell.Hq, cell.Sq)
        return run, extract

    def dense_kv(self, inp):
        """The K and V input sets a dense cell's calls read ([B, S, H, D])."""
        return inp.k, inp.v

    def kernel_name(self):
        try:
            return import_hipflash(self.path).last_kernel_name()
        except Exception:
            return ""


class HipflashBhsd(Hipflash):
    """hipflash with the LSE on K and V stored [B, Hkv, Sk, D] (the layout the decode suite gives
    cuDNN, and FlashInfer's "HND"), passed as [B, Sk, Hkv, D] views: SPEC §2 takes any strides
    with a contiguous last dimension, so a cache kept head-major needs no copy. Q and out stay
    [B, Sq, Hq, D]. With the bshd cuDNN below it makes the layout-for-layout comparison."""
    kinds = ("dense",)
    layout = "bhsd"

    def __init__(self, hipflash_path=None):
        super().__init__(True, hipflash_path)
        self.name = "hipflash+lse-bhsd"

    def dense_kv(self, inp):
        _, k, v = inp.bhsd()
        return [_bhsd_to_bshd(x) for x in k], [_bhsd_to_bshd(x) for x in v]


def paged_copy(x, page, perm):
    """x [B, Sk, H, D] as a paged cache [B * Sk / page, page, H, D]: page j of sequence b (its
    rows j * page ...) is stored at page perm[b * Sk / page + j]."""
    B, Sk = x.shape[0], x.shape[1]
    pages = torch.empty((B * (Sk // page), page) + tuple(x.shape[2:]), dtype=x.dtype,
                        device=x.device)
    pages[perm] = x.reshape((B * (Sk // page), page) + tuple(x.shape[2:]))
    return pages


class HipflashPaged(Hipflash):
    """hipflash.flash_attn_with_kvcache on a paged copy of the cell's K/V (pages of ``page``
    rows, scattered by a random permutation; the block table names them), with the LSE.
    cache_seqlens=None: every sequence fills its Sk keys, so no lengths tensor is copied to the
    host per call (with a lengths tensor the GPU path copies it back for its capacity checks,
    a host synchronisation the device timing would absorb). The paged copies are made here,
    outside the timed region. flash_attn_with_kvcache has no out= argument: the NaN-poisoned
    buffer of the check does not apply (the reference check and the bitwise repeat do)."""
    kinds = ("dense",)

    def __init__(self, page, hipflash_path=None):
        super().__init__(True, hipflash_path)
        self.page = page
        self.name = f"hipflash-paged{page}"

    def prepare(self, cell, inp):
        from attn_ref import normalize_lse

        hf = import_hipflash(self.path)
        if cell.Sk % self.page:
            raise Unavailable(f"Sk = {cell.Sk} is not a multiple of the page size {self.page}")
        blocks = cell.Sk // self.page
        gen = torch.Generator().manual_seed(7919 * self.page + 31 * cell.B + blocks)
        perm = torch.randperm(cell.B * blocks, generator=gen).to(inp.q[0].device)
        table = perm.view(cell.B, blocks).to(torch.int32)
        k_pages = [paged_copy(x, self.page, perm) for x in inp.k]
        v_pages = [paged_copy(x, self.page, perm) for x in inp.v]

        def run(i, out=None):  # `out` (the check's poisoned buffer) has nowhere to go
            return hf.flash_attn_with_kvcache(inp.q[i], k_pages[i], v_pages[i], block_table=table,
                                              softmax_scale=cell.scale, causal=cell.causal,
                                              return_lse=True)

        def extract(res):
            return res[0], normalize_lse(res[1], cell.B, cell.Hq, cell.Sq)
        return run, extract


# The decode-fp8 suite's K/V: unit normals rounded to e4m3 times 1/16 (a power of two, so the
# 16-bit copy every 16-bit backend reads and the fp8 cache hold the same values).
E4M3_KV_INV_SCALE = 16.0


def e4m3_copies(xs):
    """float8_e4m3fn copies of a cell's e4m3-exact input sets (values times 16: exact)."""
    return [(x * E4M3_KV_INV_SCALE).to(torch.float8_e4m3fn) for x in xs]


class HipflashFp8Kv(Hipflash):
    """hipflash.flash_attn_with_kvcache on an fp8 (float8_e4m3fn) copy of the cell's K/V with
    k_scale = v_scale = 1/16 (vLLM's kv_cache_dtype="fp8"), with the LSE: the cell's K/V are
    e4m3 values times 1/16 (Inputs, cell.extra["e4m3_kv"]), so the copy is exact and the check
    is the same reference. cache_seqlens=None, as hipflash-paged*. Reads half the bytes."""
    kinds = ("dense",)
    kv_fraction = 0.5

    def __init__(self, hipflash_path=None):
        super().__init__(True, hipflash_path)
        self.name = "hipflash-fp8kv"

    def prepare(self, cell, inp):
        from attn_ref import normalize_lse

        hf = import_hipflash(self.path)
        if not cell.extra.get("e4m3_kv"):
            raise Unavailable("the cell's K/V are not e4m3 values (suite decode-fp8)")
        k8, v8 = e4m3_copies(inp.k), e4m3_copies(inp.v)
        scale = torch.tensor(1.0 / E4M3_KV_INV_SCALE, device=inp.q[0].device)

        def run(i, out=None):  # `out` (the check's poisoned buffer) has nowhere to go
            return hf.flash_attn_with_kvcache(inp.q[i], k8[i], v8[i], softmax_scale=cell.scale,
                                              causal=cell.causal, return_lse=True,
                                              k_scale=scale, v_scale=scale)

        def extract(res):
            return res[0], normalize_lse(res[1], cell.B, cell.Hq, cell.Sq)
        return run, extract


class HipflashFp8(Hipflash):
    """hipflash.flash_attn_func on float8_e4m3fn copies of the cell's q, k, v with descales
    1/16 each (FlashAttention 3's fp8 forward; out bf16, no LSE, as "hipflash"): the cell's
    inputs are e4m3 values times 1/16 (Inputs, cell.extra["e4m3_qkv"]), so the copies are exact
    and the reference is the cell's. Judged by SPEC §6's fp8 rule: its probabilities are e4m3,
    so the yardstick is the reference computed so (attn_ref.reference's out_lp8)."""
    kinds = ("dense",)
    fp8 = True

    def __init__(self, hipflash_path=None):
        super().__init__(False, hipflash_path)
        self.name = "hipflash-fp8"

    def prepare(self, cell, inp):
        hf = import_hipflash(self.path)
        if not cell.extra.get("e4m3_qkv"):
            raise Unavailable("the cell's q, k, v are not e4m3 values (suite fwd-fp8)")
        q8, k8, v8 = (e4m3_copies(xs) for xs in (inp.q, inp.k, inp.v))
        d = torch.tensor([1.0 / E4M3_KV_INV_SCALE], device=inp.q[0].device)

        def run(i, out=None):
            return hf.flash_attn_func(q8[i], k8[i], v8[i], softmax_scale=cell.scale,
                                      causal=cell.causal, out=out, q_descale=d, k_descale=d,
                                      v_descale=d)

        def extract(res):
            return res, None
        return run, extract


# ---- PyTorch SDPA kernels (aten ops, [B, H, S, D]) -------------------------------------------


def _aten(name):
    op = getattr(torch.ops.aten, name, None)
    if op is None:
        raise Unavailable(f"torch.ops.aten.{name} not in this PyTorch")
    return op


class TorchFlash(Backend):
    """aten._scaled_dot_product_flash_attention: FlashAttention-2 inside PyTorch (returns LSE)."""
    name, lse, layout = "torch-flash", True, "bhsd"

    def prepare(self, cell, inp):
        op = _aten("_scaled_dot_product_flash_attention")
        _no_top_left_causal(cell)
        q, k, v = inp.bhsd()
        causal, scale = cell.causal, cell.scale

        def run(i):
            r = op(q[i], k[i], v[i], 0.0, causal, False, scale=scale)
            return r[0], r[1]
        return run, _dense_extract(cell, "bhsd")


class _TorchSdpaKernel(Backend):
    """An aten._scaled_dot_product_<kernel>_attention op taking compute_log_sumexp, with or
    without the LSE. Subclasses name the op; cuDNN's takes return_debug_mask after is_causal."""
    layout = "bhsd"
    op_name = label = None
    after_causal = ()

    def __init__(self, compute_lse=True):
        self.lse = compute_lse
        self.name = self.label if compute_lse else self.label + "-nolse"

    def prepare(self, cell, inp):
        op = _aten(self.op_name)
        _no_top_left_causal(cell)
        q, k, v = inp.bhsd()
        causal, scale, L, extra = cell.causal, cell.scale, self.lse, self.after_causal

        def run(i):
            r = op(q[i], k[i], v[i], None, L, 0.0, causal, *extra, scale=scale)
            return (r[0], r[1]) if L else r[0]
        return run, _dense_extract(cell, "bhsd")


class TorchCudnn(_TorchSdpaKernel):
    """aten._scaled_dot_product_cudnn_attention with or without compute_log_sumexp."""
    op_name, label, after_causal = "_scaled_dot_product_cudnn_attention", "torch-cudnn", (False,)


class TorchEfficient(_TorchSdpaKernel):
    """aten._scaled_dot_product_efficient_attention (memory-efficient / CUTLASS)."""
    op_name, label = "_scaled_dot_product_efficient_attention", "torch-efficient"


class CudnnSdpaGqa(Backend):
    """cuDNN through F.scaled_dot_product_attention(enable_gqa=True) (no LSE)."""
    name, lse, layout = "cudnn-sdpa-gqa", False, "bhsd"

    def prepare(self, cell, inp):
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:
            raise Unavailable("torch.nn.attention.sdpa_kernel not in this PyTorch")
        _no_top_left_causal(cell)
        F = torch.nn.functional
        q, k, v = self.inputs(inp)
        causal, scale = cell.causal, cell.scale
        gqa = cell.Hq != cell.Hkv

        def run(i):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q[i], k[i], v[i], is_causal=causal,
                                                      scale=scale, enable_gqa=gqa)
        return run, _dense_extract(cell, "bhsd")

    def inputs(self, inp):
        """The q, k and v input sets its calls read, [B, H, S, D]."""
        return inp.bhsd()


class CudnnSdpaGqaBshd(CudnnSdpaGqa):
    """cudnn-sdpa-gqa on the [B, S, H, D] tensors themselves, as [B, H, S, D] views: how a user
    whose cache is FlashAttention's layout calls cuDNN (the strided rows hipflash+lse reads)."""
    name, layout = "cudnn-sdpa-gqa-bshd", "bshd"

    def inputs(self, inp):
        return tuple([x.transpose(1, 2) for x in xs] for xs in (inp.q, inp.k, inp.v))


class FA2Native(Backend):
    """aten._flash_attention_forward: FlashAttention-2's own entry point, [B, S, H, D], native
    GQA, split-KV for decode, bottom-right causal; varlen through cu_seqlens."""
    name, lse, layout = "fa2-native", True, "bshd"
    kinds = ("dense", "varlen")

    def prepare(self, cell, inp):
        op = _aten("_flash_attention_forward")
        causal, scale = cell.causal, cell.scale
        if cell.kind == "varlen":
            from attn_ref import normalize_varlen_lse

            def run(i):
                r = op(inp.q[i], inp.k[i], inp.v[i], inp.cu_q, inp.cu_k, cell.max_q, cell.max_k,
                       0.0, causal, False, scale=scale)
                return r[0], r[1]

            def extract(res):
                return res[0], normalize_varlen_lse(res[1], cell.Hq, cell.cu_q)
            return run, extract

        def run(i):
            r = op(inp.q[i], inp.k[i], inp.v[i], None, None, cell.Sq, cell.Sk, 0.0, causal, False,
                   scale=scale)
            return r[0], r[1]
        return run, _dense_extract(cell, "bshd")


class EfficientVarlen(Backend):
    """aten._efficient_attention_forward with cu_seqlens ([1, total, H, D])."""
    name, lse, layout = "efficient-varlen", True, "bshd"
    kinds = ("varlen",)

    def prepare(self, cell, inp):
        op = _aten("_efficient_attention_forward")
        from attn_ref import normalize_varlen_lse

        mask_type = 2 if cell.causal else 0  # 2: causal from the bottom-right corner
        q = [x[None] for x in inp.q]
        k = [x[None] for x in inp.k]
        v = [x[None] for x in inp.v]
        scale = cell.scale

        def run(i):
            r = op(q[i], k[i], v[i], None, inp.cu_q, inp.cu_k, cell.max_q, cell.max_k, 0.0,
                   mask_type, True, scale=scale)
            return r[0], r[1]

        def extract(res):
            return res[0][0], normalize_varlen_lse(res[1], cell.Hq, cell.cu_q)
        return run, extract


# ---- FlexAttention ---------------------------------------------------------------------------

_FLEX = {}


def _flex_compiled():
    if "fn" in _FLEX:
        return _FLEX["fn"], _FLEX["aux"]
    from torch.nn.attention.flex_attention import flex_attention

    try:  # every shape is a new graph: keep Dynamo from giving up and running eager
        import torch._dynamo as dynamo
        for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                    "accumulated_cache_size_limit"):
            if hasattr(dynamo.config, key):
                setattr(dynamo.config, key, max(getattr(dynamo.config, key), 256))
    except Exception:
        pass
    try:
        from torch.nn.attention.flex_attention import AuxRequest
        aux = AuxRequest
    except ImportError:
        aux = None
    _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    _FLEX["aux"] = aux
    return _FLEX["fn"], aux


class Flex(Backend):
    """torch.compile(flex_attention) with the LSE (return_aux=AuxRequest(lse=True) where this
    PyTorch has it, else return_lse=True). Compiled once per shape, in the check call."""
    name, lse, layout = "flex", True, "bhsd"

    def available(self, device):
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except Exception as e:
            return False, f"flex_attention not importable: {e}"
        return True, ""

    def prepare(self, cell, inp):
        from torch.nn.attention.flex_attention import create_block_mask

        fn, aux = _flex_compiled()
        q, k, v = inp.bhsd()
        off = cell.Sk - cell.Sq
        block_mask = None
        if cell.causal:
            def causal_mod(b, h, qi, kv):
                return qi + off >= kv
            block_mask = create_block_mask(causal_mod, None, None, cell.Sq, cell.Sk,
                                           device=q[0].device)
        gqa = cell.Hq != cell.Hkv
        scale = cell.scale

        if aux is not None:
            req = aux(lse=True)

            def run(i):
                o, a = fn(q[i], k[i], v[i], block_mask=block_mask, scale=scale, enable_gqa=gqa,
                          return_aux=req)
                return o, a.lse
        else:
            def run(i):
                return fn(q[i], k[i], v[i], block_mask=block_mask, scale=scale, enable_gqa=gqa,
                          return_lse=True)
        return run, _dense_extract(cell, "bhsd")


# ---- CPU-only peers (the tiny suite that tests the runner without a GPU) ---------------------


class TorchSdpa(Backend):
    """F.scaled_dot_product_attention with PyTorch's own dispatch (no LSE)."""
    name, lse, layout = "torch-sdpa", False, "bhsd"
    devices = ("cpu", "cuda")

    def available(self, device):
        if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
            return False, f"F.scaled_dot_product_attention not in PyTorch {torch.__version__}"
        return True, ""

    def prepare(self, cell, inp):
        _no_top_left_causal(cell)
        q, k, v = inp.bhsd()
        F = torch.nn.functional
        gqa = cell.Hq != cell.Hkv
        kw = {"enable_gqa": True} if gqa else {}

        def run(i):
            return F.scaled_dot_product_attention(q[i], k[i], v[i], is_causal=cell.causal,
                                                  scale=cell.scale, **kw)
        return run, _dense_extract(cell, "bhsd")


class TorchMath(Backend):
    """Plain PyTorch matmul-softmax-matmul in the input dtype (the reference's low-precision
    path), returning the fp32 LSE: a baseline that runs anywhere."""
    name, lse, layout = "torch-math", True, "bshd"
    devices = ("cpu",)

    def prepare(self, cell, inp):
        from attn_ref import normalize_lse, reference

        def run(i):
            _, lse, out_lp = reference(inp.q[i], inp.k[i], inp.v[i], cell.scale, cell.causal)
            return out_lp, lse

        def extract(res):
            return res[0], normalize_lse(res[1], cell.B, cell.Hq, cell.Sq)
        return run, extract


def make_backends(hipflash_path=None):
    """Every backend by name."""
    bs = [Hipflash(False, hipflash_path), Hipflash(True, hipflash_path),
          HipflashPaged(1, hipflash_path), HipflashPaged(16, hipflash_path),
          HipflashPaged(256, hipflash_path),
          HipflashFp8Kv(hipflash_path), HipflashFp8(hipflash_path),
          HipflashBhsd(hipflash_path), CudnnSdpaGqaBshd(), TorchFlash(),
          TorchCudnn(True), TorchCudnn(False), TorchEfficient(True), TorchEfficient(False),
          Flex(), FA2Native(), CudnnSdpaGqa(), EfficientVarlen(), TorchSdpa(), TorchMath()]
    return {b.name: b for b in bs}
