"""hipflash's Python API on CPU tensors (the CPU backend): SPEC §1-§4 against the reference.

Sizes are kept small: the whole Python suite runs in well under two minutes on two cores.
"""
import pytest
import torch

import hipflash
from reference import (
    assert_bitwise_equal,
    attention_ref,
    bits,
    check_attention,
    check_lse,
    check_out,
    make_qkv,
    make_varlen,
    varlen_attention_ref,
    view_in_nan_storage,
)

DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [32, 64, 96, 128, 256]


def dtype_id(d):
    return str(d).replace("torch.", "")


# ---- Correctness -----------------------------------------------------------------------------

# (Sq, Sk): square, odd, cross-attention both ways, single row / key.
SHAPES = [(1, 1), (17, 33), (113, 203), (65, 17)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"sq{s[0]}_sk{s[1]}")
@pytest.mark.parametrize("dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dtype_headdim_grid(dtype, dim, seqlens, causal):
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 2, 1, dim, dtype)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)
    assert hipflash.last_kernel_name() == "cpu_reference"


@pytest.mark.parametrize("heads", [(6, 6), (6, 2), (6, 1)], ids=lambda h: f"h{h[0]}_{h[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_mqa(heads, causal):
    q, k, v = make_qkv(2, 37, 70, heads[0], heads[1], 64, torch.bfloat16, seed=1)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("seqlens", [(100, 30), (64, 1), (5, 2)], ids=lambda s: f"sq{s[0]}_sk{s[1]}")
def test_causal_sq_gt_sk_has_empty_rows(seqlens):
    """Bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key -> out 0, lse -inf."""
    sq, sk = seqlens
    q, k, v = make_qkv(1, sq, sk, 2, 2, 64, torch.float16, seed=2)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True)
    empty = sq - sk
    assert torch.isneginf(lse[:, :, :empty]).all()
    assert torch.isfinite(lse[:, :, empty:]).all()
    assert (out[:, :empty] == 0).all()


WINDOWS = [(0, 0), (16, -1), (-1, 8), (5, 3), (32, 32), (1000, 0)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("seqlens", [(77, 77), (40, 130), (130, 40)], ids=lambda s: f"sq{s[0]}_sk{s[1]}")
def test_sliding_window(seqlens, window, causal):
    sq, sk = seqlens
    q, k, v = make_qkv(1, sq, sk, 2, 1, 64, torch.bfloat16, seed=3)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal, window_size=window)



def test_window_as_an_integer_tensor():
    """FA3's tests pass the window as ``torch.randint(0, seqlen_k, (2,))``: a pair of integer
    elements in one tensor is that window, bitwise."""
    q, k, v = make_qkv(1, 40, 130, 2, 1, 64, torch.bfloat16, seed=3)
    want = hipflash.flash_attn_func(q, k, v, window_size=(5, 3), return_lse=True)
    for window in (torch.tensor([5, 3]), torch.tensor([5, 3], dtype=torch.int32),
                   (torch.tensor(5), 3)):
        got = hipflash.flash_attn_func(q, k, v, window_size=window, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), window
    for bad in (torch.tensor([5.0, 3.0]), torch.tensor([True, False])):
        with pytest.raises(ValueError, match="pair of ints"):
            hipflash.flash_attn_func(q, k, v, window_size=bad)

def test_softmax_scale():
    q, k, v = make_qkv(1, 33, 47, 2, 2, 128, torch.bfloat16, seed=4)
    out, lse = hipflash.flash_attn_func(q, k, v, softmax_scale=0.3, return_lse=True)
    check_attention(out, lse, q, k, v, softmax_scale=0.3)
    # The scale is folded into the LSE: lse = ln sum exp(scale * q.k).
    _, lse_default = hipflash.flash_attn_func(q, k, v, return_lse=True)
    _, ref_default = attention_ref(q, k, v)
    check_lse(lse_default, ref_default)


# ---- Split-K ---------------------------------------------------------------------------------

# Sk = 1100 is 18 key blocks of 64 on the CPU backend, so every count below really splits.
SPLIT_SHAPES = [(1, 1100), (20, 1100), (3, 700)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SPLIT_SHAPES, ids=lambda s: f"sq{s[0]}_sk{s[1]}")
@pytest.mark.parametrize("num_splits", [1, 2, 3, 17])
def test_num_splits(num_splits, seqlens, causal):
    sq, sk = seqlens
    q, k, v = make_qkv(1, sq, sk, 2, 1, 64, torch.bfloat16, seed=5)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, num_splits=num_splits, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)
    _, lse_1 = hipflash.flash_attn_func(q, k, v, causal=causal, num_splits=1, return_lse=True)
    finite = torch.isfinite(lse_1)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - lse_1[finite]).abs().max() <= 1e-4


