"""hipflash.distributed: ring and all-gather attention over torch.distributed (gloo on the CPU
here, 2, 3 and 4 ranks) against the fp32 reference of the gathered sequence (SPEC §6), and the
gradients against fp64 autograd with FlashAttention's 2x rule; the layouts and the window
arithmetic on their own."""
import contextlib
import itertools
import os
import random
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hipflash import distributed as hd
from reference import (attention_ref, check_lse, check_out, make_qkv, valid_mask,
                       varlen_attention_ref)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

# (batch, chunk rows, heads_q, heads_kv, head_dim, causal, window)
CASES = [
    (1, 8, 2, 2, 64, False, (-1, -1)),
    (2, 8, 4, 2, 64, True, (-1, -1)),     # GQA 2:1, causal
    (1, 12, 2, 1, 32, True, (-1, -1)),    # MQA, head dim 32
    (1, 8, 2, 2, 64, False, (11, 5)),     # sliding window cutting chunks
    (1, 8, 2, 2, 64, True, (20, -1)),     # causal sliding window (left 20)
    (1, 8, 2, 2, 128, False, (0, 0)),     # each row sees only itself
]


def _spawn(worker, world, *args):
    """worker(rank, world, init_file, *args) in `world` processes (gloo's file rendezvous)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "store")) + args, nprocs=world, join=True)


@contextlib.contextmanager
def _gloo_group(rank, world, init_file):
    """The default process group over gloo for the body, destroyed after."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _visible_global(q_off, q_len, k_off, k_len, left, right):
    i = torch.arange(q_off, q_off + q_len)[:, None]
    j = torch.arange(k_off, k_off + k_len)[None, :]
    return (j >= i - left) & (j <= i + right)


@pytest.mark.parametrize("seed", range(40))
def test_pair_call_matches_the_global_window(seed):
    # The call _pair_call plans (rows, keys, window aligned bottom-right) sees exactly the
    # (row, key) pairs the global window gives.
    rng = random.Random(seed)
    inf = float("inf")
    for _ in range(50):
        q_len, k_len = rng.randint(1, 12), rng.randint(1, 12)
        q_off, k_off = rng.randint(0, 30), rng.randint(0, 30)
        left = rng.choice([inf, rng.randint(0, 15)])
        right = rng.choice([inf, 0, rng.randint(0, 15)])
        want = _visible_global(q_off, q_len, k_off, k_len, left, right)
        call = hd._pair_call(q_off, q_len, k_off, k_len, left, right)
        got = torch.zeros(q_len, k_len, dtype=torch.bool)
        if call is not None:
            (r0, r1), (k0, k1), l, r = call
            assert 0 <= r0 < r1 <= q_len and 0 <= k0 < k1 <= k_len and l >= -1 and r >= -1
            got[r0:r1, k0:k1] = valid_mask(r1 - r0, k1 - k0, False, (l, r))
        assert torch.equal(got, want), (q_off, q_len, k_off, k_len, left, right, call)


