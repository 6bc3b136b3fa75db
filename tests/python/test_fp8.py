"""fp8 (FlashAttention 3's): float8_e4m3fn q, k, v with fp32 descale factors, per tensor or per
(batch, kv head); the scores are q.k * q_descale * k_descale * softmax_scale, out (bfloat16) is
softmax . v * v_descale, the LSE that of the descaled scores. The CPU backend dequantises (the
reference); on the GPU the sm90_ws kernel runs them on Hopper (fp8 wgmma, the probabilities in
e4m3: judged against a reference that rounds them so, SPEC §6), and every call no fp8 kernel
takes (head dim 256, strides no TMA map describes, ALiBi, other GPUs) runs on the bf16 kernels
over bf16 copies (q * q_descale * k_descale, k, v * v_descale): bitwise the bf16 call on those
copies. An fp8 KV cache
(vLLM's kv_cache_dtype="fp8") runs on the CPU backend and on NVIDIA GPUs from sm_89 (decode
calls on the decode kernel, longer queries on the generic kernel; the GPU cases at the end). Needs a PyTorch with torch.float8_e4m3fn (2.1+)."""
import pytest
import torch

import hipflash
import hipflash.compat.flash_attn_interface as fa3
from reference import assert_bitwise_equal, check_attention, make_qkv

E4M3 = getattr(torch, "float8_e4m3fn", None)
needs_fp8 = pytest.mark.skipif(
    E4M3 is None, reason=f"this PyTorch ({torch.__version__}) has no torch.float8_e4m3fn (2.1+)")
GPU = torch.cuda.is_available() and hipflash.gpu_available()
BF16 = torch.bfloat16


def fp8_case(b, sq, sk, hq, hkv, d, seed=3):
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, torch.float32, seed=seed)
    return tuple((2 * t).to(E4M3) for t in (q, k, v))


def descales(b, hkv, per_head):
    """Powers of two: every scaling is exact, so the fp8 call equals bf16 on dequantised values."""
    shape = (b, hkv) if per_head else (1,)
    n = b * hkv if per_head else 1
    qd = torch.tensor([2.0 ** (i % 3 - 1) for i in range(n)]).reshape(shape)
    kd = torch.tensor([2.0 ** (2 - i % 4) for i in range(n)]).reshape(shape)
    vd = torch.tensor([2.0 ** (i % 2 + 1) for i in range(n)]).reshape(shape)
    return qd, kd, vd


def dequantised(t, d, hq):
    """t (B, S, H, D) as float32 times its descale, per tensor or per (batch, kv head)."""
    x = t.float()
    if d.numel() == 1:
        return x * d.reshape(())
    rep = t.shape[2] // d.shape[1]
    return x * d.repeat_interleave(rep, 1)[:, None, :, None]


@needs_fp8
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_kv_head"])
def test_equals_the_bf16_call_on_dequantised_values(per_head, causal, num_splits):
    b, sq, sk, hq, hkv, d = 2, 29, 113, 4, 2, 64
    q, k, v = fp8_case(b, sq, sk, hq, hkv, d)
    qd, kd, vd = descales(b, hkv, per_head)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, num_splits=num_splits,
                                        return_lse=True, q_descale=qd, k_descale=kd,
                                        v_descale=vd)
    assert out.dtype == BF16 and lse.dtype == torch.float32
    qb, kb, vb = (dequantised(t, s, hq).to(BF16) for t, s in ((q, qd), (k, kd), (v, vd)))
    want, want_lse = hipflash.flash_attn_func(qb, kb, vb, causal=causal, num_splits=num_splits,
                                              return_lse=True)
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    check_attention(out, lse, qb, kb, vb, "fp8", causal=causal)


@needs_fp8
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not GPU, reason="needs a GPU visible to torch and a hipflash built with GPU kernels"))])
def test_inputs_that_require_grad_run_forward_only(device):
    # FA3's fp8 tests quantise q, k, v that require grad (.to(float8_e4m3fn) keeps the graph):
    # fp8 is forward only, so the call runs as without grad and out carries none.
    q, k, v = (t.to(device) for t in fp8_case(2, 16, 40, 2, 1, 64))
    qd, kd, vd = (t.to(device) for t in descales(2, 1, True))
    graph = [t.to(BF16).requires_grad_().to(E4M3) for t in (q, k, v)]
    assert all(t.requires_grad for t in graph)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    out = hipflash.flash_attn_func(*graph, **kw)
    assert not out.requires_grad
    assert_bitwise_equal(out, hipflash.flash_attn_func(q, k, v, **kw), "dense")
    cu = torch.tensor([0, 16, 32], dtype=torch.int32, device=device)
    cuk = torch.tensor([0, 40, 80], dtype=torch.int32, device=device)
    got = hipflash.flash_attn_varlen_func(*(t.flatten(0, 1) for t in graph), cu, cuk, 16, 40,
                                          **kw)
    assert not got.requires_grad
    want = hipflash.flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), cu, cuk, 16,
                                           40, **kw)
    assert_bitwise_equal(got, want, "varlen")


@needs_fp8
def test_out_buffer_and_fa3_spelling():
    q, k, v = fp8_case(1, 16, 40, 2, 1, 64)
    qd, kd, vd = descales(1, 1, True)
    want = hipflash.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    out = torch.full(want.shape, float("nan"), dtype=BF16)
    assert hipflash.flash_attn_func(q, k, v, out=out, q_descale=qd, k_descale=kd,
                                    v_descale=vd) is out
    assert_bitwise_equal(out, want, "out=")
    assert_bitwise_equal(fa3.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd),
                         want, "fa3")
    # No descales: factors of 1.
    assert_bitwise_equal(hipflash.flash_attn_func(q, k, v),
                         hipflash.flash_attn_func(q, k, v, q_descale=torch.ones(1)), "ones")


def test_descales_on_other_dtypes_are_refused():
    # Runs on any PyTorch: the descales reach the launcher, which refuses them for bfloat16.
    q, k, v = make_qkv(1, 8, 8, 2, 2, 64, BF16)
    out = torch.full_like(q, float("nan"))
    for name in ("q_descale", "k_descale", "v_descale"):
        with pytest.raises(ValueError, match=f"{name} applies to float8_e4m3fn inputs only"):
            hipflash.flash_attn_func(q, k, v, out=out, **{name: torch.ones(1)})
        with pytest.raises(ValueError, match=f"{name} applies to float8_e4m3fn inputs only"):
            fa3.flash_attn_func(q, k, v, **{name: torch.ones(1)})
    assert torch.isnan(out).all()
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="q_descale applies to float8_e4m3fn inputs only"):
        fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, q_descale=torch.ones(1))
    with pytest.raises(NotImplementedError, match="q_descale"):  # FA3's kvcache: not yet
        fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=4, q_descale=torch.ones(1))


