"""SPEC §4 as a table: every public Python entry point and registered operator against bad input.

Each row is (entry point, what is wrong, the exception type SPEC §4 names, a piece of its
message). The runner builds fresh valid inputs on the device, breaks one thing, poisons every
buffer the call could write (out, lse, KV caches; NaN or random bits), makes the call, and checks
the typed error, a short message, and that every such buffer is bit-for-bit what it was. Runs
on the CPU backend everywhere and on the GPU kernels where torch sees a GPU and this build has
them (the `device` parameter; CI has no GPU: those cases skip with the reason). docs/spec.md §4
lists the same cases; tests/cpp/bad_input_cases.hpp walks the C++ entry points.
"""
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import hipflash
from reference import bits, make_qkv, make_varlen

GPU = torch.cuda.is_available() and hipflash.gpu_available()
DEVICES = ["cpu", "cuda"]
BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
MAX_MESSAGE = 300  # characters: a message names the argument, never dumps a tensor


class Inputs:
    """A valid call of each entry point on `device`, with the buffers it writes poisoned."""

    def __init__(self, device):
        self.device = device
        # Dense: B = 2, Sq = 5, Sk = 7, Hq = 4, Hkv = 2, D = 64.
        self.q, self.k, self.v = make_qkv(2, 5, 7, 4, 2, 64, BF16, device=device)
        self.out = self.nan(self.q.shape)
        self.lse = self.nan((2, 4, 5), F32)
        # Varlen: three sequences, one without queries, one without keys.
        self.vq, self.vk, self.vv, self.cu_q, self.cu_k = make_varlen(
            [3, 0, 4], [5, 2, 0], 4, 2, 64, BF16, device=device)
        self.vout = self.nan(self.vq.shape)
        # KV cache: contiguous [2, 32, 2, 64], paged [5, 16, 2, 64] with two pages a sequence;
        # one new key row per sequence.
        g = torch.Generator().manual_seed(7)
        self.k_cache = torch.randn(2, 32, 2, 64, generator=g).to(BF16).to(device)
        self.v_cache = torch.randn(2, 32, 2, 64, generator=g).to(BF16).to(device)
        self.k_pages = torch.randn(5, 16, 2, 64, generator=g).to(BF16).to(device)
        self.v_pages = torch.randn(5, 16, 2, 64, generator=g).to(BF16).to(device)
        self.table = torch.tensor([[4, 0], [2, 3]], dtype=I32, device=device)
        self.k_new = torch.randn(2, 1, 2, 64, generator=g).to(BF16).to(device)
        self.v_new = torch.randn(2, 1, 2, 64, generator=g).to(BF16).to(device)
        self.seqlens = torch.tensor([3, 20], dtype=I32, device=device)
        self.dq = self.q[:, :1]  # one decode row per sequence
        # Merge: two dense parts [2, 5, 4, 64] with LSEs [2, 4, 5].
        self.out_a, self.out_b = self.q.clone(), self.q.flip(1).contiguous()
        self.lse_a = torch.randn(2, 4, 5, generator=g).to(device)
        self.lse_b = torch.randn(2, 4, 5, generator=g).to(device)
        # Backward: the forward's out and LSE, and an incoming gradient.
        self.fout, self.flse = hipflash.flash_attn_func(self.q, self.k, self.v, return_lse=True)
        self.dout = torch.randn(self.q.shape, generator=g).to(BF16).to(device)

    def nan(self, shape, dtype=BF16):
        return torch.full(shape, float("nan"), dtype=dtype, device=self.device)

    def other_device(self):
        """A device that is not this one (cross-device cases run where a GPU exists)."""
        return "cpu" if self.device != "cpu" else "cuda"

    # The entry points, each with the buffers it could write.
    def fwd(self, **kw):
        a = dict(q=self.q, k=self.k, v=self.v, out=self.out, return_lse=True)
        a.update(kw)
        return (lambda: hipflash.flash_attn_func(**a)), [a["out"]]

    def varlen(self, **kw):
        a = dict(q=self.vq, k=self.vk, v=self.vv, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
                 max_seqlen_q=4, max_seqlen_k=5, out=self.vout, return_lse=True)
        a.update(kw)
        return (lambda: hipflash.flash_attn_varlen_func(**a)), [a["out"]]

    def kvcache(self, paged=False, **kw):
        a = dict(q=self.dq, k_cache=self.k_pages if paged else self.k_cache,
                 v_cache=self.v_pages if paged else self.v_cache, k=self.k_new, v=self.v_new,
                 cache_seqlens=self.seqlens, block_table=self.table if paged else None,
                 return_lse=True)
        a.update(kw)
        return (lambda: hipflash.flash_attn_with_kvcache(**a)), [a["k_cache"], a["v_cache"]]

    def merge(self, **kw):
        a = dict(out_a=self.out_a, lse_a=self.lse_a, out_b=self.out_b, lse_b=self.lse_b)
        a.update(kw)
        return (lambda: hipflash.merge_attn_states(**a)), [a["out_a"], a["out_b"]]

    def bwd_op(self, **kw):
        a = dict(dout=self.dout, q=self.q, k=self.k, v=self.v, out=self.fout, lse=self.flse)
        a.update(kw)
        return (lambda: torch.ops.hipflash.bwd(a["dout"], a["q"], a["k"], a["v"], a["out"],
                                               a["lse"], None, False, -1, -1, False)), []

    def fwd_out_op(self, **kw):
        a = dict(q=self.q, k=self.k, v=self.v, out=self.out, lse=self.lse, return_lse=True)
        a.update(kw)
        return (lambda: torch.ops.hipflash.fwd_out(a["q"], a["k"], a["v"], a["out"], a["lse"], None,
                                                   False, -1, -1, 0, a["return_lse"])), \
            [a["out"]] + ([a["lse"]] if isinstance(a["lse"], torch.Tensor) else [])

    def fwd_op(self, **kw):
        a = dict(q=self.q, k=self.k, v=self.v)
        a.update(kw)
        return (lambda: torch.ops.hipflash.fwd(a["q"], a["k"], a["v"], None, False, -1, -1, 0,
                                               True)), []


