"""hipflash as PyTorch operators (torch.ops.hipflash.*) and against hostile inputs.

Runs on the CPU backend everywhere and on the GPU kernels where torch sees a GPU and this build
has them (the `device` parameter). What needs a newer torch than Debian's 1.13 (torch.compile,
torch.library.opcheck, register_fake) skips with the reason on older ones.
"""
import _thread
import math
import signal
import sys
import threading
import time

import pytest
import torch

import hipflash
from reference import assert_bitwise_equal, attention_ref, make_qkv, make_varlen

GPU = torch.cuda.is_available() and hipflash.gpu_available()
DEVICES = ["cpu"] + (["cuda"] if GPU else [])
HAS_FAKE = hasattr(torch.library, "register_fake")
needs_compile = pytest.mark.skipif(
    not HAS_FAKE, reason=f"torch.compile with custom-op fake kernels needs torch >= 2.4, this is "
    f"{torch.__version__}")
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a GPU visible to torch and a hipflash built "
                               f"with GPU kernels; this build: {hipflash.build_info()!r}")


def qkv(device, b=2, sq=37, sk=150, hq=4, hkv=2, d=64, dtype=torch.bfloat16, seed=0):
    return make_qkv(b, sq, sk, hq, hkv, d, dtype, device=device, seed=seed)


def varlen_inputs(device, seed=0):
    return make_varlen([3, 17, 0, 40], [5, 33, 2, 40], 4, 2, 64, torch.bfloat16, device=device,
                       seed=seed)


# ---- Registration, tracing, compile, graphs --------------------------------------------------


def test_operators_are_registered_with_their_mutations():
    ops = torch.ops.hipflash
    assert "Tensor(a!) out" in str(ops.fwd_out.default._schema)
    assert "Tensor(b!)? lse" in str(ops.fwd_out.default._schema)
    assert "Tensor(a!) out" in str(ops.varlen_fwd_out.default._schema)
    assert "-> (Tensor out, Tensor lse)" in str(ops.fwd.default._schema)
    assert "-> (Tensor out, Tensor lse)" in str(ops.varlen_fwd.default._schema)
    assert "-> (Tensor out, Tensor lse)" in str(ops.merge_attn_states.default._schema)


@pytest.mark.parametrize("device", DEVICES)
def test_jit_trace_records_the_operator(device):
    q, k, v = qkv(device)

    def f(q, k, v):
        return hipflash.flash_attn_func(q, k, v, causal=True, num_splits=2, return_lse=True)

    traced = torch.jit.trace(f, (q, k, v), check_trace=False)
    assert "hipflash::fwd" in str(traced.graph)
    q2, k2, v2 = qkv(device, seed=1)  # new inputs: a trace of the allocation alone would fail
    for a in ((q, k, v), (q2, k2, v2)):
        got, want = traced(*a), f(*a)
        assert_bitwise_equal(got[0], want[0], "out")
        assert_bitwise_equal(got[1], want[1], "lse")


@pytest.mark.parametrize("device", DEVICES)
def test_jit_trace_varlen(device):
    q, k, v, cq, ck = varlen_inputs(device)

    def f(q, k, v, cq, ck):
        return hipflash.flash_attn_varlen_func(q, k, v, cq, ck, 40, 40, causal=True,
                                               return_lse=True, lse_layout="packed")

    traced = torch.jit.trace(f, (q, k, v, cq, ck), check_trace=False)
    assert "hipflash::varlen_fwd" in str(traced.graph)
    got, want = traced(q, k, v, cq, ck), f(q, k, v, cq, ck)
    assert_bitwise_equal(got[0], want[0])
    assert_bitwise_equal(got[1], want[1])