def test_cache_scales_of_a_varlen_call_are_refused_without_an_fp8_paged_cache():
    # Runs on any PyTorch: k_scale / v_scale belong to a block_table's fp8 cache.
    q, k, v = make_qkv(1, 8, 8, 2, 2, 64, BF16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale applies to an fp8 paged cache"):
        hipflash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, k_scale=torch.ones(1))
    pages, table = k.reshape(1, 8, 2, 64), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="v_scale applies to float8_e4m3fn caches only"):
        hipflash.flash_attn_varlen_func(q[0], pages, pages, cu, cu, 8, 8, block_table=table,
                                        v_scale=torch.ones(1))


@needs_fp8
@pytest.mark.parametrize("breaks, error, match", [
    (lambda q, k, v, kw: (q, k.to(BF16), v, kw), TypeError, "k must have dtype float8_e4m3fn"),
    (lambda q, k, v, kw: (q, k, v, dict(kw, q_descale=torch.ones(3))), ValueError,
     "q_descale must have shape"),
    (lambda q, k, v, kw: (q, k, v, dict(kw, k_descale=torch.ones(1, dtype=BF16))), TypeError,
     "k_descale must have dtype float32"),
    (lambda q, k, v, kw: (q.float().to(BF16), k.float().to(BF16), v.float().to(BF16), kw),
     ValueError, "q_descale applies to float8_e4m3fn inputs only"),
])
def test_bad_calls_are_refused_and_nothing_is_written(breaks, error, match):
    q, k, v = fp8_case(1, 8, 8, 2, 2, 64)
    q, k, v, kw = breaks(q, k, v, dict(q_descale=torch.ones(1)))
    out = torch.full((1, 8, 2, 64), float("nan"), dtype=BF16)
    with pytest.raises(error, match=match):
        hipflash.flash_attn_func(q, k, v, out=out, **kw)
    assert torch.isnan(out).all()


def fp8_gpu():
    """(ok, why): whether this GPU runs fp8 q, k and v on an fp8 kernel (Hopper with the sm90_ws
    kernels); other GPUs run them on bf16 copies (WIDE_GPU)."""
    if not GPU or E4M3 is None:
        return False, "needs a GPU visible to torch, a hipflash with GPU kernels and float8_e4m3fn"
    q = torch.zeros(1, 1, 1, 64, dtype=E4M3, device="cuda")
    try:
        hipflash.flash_attn_func(q, q, q)
    except Exception:  # it should run: the tests below say how it fails
        return True, ""
    name = hipflash.last_kernel_name()
    if not name.startswith("fwd_sm90_ws_fp8_"):
        return False, f"this GPU runs fp8 q, k and v on bf16 copies ({name}), not an fp8 kernel"
    return True, ""


FP8_GPU, FP8_GPU_WHY = fp8_gpu()
needs_fp8_gpu = pytest.mark.skipif(not FP8_GPU, reason=FP8_GPU_WHY)
WIDE_GPU = GPU and E4M3 is not None
needs_wide_gpu = pytest.mark.skipif(
    not WIDE_GPU, reason="needs a GPU visible to torch, a hipflash with GPU kernels "
    f"(this build: {hipflash.build_info()!r}) and float8_e4m3fn")


def fp8_reference(qf, kf, vf, causal=False, window_size=(-1, -1), softcap=0.0):
    """(ref32 out, fp8 lowp out, ref32 lse) of dequantised fp32 q, k, v: the low-precision one
    computes as the fp8 kernel does — fp32 scores, each probability exp(s - max) times 2^8
    rounded to e4m3 for P V, the row sum in fp32, out rounded to bf16 — the yardstick of SPEC
    §6's rule for the GPU's fp8 calls."""
    from reference import attention_ref, valid_mask
    out32, lse = attention_ref(qf, kf, vf, causal=causal, window_size=window_size,
                               softcap=softcap)
    b, sq, hq, d = qf.shape
    sk, hkv = kf.shape[1], kf.shape[2]
    g = hq // hkv
    s = torch.einsum("bqhgd,bkhd->bhgqk", qf.reshape(b, sq, hkv, g, d), kf) / d ** 0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~valid_mask(sq, sk, causal, window_size, qf.device), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    p8 = (p * 256).to(E4M3).float() / 256
    out = torch.einsum("bhgqk,bkhd->bqhgd", p8, vf) / p.sum(-1).permute(0, 3, 1, 2)[..., None]
    out = torch.nan_to_num(out, nan=0.0).reshape(b, sq, hq, d).to(BF16).float()
    return out32, out, lse


def check_fp8_gpu(out, lse, q, k, v, qd, kd, vd, what, **kw):
    """SPEC §6 for a GPU fp8 call: out against ref32 of the dequantised inputs within twice the
    fp8 low-precision reference's error (+1e-5), the LSE within 1e-3, -inf where it is."""
    from reference import check_lse
    hq = q.shape[2]
    qf, kf, vf = (dequantised(t.cpu(), s.cpu(), hq) for t, s in ((q, qd), (k, kd), (v, vd)))
    out32, out_lp, lse_ref = fp8_reference(qf, kf, vf, **kw)
    assert out.dtype == BF16 and not torch.isnan(out).any(), what
    err = (out.float().cpu() - out32).abs().max().item()
    tol = 2 * (out_lp - out32).abs().max().item() + 1e-5
    assert err <= tol, f"{what}: max|out - ref| = {err:.3e} > tolerance {tol:.3e}"
    if lse is not None:
        check_lse(lse.cpu(), lse_ref, what)


@needs_fp8_gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 200, 333, 4, 2), (1, 1, 130, 8, 1), (1, 640, 640, 2, 2),
                                   (3, 77, 1000, 6, 3)], ids=["odd", "decode", "square", "gqa3"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_kv_head"])
def test_gpu_fp8_forward_matches_the_reference(d, causal, shape, per_head):
    b, sq, sk, hq, hkv = shape
    q, k, v = (t.cuda() for t in fp8_case(b, sq, sk, hq, hkv, d, seed=sq + d))
    qd, kd, vd = (t.cuda() for t in descales(b, hkv, per_head))
    out = torch.full((b, sq, hq, d), float("nan"), dtype=BF16, device="cuda")
    _, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, out=out,
                                      q_descale=qd, k_descale=kd, v_descale=vd)
    check_fp8_gpu(out, lse, q, k, v, qd, kd, vd, f"d{d} {shape}", causal=causal)
    again = hipflash.flash_attn_func(q, k, v, causal=causal, q_descale=qd, k_descale=kd,
                                     v_descale=vd)
    assert_bitwise_equal(again, out, "without the LSE, and run again")
    assert hipflash.last_kernel_name().startswith("fwd_sm90_ws_fp8_"), hipflash.last_kernel_name()