@pytest.mark.parametrize("window", [(-1, -1), (100, 0)], ids=["full", "w100_0"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 2048), (1, 16, 2, 2, 1500), (2, 64, 4, 2, 300)],
                         ids=lambda s: "b{}_sq{}_h{}_{}_sk{}".format(*s))
def test_num_splits_zero_is_the_resolved_count(shape, window):
    b, sq, hq, hkv, sk = shape
    q, k, v = make_qkv(b, sq, sk, hq, hkv, 64, torch.float16, seed=6)
    resolved = hipflash.resolve_num_splits(q, k, window_size=window)
    assert resolved >= 1
    out0, lse0 = hipflash.flash_attn_func(q, k, v, window_size=window, num_splits=0, return_lse=True)
    outn, lsen = hipflash.flash_attn_func(q, k, v, window_size=window, num_splits=resolved,
                                          return_lse=True)
    assert_bitwise_equal(out0, outn, f"num_splits=0 vs {resolved}")
    assert_bitwise_equal(lse0, lsen, f"num_splits=0 vs {resolved}")
    check_attention(out0, lse0, q, k, v, window_size=window)


def test_resolve_num_splits_clamps_to_key_blocks():
    q, k, _ = make_qkv(1, 1, 100, 1, 1, 64, torch.float16)
    assert hipflash.resolve_num_splits(q, k, num_splits=1) == 1
    assert 1 <= hipflash.resolve_num_splits(q, k, num_splits=200) <= 2  # 100 keys: 2 blocks


# ---- Return types, layouts, out= -------------------------------------------------------------


def test_return_types():
    q, k, v = make_qkv(2, 9, 11, 4, 2, 64, torch.bfloat16)
    out = hipflash.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert out.is_contiguous()
    res = hipflash.flash_attn_func(q, k, v, return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2
    out2, lse = res
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert_bitwise_equal(out, out2)
    assert not out.requires_grad


def test_out_argument_is_written_and_returned():
    q, k, v = make_qkv(2, 21, 30, 2, 2, 96, torch.float16, seed=7)
    buf = torch.full_like(q, float("nan"))
    res, lse = hipflash.flash_attn_func(q, k, v, causal=True, return_lse=True, out=buf)
    assert res is buf
    check_attention(buf, lse, q, k, v, causal=True)
    assert_bitwise_equal(buf, hipflash.flash_attn_func(q, k, v, causal=True))


def test_out_argument_strided_view():
    """out= may be any strided view with a contiguous last dim, e.g. [B, H, S, D] transposed."""
    q, k, v = make_qkv(2, 19, 25, 3, 1, 64, torch.bfloat16, seed=8)
    storage = torch.full((2, 3, 19, 64), float("nan"), dtype=torch.bfloat16)
    out = storage.transpose(1, 2)
    hipflash.flash_attn_func(q, k, v, out=out)
    check_attention(out, None, q, k, v)


def test_varlen_lse_layouts():
    lens_q, lens_k = [5, 0, 17, 1, 33], [7, 3, 0, 20, 33]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, 64, torch.bfloat16, seed=9)
    max_q, max_k = max(lens_q), max(lens_k)
    out_ref, lse_packed_ref, lse_padded_ref = varlen_attention_ref(q, k, v, cu_q, cu_k, max_q)
    out_lp, _, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, max_q, lowp=True)

    out = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    check_out(out, out_ref, out_lp, "no lse")

    out_p, lse_p = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                   return_lse=True)
    assert lse_p.shape == (5, 4, max_q)
    check_out(out_p, out_ref, out_lp, "padded")
    check_lse(lse_p, lse_padded_ref, "padded")
    # Rows past each sequence's length are -inf, not garbage; so is sequence 2 (no keys).
    for b, n in enumerate(lens_q):
        assert torch.isneginf(lse_p[b, :, n:]).all()
    assert torch.isneginf(lse_p[2]).all()

    out_k, lse_k = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                   return_lse=True, lse_layout="packed")
    assert lse_k.shape == (4, sum(lens_q))
    check_out(out_k, out_ref, out_lp, "packed")
    check_lse(lse_k, lse_packed_ref, "packed")
    assert_bitwise_equal(out_p, out_k)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (4, 2)), (True, (8, -1))],
                         ids=["causal", "w4_2", "causal_w8"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_varlen_masks_and_splits(causal, window, num_splits):
    lens_q, lens_k = [40, 0, 3, 70], [90, 5, 0, 200]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 6, 2, 128, torch.float16, seed=10)
    max_q, max_k = max(lens_q), max(lens_k)
    kw = dict(causal=causal, window_size=window)
    out_ref, lse_ref, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, max_q, **kw)
    out_lp, _, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, max_q, lowp=True, **kw)
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True,
                                               lse_layout="packed", num_splits=num_splits, **kw)
    check_out(out, out_ref, out_lp)
    check_lse(lse, lse_ref)