@needs_compile
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_dynamic_matches_eager_bitwise(device):
    torch._dynamo.reset()

    def f(q, k, v, cq, ck, qv, kv, vv):
        out, lse = hipflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
        vout, vlse = hipflash.flash_attn_varlen_func(qv, kv, vv, cq, ck, 40, 40, causal=True,
                                                     return_lse=True)
        return out * 2, lse + 1, vout, vlse

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for shape_seed, (sq, sk) in enumerate([(37, 150), (64, 200), (5, 7)]):
        q, k, v = qkv(device, sq=sq, sk=sk, seed=shape_seed)
        qv, kv, vv, cq, ck = varlen_inputs(device, seed=shape_seed)
        got = compiled(q, k, v, cq, ck, qv, kv, vv)
        want = f(q, k, v, cq, ck, qv, kv, vv)
        for g, w in zip(got, want):
            assert_bitwise_equal(g, w, f"sq={sq} sk={sk}")


@needs_compile
@pytest.mark.parametrize("device", DEVICES)
def test_compile_runs_a_training_step(device):
    # The backward operator has a fake kernel too, so a compiled forward of the autograd
    # function gets a compiled backward (hipflash::bwd): the gradients equal eager's, bitwise
    # (deterministic dq).
    torch._dynamo.reset()

    def attn(q, k, v):
        return hipflash.flash_attn_func(q, k, v, causal=True, deterministic=True)

    compiled = torch.compile(attn, dynamic=True)
    for seed, (sq, sk) in enumerate([(37, 150), (64, 200)]):
        q, k, v = qkv(device, sq=sq, sk=sk, seed=seed)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q)
        grads = []
        for fn in (compiled, attn):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            fn(*leaves).backward(dout)
            grads.append([t.grad for t in leaves])
        for g, w in zip(*grads):
            assert_bitwise_equal(g, w, f"sq={sq} sk={sk}")


@needs_compile
@pytest.mark.parametrize("device", DEVICES)
def test_compile_with_out_buffer(device):
    torch._dynamo.reset()
    q, k, v = qkv(device)

    def f(q, k, v, out):
        o, lse = hipflash.flash_attn_func(q, k, v, return_lse=True, out=out)
        return o + 0, lse

    out_c, out_e = torch.empty_like(q), torch.empty_like(q)
    got = torch.compile(f, fullgraph=True)(q, k, v, out_c)
    want = f(q, k, v, out_e)
    assert_bitwise_equal(out_c, out_e, "out buffer")
    assert_bitwise_equal(got[1], want[1], "lse")


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"),
                    reason=f"torch.library.opcheck needs torch >= 2.4, this is {torch.__version__}")
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    ops = torch.ops.hipflash
    q, k, v = qkv(device)
    qv, kv, vv, cq, ck = varlen_inputs(device)
    for return_lse in (False, True):
        torch.library.opcheck(ops.fwd.default, (q, k, v, None, True, -1, -1, 2, return_lse))
        torch.library.opcheck(ops.varlen_fwd.default,
                              (qv, kv, vv, cq, ck, 40, 40, 0.1, False, 8, -1, 0, return_lse,
                               "packed"))
    out, lse = torch.empty_like(q), q.new_empty((2, 4, 37), dtype=torch.float32)
    torch.library.opcheck(ops.fwd_out.default, (q, k, v, out, lse, None, False, -1, -1, 0, True))
    vout, vlse = torch.empty_like(qv), qv.new_empty((4, 4, 40), dtype=torch.float32)
    torch.library.opcheck(ops.merge_attn_states.default,
                          (torch.randn(3, 5, 2, 64, device=device, dtype=torch.bfloat16),
                           torch.randn(3, 2, 5, device=device)))
    torch.library.opcheck(ops.varlen_fwd_out.default,
                          (qv, kv, vv, cq, ck, 40, 40, vout, vlse, None, True, -1, -1, 0, True,
                           "padded"))
    if device == "cpu":  # (the GPU KV-cache ops are checked by test_gpu.py's calls)
        k_pages = torch.randn(6, 16, 2, 64, dtype=torch.bfloat16)
        v_pages = torch.randn_like(k_pages)
        table = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
        lens = torch.tensor([7, 20], dtype=torch.int32)
        k_new = torch.randn(2, 3, 2, 64, dtype=torch.bfloat16)
        torch.library.opcheck(ops.fwd_kvcache.default,
                              (q, k_pages, v_pages, k_new, torch.randn_like(k_new), lens, table,
                               None, True, -1, -1, 0, True))
        cu_q = torch.tensor([0, 5, 9], dtype=torch.int32)  # chunked prefill: 5 and 4 new rows
        cu_k = torch.tensor([0, 7, 27], dtype=torch.int32)  # against 7 and 20 cached keys
        for layout in ("padded", "packed"):
            torch.library.opcheck(ops.varlen_fwd_paged.default,
                                  (qv[:9], k_pages, v_pages, cu_q, cu_k, table, 5, 20, None, True,
                                   -1, -1, 0, True, layout))