@needs_fp8_gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_fp8_forward_splits(d, num_splits, causal):
    q, k, v = (t.cuda() for t in fp8_case(2, 96, 1500, 4, 2, d, seed=7))
    qd, kd, vd = (t.cuda() for t in descales(2, 2, True))
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True,
                                        num_splits=num_splits, q_descale=qd, k_descale=kd,
                                        v_descale=vd)
    check_fp8_gpu(out, lse, q, k, v, qd, kd, vd, f"splits {num_splits}", causal=causal)


@needs_fp8_gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp8_forward_blocks_walk_several_tiles(d, causal):
    # More tiles than any Hopper has SMs (hd128: 2 x 9 x 16 = 288 of 128 rows; hd64 unmasked:
    # 192 of 192): the persistent blocks walk several tiles each, their K, V and Vt rings and Q
    # stages carried from one tile into the next, a key tail (700) in every tile.
    q, k, v = (t.cuda() for t in fp8_case(2, 1152, 700, 16, 4, d, seed=11))
    qd, kd, vd = (t.cuda() for t in descales(2, 4, True))
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, q_descale=qd,
                                        k_descale=kd, v_descale=vd)
    assert hipflash.last_kernel_name().startswith("fwd_sm90_ws_fp8_"), hipflash.last_kernel_name()
    check_fp8_gpu(out, lse, q, k, v, qd, kd, vd, f"d{d} several tiles a block", causal=causal)


@needs_fp8_gpu
def test_gpu_fp8_forward_long_rows_masked_hd64():
    # The masked hd64 long-row tile (three consumers; sm90_ws::long_row_tile): 4k query rows
    # seeing 4k keys or more on average (causal, bottom-right, over 6k keys) and 12 heads of 22
    # 192-row tiles, two for each of 132 multiprocessors.
    q, k, v = (t.cuda() for t in fp8_case(1, 4096, 6144, 12, 4, 64, seed=13))
    qd, kd, vd = (t.cuda() for t in descales(1, 4, True))
    out, lse = hipflash.flash_attn_func(q, k, v, causal=True, return_lse=True, q_descale=qd,
                                        k_descale=kd, v_descale=vd)
    name = hipflash.last_kernel_name()
    assert name.startswith("fwd_sm90_ws_fp8_") and "_longrows" in name, name
    check_fp8_gpu(out, lse, q, k, v, qd, kd, vd, "long rows", causal=True)


@needs_fp8_gpu
@pytest.mark.parametrize("d", [32, 96])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp8_forward_padded_head_dims(d, causal):
    # 32 and 96 run on the 64 / 128 tiles, their last head-dim bytes read as zeros.
    q, k, v = (t.cuda() for t in fp8_case(2, 150, 260, 4, 2, d, seed=d))
    qd, kd, vd = (t.cuda() for t in descales(2, 2, True))
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, q_descale=qd,
                                        k_descale=kd, v_descale=vd)
    check_fp8_gpu(out, lse, q, k, v, qd, kd, vd, f"d{d}", causal=causal)


@needs_fp8_gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gpu_fp8_forward_rows_without_keys(d, num_splits):
    # Causal with Sq > Sk (bottom-right: the first Sq - Sk rows see no key) and a band window
    # that leaves them empty too: out 0 and LSE -inf there (check_fp8_gpu), through the splits.
    q, k, v = (t.cuda() for t in fp8_case(1, 300, 100, 2, 2, d, seed=3))
    one = torch.ones(1, device="cuda")
    for kw in (dict(causal=True), dict(window_size=(10, 0))):
        out, lse = hipflash.flash_attn_func(q, k, v, return_lse=True, num_splits=num_splits, **kw)
        check_fp8_gpu(out, lse, q, k, v, one, one, one, str(kw), **kw)
        assert torch.isneginf(lse[:, :, :200]).all(), "rows 0 .. 199 see no key"


@needs_fp8_gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mod", ["window", "softcap", "no_descale"])
def test_gpu_fp8_forward_options(mod, d):
    q, k, v = (t.cuda() for t in fp8_case(2, 300, 700, 4, 4, d, seed=9))
    qd, kd, vd = (t.cuda() for t in descales(2, 4, False))
    kw, ref_kw = {}, {}
    if mod == "window":
        kw = ref_kw = dict(window_size=(100, 20))
    elif mod == "softcap":
        kw = ref_kw = dict(softcap=3.0)
    else:
        qd = kd = vd = torch.ones(1, device="cuda")
    desc = {} if mod == "no_descale" else dict(q_descale=qd, k_descale=kd, v_descale=vd)
    out, lse = hipflash.flash_attn_func(q, k, v, return_lse=True, **kw, **desc)
    check_fp8_gpu(out, lse, q, k, v, qd, kd, vd, mod, **ref_kw)


@needs_wide_gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_gpu_fp8_forward_nan_reaches_its_rows(where, d):
    # A NaN byte (0x7f) in one row of q, k or v: out NaN wherever the CPU backend has it —
    # exactly there for q and k; for v also in rows whose mask hides that key but whose key
    # block holds it (P = 0 times NaN in the tensor-core product: SPEC §3's documented case).
    # Head dim 256 runs on bf16 copies, where the NaN byte is a NaN element.
    q, k, v = fp8_case(1, 200, 300, 2, 2, d, seed=4)
    t = dict(q=q, k=k, v=v)[where]
    t.view(torch.uint8)[0, 150, 1, 7] = 0x7F
    out = hipflash.flash_attn_func(q.cuda(), k.cuda(), v.cuda(), causal=True)
    want = hipflash.flash_attn_func(q, k, v, causal=True)  # the CPU backend
    got_nan, want_nan = torch.isnan(out.cpu()), torch.isnan(want)
    assert want_nan.any() and not (want_nan & ~got_nan).any()
    if where != "v":
        assert torch.equal(got_nan, want_nan)


def bf16_copies(q, k, v, qd, kd, vd):
    """The bf16 tensors a widened fp8 call computes on: q * q_descale * k_descale, k and
    v * v_descale, each rounded once to bfloat16, contiguous."""
    hq = q.shape[2]
    return (dequantised(q, qd * kd, hq).to(BF16).contiguous(), k.to(BF16).contiguous(),
            dequantised(v, vd, hq).to(BF16).contiguous())


NVIDIA_WIDE = pytest.mark.skipif(
    torch.version.hip is not None, reason="on AMD the generic kernel's fp8 body takes these "
    "calls itself (gfx94x / gfx950) and ALiBi is refused")