def test_varlen_larger_max_seqlen_is_fine():
    """max_seqlen may exceed every length, up to the tensor's rows (it sizes the padded LSE);
    beyond them no sequence can exist, and the call is refused."""
    lens = [3, 9]
    q, k, v, cu_q, cu_k = make_varlen(lens, lens, 2, 2, 32, torch.bfloat16, seed=11)
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, return_lse=True)
    assert lse.shape == (2, 2, 12)
    _, _, lse_ref = varlen_attention_ref(q, k, v, cu_q, cu_k, 12)
    check_lse(lse, lse_ref)
    for max_q, max_k in ((13, 12), (12, 13)):
        with pytest.raises(ValueError, match="no sequence can be that long"):
            hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True)


# ---- Strided inputs --------------------------------------------------------------------------


def test_packed_qkv_views():
    """q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2] of one [B, S, 3, H, D] tensor."""
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(2, 45, 3, 4, 64, generator=g).to(torch.bfloat16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.is_contiguous()
    out, lse = hipflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True)
    out_c = hipflash.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert_bitwise_equal(out, out_c, "packed vs contiguous")


def test_transposed_layouts():
    """[B, H, S, D] tensors transposed to [B, S, H, D] views."""
    g = torch.Generator().manual_seed(13)
    q = torch.randn(2, 4, 31, 128, generator=g).to(torch.float16).transpose(1, 2)
    k = torch.randn(2, 2, 50, 128, generator=g).to(torch.float16).transpose(1, 2)
    v = torch.randn(2, 2, 50, 128, generator=g).to(torch.float16).transpose(1, 2)
    out, lse = hipflash.flash_attn_func(q, k, v, window_size=(10, 10), return_lse=True)
    check_attention(out, lse, q, k, v, window_size=(10, 10))


def test_views_inside_nan_storage():
    """Inputs as views inside NaN-filled buffers: nothing outside the view may be read."""
    q, k, v = make_qkv(2, 33, 70, 4, 2, 64, torch.bfloat16, seed=14)
    qn, kn, vn = view_in_nan_storage(q), view_in_nan_storage(k), view_in_nan_storage(v)
    out, lse = hipflash.flash_attn_func(qn, kn, vn, causal=True, num_splits=2, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True)


def test_broadcast_kv_batch_stride_zero():
    """Strides are free: k/v expanded over the batch (batch stride 0)."""
    q, k, v = make_qkv(3, 12, 20, 2, 2, 64, torch.bfloat16, seed=15)
    k1, v1 = k[:1].expand(3, -1, -1, -1), v[:1].expand(3, -1, -1, -1)
    out, lse = hipflash.flash_attn_func(q, k1, v1, return_lse=True)
    check_attention(out, lse, q, k1.contiguous(), v1.contiguous())


# ---- Determinism, empty problems -------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3])
def test_deterministic(num_splits):
    q, k, v = make_qkv(2, 50, 300, 4, 2, 64, torch.bfloat16, seed=16)
    first = hipflash.flash_attn_func(q, k, v, causal=True, num_splits=num_splits, return_lse=True)
    for _ in range(2):
        again = hipflash.flash_attn_func(q, k, v, causal=True, num_splits=num_splits,
                                         return_lse=True)
        assert_bitwise_equal(first[0], again[0], "out")
        assert_bitwise_equal(first[1], again[1], "lse")