@needs_gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_cuda_graph_replays(num_splits):
    q, k, v = qkv("cuda", b=1, sq=1, sk=700, hq=8, hkv=2, d=128)
    qv, kv, vv, cq, ck = varlen_inputs("cuda")
    static = [t.clone() for t in (q, k, v, qv, kv, vv)]

    def step():
        sq, sk, sv, sqv, skv, svv = static
        out, lse = hipflash.flash_attn_func(sq, sk, sv, num_splits=num_splits, return_lse=True)
        vout, vlse = hipflash.flash_attn_varlen_func(sqv, skv, svv, cq, ck, 40, 40, causal=True,
                                                     num_splits=num_splits, return_lse=True)
        return out, lse, vout, vlse

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    for seed in (1, 2):  # new data into the static inputs, replay, compare with eager
        fresh = list(qkv("cuda", b=1, sq=1, sk=700, hq=8, hkv=2, d=128, seed=seed)) + \
            list(varlen_inputs("cuda", seed=seed)[:3])
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for g, w in zip(results, want):
            assert_bitwise_equal(g, w, f"replay {seed}")


# ---- The autograd boundary -----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_that_require_grad_raise_under_grad_mode(device):
    q, k, v = qkv(device)
    qv, kv, vv, cq, ck = varlen_inputs(device)
    # The backward exists on the CPU and the GPU (tests/python/test_backward.py).
    assert hipflash.flash_attn_func(q.requires_grad_(), k, v).grad_fn is not None
    assert hipflash.flash_attn_varlen_func(qv, kv, vv.requires_grad_(), cq, ck, 40, 40).grad_fn
    with pytest.raises(RuntimeError, match="no backward yet"):  # the bare operator: none
        torch.ops.hipflash.fwd(q, k, v, None, False, -1, -1, 0, False)
    with torch.no_grad():  # allowed, and plainly detached
        out = hipflash.flash_attn_func(q, k, v)
        assert not out.requires_grad and out.grad_fn is None
    with pytest.raises(RuntimeError, match="no backward yet"):  # a leaf out that requires grad
        hipflash.flash_attn_func(q.detach(), k, v, out=torch.empty_like(q).requires_grad_())


@pytest.mark.parametrize("device", DEVICES)
def test_out_bumps_the_version_counter(device):
    q, k, v = qkv(device)
    out = torch.empty_like(q)
    v0 = out._version
    hipflash.flash_attn_func(q, k, v, out=out, return_lse=True)
    assert out._version > v0
    # autograd sees the overwrite of a tensor it saved (exp saves its output).
    w = torch.randn(q.shape, device=device).requires_grad_()
    a = w.exp()
    buf = a.detach().to(q.dtype)  # a different tensor: writing it is fine ...
    hipflash.flash_attn_func(q, k, v, out=buf)
    a.sum().backward()
    w2 = torch.randn(q.shape, device=device, dtype=q.dtype).requires_grad_()
    a2 = w2.exp()
    with torch.no_grad():
        hipflash.flash_attn_func(q, k, v, out=a2.detach())  # ... this one is the saved output
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        a2.sum().backward()


# ---- Interrupting a long CPU call ----------------------------------------------------------