@needs_wide_gpu
@NVIDIA_WIDE
@pytest.mark.parametrize("case", ["hd256", "alibi", "broadcast_kv", "odd_descales_hd256",
                                  "decode_hd256"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_kv_head"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gpu_fp8_calls_no_fp8_kernel_takes_run_on_bf16_copies(case, causal, per_head, num_splits):
    # Head dim 256 (past the fp8 tiles; GQA decode too, its query heads packed after the
    # widening), ALiBi (no fp8 kernel adds it), a kv head stride of 0 (no TMA map describes it):
    # the fp8 call widens q, k and v and runs the bf16 kernel, bitwise the bf16 call on the same
    # copies (out and LSE, the kernel named alike); with power-of-two descales the copies are
    # exact and SPEC §6's fp8 rule holds against the fp32 reference.
    d = 256 if case.endswith("hd256") else 128  # named so that -k "not 256" leaves them out
    b, sq, sk, hq, hkv = 2, 1 if case.startswith("decode") else 150, 333, 4, 2
    q, k, v = (t.cuda() for t in fp8_case(b, sq, sk, hq, hkv, d, seed=d + sq))
    if case == "broadcast_kv":
        k, v = (t[:, :, :1].expand(b, sk, hkv, d) for t in (k, v))
    qd, kd, vd = (t.cuda() for t in descales(b, hkv, per_head))
    if case.startswith("odd_descales"):  # each product rounded once to bf16, alike in both calls
        g = torch.Generator().manual_seed(5)
        qd, kd, vd = ((torch.rand(qd.shape, generator=g) + 0.5).cuda() for _ in range(3))
    kw = dict(causal=causal, num_splits=num_splits, return_lse=True)
    if case == "alibi":
        kw["alibi_slopes"] = torch.tensor([0.25, 0.125, 0.0625, 0.5], device="cuda")
    out = torch.full((b, sq, hq, d), float("nan"), dtype=BF16, device="cuda")
    _, lse = hipflash.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, out=out,
                                      **kw)
    name = hipflash.last_kernel_name()
    assert "_from_fp8_" in name, name
    want, want_lse = hipflash.flash_attn_func(*bf16_copies(q, k, v, qd, kd, vd), **kw)
    assert hipflash.last_kernel_name() == name.replace("_from_fp8", ""), name
    assert_bitwise_equal(out, want, f"{case} out")
    assert_bitwise_equal(lse, want_lse, f"{case} lse")
    if case != "alibi" and not case.startswith("odd_descales"):
        check_fp8_gpu(out, lse, q, k, v, qd, kd, vd, case, causal=causal)


def test_cache_scales_need_an_fp8_cache():
    # Runs on any PyTorch: the scales reach the launcher, which refuses them for a bf16 cache.
    q = torch.randn(1, 1, 2, 64).to(BF16)
    cache = torch.zeros(1, 16, 2, 64, dtype=BF16)
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=f"{name} applies to float8_e4m3fn caches only"):
            hipflash.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=4,
                                             **{name: torch.ones(1)})