@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (0, 0, 0)], ids=["b0", "sq0", "b0_sq0_sk0"])
def test_empty_batch_or_queries(shape):
    b, sq, sk = shape
    q, k, v = make_qkv(b, sq, sk, 2, 2, 64, torch.float16)
    out, lse = hipflash.flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (b, sq, 2, 64) and lse.shape == (b, 2, sq)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_no_keys(causal):
    """Sk = 0: out = 0 and lse = -inf (also into a NaN-poisoned out=)."""
    q, k, v = make_qkv(2, 5, 0, 2, 1, 64, torch.bfloat16)
    buf = torch.full_like(q, float("nan"))
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, out=buf)
    assert (out == 0).all()
    assert torch.isneginf(lse).all() and lse.shape == (2, 2, 5)


def test_varlen_empty_batch():
    q, k, v, cu_q, cu_k = make_varlen([], [], 2, 2, 64, torch.bfloat16)
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, 0, return_lse=True)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2, 0)


def test_info_functions():
    assert isinstance(hipflash.__version__, str) and hipflash.__version__.count(".") >= 1
    assert isinstance(hipflash.build_info(), str) and "cpu" in hipflash.build_info()
    assert isinstance(hipflash.gpu_available(), bool)


# ---- Errors (SPEC §4): the Python type, a clear message, nothing written ---------------------


def _dense(dtype=torch.bfloat16, b=2, sq=8, sk=8, hq=4, hkv=2, d=64):
    return make_qkv(b, sq, sk, hq, hkv, d, dtype)


def _nan_out(q):
    return torch.full(q.shape, float("nan"), dtype=q.dtype)


# Each case: (id, lambda(q, k, v) -> (q, k, v) for flash_attn_func, exception, message regex).
# The out= of every call is a NaN-poisoned buffer that must come back untouched.
DENSE_ERRORS = [
    ("q_rank3", lambda q, k, v: (q[0], k, v), ValueError, r"q must have rank 4"),
    ("k_rank5", lambda q, k, v: (q, k[None], v), ValueError, r"k has rank 5"),
    ("batch_mismatch", lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"batch size differs"),
    ("headdim_mismatch", lambda q, k, v: (q, k[..., :32], v[..., :32]), ValueError, r"head dim differs"),
    ("seqlen_k_mismatch", lambda q, k, v: (q, k, v[:, :5]), ValueError, r"same seqlen_k"),
    ("heads_kv_mismatch", lambda q, k, v: (q, k, v[:, :, :1]), ValueError, r"same number of heads"),
    ("heads_not_divisible", lambda q, k, v: (q[:, :, :3], k, v), ValueError, r"must divide"),
    ("k_dtype_differs", lambda q, k, v: (q, k.half(), v), TypeError, r"k must have dtype bfloat16"),
    ("v_dtype_differs", lambda q, k, v: (q, k, v.half()), TypeError, r"v must have dtype bfloat16"),
    ("q_float32", lambda q, k, v: (q.float(), k.float(), v.float()), TypeError, r"float16, bfloat16 or float8_e4m3fn, got float32"),
    ("q_float64", lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, r"got float64"),
    ("q_int32", lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, r"got int32"),
    ("q_last_dim_stride", lambda q, k, v: (torch.cat([q, q], -1)[..., ::2], k, v), ValueError, r"contiguous last dimension"),
    ("k_last_dim_stride", lambda q, k, v: (q, torch.cat([k, k], -1)[..., ::2], v), ValueError, r"contiguous last dimension"),
]


def _unsupported_dim(d):
    return (lambda q, k, v: (torch.zeros(2, 8, 4, d, dtype=q.dtype), torch.zeros(2, 8, 2, d, dtype=q.dtype),
                             torch.zeros(2, 8, 2, d, dtype=q.dtype)))


DENSE_ERRORS += [
    (f"headdim_{d}", _unsupported_dim(d), ValueError, r"supported head dims are 32, 64, 96, 128, 256")
    for d in (16, 48, 80, 160, 512)
]


@pytest.mark.parametrize("make,exc,match", [c[1:] for c in DENSE_ERRORS], ids=[c[0] for c in DENSE_ERRORS])
def test_dense_errors_write_nothing(make, exc, match):
    q, k, v = make(*_dense())
    # A NaN out of q's shape when q is a valid half tensor; otherwise any poisoned buffer.
    out_dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    out = torch.full(q.shape, float("nan"), dtype=out_dtype)
    before = bits(out).clone()
    with pytest.raises(exc, match=match):
        hipflash.flash_attn_func(q, k, v, out=out, return_lse=True)
    assert torch.equal(bits(out), before), "a rejected call wrote into out"