def test_ctrl_c_interrupts_a_long_cpu_call():
    # Calls of ~1 s (2 cores) back to back until a simulated Ctrl-C lands; it must land inside
    # a call, stopped by hipflash's poll (re-raised by `_C.take_pending_signal_error`): one
    # landing between calls is retried. Python's SIGINT handler is installed for the test.
    q, k, v = qkv("cpu", b=1, sq=4096, sk=4096, hq=8, hkv=8, d=64)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for _ in range(3):
            timer = threading.Timer(0.3, _thread.interrupt_main)
            start = time.monotonic()
            timer.start()
            try:
                with pytest.raises(KeyboardInterrupt) as info:
                    while time.monotonic() - start < 10:
                        hipflash.flash_attn_func(q, k, v)
            finally:
                timer.cancel()
            if "take_pending_signal_error" in str(info.traceback[-1].statement):
                break
        else:
            pytest.fail("Ctrl-C never landed inside a hipflash call (3 attempts)")
        assert time.monotonic() - start < 3.0, "the interrupt took too long to land"
    finally:
        signal.signal(signal.SIGINT, previous)
    out = hipflash.flash_attn_func(*qkv("cpu"))  # the library is usable afterwards
    assert torch.isfinite(out).all()


def test_a_signal_handlers_own_exception_comes_through():
    import signal

    class Timeout(Exception):
        pass

    def handler(*_):
        raise Timeout()

    old = signal.signal(signal.SIGALRM, handler)
    q, k, v = qkv("cpu", b=1, sq=4096, sk=4096, hq=8, hkv=8, d=64)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Timeout):
            hipflash.flash_attn_func(q, k, v)
            time.sleep(5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- Hostile arguments ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_huge_windows_saturate(device):
    q, k, v = qkv(device)
    want = hipflash.flash_attn_func(q, k, v, return_lse=True)
    for window in [(-1, sys.maxsize), (sys.maxsize, -1), (2**63, 2**70), (150, 37)]:
        got = hipflash.flash_attn_func(q, k, v, window_size=window, return_lse=True)
        assert_bitwise_equal(got[0], want[0], str(window))
        assert_bitwise_equal(got[1], want[1], str(window))
    causal = hipflash.flash_attn_func(q, k, v, causal=True)
    assert_bitwise_equal(hipflash.flash_attn_func(q, k, v, causal=True, window_size=(2**80, -1)),
                         causal)


@pytest.mark.parametrize("device", DEVICES)
def test_causal_decode_is_unmasked(device):
    """One query row, bottom-right aligned: causal masks nothing, so a causal decode call runs
    the same kernel as a non-causal one (on the GPU the packed GQA decode path) and agrees with
    it bitwise, the exact window bounds (Sk - 1, Sq - 1) as well."""
    q, k, v = qkv(device, b=2, sq=1, sk=300, hq=8, hkv=2, d=128)
    want = hipflash.flash_attn_func(q, k, v, return_lse=True)
    name = hipflash.last_kernel_name()
    for kwargs in [dict(causal=True), dict(window_size=(299, 0))]:
        got = hipflash.flash_attn_func(q, k, v, return_lse=True, **kwargs)
        assert hipflash.last_kernel_name() == name, kwargs
        assert_bitwise_equal(got[0], want[0], str(kwargs))
        assert_bitwise_equal(got[1], want[1], str(kwargs))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(num_splits=2**31), ValueError, r"num_splits must be in \[0, 256\]"),
    (dict(num_splits=2**70), ValueError, r"num_splits must be in \[0, 256\]"),
    (dict(window_size=(-2**70, 0)), ValueError, "window_size"),
    (dict(softmax_scale=1e37), ValueError, "softmax_scale must be a number in"),
    (dict(softmax_scale=1e300), ValueError, "softmax_scale must be a number in"),
])
def test_bad_numbers_give_short_typed_errors(kwargs, exc, match):
    q, k, v = qkv("cpu")
    out = torch.full_like(q, float("nan"))
    with pytest.raises(exc, match=match) as info:
        hipflash.flash_attn_func(q, k, v, out=out, **kwargs)
    assert len(str(info.value)) < 300 and "tensor(" not in str(info.value)
    assert torch.isnan(out).all(), "nothing is written"


def test_varlen_huge_max_seqlen():
    """A maximum beyond the tensors' rows is refused at once, before any allocation."""
    q, k, v, cq, ck = varlen_inputs("cpu")
    for max_q in (2**40, 2**62, 2**70):
        with pytest.raises(ValueError) as info:
            hipflash.flash_attn_varlen_func(q, k, v, cq, ck, max_q, 40)
        assert len(str(info.value)) < 300