@needs_fp8
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_fp8_cache_equals_the_bf16_cache_of_its_dequantised_values(paged):
    # vLLM's kv_cache_dtype="fp8": the cache holds K / k_scale; appended rows are quantised in
    # place (saturating at 448). Power-of-two scales: bitwise the bf16 cache of the same values.
    torch.manual_seed(4)
    b, hq, hkv, d, cap, ks, vs = 2, 8, 2, 64, 64, 0.5, 0.25
    q = torch.randn(b, 2, hq, d).to(BF16)
    k_new, v_new = torch.randn(b, 2, hkv, d).to(BF16), torch.randn(b, 2, hkv, d).to(BF16)
    k_new[0, 0, 0, 0] = 1000.0  # 2000 after the scale: saturates to 448
    k8 = (torch.randn(b, cap, hkv, d) / ks).to(E4M3)
    v8 = (torch.randn(b, cap, hkv, d) / vs).to(E4M3)
    lens = torch.tensor([37, 5], dtype=torch.int32)
    table = None
    if paged:  # pages of 16 rows, in reverse order
        table = torch.arange(b * cap // 16, dtype=torch.int32).flip(0).reshape(b, cap // 16)
        order = table.flatten().argsort()  # (indexing as bytes: few ops take float8)
        k8 = k8.view(torch.uint8).reshape(-1, 16, hkv, d)[order].view(E4M3)
        v8 = v8.view(torch.uint8).reshape(-1, 16, hkv, d)[order].view(E4M3)
    kb, vb = (k8.float() * ks).to(BF16), (v8.float() * vs).to(BF16)

    def deq(x, s):
        return (x.float() / s).clamp(-448, 448).to(E4M3).float().mul(s).to(BF16)

    kw = dict(cache_seqlens=lens, block_table=table, causal=True, return_lse=True)
    out8, lse8 = hipflash.flash_attn_with_kvcache(q, k8, v8, k_new, v_new, **kw,
                                                  k_scale=torch.tensor(ks),
                                                  v_scale=torch.tensor([vs]))
    out, lse = hipflash.flash_attn_with_kvcache(q, kb, vb, deq(k_new, ks), deq(v_new, vs), **kw)
    assert out8.dtype == BF16
    assert_bitwise_equal(out8, out, "out")
    assert_bitwise_equal(lse8, lse, "lse")
    assert_bitwise_equal((k8.float() * ks).to(BF16), kb, "k_cache after the append")
    assert_bitwise_equal((v8.float() * vs).to(BF16), vb, "v_cache after the append")
    first_new = k8[table[0, 2], 37 - 32] if paged else k8[0, 37]
    assert first_new[0, 0].float() == 448.0


# ---- An fp8 KV cache on the GPU (sm_89+): the decode kernel up to 16 query rows per kv head,
# the generic kernel beyond.

needs_gpu_fp8 = pytest.mark.skipif(
    E4M3 is None or not GPU or (GPU and torch.cuda.get_device_capability() < (8, 9)),
    reason="needs torch.float8_e4m3fn, a GPU of sm_89 or newer visible to torch and a hipflash "
           f"built with GPU kernels (this build: {hipflash.build_info()!r})")


def fp8_cache(lens, cap, hkv, d, ks, vs, page=None, seed=5):
    """A contiguous e4m3 cache [B, cap, Hkv, D] (K / k_scale, V / v_scale of unit normals) and,
    with `page`, the same rows on shuffled pages with a block table. Rows past each length hold
    NaN bytes (0x7f), which the call must not read."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    k8 = (torch.randn(b, cap, hkv, d, generator=g) / ks).to(E4M3)
    v8 = (torch.randn(b, cap, hkv, d, generator=g) / vs).to(E4M3)
    for i, n in enumerate(lens):
        k8.view(torch.uint8)[i, n:] = 0x7F
        v8.view(torch.uint8)[i, n:] = 0x7F
    if page is None:
        return k8, v8, None
    blocks = b * cap // page
    table = torch.randperm(blocks, generator=g).to(torch.int32).reshape(b, cap // page)
    order = table.flatten().argsort()
    kp = k8.view(torch.uint8).reshape(-1, page, hkv, d)[order].view(E4M3)
    vp = v8.view(torch.uint8).reshape(-1, page, hkv, d)[order].view(E4M3)
    return kp, vp, table


def check_fp8_cache_call(out, lse, q, k8, v8, lens, ks, vs, **kw):
    """Each sequence against the reference on its dequantised keys (fp32), SPEC §6's tolerance."""
    for i, n in enumerate(lens):
        kf = k8[i:i + 1, :n].float() * ks
        vf = v8[i:i + 1, :n].float() * vs
        check_attention(out[i:i + 1], lse[i:i + 1], q[i:i + 1], kf, vf, what=f"sequence {i}",
                        **kw)


@needs_gpu_fp8
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("heads, sq", [((8, 2), 1), ((2, 2), 5), ((64, 2), 1)],
                         ids=["gqa4_decode", "sq5", "group32_unpacked"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_fp8_cache_matches_the_reference(d, dtype, heads, sq, num_splits, paged):
    hq, hkv = heads
    lens, cap, ks, vs = [300, 0, 77], 320, 0.03, 0.02
    k8, v8, _ = fp8_cache(lens, cap, hkv, d, ks, vs)
    kc, vc, table = fp8_cache(lens, cap, hkv, d, ks, vs, page=16 if paged else None)
    q = torch.randn(len(lens), sq, hq, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
              block_table=None if table is None else table.cuda(), causal=True,
              num_splits=num_splits, return_lse=True,
              k_scale=torch.tensor(ks, device="cuda"), v_scale=torch.tensor([vs], device="cuda"))
    out, lse = hipflash.flash_attn_with_kvcache(q.cuda(), kc.cuda(), vc.cuda(), **kw)
    assert hipflash.last_kernel_name().startswith("fwd_decode_") and "_kvfp8_" in \
        hipflash.last_kernel_name(), hipflash.last_kernel_name()
    assert out.dtype == dtype
    check_fp8_cache_call(out.cpu(), lse.cpu(), q, k8, v8, lens, ks, vs, causal=True)


@needs_gpu_fp8
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_fp8_cache_append_writes_the_cpu_bytes(paged):
    # The append quantises k / k_scale in place as the CPU backend does (bitwise), then the call
    # reads the new rows; the result agrees with the CPU backend's within the tolerance.
    lens, cap, hkv, hq, d, ks, vs = [40, 3], 64, 2, 8, 128, 0.05, 0.04
    kc, vc, table = fp8_cache(lens, cap, hkv, d, ks, vs, page=16 if paged else None)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 3, hq, d, generator=g).to(BF16)
    k_new = torch.randn(2, 3, hkv, d, generator=g).to(BF16)
    v_new = torch.randn(2, 3, hkv, d, generator=g).to(BF16)
    k_new[0, 0, 0, :4] = torch.tensor([1000.0, -1000.0, float("nan"), 1e-12])  # saturate, NaN, 0
    v_new[1, 2, 1, :2] = torch.tensor([3e-7, -22.4])
    seqlens = torch.tensor(lens, dtype=torch.int32)
    args = dict(block_table=table, causal=True, return_lse=True, k_scale=torch.tensor(ks),
                v_scale=torch.tensor(vs))
    k_cpu, v_cpu = kc.clone(), vc.clone()
    out_cpu, lse_cpu = hipflash.flash_attn_with_kvcache(q, k_cpu, v_cpu, k_new, v_new,
                                                        cache_seqlens=seqlens, **args)
    cuda = {n: (t.cuda() if torch.is_tensor(t) else t) for n, t in args.items()}
    k_gpu, v_gpu = kc.cuda(), vc.cuda()
    out, lse = hipflash.flash_attn_with_kvcache(q.cuda(), k_gpu, v_gpu, k_new.cuda(), v_new.cuda(),
                                                cache_seqlens=seqlens.cuda(), **cuda)
    for name, gpu, cpu in (("k_cache", k_gpu, k_cpu), ("v_cache", v_gpu, v_cpu)):
        g8, c8 = gpu.cpu().view(torch.uint8), cpu.view(torch.uint8)
        bad = (g8 != c8).nonzero()[:8].tolist()
        assert not bad, f"{name} bytes differ at {bad}: gpu {[g8[tuple(i)].item() for i in bad]}, " \
                        f"cpu {[c8[tuple(i)].item() for i in bad]}"
    # Sequence 0's first new key holds a NaN: its rows that see it are NaN on both backends.
    assert torch.equal(torch.isnan(out.cpu()), torch.isnan(out_cpu))
    assert torch.equal(torch.isnan(lse.cpu()), torch.isnan(lse_cpu))
    ok = ~torch.isnan(out_cpu)
    assert (out.cpu()[ok].float() - out_cpu[ok].float()).abs().max() < 2e-2
    fin = torch.isfinite(lse_cpu)
    assert (lse.cpu()[fin] - lse_cpu[fin]).abs().max() < 1e-3


@needs_gpu_fp8
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_fp8_cache_nan_reaches_its_rows(where, num_splits):
    lens, cap, hkv, hq, d = [200, 200], 256, 2, 4, 128
    kc, vc, _ = fp8_cache(lens, cap, hkv, d, 0.1, 0.1)
    (kc if where == "k" else vc).view(torch.uint8)[1, 150, 0, 7] = 0xFF  # -NaN, kv head 0
    q = torch.randn(2, 1, hq, d).to(BF16).cuda()
    out, lse = hipflash.flash_attn_with_kvcache(
        q, kc.cuda(), vc.cuda(), cache_seqlens=torch.tensor(lens, dtype=torch.int32).cuda(),
        num_splits=num_splits, return_lse=True, k_scale=torch.tensor(0.1).cuda(),
        v_scale=torch.tensor(0.1).cuda())
    out, lse = out.cpu(), lse.cpu()
    # Query heads 0 and 1 (kv head 0) of sequence 1 see the NaN: a key's NaN reaches their
    # whole rows and LSE, a value's NaN their column 7 alone.
    nan = torch.zeros_like(out, dtype=torch.bool)
    if where == "k":
        nan[1, :, :2] = True
    else:
        nan[1, :, :2, 7] = True
    assert torch.equal(torch.isnan(out), nan), torch.isnan(out).nonzero()[:8].tolist()
    lse_nan = torch.zeros_like(lse, dtype=torch.bool)
    if where == "k":
        lse_nan[1, :2] = True
    assert torch.equal(torch.isnan(lse), lse_nan)


@needs_gpu_fp8
def test_gpu_fp8_cache_keeps_queries_of_any_magnitude():
    # Q is rounded to f16 after a power-of-two scale a row: bf16 rows far outside f16's range
    # (and tiny ones) give the reference's result, with softmax_scale bringing the scores back.
    lens, cap, hkv, hq, d = [96], 128, 1, 4, 64
    kc, vc, _ = fp8_cache(lens, cap, hkv, d, 1.0, 1.0)
    q = torch.randn(1, 1, hq, d, generator=torch.Generator().manual_seed(2))
    q[0, 0, 0] *= 1e30
    q[0, 0, 1] *= 1e-6  # below f16's normal range
    q[0, 0, 2, ::2] = 0  # mixed magnitudes within one row
    q[0, 0, 2, 1] = 3e20
    for scale, rows in ((1e-30, [0]), (65536.0, [1]), (1e-20, [2]), (0.125, [3])):
        qb = q.to(BF16)
        out, lse = hipflash.flash_attn_with_kvcache(
            qb.cuda(), kc.cuda(), vc.cuda(), cache_seqlens=torch.tensor(lens, dtype=torch.int32).cuda(),
            softmax_scale=scale, return_lse=True)
        ref_out, ref_lse = check_fp8_reference(qb, kc, vc, lens, scale)
        for r in rows:
            assert (out.cpu()[0, 0, r].float() - ref_out[0, 0, r]).abs().max() < 3e-2, (scale, r)
            assert abs(lse.cpu()[0, r, 0] - ref_lse[0, r, 0]) < 1e-2 * max(1.0, abs(ref_lse[0, r, 0])), (scale, r)


def check_fp8_reference(q, k8, v8, lens, scale):
    from reference import attention_ref
    n = lens[0]
    return attention_ref(q, k8[:, :n].float(), v8[:, :n].float(), softmax_scale=scale)


@needs_gpu_fp8
@pytest.mark.parametrize("mod", ["softcap", "alibi", "window"])
def test_gpu_fp8_cache_with_score_modifiers(mod):
    lens, cap, hkv, hq, d, ks, vs = [180, 33], 192, 2, 8, 128, 0.05, 0.05
    kc, vc, _ = fp8_cache(lens, cap, hkv, d, ks, vs)
    q = torch.randn(2, 1, hq, d, generator=torch.Generator().manual_seed(3)).to(BF16)
    kw = dict(softcap=20.0) if mod == "softcap" else (
        dict(alibi_slopes=torch.linspace(0.05, 0.5, hq)) if mod == "alibi" else
        dict(window_size=(50, 0), causal=True))
    gkw = {n: (t.cuda() if torch.is_tensor(t) else t) for n, t in kw.items()}
    out, lse = hipflash.flash_attn_with_kvcache(
        q.cuda(), kc.cuda(), vc.cuda(), cache_seqlens=torch.tensor(lens, dtype=torch.int32).cuda(),
        return_lse=True, k_scale=torch.tensor(ks).cuda(), v_scale=torch.tensor(vs).cuda(), **gkw)
    check_fp8_cache_call(out.cpu(), lse.cpu(), q, kc, vc, lens, ks, vs, **kw)


def unpage(kp, table):
    """A paged cache's rows as a contiguous [B, cap, Hkv, D] cache (the block table's order)."""
    b, pages = table.shape
    return kp.view(torch.uint8)[table.flatten().long()].reshape(
        b, pages * kp.shape[1], *kp.shape[2:]).view(E4M3)


@needs_gpu_fp8
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_fp8_cache_prefill_runs_on_the_generic_kernel(d, dtype, num_splits, paged):
    # More than 16 query rows per kv head (chunked prefill: 40 new rows appended and attended,
    # causal): the generic kernel widens the e4m3 rows to q's dtype in shared memory. Rows past
    # each sequence's keys hold NaN bytes, which it must not read.
    lens, cap, hkv, hq, sq, ks, vs = [100, 0, 333], 384, 2, 4, 40, 0.04, 0.03
    kc, vc, table = fp8_cache(lens, cap, hkv, d, ks, vs, page=16 if paged else None)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(len(lens), sq, hq, d, generator=g).to(dtype)
    k_new = torch.randn(len(lens), sq, hkv, d, generator=g).to(dtype)
    v_new = torch.randn(len(lens), sq, hkv, d, generator=g).to(dtype)
    kc, vc = kc.cuda(), vc.cuda()
    out, lse = hipflash.flash_attn_with_kvcache(
        q.cuda(), kc, vc, k_new.cuda(), v_new.cuda(),
        cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_table=None if table is None else table.cuda(), causal=True, return_lse=True,
        num_splits=num_splits, k_scale=torch.tensor(ks, device="cuda"),
        v_scale=torch.tensor([vs], device="cuda"))
    name = hipflash.last_kernel_name()
    assert name.startswith("fwd_generic_") and "_kvfp8_" in name, name
    assert out.dtype == dtype
    k8, v8 = kc.cpu(), vc.cpu()  # the cache after the append
    if paged:
        k8, v8 = unpage(k8, table), unpage(v8, table)
    check_fp8_cache_call(out.cpu(), lse.cpu(), q, k8, v8, [n + sq for n in lens], ks, vs,
                         causal=True)


def quantise_per_tensor(x):
    """x as float8_e4m3fn with a per-tensor scale amax / 448 (FlashAttention 3's recipe)."""
    scale = (x.float().abs().max() / 448.0).clamp(min=1e-12)
    return (x.float() / scale).to(E4M3), scale.reshape(1)


@needs_fp8
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not GPU, reason="needs a GPU visible to torch and a hipflash built with GPU kernels"))])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_lse_within_2e2_of_the_bf16_reference(device, causal):
    # SPEC §6's fp8 rule against the 16-bit inputs before quantisation: |LSE - ref| within 2e-2
    # on average over the rows, 6e-2 at the worst (e4m3 rounding alone reaches ~0.045). The fp8
    # forward runs on the CPU backend (the GPU refuses fp8 q, k, v for now); an fp8 KV cache
    # with bf16 queries on either.
    q, k, v = make_qkv(2, 64, 96, 4, 2, 128, torch.bfloat16, seed=11)
    from reference import attention_ref
    _, ref_lse = attention_ref(q, k, v, causal=causal)
    if device == "cpu":
        (q8, qs), (k8, ks), (v8, vs) = (quantise_per_tensor(t) for t in (q, k, v))
        _, lse = hipflash.flash_attn_func(q8, k8, v8, causal=causal, return_lse=True,
                                          q_descale=qs, k_descale=ks, v_descale=vs)
        err = (lse - ref_lse).abs()
        assert err.mean() < 2e-2 and err.max() < 6e-2, (err.mean(), err.max())
    (k8, ks), (v8, vs) = (quantise_per_tensor(t) for t in (k, v))
    qd = q[:, :1].to(device)  # one query row: the decode kernel on the GPU
    _, lse = hipflash.flash_attn_with_kvcache(qd, k8.to(device), v8.to(device), causal=causal,
                                              return_lse=True, k_scale=ks.to(device),
                                              v_scale=vs.to(device))
    _, ref1 = attention_ref(q[:, :1], k, v, causal=causal)
    err = (lse.cpu() - ref1).abs()
    assert err.mean() < 2e-2 and err.max() < 6e-2, (err.mean(), err.max())