@dataclass
class Case:
    id: str
    build: Callable  # Inputs -> (call, written buffers)
    error: type
    match: str
    cross_device: bool = False  # needs a second device: runs on the GPU parameter only


def expanded(t):
    """A stride-0 view of t's first entry with t's shape: every index is one element."""
    return t[:1].expand(t.shape)


C = Case
CASES = [
    # ---- flash_attn_func (SPEC §4, dense) --------------------------------------------------
    C("fwd-rank", lambda I: I.fwd(q=I.q[0]), ValueError, "q must have rank 4"),
    C("fwd-batch-differs", lambda I: I.fwd(k=I.k[:1], v=I.v[:1]), ValueError, "batch size differs"),
    C("fwd-headdim-differs", lambda I: I.fwd(v=I.v[..., :32]), ValueError, "head dim differs"),
    C("fwd-seqlen-k-differs", lambda I: I.fwd(v=I.v[:, :6]), ValueError, "same seqlen_k"),
    C("fwd-heads-divide", lambda I: I.fwd(q=I.q[:, :, :3], out=I.out[:, :, :3]), ValueError,
      "must divide"),
    C("fwd-dtype-f32", lambda I: I.fwd(q=I.q.float(), k=I.k.float(), v=I.v.float(),
                                       out=I.out.float()), TypeError, "float16, bfloat16 or float8_e4m3fn"),
    C("fwd-dtypes-differ", lambda I: I.fwd(k=I.k.half()), TypeError, "k must have dtype"),
    C("fwd-k-other-device", lambda I: I.fwd(k=I.k.to(I.other_device())), ValueError,
      "same device", cross_device=True),
    C("fwd-last-dim-stride", lambda I: I.fwd(q=I.q.transpose(2, 3).contiguous().transpose(2, 3)),
      ValueError, "contiguous last dimension"),
    C("fwd-head-dim-48", lambda I: I.fwd(q=I.q[..., :48], k=I.k[..., :48], v=I.v[..., :48],
                                         out=I.out[..., :48]), ValueError, "supported head dims"),
    C("fwd-out-aliases-q", lambda I: (lambda c, _: (c, [I.q]))(*I.fwd(out=I.q)), ValueError,
      "out must not alias q"),
    C("fwd-out-overlaps-itself", lambda I: I.fwd(out=expanded(I.out)), ValueError,
      "out must not overlap itself"),
    C("fwd-out-shape", lambda I: I.fwd(out=I.out[:, :4]), ValueError, "out must have the shape"),
    # B * Hq * Sq * (D + 2) * 4 (the rows of the LSE and split-K buffers) past int64; stride-0
    # views, so that no tensor of that size exists (out= and no LSE: nothing is allocated).
    C("fwd-size-overflows-int64", lambda I: I.fwd(q=I.q[:1, :1].expand(2**53, 1, 4, 64),
                                                  k=I.k[:1].expand(2**53, 7, 2, 64),
                                                  v=I.v[:1].expand(2**53, 7, 2, 64),
                                                  out=I.out[:1, :1].expand(2**53, 1, 4, 64),
                                                  return_lse=False),
      ValueError, "overflows int64"),
    C("fwd-window", lambda I: I.fwd(window_size=(-2, 0)), ValueError, "window_size"),
    C("fwd-softmax-scale", lambda I: I.fwd(softmax_scale=-1.0), ValueError, "softmax_scale"),
    C("fwd-num-splits", lambda I: I.fwd(num_splits=10**6), ValueError, "num_splits"),
    C("fwd-requires-grad-with-out", lambda I: I.fwd(q=I.q.clone().requires_grad_()), RuntimeError,
      "grad"),
    # ---- flash_attn_varlen_func --------------------------------------------------------------
    C("varlen-cu-dtype", lambda I: I.varlen(cu_seqlens_q=I.cu_q.long()), ValueError, "int32"),
    C("varlen-cu-length", lambda I: I.varlen(cu_seqlens_k=I.cu_k[:-1]), ValueError,
      "length of cu_seqlens_q"),
    C("varlen-cu-decreasing", lambda I: I.varlen(cu_seqlens_q=I.cu_q.flip(0).contiguous()),
      ValueError, "non-decreasing|must be >= 0|exceeds"),
    C("varlen-max-seqlen-small", lambda I: I.varlen(max_seqlen_q=3), ValueError, "too small"),
    C("varlen-max-seqlen-q-huge", lambda I: I.varlen(max_seqlen_q=2**40), ValueError,
      "max_seqlen_q"),
    C("varlen-max-seqlen-q-huge-no-out", lambda I: I.varlen(max_seqlen_q=2**40, out=None),
      ValueError, "max_seqlen_q"),
    C("varlen-max-seqlen-k-huge", lambda I: I.varlen(max_seqlen_k=2**40), ValueError,
      "max_seqlen_k"),
    C("varlen-cu-other-device", lambda I: I.varlen(cu_seqlens_k=I.cu_k.to(I.other_device())),
      ValueError, "same device", cross_device=True),
    C("varlen-lse-layout", lambda I: I.varlen(lse_layout="ragged"), ValueError, "lse_layout"),
    C("varlen-rank", lambda I: I.varlen(q=I.vq[None], out=I.vout[None]), ValueError,
      "q must have rank 3"),
    # ---- flash_attn_with_kvcache (contiguous and paged caches; the append is in place) -------
    C("kvcache-expanded-cache", lambda I: I.kvcache(k_cache=expanded(I.k_cache),
                                                    v_cache=expanded(I.v_cache)),
      ValueError, "k_cache must not overlap itself"),
    C("kvcache-expanded-pages", lambda I: I.kvcache(paged=True, k_cache=expanded(I.k_pages),
                                                    v_cache=expanded(I.v_pages)),
      ValueError, "k_cache must not overlap itself"),
    C("kvcache-caches-alias", lambda I: I.kvcache(v_cache=I.k_cache), ValueError,
      "must not alias"),
    C("kvcache-seqlens-int-2**31", lambda I: I.kvcache(cache_seqlens=2**31), ValueError,
      "cache_seqlens"),
    C("kvcache-seqlens-dtype", lambda I: I.kvcache(cache_seqlens=I.seqlens.long()), ValueError,
      "int32"),
    C("kvcache-seqlens-shape", lambda I: I.kvcache(cache_seqlens=I.seqlens[:1]), ValueError,
      "one entry per sequence"),
    C("kvcache-seqlens-overflow", lambda I: I.kvcache(cache_seqlens=I.seqlens + 12), ValueError,
      "cache holds"),
    # (CPU cache_seqlens / cache_leftpad with GPU q are the host-held lengths, SPEC §7)
    C("kvcache-table-other-device",
      lambda I: I.kvcache(paged=True, block_table=I.table.to(I.other_device())), ValueError,
      "same device", cross_device=True),
    C("kvcache-page-size", lambda I: I.kvcache(paged=True, k_cache=I.k_pages[:, :0],
                                               v_cache=I.v_pages[:, :0]), ValueError,
      "must be >= 1"),
    C("kvcache-table-dtype", lambda I: I.kvcache(paged=True, block_table=I.table.long()),
      ValueError, "int32"),
    C("kvcache-table-rows", lambda I: I.kvcache(paged=True, block_table=I.table[:1]), ValueError,
      "one row per sequence"),
    C("kvcache-new-kv-alone", lambda I: I.kvcache(v=None), ValueError, "together"),
    C("kvcache-new-shape", lambda I: I.kvcache(k=I.k_new[:, :, :1], v=I.v_new[:, :, :1]),
      ValueError, "k must have shape"),
    # ---- merge_attn_states --------------------------------------------------------------------
    C("merge-dtypes-differ", lambda I: I.merge(out_b=I.out_b.half()), TypeError, "one dtype"),
    C("merge-shapes-differ", lambda I: I.merge(out_b=I.out_b[:, :4], lse_b=I.lse_b[..., :4]),
      ValueError, "shapes differ"),
    C("merge-other-device", lambda I: I.merge(out_b=I.out_b.to(I.other_device()),
                                              lse_b=I.lse_b.to(I.other_device())),
      ValueError, "same device", cross_device=True),
    C("merge-lse-dtype", lambda I: I.merge(lse_a=I.lse_a.double(), lse_b=I.lse_b.double()),
      TypeError, "float32"),
    C("merge-not-a-tensor", lambda I: I.merge(out_a=[1.0] * 10000), TypeError, "torch.Tensor"),
    # ---- backward (the registered operator autograd calls) -----------------------------------
    C("bwd-dout-shape", lambda I: I.bwd_op(dout=I.dout[:, :4]), ValueError,
      "dout must have the shape"),
    C("bwd-lse-dtype", lambda I: I.bwd_op(lse=I.flse.double()), TypeError, "float32"),
    C("bwd-lse-shape", lambda I: I.bwd_op(lse=I.flse[:, :, :4]), ValueError, "lse buffer"),
    C("bwd-dout-last-dim", lambda I: I.bwd_op(
        dout=I.dout.transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
      "contiguous last dimension"),
    # ---- registered operators called directly -------------------------------------------------
    C("op-list-for-tensor", lambda I: I.fwd_op(q=list(range(10000))), TypeError,
      "argument 'q' must be Tensor"),
    C("op-missing-argument", lambda I: (lambda: torch.ops.hipflash.fwd(I.q, I.k), []), TypeError,
      "missing value for argument"),
    C("op-lse-too-small", lambda I: I.fwd_out_op(lse=I.lse[:, :, :4]), ValueError, "lse buffer"),
    C("op-lse-dtype", lambda I: I.fwd_out_op(lse=I.lse.half()), TypeError, "float32"),
    C("op-lse-aliases-out", lambda I: I.fwd_out_op(
        lse=I.out.view(-1).view(F32)[:40].view(2, 4, 5)), ValueError, "lse must not alias out"),
    C("op-lse-missing", lambda I: I.fwd_out_op(lse=None), ValueError, "no lse buffer"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_is_refused_and_writes_nothing(device, case):
    if device == "cuda" and not GPU:
        pytest.skip("needs a GPU visible to torch and a hipflash built with GPU kernels; this "
                    f"build: {hipflash.build_info()!r}")
    if case.cross_device and not GPU:
        pytest.skip("a cross-device case needs a second device (a GPU)")
    if case.cross_device and device == "cpu":
        pytest.skip("cross-device cases run once, on the GPU parameter")
    inputs = Inputs(device)
    call, written = case.build(inputs)
    written = [t for t in written if isinstance(t, torch.Tensor) and t.numel() < 2**24]
    before = [bits(t).clone() for t in written]
    with pytest.raises(case.error, match=case.match) as info:
        call()
    if device == "cuda":
        torch.cuda.synchronize()  # nothing was launched, and nothing failed late either
    assert len(str(info.value)) < MAX_MESSAGE, f"{len(str(info.value))} characters: {info.value}"
    for i, (t, b) in enumerate(zip(written, before)):
        assert torch.equal(bits(t), b), f"buffer {i} was written by a refused call"