OPTION_ERRORS = [
    ("window_negative", dict(window_size=(-2, 0)), ValueError, r"window_size"),
    ("window_triple", dict(window_size=(1, 2, 3)), ValueError, r"window_size must be a pair"),
    ("window_scalar", dict(window_size=4), ValueError, r"window_size must be a pair"),
    ("window_float", dict(window_size=(1.5, 2)), ValueError, r"pair of ints"),
    ("num_splits_negative", dict(num_splits=-1), ValueError, r"num_splits must be in"),
    ("num_splits_too_big", dict(num_splits=257), ValueError, r"num_splits must be in"),
    ("num_splits_float", dict(num_splits=2.0), TypeError, r"num_splits must be an int"),
    ("scale_negative", dict(softmax_scale=-1.0), ValueError, r"softmax_scale"),
    ("scale_zero", dict(softmax_scale=0.0), ValueError, r"softmax_scale"),
    ("scale_nan", dict(softmax_scale=float("nan")), ValueError, r"softmax_scale"),
    ("scale_string", dict(softmax_scale="0.1"), TypeError, r"softmax_scale"),
]


@pytest.mark.parametrize("kwargs,exc,match", [c[1:] for c in OPTION_ERRORS], ids=[c[0] for c in OPTION_ERRORS])
def test_option_errors_write_nothing(kwargs, exc, match):
    q, k, v = _dense()
    out = _nan_out(q)
    with pytest.raises(exc, match=match):
        hipflash.flash_attn_func(q, k, v, out=out, **kwargs)
    assert torch.isnan(out).all()


def test_non_tensor_arguments():
    q, k, v = _dense()
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        hipflash.flash_attn_func(q.tolist(), k, v)
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        hipflash.flash_attn_func(q, k, None)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        hipflash.flash_attn_func(q, k, v, out=[1])
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor"):
        hipflash.flash_attn_varlen_func(q[0], k[0], v[0], torch.tensor([0, 8], dtype=torch.int32),
                                        [0, 8], 8, 8)


def test_out_errors():
    q, k, v = _dense(sk=8, hkv=4)  # k and v shaped like q, so out=k is shape-valid
    for what, out, exc, match in [
        ("aliases q", q, ValueError, r"out must not alias q"),
        ("aliases k", k, ValueError, r"out must not alias k"),
        ("wrong shape", torch.full((2, 8, 4, 32), float("nan"), dtype=q.dtype), ValueError, r"out must have the shape of q"),
        ("wrong dtype", torch.full(q.shape, float("nan"), dtype=torch.float16), TypeError, r"out must have dtype bfloat16"),
        ("float32", torch.full(q.shape, float("nan")), TypeError, r"out must have dtype bfloat16"),
    ]:
        before = [bits(t).clone() for t in (q, k, v, out)]
        with pytest.raises(exc, match=match):
            hipflash.flash_attn_func(q, k, v, out=out)
        after = [bits(t) for t in (q, k, v, out)]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), f"out {what}: something was written"