@needs_fp8
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if GPU else []))
def test_fa3_all_e4m3_kvcache_call(device):
    # FA3's fp8 flash_attn_with_kvcache (q, the cache and the new k / v all e4m3, no descales):
    # bitwise hipflash's fp8-cache call with q and k / v widened to bf16, which is exact; the
    # appended rows the new ones' bytes; out bf16.
    q, k, v = (t.to(device) for t in fp8_case(2, 3, 4, 8, 2, 64, seed=5))
    kc, vc = (t.to(device) for t in fp8_case(2, 1, 40, 2, 2, 64, seed=6)[1:])
    seqlens = torch.tensor([10, 30], dtype=torch.int32, device=device)
    caches = kc.clone(), vc.clone()
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, *caches, k=k, v=v, cache_seqlens=seqlens,
                                               causal=True, return_softmax_lse=True)
    want_caches = kc.clone(), vc.clone()
    want, want_lse = hipflash.flash_attn_with_kvcache(
        q.to(BF16), *want_caches, k.to(BF16), v.to(BF16), seqlens, causal=True, return_lse=True)
    assert out.dtype == BF16
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    for got, ref in zip(caches, want_caches):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(caches[0][0, 10:14].view(torch.uint8), k[0].view(torch.uint8))


@needs_fp8
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu_fp8)])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_queries_against_an_fp8_paged_cache(device, d):
    # Chunked prefill with an fp8 cache (flash_attn_varlen_func with a block_table, k_scale and
    # v_scale): each sequence's rows against the reference on its dequantised keys (its cache's
    # first cu_seqlens_k lengths; NaN bytes past them), causal bottom-right. On the GPU the
    # generic kernel (more than 16 rows of a sequence) or the decode kernel (the short call).
    lens_k, cap, hkv, hq, ks, vs = [100, 0, 333, 17], 352, 2, 4, 0.04, 0.03
    k8, v8, _ = fp8_cache(lens_k, cap, hkv, d, ks, vs)
    kp, vp, table = fp8_cache(lens_k, cap, hkv, d, ks, vs, page=16)
    for lens_q in ([40, 0, 33, 17], [3, 0, 1, 2]):
        q = torch.randn(sum(lens_q), hq, d, generator=torch.Generator().manual_seed(7)).to(BF16)
        cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
        out, lse = hipflash.flash_attn_varlen_func(
            q.to(device), kp.to(device), vp.to(device), cu_q.to(device), cu_k.to(device),
            max(lens_q), max(lens_k), causal=True, return_lse=True, block_table=table.to(device),
            k_scale=torch.tensor(ks, device=device), v_scale=torch.tensor([vs], device=device))
        assert out.dtype == BF16
        out, lse = out.cpu(), lse.cpu()
        for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
            if nq == 0:
                continue
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            check_attention(out[None, rows], lse[b:b + 1, :, :nq].contiguous(), q[None, rows],
                            k8[b:b + 1, :nk].float() * ks, v8[b:b + 1, :nk].float() * vs,
                            what=f"sequence {b} of {lens_q}", causal=True)