@pytest.mark.parametrize("device", DEVICES)
def test_out_overlapping_itself_is_refused(device):
    q, k, v = qkv(device)
    expanded = torch.empty(q.shape[0], 1, q.shape[2], q.shape[3], dtype=q.dtype,
                           device=device).expand(q.shape)
    with pytest.raises(ValueError, match="out must not overlap itself"):
        hipflash.flash_attn_func(q, k, v, out=expanded)


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_disjoint_views_are_accepted(device):
    # q in the odd heads and out in the even heads of one buffer: no element is shared.
    q0, k, v = qkv(device, hq=2, hkv=2)
    buf = torch.empty(q0.shape[0], q0.shape[1], 4, q0.shape[3], dtype=q0.dtype, device=device)
    q, out = buf[:, :, 1::2], buf[:, :, 0::2]
    q.copy_(q0)
    hipflash.flash_attn_func(q, k, v, out=out)
    assert_bitwise_equal(out, hipflash.flash_attn_func(q0, k, v))
    with pytest.raises(ValueError, match="out must not alias q"):
        hipflash.flash_attn_func(q, k, v, out=buf[:, :, 1::2])


@pytest.mark.parametrize("device", DEVICES)
def test_out_or_lse_overlapping_cu_seqlens_is_refused(device):
    q, k, v, cq, ck = varlen_inputs(device)
    out = torch.full_like(q, float("nan"))
    cq_in_out = out.view(-1).view(torch.int32)[: cq.numel()]
    cq_in_out.copy_(cq)
    with pytest.raises(ValueError, match="out must not alias cu_seqlens_q"):
        hipflash.flash_attn_varlen_func(q, k, v, cq_in_out, ck, 40, 40, out=out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 0])
@pytest.mark.parametrize("shape", [(2, 37, 150, 4, 2, 64), (2, 1, 600, 8, 2, 128)],
                         ids=["prefill", "decode"])
def test_nan_reaches_what_the_reference_reaches(device, where, causal, num_splits, shape):
    if where == "v" and causal:
        pytest.skip("a masked key's v enters the GPU's tensor-core product as 0 * NaN "
                    "(docs/spec.md §3); v is planted unmasked only")
    b, sq, sk, hq, hkv, d = shape
    q, k, v = qkv(device, b, sq, sk, hq, hkv, d)
    t = {"q": q, "k": k, "v": v}[where]
    if where == "v":
        t[1, sk // 2, hkv - 1, 5] = float("nan")
    else:
        t[1, t.shape[1] // 2, t.shape[2] - 1, :] = float("nan")
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, num_splits=num_splits,
                                        return_lse=True)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    assert torch.equal(torch.isnan(out), torch.isnan(out_ref)), "NaN pattern of out"
    assert torch.equal(torch.isnan(lse), torch.isnan(lse_ref)), "NaN pattern of lse"
    assert torch.isnan(lse).any() or where == "v"
    fin = ~torch.isnan(out_ref)
    torch.testing.assert_close(out.float()[fin], out_ref[fin], atol=3e-2, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
def test_tied_huge_scores_are_weighted_by_key_counts(device, num_splits):
    q, k, v = qkv(device, b=1, sq=4, sk=300, hq=2, hkv=1, d=64)
    q.fill_(1e4)
    k.fill_(1e4)
    out, lse = hipflash.flash_attn_func(q, k, v, num_splits=num_splits, return_lse=True)
    # Every score is the same 64 * 9984^2 / 8: out is the plain mean of v, lse = s + log(300)
    # (in fp64: an fp32 reference would itself lose log(300) next to 8e8).
    want = v.double().mean(dim=1, keepdim=True).expand(1, 4, 2, 64)
    torch.testing.assert_close(out.double(), want, atol=4e-3, rtol=0)
    s = 64 * 9984.0**2 / 8
    torch.testing.assert_close(lse.double(), torch.full_like(lse, s + math.log(300)).double(),
                               atol=0, rtol=1e-6)