@pytest.mark.parametrize("layout", hd.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    shards = [hd.shard(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 24 // world, 3) for s in shards)
    assert torch.equal(hd.unshard(shards, layout), x)
    if layout == "zigzag" and world == 2:  # rank 0: chunks 0 and 3 of 4 (rows 0-5, 18-23)
        assert torch.equal(shards[0][0, :, 0], 3 * torch.tensor([0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23]))


def test_shard_refuses_lengths_the_layout_cannot_cut():
    with pytest.raises(ValueError, match="multiple of 6"):
        hd.shard(torch.zeros(1, 10, 1, 1), 0, 3, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        hd.shard(torch.zeros(1, 10, 1, 1), 0, 2, "striped")


def test_needs_a_process_group():
    q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        hd.ring_flash_attn_func(q, q, q)


# ---- Multi-process runs (gloo) ----------------------------------------------------------------


def _torch_attention(q, k, v, dtype, causal, window):
    """SPEC §3 in `dtype` with PyTorch ops, for autograd; [B, S, H, D]."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    qq, kk, vv = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    kk = kk.repeat_interleave(hq // hkv, dim=1)
    vv = vv.repeat_interleave(hq // hkv, dim=1)
    mm = (lambda a, b: a @ b) if dtype != torch.float16 else (lambda a, b: (a.float() @ b.float()).to(dtype))
    sc = mm(qq, kk.transpose(-1, -2)) * d ** -0.5
    sc = sc.masked_fill(~valid_mask(s, s, causal, window), float("-inf"))
    p = torch.softmax(sc.float(), dim=-1).nan_to_num(0.0).to(dtype)
    return mm(p, vv).transpose(1, 2)


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(out.dtype))
    return [t.grad.detach() for t in (q, k, v)]


def _check_case(rank, world, case, layout, mode, dtype, seed, group=None):
    b, chunk, hq, hkv, d, causal, window = case
    s = 2 * world * chunk
    q, k, v = make_qkv(b, s, s, hq, hkv, d, dtype, seed=seed)
    dout = torch.randn(b, s, hq, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    what = f"rank {rank}/{world} {layout} {mode} case {case}"
    kw = dict(causal=causal, window_size=window)
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    out_lp, _ = attention_ref(q, k, v, lowp=True, **kw)

    sq, sk, sv = (hd.shard(t, rank, world, layout).requires_grad_() for t in (q, k, v))
    out, lse = hd.ring_flash_attn_func(sq, sk, sv, causal=causal, window_size=window,
                                       return_lse=True, layout=layout, mode=mode, group=group)
    check_out(out.detach(), hd.shard(out_ref, rank, world, layout),
              hd.shard(out_lp, rank, world, layout), what)
    check_lse(lse, hd.shard(lse_ref, rank, world, layout, dim=2), what)
    out.backward(hd.shard(dout, rank, world, layout))

    g64 = _grads(lambda *a: _torch_attention(*a, torch.float64, causal, window), q, k, v, dout)
    glp = _grads(lambda *a: _torch_attention(*a, dtype, causal, window), q, k, v, dout)
    for name, ours, low, ref in zip("qkv", (sq.grad, sk.grad, sv.grad), glp, g64):
        assert ours is not None and ours.dtype == dtype, f"{what}: d{name}"
        err = (ours.double() - hd.shard(ref, rank, world, layout)).abs().max().item()
        tol = 2 * (low.double() - ref).abs().max().item() + 1e-5
        assert err <= tol, f"{what}: d{name} max|err| {err:.3e} > {tol:.3e}"


# (chunk rows of each sequence (0: empty), heads_q, heads_kv, head_dim, causal, window)
VARLEN_CASES = [
    ((3, 1, 5), 2, 2, 64, True, (-1, -1)),
    ((2, 0, 4), 4, 2, 64, False, (-1, -1)),    # an empty sequence, GQA
    ((4, 2), 2, 1, 32, False, (5, 3)),         # windows: a call per window the sequences need
    ((3, 6), 2, 2, 64, True, (7, -1)),
]


def _varlen_torch(q, k, v, cu, dtype, causal, window):
    """_torch_attention per sequence of packed rows, concatenated (autograd through it)."""
    outs = []
    for a, b in zip(cu, cu[1:]):
        if b > a:
            outs.append(_torch_attention(q[None, a:b], k[None, a:b], v[None, a:b], dtype, causal,
                                         window)[0])
    return torch.cat(outs)


def _check_varlen_case(rank, world, case, layout, mode, dtype, seed):
    chunks, hq, hkv, d, causal, window = case
    lens = [2 * world * c for c in chunks]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(cu[-1], hq, d, generator=g).to(dtype)
    k = torch.randn(cu[-1], hkv, d, generator=g).to(dtype)
    v = torch.randn(cu[-1], hkv, d, generator=g).to(dtype)
    dout = torch.randn(cu[-1], hq, d, generator=g).to(dtype)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    what = f"rank {rank}/{world} varlen {layout} {mode} case {case}"
    kw = dict(causal=causal, window_size=window)
    out_ref, lse_ref, _ = varlen_attention_ref(q, k, v, cu_t, cu_t, max(lens), **kw)
    out_lp, _, _ = varlen_attention_ref(q, k, v, cu_t, cu_t, max(lens), lowp=True, **kw)

    def mine(x, dim=0):
        return hd.shard_varlen(x if dim == 0 else x.transpose(0, 1), cu_t, rank, world,
                               layout) if dim == 0 else \
            hd.shard_varlen(x.transpose(0, 1), cu_t, rank, world, layout).transpose(0, 1)

    sq, sk, sv = (mine(t).requires_grad_() for t in (q, k, v))
    out, lse = hd.ring_flash_attn_varlen_func(sq, sk, sv, cu_t // world, max(lens) // world,
                                              return_lse=True, layout=layout, mode=mode, **kw)
    check_out(out.detach(), mine(out_ref), mine(out_lp), what)
    check_lse(lse, mine(lse_ref, dim=1).contiguous(), what)
    out.backward(mine(dout))
    g64 = _grads(lambda *a: _varlen_torch(*a, cu, torch.float64, causal, window), q, k, v, dout)
    glp = _grads(lambda *a: _varlen_torch(*a, cu, dtype, causal, window), q, k, v, dout)
    for name, ours, low, ref in zip("qkv", (sq.grad, sk.grad, sv.grad), glp, g64):
        err = (ours.double() - mine(ref)).abs().max().item()
        tol = 2 * (low.double() - ref).abs().max().item() + 1e-5
        assert err <= tol, f"{what}: d{name} max|err| {err:.3e} > {tol:.3e}"

    # The layout helpers round-trip.
    assert torch.equal(hd.unshard_varlen([hd.shard_varlen(q, cu_t, r, world, layout)
                                          for r in range(world)], cu_t, layout), q)


def _worker(rank, world, init_file, dtype):
    with _gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        for i, (case, layout, mode) in enumerate(itertools.product(CASES, hd.LAYOUTS, hd.MODES)):
            _check_case(rank, world, case, layout, mode, dtype, seed=100 + i)
        for i, (case, layout, mode) in enumerate(itertools.product(VARLEN_CASES, hd.LAYOUTS,
                                                                   hd.MODES)):
            _check_varlen_case(rank, world, case, layout, mode, dtype, seed=200 + i)
        # A sub-group: ranks {1, 2} of a larger world (P2P addresses global ranks).
        if world > 2:
            sub = dist.new_group([1, 2])
            if rank in (1, 2):
                for mode in hd.MODES:
                    _check_case(rank - 1, 2, CASES[1], "zigzag", mode, dtype, seed=7, group=sub)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_and_allgather_match_the_reference(world):
    _spawn(_worker, world, torch.bfloat16)


# ---- hipflash.compat.ring_flash_attn: ring-flash-attn's names and layouts ---------------------


def _compat_worker(rank, world, init_file):
    import hipflash.compat.ring_flash_attn as rfa
    with _gloo_group(rank, world, init_file):
        q, k, v = make_qkv(2, 8 * 2 * world, 8 * 2 * world, 4, 2, 64, torch.bfloat16, seed=5)
        for layout, func in (("contiguous", rfa.ring_flash_attn_func),
                             ("zigzag", rfa.zigzag_ring_flash_attn_func)):
            # ring-flash-attn's ring_flash_attn_func takes contiguous shards, its zigzag_ one
            # zigzag shards: each is hipflash.distributed's call with that layout.
            ql, kl, vl = (hd.shard(t, rank, world, layout) for t in (q, k, v))
            out, lse, probs = func(ql, kl, vl, causal=True, return_attn_probs=True)
            want, want_lse = hd.ring_flash_attn_func(ql, kl, vl, causal=True, return_lse=True,
                                                     layout=layout)
            assert probs is None and torch.equal(out, want) and torch.equal(lse, want_lse)
        lens = [4 * world, 8 * world]  # each sequence sharded on its own
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        qv, kv, vv = (t[0, :sum(lens)] for t in (q, k, v))
        for layout, func in (("contiguous", rfa.ring_flash_attn_varlen_func),
                             ("zigzag", rfa.zigzag_ring_flash_attn_varlen_func)):
            ql, kl, vl = (hd.shard_varlen(t, cu, rank, world, layout) for t in (qv, kv, vv))
            cu_local = cu // world
            out, lse, _ = func(ql, kl, vl, cu_local, max(lens) // world, causal=True,
                               return_attn_probs=True)
            want, want_lse = hd.ring_flash_attn_varlen_func(ql, kl, vl, cu_local, causal=True,
                                                            return_lse=True, layout=layout)
            assert torch.equal(out, want)
            # ring-flash-attn's varlen LSE: padded [batch, nheads, max_seqlen], -inf past a
            # sequence's rows
            assert lse.shape == (2, 4, max(lens) // world)
            for b in range(2):
                a, n = int(cu_local[b]), int(cu_local[b + 1] - cu_local[b])
                assert torch.equal(lse[b, :, :n], want_lse[:, a:a + n])
                assert bool((lse[b, :, n:] == float("-inf")).all())


def test_ring_flash_attn_compat_takes_ring_flash_attns_layouts():
    _spawn(_compat_worker, 2)


def test_ring_flash_attn_compat_refuses_dropout_and_alibi():
    import hipflash.compat.ring_flash_attn as rfa
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="dropout"):
        rfa.ring_flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        rfa.zigzag_ring_flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))


# ---- Hostile calls: refused on every rank, and the group still usable after -----------------


def _zigzag_shards(rank, world, seed):
    """This rank's zigzag shards of a q, k, v of 16 rows a rank (GQA 4/2, head dim 64)."""
    q, k, v = make_qkv(1, 8 * 2 * world, 8 * 2 * world, 4, 2, 64, torch.bfloat16, seed=seed)
    return tuple(hd.shard(t, rank, world, "zigzag") for t in (q, k, v))


def _hostile_worker(rank, world, init_file):
    with _gloo_group(rank, world, init_file):
        ql, kl, vl = _zigzag_shards(rank, world, seed=11)
        # A call the attention refuses on every rank, in ring mode after its first exchange has
        # started: the error, and the exchange finished, so the group's next calls run.
        for mode in hd.MODES:
            want = hd.ring_flash_attn_func(ql, kl, vl, causal=True, mode=mode)
            with pytest.raises(ValueError):
                hd.ring_flash_attn_func(torch.cat([ql, ql[:, :, :1]], 2), kl, vl, mode=mode)
            dist.barrier()
            assert torch.equal(hd.ring_flash_attn_func(ql, kl, vl, causal=True, mode=mode), want)
        # Empty shards: empty results in both modes (gloo aborts on a 0-byte all_gather).
        for mode in hd.MODES:
            out = hd.ring_flash_attn_func(ql[:0], kl[:0], vl[:0], mode=mode)
            assert out.shape == ql[:0].shape
        # A window bound past any sequence is no bound, however large the integer.
        for mode in hd.MODES:
            huge = hd.ring_flash_attn_func(ql, kl, vl, window_size=(2**63 - 1, 3), mode=mode)
            assert torch.equal(huge, hd.ring_flash_attn_func(ql, kl, vl, window_size=(-1, 3),
                                                             mode=mode))
        cu = torch.tensor([0, kl.shape[1]], dtype=torch.int64)
        with pytest.raises(ValueError, match="int32"):
            hd.ring_flash_attn_varlen_func(ql[0], kl[0], vl[0], cu)
        # A process outside the group: refused, not an empty answer.
        sub = dist.new_group([1, 2])
        if rank == 0:
            with pytest.raises(ValueError, match="not a member"):
                hd.ring_flash_attn_func(ql, kl, vl, group=sub)
        dist.barrier()


def test_hostile_calls_are_refused_and_leave_the_group_usable():
    _spawn(_hostile_worker, 3)


def _disagreeing_worker(rank, world, init_file):
    # TORCH_DISTRIBUTED_DEBUG=DETAIL: the ranks compare their calls before any exchange.
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    with _gloo_group(rank, world, init_file):
        ql, kl, vl = _zigzag_shards(rank, world, seed=12)
        for mode in hd.MODES:
            want = hd.ring_flash_attn_func(ql, kl, vl, causal=True, mode=mode)
            # One rank's call differs: every rank raises, naming the argument.
            with pytest.raises(ValueError, match="disagree on causal"):
                hd.ring_flash_attn_func(ql, kl, vl, causal=rank != 1, mode=mode)
            with pytest.raises(ValueError, match="disagree on window"):
                hd.ring_flash_attn_func(ql, kl, vl, window_size=(4 + (rank == 2), -1), mode=mode)
            with pytest.raises(ValueError, match="disagree on q"):
                hd.ring_flash_attn_func(ql.half() if rank == 0 else ql, kl, vl, mode=mode)
            with pytest.raises(ValueError, match="disagree on mode"):
                hd.ring_flash_attn_func(ql, kl, vl, mode=hd.MODES[rank % 2])
            # The same window spelt two ways, and the default scale given on one rank: agreed.
            got = hd.ring_flash_attn_func(ql, kl, vl, causal=True, mode=mode,
                                          window_size=(-1, -1) if rank else (2**62, 5),
                                          softmax_scale=None if rank else 64 ** -0.5)
            assert torch.equal(got, want)
            # A call one rank refuses: its error there, a ValueError naming it elsewhere, and
            # nothing exchanged, so the group's next call runs.
            bad = ql[:, 1:] if rank == 2 else ql
            with pytest.raises(ValueError, match="same batch" if rank == 2 else r"rank\(s\) \[2\]"):
                hd.ring_flash_attn_func(bad, kl, vl, causal=True, mode=mode)
            assert torch.equal(hd.ring_flash_attn_func(ql, kl, vl, causal=True, mode=mode), want)
            # Any error on one rank, not only a ValueError; and True and 1 agree.
            odd = torch.tensor([1, 0]) if rank == 2 else True
            with pytest.raises(RuntimeError if rank == 2 else ValueError):
                hd.ring_flash_attn_func(ql, kl, vl, causal=odd, mode=mode)
            got = hd.ring_flash_attn_func(ql, kl, vl, causal=True if rank else 1, mode=mode)
            assert torch.equal(got, want)
        # Varlen: the local cu_seqlens must agree.
        cu = torch.tensor([0, 8, ql.shape[1]], dtype=torch.int32)
        other = torch.tensor([0, 4 if rank == 1 else 8, ql.shape[1]], dtype=torch.int32)
        hd.ring_flash_attn_varlen_func(ql[0], kl[0], vl[0], cu)
        with pytest.raises(ValueError, match="disagree on cu_seqlens"):
            hd.ring_flash_attn_varlen_func(ql[0], kl[0], vl[0], other)
        dist.barrier()


def test_detail_debug_mode_refuses_calls_the_ranks_disagree_on():
    _spawn(_disagreeing_worker, 3)