@needs_fp8
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu_fp8)])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged"])
def test_attention_chunk_with_an_fp8_cache(device, page):
    # attention_chunk against an fp8 cache (the pieces: varlen queries against it as pages of one
    # row): the new rows quantised as the call without chunks stores them (bitwise), each
    # sequence's rows against the reference with the chunk mask on its dequantised keys.
    lens, cap, hkv, hq, d, ks, vs, sq, chunk = [30, 0, 45], 96, 2, 4, 64, 0.05, 0.04, 7, 16
    k8, v8, table = fp8_cache(lens, cap, hkv, d, ks, vs, page=page)
    g = torch.Generator().manual_seed(12)
    q, k_new, v_new = (torch.randn(len(lens), sq, n, d, generator=g).to(BF16)
                       for n in (hq, hkv, hkv))
    dev = lambda *ts: [None if t is None else t.to(device) for t in ts]  # noqa: E731
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device), causal=True,
              return_lse=True, k_scale=torch.tensor(ks, device=device),
              v_scale=torch.tensor([vs], device=device),
              block_table=None if table is None else table.to(device))
    kc, vc = dev(k8.clone(), v8.clone())
    out, lse = hipflash.flash_attn_with_kvcache(*dev(q), kc, vc, *dev(k_new, v_new),
                                                attention_chunk=chunk, **kw)
    kc2, vc2 = dev(k8.clone(), v8.clone())
    hipflash.flash_attn_with_kvcache(*dev(q), kc2, vc2, *dev(k_new, v_new), **kw)
    for got, want in ((kc, kc2), (vc, vc2)):
        assert torch.equal(got.view(torch.uint8).cpu(), want.view(torch.uint8).cpu())
    kd, vd = kc.cpu(), vc.cpu()
    if page:
        kd, vd = unpage(kd, table), unpage(vd, table)
    for b, n in enumerate(lens):
        check_attention(out[b:b + 1].cpu(), lse[b:b + 1].cpu(), q[b:b + 1],
                        kd[b:b + 1, :n + sq].float() * ks, vd[b:b + 1, :n + sq].float() * vs,
                        what=f"sequence {b}", causal=True, attention_chunk=chunk)