def test_out_overlapping_v_storage():
    """out partially overlapping v's storage (not the same view) is rejected too."""
    q, k, _ = _dense(sk=8, hkv=4)
    storage = torch.randn(2 * q.numel()).to(q.dtype)
    v = storage[: q.numel()].view(q.shape)
    out = storage[q.numel() // 2: q.numel() // 2 + q.numel()].view(q.shape)
    with pytest.raises(ValueError, match="out must not alias v"):
        hipflash.flash_attn_func(q, k, v, out=out)


def _varlen(lens_q=(3, 5), lens_k=(4, 6)):
    return make_varlen(list(lens_q), list(lens_k), 4, 2, 64, torch.bfloat16)


def _i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


# Each case: (id, lambda(q, k, v, cu_q, cu_k) -> (q, k, v, cu_q, cu_k, max_q, max_k), exc, regex).
VARLEN_ERRORS = [
    ("cu_q_int64", lambda q, k, v, cq, ck: (q, k, v, cq.long(), ck, 5, 6), ValueError, r"cu_seqlens_q must have dtype int32, got int64"),
    ("cu_k_float32", lambda q, k, v, cq, ck: (q, k, v, cq, ck.float(), 5, 6), ValueError, r"cu_seqlens_k must have dtype int32, got float32"),
    ("cu_k_length", lambda q, k, v, cq, ck: (q, k, v, cq, ck[:2], 5, 6), ValueError, r"cu_seqlens_k must have the length of cu_seqlens_q"),
    ("cu_q_rank2", lambda q, k, v, cq, ck: (q, k, v, cq[None], ck, 5, 6), ValueError, r"cu_seqlens_q must be a 1-D tensor"),
    ("cu_q_empty", lambda q, k, v, cq, ck: (q, k, v, cq[:0], ck[:0], 5, 6), ValueError, r"cu_seqlens_q must be a 1-D tensor"),
    ("cu_q_not_monotone", lambda q, k, v, cq, ck: (q, k, v, _i32(0, 5, 3), ck, 5, 6), ValueError, r"non-decreasing"),
    ("cu_k_not_monotone", lambda q, k, v, cq, ck: (q, k, v, cq, _i32(0, 6, 4), 5, 6), ValueError, r"non-decreasing"),
    ("cu_q_negative_start", lambda q, k, v, cq, ck: (q, k, v, _i32(-1, 3, 8), ck, 5, 6), ValueError, r"cu_seqlens_q\[0\] must be >= 0"),
    ("cu_q_past_total", lambda q, k, v, cq, ck: (q, k, v, _i32(0, 3, 9), ck, 6, 6), ValueError, r"exceeds the number of rows"),
    ("cu_q_strided", lambda q, k, v, cq, ck: (q, k, v, _i32(0, 0, 3, 0, 8, 0)[::2], ck, 5, 6), ValueError, r"contiguous"),
    ("max_seqlen_q_small", lambda q, k, v, cq, ck: (q, k, v, cq, ck, 4, 6), ValueError, r"max_seqlen_q = 4 is too small"),
    ("max_seqlen_k_small", lambda q, k, v, cq, ck: (q, k, v, cq, ck, 5, 5), ValueError, r"max_seqlen_k = 5 is too small"),
    ("max_seqlen_negative", lambda q, k, v, cq, ck: (q, k, v, cq, ck, -1, 6), ValueError, r"max_seqlen_q and max_seqlen_k must be >= 0"),
    ("max_seqlen_float", lambda q, k, v, cq, ck: (q, k, v, cq, ck, 5.0, 6), TypeError, r"max_seqlen_q must be an int"),
    ("q_rank4", lambda q, k, v, cq, ck: (q[None], k, v, cq, ck, 5, 6), ValueError, r"q must have rank 3"),
    ("k_v_shape", lambda q, k, v, cq, ck: (q, k, v[:, :1], cq, ck, 5, 6), ValueError, r"k and v must have the same shape"),
    ("heads_not_divisible", lambda q, k, v, cq, ck: (q[:, :3], k, v, cq, ck, 5, 6), ValueError, r"must divide"),
    ("dtype_differs", lambda q, k, v, cq, ck: (q, k.half(), v.half(), cq, ck, 5, 6), TypeError, r"k must have dtype bfloat16"),
    ("headdim_48", lambda q, k, v, cq, ck: (q[..., :48], k[..., :48], v[..., :48], cq, ck, 5, 6), ValueError, r"supported head dims"),
]


@pytest.mark.parametrize("lse_layout", ["padded", "packed"])
@pytest.mark.parametrize("make,exc,match", [c[1:] for c in VARLEN_ERRORS], ids=[c[0] for c in VARLEN_ERRORS])
def test_varlen_errors_write_nothing(make, exc, match, lse_layout):
    q, k, v, cq, ck, max_q, max_k = make(*_varlen())
    out_dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    out = torch.full(q.shape, float("nan"), dtype=out_dtype)
    with pytest.raises(exc, match=match):
        hipflash.flash_attn_varlen_func(q, k, v, cq, ck, max_q, max_k, return_lse=True,
                                        lse_layout=lse_layout, out=out)
    assert torch.isnan(out).all(), "a rejected call wrote into out"


def test_varlen_bad_lse_layout():
    q, k, v, cq, ck = _varlen()
    with pytest.raises(ValueError, match="lse_layout must be 'padded' or 'packed'"):
        hipflash.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, return_lse=True, lse_layout="flat")
    with pytest.raises(ValueError, match="lse_layout"):
        hipflash.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, lse_layout=None)


def test_error_messages_name_argument_and_values():
    q, k, v = _dense(hq=6, hkv=4)
    with pytest.raises(ValueError) as e:
        hipflash.flash_attn_func(q, k, v)
    assert "(4)" in str(e.value) and "(6)" in str(e.value)
    with pytest.raises(ValueError) as e:
        hipflash.flash_attn_func(q[0], k, v)
    assert "[8, 6, 64]" in str(e.value)