@needs_fp8
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu_fp8)])
def test_fa3_all_e4m3_varlen_kvcache_call(device):
    # FA3's fp8 flash_attn_with_kvcache with varlen queries and a page table (q, the cache and
    # the new k / v all e4m3): bitwise hipflash's paged varlen call with q widened to bf16 on
    # the cache after the append, which copies the new rows' bytes.
    lens, cap, hkv, hq, d = [20, 5], 64, 2, 4, 64
    kp, vp, table = fp8_cache(lens, cap, hkv, d, 1.0, 1.0, page=16)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(30, hq, d, generator=g).to(E4M3)
    k_new = torch.randn(30, hkv, d, generator=g).to(E4M3)
    v_new = torch.randn(30, hkv, d, generator=g).to(E4M3)
    cu_q = torch.tensor([0, 18, 30], dtype=torch.int32)
    dev = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    kc, vc = dev(kp.clone(), vp.clone())
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        *dev(q), kc, vc, *dev(k_new, v_new), cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                                                        device=device),
        page_table=table.to(device), cu_seqlens_q=cu_q.to(device),
        cu_seqlens_k_new=cu_q.to(device), max_seqlen_q=18, causal=True, return_softmax_lse=True)
    assert out.dtype == BF16
    new_lens = [n + m for n, m in zip(lens, (18, 12))]
    cu_k = torch.tensor([0, new_lens[0], sum(new_lens)], dtype=torch.int32)
    want, want_lse = hipflash.flash_attn_varlen_func(
        *dev(q.to(BF16), kc, vc, cu_q, cu_k), 18, max(new_lens), causal=True, return_lse=True,
        lse_layout="packed", block_table=table.to(device))
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    k8 = unpage(kc.cpu(), table)
    assert torch.equal(k8[0, 20:38].view(torch.uint8), k_new[:18].view(torch.uint8))


@needs_fp8
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_wide_gpu)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("len0", [113, 150, 200])
def test_varlen_fp8_equals_each_sequences_dense_call(causal, device, d, len0):
    # Varlen fp8 with descales per (sequence, kv head): each sequence bitwise the dense fp8 call
    # on it alone with its descale row (on the GPU the same sm90_ws tiles, the keys a box reads
    # past a sequence zeroed as the dense map's edge zero-fills them; head dim 256 on bf16
    # copies, each row scaled by its sequence's descales); FA3's varlen spelling returns the
    # same. Sequence 1's keys and values are NaN and e4m3's largest: they must reach no other
    # sequence (0 x NaN in P V).
    # Every sequence's dense call has more than 16 query rows, so that no decode kernel takes
    # it where the bf16 copies run (nor the varlen call, of 29 rows at most).
    # Sequence 0's keys (len0) end inside its last key block at every key-block size the fp8
    # tiles have, a block's first 128 keys or past them (150, 200: a partial second 128-key
    # panel of V transposed), so that only the tail's zeroing keeps sequence 1's NaN out.
    hq, hkv, n_k = 4, 2, len0 + 45
    cu_q = torch.tensor([0, 29, 29, 49], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, len0, len0 + 5, n_k], dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(2)
    q, k, v = (2 * torch.randn(n, h, d, generator=g)
               for n, h in ((49, hq), (n_k, hkv), (n_k, hkv)))
    k[len0:len0 + 5], v[len0:len0 + 3], v[len0 + 3:len0 + 5] = float("nan"), float("nan"), 448.0
    q, k, v = (t.to(E4M3).to(device) for t in (q, k, v))
    qd, kd, vd = ((torch.rand(3, hkv, generator=g) + 0.5).to(device) for _ in range(3))
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 29, len0, causal=causal,
                                               num_splits=1, return_lse=True,
                                               lse_layout="packed", q_descale=qd, k_descale=kd,
                                               v_descale=vd)
    assert out.dtype == BF16
    assert not out.isnan().any()  # sequence 1 has no rows
    for b in range(3):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        want, want_lse = hipflash.flash_attn_func(
            q[None, rq], k[None, rk], v[None, rk], causal=causal, num_splits=1, return_lse=True,
            q_descale=qd[b:b + 1], k_descale=kd[b:b + 1], v_descale=vd[b:b + 1])
        assert_bitwise_equal(out[rq], want[0], f"out {b}")
        assert_bitwise_equal(lse[:, rq], want_lse[0], f"lse {b}")
    fa3_out, fa3_lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 29, len0, causal=causal,
                                                  q_descale=qd, k_descale=kd, v_descale=vd,
                                                  return_attn_probs=True)
    assert_bitwise_equal(fa3_out, out, "fa3 out")


@needs_fp8
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_fp8_gpu)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_chunk_takes_each_sequences_descales(causal, device):
    # attention_chunk runs as varlen pieces, a piece with its sequence's descale row: each
    # chunk's rows bitwise the dense fp8 call on that chunk alone (Sq = Sk: a chunk's rows see
    # its keys only), the varlen spelling bitwise the dense one, and on the CPU (which
    # dequantises) the bf16 chunked call on dequantised values; a descale of another batch is
    # refused before anything is written.
    b, s, hq, hkv, d, c = 2, 40, 4, 2, 64, 16
    q, k, v = (t.to(device) for t in fp8_case(b, s, s, hq, hkv, d))
    qd, kd, vd = (t.to(device) for t in descales(b, hkv, True))
    kw = dict(causal=causal, num_splits=1, return_lse=True)
    out, lse = hipflash.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                                        attention_chunk=c, **kw)
    for i in range(b):
        for r0 in range(0, s, c):
            rows = slice(r0, min(r0 + c, s))
            want, want_lse = hipflash.flash_attn_func(
                q[i:i + 1, rows], k[i:i + 1, rows], v[i:i + 1, rows], q_descale=qd[i:i + 1],
                k_descale=kd[i:i + 1], v_descale=vd[i:i + 1], **kw)
            assert_bitwise_equal(out[i:i + 1, rows], want, f"out {i} {r0}")
            assert_bitwise_equal(lse[i:i + 1, :, rows], want_lse, f"lse {i} {r0}")
    cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device=device)
    flat = lambda t: t.flatten(0, 1)  # noqa: E731
    vout, vlse = hipflash.flash_attn_varlen_func(
        flat(q), flat(k), flat(v), cu, cu, s, s, q_descale=qd, k_descale=kd, v_descale=vd,
        attention_chunk=c, lse_layout="padded", **kw)
    assert_bitwise_equal(vout, flat(out), "varlen out")
    assert_bitwise_equal(vlse, lse, "varlen lse")
    if device == "cpu":
        qb, kb, vb = (dequantised(t, sc, hq).to(BF16) for t, sc in ((q, qd), (k, kd), (v, vd)))
        want, want_lse = hipflash.flash_attn_func(qb, kb, vb, attention_chunk=c, **kw)
        assert_bitwise_equal(out, want, "bf16 out")
        assert_bitwise_equal(lse, want_lse, "bf16 lse")
    sink = torch.full((b, s, hq, d), float("nan"), dtype=BF16, device=device)
    with pytest.raises(ValueError, match="q_descale must have a row per sequence"):
        hipflash.flash_attn_func(q, k, v, q_descale=torch.ones(b + 1, hkv, device=device),
                                 attention_chunk=c, out=sink)
    assert sink.isnan().all()
