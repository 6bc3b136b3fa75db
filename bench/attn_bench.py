#!/usr/bin/env python3
"""hipflash attention-forward benchmark: hipflash (LSE off and on) against PyTorch's kernels,
side by side in one process.

    python3 bench/attn_bench.py --suite quick --out /tmp/bench-quick     # < 3 min on an H200
    python3 bench/attn_bench.py --suite full  --out bench/results/full   # < 8 min on an H200
    python3 bench/attn_bench.py --suite tiny --device cpu --out /tmp/t   # tests the runner, no GPU

Suites: fa-grid (FlashAttention's grid: B*S = 16k, H*D = 2048, D 64/128, S 512..16k, causal and
not), decode (Sq 1, GQA 32/8, Sk 4k..128k, B 1/8/32), varlen (mixed lengths), lse-overhead,
host-overhead (the cost of a call as a user makes it, on a tiny problem and B 1/8 decode);
quick (a subset of each, to run after every kernel change) and full (all five). Run on their
own: merge (hipflash.merge_attn_states in GB/s against a torch copy of the same bytes, see
run_merge_suite), serving (decode Sq 1, GQA 32/8, D 128, B 1/8/32, Sk 4k/16k/64k, LSE on: the
contiguous cache against paged caches of 16- and 256-row pages, fa2-native for reference) and
train (forward + backward against FA2 and cuDNN, bench/train_bench.py).

Per cell: fresh random inputs (never zeros), several input sets rotated so the inputs of one call
are not in L2 from the call before; every backend's result is checked against an fp32 reference
first (SPEC §6; hipflash also gets a NaN-poisoned out= buffer and a bitwise repeat), and a FAIL
is never timed. Timing: CUDA events around each call, warm-up, GPU queue pre-filled with a sleep
kernel so host launch overhead stays out, median of many calls. The host-overhead, decode and
serving suites also time the whole Python call by wall clock: calls issued back to back, and
each one synchronised.

Writes OUT/results.csv, OUT/results.md, OUT/results.json and OUT/<suite>.png, prints the tables.
docs/benchmarks.md is rendered from a full run's OUT by bench/make_report.py.
"""

import argparse
import datetime
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

import attn_backends as ab  # noqa: E402
import attn_report as rep  # noqa: E402
from attn_ref import attn_flops, check, kv_bytes, reference, reference_varlen, valid_pairs  # noqa: E402,E501

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
HF = ["hipflash", "hipflash+lse"]
DENSE_PEERS = ["torch-flash", "torch-cudnn", "torch-efficient"]
DECODE_PEERS = ["fa2-native", "cudnn-sdpa-gqa", "torch-flash", "torch-cudnn", "torch-efficient"]
# The decode suite's layout-for-layout pair: hipflash on cuDNN's [B, Hkv, Sk, D] memory, cuDNN on
# hipflash's [B, Sk, Hkv, D] (each through a view; the headline ratios stay each in its own).
DECODE_LAYOUTS = ["hipflash+lse-bhsd", "cudnn-sdpa-gqa-bshd"]
VARLEN_PEERS = ["fa2-native", "efficient-varlen"]
LSE_OVERHEAD = ["hipflash", "hipflash+lse", "torch-cudnn-nolse", "torch-cudnn",
                "torch-efficient-nolse", "torch-efficient"]
# fa2-native has no LSE switch (aten._flash_attention_forward always returns the LSE).
HOST_OVERHEAD = HF + ["fa2-native", "torch-cudnn-nolse", "torch-cudnn"]
# The serving suite: contiguous (the plain forward) vs paged caches, all with the LSE.
SERVING = ["hipflash+lse", "hipflash-paged16", "hipflash-paged256", "fa2-native"]
HOST = rep.HOST  # the suite whose cells also get the host timing (Timer.host)


# ---- Cells -----------------------------------------------------------------------------------


@dataclass
class Cell:
    suite: str
    kind: str            # "dense" or "varlen"
    B: int
    Sq: int
    Sk: int
    Hq: int
    Hkv: int
    D: int
    causal: bool
    dtype: str
    backends: List[str]
    label: str = ""      # row name in the tables
    group: str = ""      # subplot
    xlabel: str = ""     # x tick in the subplot
    cu_q: Optional[List[int]] = None
    cu_k: Optional[List[int]] = None
    seed: int = 0
    flops: int = 0
    kvbytes: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.D)

    @property
    def total_q(self):
        return self.cu_q[-1]

    @property
    def total_k(self):
        return self.cu_k[-1]

    @property
    def max_q(self):
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:]))

    @property
    def max_k(self):
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:]))

    @property
    def id(self):
        return f"{self.suite}:{self.label}"

    def finish(self):
        if self.kind == "varlen":
            pairs = sum(valid_pairs(q1 - q0, k1 - k0, self.causal)
                        for q0, q1, k0, k1 in zip(self.cu_q, self.cu_q[1:], self.cu_k, self.cu_k[1:]))
            self.flops = attn_flops(1, self.Hq, self.D, pairs)
            self.kvbytes = kv_bytes(1, self.Hkv, self.total_k, self.D)
        else:
            self.flops = attn_flops(self.B, self.Hq, self.D,
                                    valid_pairs(self.Sq, self.Sk, self.causal))
            self.kvbytes = kv_bytes(self.B, self.Hkv, self.Sk, self.D)
        return self


def _k(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def fa_grid(seqlens, dims, causals, dtype, backends, suite="fa-grid"):
    """FlashAttention's benchmark grid: B*S = 16k tokens, H*D = 2048."""
    cells = []
    for D in dims:
        for causal in causals:
            for S in seqlens:
                B, H = 16384 // S, 2048 // D
                cm = " causal" if causal else ""
                cells.append(Cell(suite, "dense", B, S, S, H, H, D, causal, dtype, list(backends),
                                  label=f"hd{D} S={_k(S)}{cm}",
                                  group=f"head dim {D}, {'causal' if causal else 'non-causal'}",
                                  xlabel=_k(S)).finish())
    return cells


def decode(seqlens_k, batches, dtype, backends, suite="decode", D=128):
    """Decode: one query token, GQA 32 query heads over 8 KV heads, D 128 (the issue's; another
    head dim is named in the labels)."""
    cells = []
    hd = "" if D == 128 else f" hd{D}"
    for B in batches:
        for Sk in seqlens_k:
            cells.append(Cell(suite, "dense", B, 1, Sk, 32, 8, D, False, dtype, list(backends),
                              label=f"B={B} Sk={_k(Sk)}{hd}", group=f"batch {B}",
                              xlabel=_k(Sk)).finish())
    return cells


def serving(seqlens_k, batches, dtype, backends, suite="serving", D=128):
    """Decode against a KV cache (Sq 1, GQA 32/8, D 128, LSE on): the contiguous cache (the
    plain forward, whose decode kernel reads the same row source) against paged caches of 16-
    and 256-row pages (hipflash.flash_attn_with_kvcache with a block table)."""
    return decode(seqlens_k, batches, dtype, backends, suite, D)


def host_overhead(dtype, backends, decode_batches, decode_shape=(4096, 32, 8, 128)):
    """Host overhead per call: a tiny dense problem (B 1, S 128, 8 heads, D 64: a few µs of GPU
    work, so issuing the call is what costs) and decode at the decode suite's shape (Sk, Hq, Hkv,
    D) = decode_shape for each batch. One plot, a bar group per cell."""
    Sk, Hq, Hkv, D = decode_shape
    cells = [Cell(HOST, "dense", 1, 128, 128, 8, 8, 64, False, dtype, list(backends),
                  label="dense B=1 S=128 hd64")]
    cells += [Cell(HOST, "dense", B, 1, Sk, Hq, Hkv, D, False, dtype, list(backends),
                   label=f"decode B={B} Sk={_k(Sk)}") for B in decode_batches]
    for c in cells:
        c.xlabel = c.label
        c.finish()
    return cells


def varlen_lengths(total, lo, hi, seed):
    """Deterministic mixed lengths in [lo, hi] summing to `total`."""
    rng = random.Random(seed)
    lens = []
    while sum(lens) < total:
        lens.append(min(rng.randint(lo, hi), total - sum(lens)))
    return lens


def varlen(configs, dims, causals, dtype, backends, suite="varlen"):
    cells = []
    for name, total, lo, hi in configs:
        lens = varlen_lengths(total, lo, hi, seed=len(name) * 7919 + total)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        for D in dims:
            for causal in causals:
                H = 2048 // D
                cm = " causal" if causal else ""
                c = Cell(suite, "varlen", len(lens), max(lens), max(lens), H, H, D, causal,
                         dtype, list(backends),
                         label=f"{name} hd{D}{cm}", group="", cu_q=list(cu), cu_k=list(cu),
                         xlabel=f"{name}\nhd{D}{cm}")
                c.extra["seqlens"] = f"{len(lens)} seqs, {min(lens)}..{max(lens)}, total {total}"
                cells.append(c.finish())
    return cells


def build_suite(name, dtype, flex, decode_dim=128):
    """Cells of a suite. flex: include FlexAttention on the fa-grid cells of head dim 128.
    decode_dim: the head dim of the decode and serving suites' cells."""
    def with_flex(cells):
        for c in cells:
            if c.D == 128:
                c.backends.append("flex")
        return cells

    full_grid = fa_grid([512, 1024, 2048, 4096, 8192, 16384], [64, 128], [False, True], dtype,
                        HF + DENSE_PEERS)
    full_decode = decode([4096, 8192, 16384, 32768, 65536, 131072], [1, 8, 32], dtype,
                         HF + DECODE_PEERS + DECODE_LAYOUTS, D=decode_dim)
    full_varlen = varlen([("mixed 128..4k", 16384, 128, 4096), ("short 16..512", 16384, 16, 512)],
                         [64, 128], [False, True], dtype, HF + VARLEN_PEERS)
    full_lse = (fa_grid([1024, 4096, 16384], [128], [False], dtype, LSE_OVERHEAD, "lse-overhead")
                + decode([32768], [8], dtype, LSE_OVERHEAD, "lse-overhead"))
    # Head dims outside the FA grid that the Hopper issue names (96 and 256, against FA2).
    head_dims = fa_grid([1024, 4096, 16384], [96, 256], [False, True], dtype, HF + DENSE_PEERS,
                        "head-dims")
    if name == "fa-grid":
        return with_flex(full_grid) if flex else full_grid
    if name == "head-dims":
        return head_dims
    if name == "dev":  # kernel work on Hopper: part of the grid, hd96 and hd256, < 1 min
        return fa_grid([1024, 4096, 16384], [64, 128], [False, True], dtype, HF + DENSE_PEERS) \
            + fa_grid([4096], [96, 256], [False, True], dtype, HF + DENSE_PEERS, "head-dims") \
            + fa_grid([4096], [128], [False], dtype, LSE_OVERHEAD, "lse-overhead")
    if name == "decode":
        return full_decode
    if name == "serving":  # run on its own (not part of full): paged KV-cache decode
        return serving([4096, 16384, 65536], [1, 8, 32], dtype, SERVING, D=decode_dim)
    if name == "varlen":
        return full_varlen
    full_host = host_overhead(dtype, HOST_OVERHEAD, [1, 8])
    if name == "lse-overhead":
        return full_lse
    if name == HOST:
        return full_host
    if name == "full":
        return (with_flex(full_grid) if flex else full_grid) + head_dims + full_decode \
            + full_varlen + full_lse + full_host
    if name == "quick":
        grid = fa_grid([1024, 4096, 16384], [64, 128], [False, True], dtype, HF + DENSE_PEERS)
        return (with_flex(grid) if flex else grid) \
            + decode([8192, 131072], [1, 32], dtype, HF + DECODE_PEERS) \
            + varlen([("mixed 128..4k", 16384, 128, 4096)], [128], [False, True], dtype,
                     HF + VARLEN_PEERS) \
            + fa_grid([4096], [128], [False], dtype, LSE_OVERHEAD, "lse-overhead") \
            + decode([32768], [8], dtype, LSE_OVERHEAD, "lse-overhead") \
            + host_overhead(dtype, HOST_OVERHEAD, [1])
    if name == "tiny":  # CPU: every suite kind and code path, at toy sizes
        peers = ["torch-sdpa", "torch-math"]
        cells = []
        for causal in (False, True):
            for S in (128, 256):
                cells.append(Cell("fa-grid", "dense", 2, S, S, 4, 4, 64, causal, dtype,
                                  HF + peers, label=f"hd64 S={S}{' causal' if causal else ''}",
                                  group=f"head dim 64, {'causal' if causal else 'non-causal'}",
                                  xlabel=str(S)).finish())
        for Sk in (512, 1024):
            cells.append(Cell("decode", "dense", 2, 1, Sk, 8, 2, 64, False, dtype,
                              HF + DECODE_LAYOUTS[:1] + peers,
                              label=f"B=2 Sk={Sk}", group="batch 2", xlabel=str(Sk)).finish())
        cells += varlen([("mixed 16..200", 600, 16, 200)], [64], [False, True], dtype,
                        HF + ["torch-math"])
        cells.append(Cell("serving", "dense", 2, 1, 512, 8, 2, 64, False, dtype,
                          SERVING[:3] + ["torch-math"], label="B=2 Sk=512", group="batch 2",
                          xlabel="512").finish())
        lse = Cell("lse-overhead", "dense", 2, 256, 256, 4, 4, 64, False, dtype,
                   ["hipflash", "hipflash+lse", "torch-sdpa", "torch-math"], label="hd64 S=256",
                   xlabel="256").finish()
        return cells + [lse] + host_overhead(dtype, HF + peers, [1], decode_shape=(512, 8, 2, 64))
    raise SystemExit(f"unknown suite {name!r}")


# ---- Timing ----------------------------------------------------------------------------------


class Timer:
    """Median per-call time. CUDA: events around each call, queue pre-filled with a sleep
    kernel (so the host's launch cost is not in the device time). CPU: perf_counter.
    rounds > 1: run_cell times a cell's backends in that many rounds each, taking turns
    (interleaved), every round a 1/rounds share of the repetitions."""

    def __init__(self, device, warmup_ms, rep_ms, min_reps, max_reps, rounds=1):
        self.device = device
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.min_reps, self.max_reps = min_reps, max_reps
        self.rounds = max(1, int(rounds))
        self.cycles_per_ms = None
        if device == "cuda" and hasattr(torch.cuda, "_sleep"):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = 2_000_000
            torch.cuda._sleep(n)  # first launch outside the measurement
            a.record()
            torch.cuda._sleep(n)
            b.record()
            torch.cuda.synchronize()
            ms = a.elapsed_time(b)
            self.cycles_per_ms = n / ms if ms > 0 else None

    def _sleep(self, ms):
        if self.cycles_per_ms:
            torch.cuda._sleep(int(min(ms, 250.0) * self.cycles_per_ms))

    def time(self, run, nsets):
        return _stats(self.samples(run, nsets))

    def time_in_rounds(self, run, nsets):
        """One backend on its own in the cells' timing windows: `rounds` windows of a 1/rounds
        share each (with rounds 1 the same as time), so that a reference measured apart from
        the cells (matmul_rate) runs at the duty cycle the cells ran at."""
        ts = []
        for r in range(self.rounds):
            ts += self.samples(run, nsets, share=1.0 / self.rounds, first=r == 0)
        return _stats(sorted(ts))

    def _reps(self, est_ms, share, lo, hi):
        """Repetitions for a share of the timed budget at est_ms a call, within [lo, hi]
        scaled by the share (at least one)."""
        lo = max(1, math.ceil(lo * share))
        hi = max(lo, math.ceil(hi * share))
        return int(min(hi, max(lo, math.ceil(self.rep_ms * share / max(est_ms, 1e-3)))))

    def samples(self, run, nsets, share=1.0, first=True):
        """The sorted per-call times (ms) of one timing window: a warm-up (the full one if
        `first`, else its `share`), then `share` of the budget's repetitions."""
        warmup_ms = self.warmup_ms * (1.0 if first else share)
        if self.device != "cuda":
            return self._samples_cpu(run, nsets, share, warmup_ms)
        sync = torch.cuda.synchronize
        sync()
        t0, n = time.perf_counter(), 0
        while n < 3 or (time.perf_counter() - t0) * 1e3 < warmup_ms:
            run(n % nsets)
            sync()
            n += 1
        # device time per call, for the repetition count
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for j in range(3):
            run(j % nsets)
        b.record()
        sync()
        est = max(a.elapsed_time(b) / 3, 1e-3)
        # host cost per call, for how long the queue must be held
        host = 1.0
        if self.cycles_per_ms:
            self._sleep(50.0)
            h0 = time.perf_counter()
            run(0)
            run(1 % nsets)
            host = (time.perf_counter() - h0) * 1e3 / 2
            sync()
        reps = self._reps(est, share, self.min_reps, self.max_reps)
        chunk = max(1, min(reps, int(150.0 / max(host, 1e-3))))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for c0 in range(0, reps, chunk):
            m = min(chunk, reps - c0)
            self._sleep(m * host * 1.5 + 0.5)
            for j in range(c0, c0 + m):
                starts[j].record()
                run(j % nsets)
                ends[j].record()
        sync()
        return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))

    def _samples_cpu(self, run, nsets, share, warmup_ms):
        t0, n = time.perf_counter(), 0
        while n < 2 or (time.perf_counter() - t0) * 1e3 < warmup_ms:
            run(n % nsets)
            n += 1
        est = (time.perf_counter() - t0) * 1e3 / n
        reps = self._reps(est, share, 3, 50)
        ts = []
        for j in range(reps):
            t = time.perf_counter()
            run(j % nsets)
            ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts)

    def host(self, runs, nsets, loops=None):
        """Wall-clock cost of a call as a user makes it (the whole Python call: argument
        handling, output allocation, launch), for the backends of one cell at once.

        runs: {backend: run}. Back to back: after a warm-up and a synchronize, N calls issued with
        no synchronisation, then a synchronize; wall time / N, median and min over the repeats
        (on a small problem this is how fast calls can be issued). Synchronised: each call
        followed by a synchronize; median over the calls (the latency of one call). The backends
        take turns repeat by repeat and call by call, so a drift in the host's speed hits them
        alike. On the CPU there is nothing to synchronise: both are plain wall clock.
        loops: (repeats, calls back to back, synchronised calls), default HOST_LOOPS.
        Returns {backend: {"b2b_us", "b2b_min_us", "sync_us"}}."""
        repeats, n, ncalls = loops or HOST_LOOPS[self.device]
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        clock = time.perf_counter_ns
        names = list(runs)
        b2b = {b: [] for b in names}
        one = {b: [] for b in names}
        for b in names:  # warm-up
            for j in range(n):
                runs[b](j % nsets)
        sync()
        for r in range(repeats):
            for b in names[r % len(names):] + names[:r % len(names)]:
                run = runs[b]
                sync()
                t0 = clock()
                for j in range(n):
                    run(j % nsets)
                sync()
                b2b[b].append((clock() - t0) / n / 1e3)
        for j in range(ncalls):
            for b in names:
                t0 = clock()
                runs[b](j % nsets)
                sync()
                one[b].append((clock() - t0) / 1e3)
        return {b: {"b2b_us": statistics.median(b2b[b]), "b2b_min_us": min(b2b[b]),
                    "sync_us": statistics.median(one[b])} for b in names}


def _stats(ts):
    q = lambda f: ts[min(len(ts) - 1, int(f * (len(ts) - 1) + 0.5))]  # noqa: E731
    return {"time_ms": q(0.5), "p10_ms": q(0.1), "p90_ms": q(0.9), "reps": len(ts)}


BUDGETS = {  # warm-up ms, timed ms per backend and cell, min and max repetitions
    "quick": (25.0, 60.0, 10, 200),
    "full": (40.0, 250.0, 25, 500),
}
HOST_LOOPS = {  # host-overhead suite: repeats x calls back to back, synchronised calls
    "cuda": (7, 200, 200),
    "cpu": (3, 10, 10),  # the runner's test: enough to run the code, no more
}


# ---- Running a cell --------------------------------------------------------------------------


def is_fatal_cuda_error(exc):
    msg = str(exc).lower()
    return any(s in msg for s in ("illegal memory access", "illegal address", "unspecified launch",
                                  "misaligned address", "device-side assert", "launch failure",
                                  "an illegal instruction"))


def _err(e, limit=300):
    s = f"{type(e).__name__}: {e}".replace("\n", " ").strip()
    return s[:limit]


def base_row(cell, name, backend):
    return {
        "suite": cell.suite, "cell": cell.id, "label": cell.label, "group": cell.group,
        "xlabel": cell.xlabel, "kind": cell.kind, "B": cell.B, "Sq": cell.Sq, "Sk": cell.Sk,
        "Hq": cell.Hq, "Hkv": cell.Hkv, "D": cell.D, "causal": cell.causal, "dtype": cell.dtype,
        "seqlens": cell.extra.get("seqlens", ""), "backend": name,
        "peer": backend.peer if backend else True, "lse": backend.lse if backend else False,
        "status": "n/a", "check": "", "err_out": None, "tol_out": None, "err_lse": None,
        "time_ms": None, "p10_ms": None, "p90_ms": None, "reps": None, "nsets": None,
        "tflops": None, "gbps": None, "b2b_us": None, "b2b_min_us": None, "sync_us": None,
        "kernel": "", "note": "",
    }


def choose_nsets(cell, device, l2_bytes, mem_cap):
    """Enough input sets that their total is >= 4x L2 (one set if it is that big already)."""
    if device != "cuda":
        return 2
    per = ab.inputs_bytes(cell)
    if cell.kind == "dense":
        per += 2 * cell.B * cell.D * (cell.Sq * cell.Hq + 2 * cell.Sk * cell.Hkv)  # bhsd copies
    n = 1 if per >= 4 * l2_bytes else math.ceil(4 * l2_bytes / per)
    n = min(n, 64)
    while n > 1 and n * per > mem_cap:
        n -= 1
    return n


def run_cell(cell, backends, avail, timer, device, l2_bytes, mem_cap, log):
    """Check and time every backend of one cell; in the host-overhead suite, then the host cost
    of a call of every backend that passed (Timer.host, the backends taking turns). Returns
    (rows, fatal error or None)."""
    nsets = choose_nsets(cell, device, l2_bytes, mem_cap)
    rows = {}
    todo = []
    for name in cell.backends:
        b = backends.get(name)
        row = base_row(cell, name, b)
        rows[name] = row
        if b is None:
            row["note"] = "unknown backend"
        elif not avail[name][0]:
            row["note"] = avail[name][1]
        elif cell.kind not in b.kinds:
            row["note"] = f"{name} has no {cell.kind} entry point"
        else:
            todo.append(name)
    if not todo:
        return [rows[n] for n in cell.backends], None

    try:
        inp = ab.Inputs(cell, nsets, device, seed=cell.seed or zlib.crc32(cell.id.encode()))
        if cell.kind == "varlen":
            ref = reference_varlen(inp.q[0], inp.k[0], inp.v[0], cell.cu_q, cell.cu_k, cell.scale,
                                   cell.causal, budget_bytes=_ref_budget(device))
        else:
            ref = reference(inp.q[0], inp.k[0], inp.v[0], cell.scale, cell.causal,
                            budget_bytes=_ref_budget(device))
    except Exception as e:
        fatal = e if (device == "cuda" and is_fatal_cuda_error(e)) else None
        for n in todo:
            rows[n]["note"] = f"inputs/reference failed: {_err(e)}"
        return [rows[n] for n in cell.backends], fatal

    # Peers first, hipflash last: a device fault in a new kernel cannot cost the peers' numbers.
    order = [n for n in todo if backends[n].peer] + [n for n in todo if not backends[n].peer]
    fatal = None
    host_runs = {}  # host-overhead, decode, serving: the checked and timed backends' calls
    wall_clock = cell.suite == HOST or cell.suite in rep.WALL_CLOCK_SUITES
    interleaved = {}  # timer.rounds > 1: the checked backends' calls, timed after the checks
    for name in order:
        b, row = backends[name], rows[name]
        row["nsets"] = nsets
        try:
            run, extract = b.prepare(cell, inp)
            res = _check_call(b, run, inp)
            if device == "cuda":
                torch.cuda.synchronize()
            out, lse = extract(res)
            chk = check(out, lse, ref, lse_expected=b.lse)
            if not b.peer:
                row["kernel"] = b.kernel_name()
                if chk["ok"]:
                    res2 = run(0)
                    if not _bitwise_equal(res, res2):
                        chk.update(ok=False, check="FAIL",
                                   note="two runs on the same input differ (SPEC §6: bitwise)")
                    del res2
            del res, out, lse
            row.update(check=chk["check"], err_out=chk["err_out"], tol_out=chk["tol_out"],
                       err_lse=chk["err_lse"], note=chk["note"])
            if not chk["ok"]:
                row["status"] = "FAIL"
            elif timer.rounds > 1:
                interleaved[name] = run  # timed below, the backends taking turns
            else:
                _record_time(cell, row, timer.time(run, nsets))
                if wall_clock:
                    host_runs[name] = run
        except ab.Unavailable as e:
            row["status"], row["note"] = "n/a", str(e)
        except Exception as e:
            row["status"], row["note"] = "n/a", _err(e)
            if device == "cuda":
                if _context_lost(e):
                    fatal = RuntimeError(f"CUDA context lost in {name} @ {cell.label}: {_err(e)}")
                    row["note"] = str(fatal)
                    break
                torch.cuda.empty_cache()
        log(name)
    if interleaved and fatal is not None:
        for n in interleaved:
            rows[n]["note"] = f"not timed: {fatal}"
    elif interleaved:
        fatal = _time_interleaved(cell, interleaved, rows, timer, nsets, device)
        if wall_clock and fatal is None:
            host_runs.update((n, interleaved[n]) for n in interleaved if rows[n]["status"] == "ok")
    del interleaved
    if host_runs and fatal is None:
        try:
            for name, st in timer.host(host_runs, nsets).items():
                rows[name].update(st)
        except Exception as e:  # the device times stand; the host columns stay empty
            for name in host_runs:
                rows[name]["note"] = f"host timing failed: {_err(e)}"
            if device == "cuda" and _context_lost(e):
                fatal = RuntimeError(f"CUDA context lost in host timing @ {cell.label}: "
                                     f"{_err(e)}")
    del inp, ref, host_runs
    return [rows[n] for n in cell.backends], fatal


def _positive_int(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: a count of at least 1")
    return n


def _record_time(cell, row, st):
    """A timed backend's row: the statistics, TFLOP/s and, for decode-shaped cells, GB/s."""
    row.update(st)
    row["status"] = "ok"
    t = st["time_ms"] * 1e-3
    row["tflops"] = cell.flops / t / 1e12
    if cell.suite == "decode" or (cell.Sq == 1 and cell.kind == "dense"):
        row["gbps"] = cell.kvbytes / t / 1e9


def interleaved_order(names, rounds):
    """The order of the timing windows with `rounds` rounds: every backend once a round, the
    round's first backend rotating, so that no backend always follows the same one."""
    names = list(names)
    return [n for r in range(rounds) for n in names[r % len(names):] + names[:r % len(names)]]


def _time_interleaved(cell, runs, rows, timer, nsets, device):
    """Times the checked backends of one cell in timer.rounds rounds, taking turns: a change
    of the GPU's clock (its power limit) during the cell then reaches every backend's median
    alike. A backend that fails is n/a and leaves the rounds. Returns a fatal error or None."""
    ts = {n: [] for n in runs}
    seen = set()
    for name in interleaved_order(runs, timer.rounds):
        if name not in ts:
            continue
        try:
            ts[name] += timer.samples(runs[name], nsets, share=1.0 / timer.rounds,
                                      first=name not in seen)
            seen.add(name)
        except Exception as e:
            del ts[name]
            rows[name]["status"], rows[name]["note"] = "n/a", _err(e)
            if device == "cuda":
                if _context_lost(e):
                    fatal = RuntimeError(f"CUDA context lost in {name} @ {cell.label}: {_err(e)}")
                    rows[name]["note"] = str(fatal)
                    for other in ts:  # their rounds are not complete: no median to give
                        rows[other]["note"] = f"not timed: {fatal}"
                    return fatal
                torch.cuda.empty_cache()
    for name, t in ts.items():
        _record_time(cell, rows[name], _stats(sorted(t)))
    return None


def _check_call(b, run, inp):
    """hipflash writes into an out= buffer poisoned with NaN, so an element it never writes
    fails the check; the peers allocate their own outputs."""
    if b.peer:
        return run(0)
    poison = torch.full_like(inp.q[0], float("nan"))
    return run(0, out=poison)


def _bitwise_equal(a, b):
    ta = a if isinstance(a, tuple) else (a,)
    tb = b if isinstance(b, tuple) else (b,)
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb):
        if x is None or y is None:
            if x is not y:
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        # compare raw bits (NaN == NaN, -0 != +0)
        xv = x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)
        yv = y.contiguous().view(torch.int16 if y.element_size() == 2 else torch.int32)
        if not torch.equal(xv, yv):
            return False
    return True


def _context_lost(e):
    """After exception e on the GPU: is the CUDA context gone (so the run must stop)?"""
    return is_fatal_cuda_error(e) or not _cuda_alive()


def _cuda_alive():
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def _ref_budget(device):
    return (1 << 31) if device == "cuda" else (1 << 27)


# ---- Environment -----------------------------------------------------------------------------


def _sh(cmd, cwd=None):
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
        return r.stdout.strip() if r.returncode == 0 else ""
    except Exception:
        return ""


def git_commit(arg):
    if arg:
        return arg
    if os.environ.get("HIPFLASH_COMMIT"):
        return os.environ["HIPFLASH_COMMIT"]
    sha = _sh(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO)
    if not sha:
        return "unknown (no git; pass --commit or HIPFLASH_COMMIT)"
    dirty = _sh(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO)
    return sha + ("-dirty" if dirty else "")


def command_line(environ=os.environ, argv=None):
    """The command as run: the library's run-time switches (HIPFLASH_*, which change the kernels
    it picks) in front of the interpreter and its arguments. HIPFLASH_COMMIT is recorded apart."""
    switches = [f"{k}={v}" for k, v in sorted(environ.items())
                if k.startswith("HIPFLASH_") and k != "HIPFLASH_COMMIT"]
    words = [os.path.basename(sys.executable)] + (sys.argv if argv is None else argv)
    return " ".join(shlex.quote(a) for a in switches + words)


def collect_meta(args, device, hf_path):
    m = {"device": device, "suite": args.suite, "dtype": args.dtype,
         "command": command_line(),
         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
         "torch": torch.__version__, "python": platform.python_version(),
         "commit": git_commit(args.commit)}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        m["gpu"] = f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB" + \
            (f", L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB)"
             if getattr(p, "L2_cache_size", 0) else ")")
        m["cuda"] = torch.version.cuda or ""
        drv = _sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        m["driver"] = drv.splitlines()[0] if drv else "unknown (nvidia-smi not answering)"
        try:
            m["cudnn"] = str(torch.backends.cudnn.version())
        except Exception:
            pass
    else:
        m["gpu"] = f"none (CPU: {platform.processor() or platform.machine()}, " \
                   f"{os.cpu_count()} threads)"
    try:
        import triton
        m["triton"] = triton.__version__
    except Exception:
        pass
    try:
        hf = ab.import_hipflash(hf_path)
        info = getattr(hf, "build_info", lambda: "")()
        m["hipflash"] = f"{getattr(hf, '__version__', '?')} {info}".strip()
    except Exception as e:
        m["hipflash"] = f"not importable ({str(e)[:200]})"
    return m


# ---- Main ------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="quick",
                    choices=["quick", "full", "fa-grid", "head-dims", "dev", "decode", "varlen",
                             "lse-overhead", HOST, "serving", "tiny", "merge", "train"])
    ap.add_argument("--out", default=None, help="results directory (default bench/results/SUITE)")
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"],
                    help="default: cuda if available, else cpu (CPU runs only test the runner)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--flex", default="auto", choices=["auto", "on", "off"],
                    help="FlexAttention (torch.compile, slow to build): auto = full/fa-grid only, "
                         "head dim 128 cells")
    ap.add_argument("--backends", default=None,
                    help="comma list: time only these (e.g. hipflash,torch-flash)")
    ap.add_argument("--commit", default=None, help="commit to record (else $HIPFLASH_COMMIT, git)")
    ap.add_argument("--hipflash-path", default=None,
                    help="directory holding the hipflash package, if not importable as is")
    ap.add_argument("--budget", default=None, choices=sorted(BUDGETS),
                    help="timing budget (default: quick for the quick suite, else full)")
    ap.add_argument("--progress", default="auto", choices=["auto", "bar", "plain", "none"])
    ap.add_argument("--cells", default=None,
                    help="only the cells whose label matches this regular expression")
    ap.add_argument("--decode-head-dim", type=int, default=128, choices=[64, 128],
                    help="head dim of the decode and serving suites' cells (default 128, the "
                         "issue's; 64 for the hd64 decode kernels)")
    ap.add_argument("--rounds", type=_positive_int, default=1,
                    help="time each cell's backends in N interleaved rounds (default 1: each "
                         "backend's calls in one window, in turn)")
    ap.add_argument("--max-cells", type=int, default=0, help="debug: stop after N cells")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    device = args.device or ("cuda" if torch.cuda.is_available() or args.dry_run else "cpu")
    if device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    if args.rounds > 1 and args.suite in ("merge", "train"):
        raise SystemExit(f"--rounds: the {args.suite} suite times its own pairs in one window each")
    if args.suite == "merge":
        return run_merge_suite(args, device)
    if args.suite == "train":  # forward + backward: bench/train_bench.py
        import train_bench
        out_dir = args.out or os.path.join(HERE, "results", "train")
        os.makedirs(out_dir, exist_ok=True)
        budget = BUDGETS[args.budget or "full"] if device == "cuda" else (5.0, 20.0, 3, 50)
        return train_bench.run_train_suite(args, device, Timer(device, *budget),
                                           collect_meta(args, device, args.hipflash_path), out_dir)
    if device == "cpu" and args.suite != "tiny":
        print(f"note: --device cpu runs only the tiny suite (asked for {args.suite})")
        args.suite = "tiny"
    flex = args.flex == "on" or (args.flex == "auto" and args.suite in ("full", "fa-grid"))
    cells = build_suite(args.suite, args.dtype, flex and device == "cuda", args.decode_head_dim)
    if args.backends:
        keep = set(args.backends.split(","))
        for c in cells:
            c.backends = [b for b in c.backends if b in keep]
        cells = [c for c in cells if c.backends]
    cells = ab.select_cells(cells, args.cells, lambda c: c.label, args.suite)
    if args.max_cells:
        cells = cells[:args.max_cells]
    out_dir = args.out or os.path.join(HERE, "results", args.suite)

    if args.dry_run:
        print(f"{len(cells)} cells on {device}, out: {out_dir}")
        for c in cells:
            shape = (f"varlen {c.extra.get('seqlens')}" if c.kind == "varlen"
                     else f"B={c.B} Sq={c.Sq} Sk={c.Sk}")
            print(f"  {c.suite:12s} {c.label:28s} {shape} Hq={c.Hq} Hkv={c.Hkv} D={c.D} "
                  f"GFLOP={c.flops / 1e9:.1f} in={ab.inputs_bytes(c) / 2**20:.0f}MiB "
                  f"[{', '.join(c.backends)}]")
        return 0

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    backends = ab.make_backends(args.hipflash_path)
    names = sorted({n for c in cells for n in c.backends})
    avail = {}
    for n in names:
        b = backends.get(n)
        if b is None:
            avail[n] = (False, "unknown backend")
        elif device not in b.devices:
            avail[n] = (False, f"{n} does not run on {device}")
        else:
            try:
                avail[n] = b.available(device)
            except Exception as e:
                avail[n] = (False, _err(e))
    meta = collect_meta(args, device, args.hipflash_path)
    print(f"hipflash bench: suite={args.suite} device={device} gpu={meta.get('gpu')} "
          f"torch={meta['torch']} commit={meta['commit']}")
    for n in names:
        if not avail[n][0]:
            print(f"  {n}: n/a ({avail[n][1][:200]})")

    l2 = 0
    mem_cap = 0
    if device == "cuda":
        # fp32 reference must be IEEE fp32, not TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        p = torch.cuda.get_device_properties(0)
        l2 = getattr(p, "L2_cache_size", 0) or (60 << 20)
        free, _ = torch.cuda.mem_get_info()
        mem_cap = int(free * 0.35)
        _warm_gpu()
    budget = BUDGETS[args.budget or ("quick" if args.suite == "quick" else "full")]
    if device != "cuda":
        budget = (5.0, 20.0, 3, 50)
    timer = Timer(device, *budget, rounds=args.rounds)
    meta["timing"] = (
        "CUDA events around each call; warm-up >= %.0f ms; median of max(%d, min(%d, %.0f ms / "
        "time per call)) calls; inputs rotated over enough sets to exceed 4x L2; GPU queue "
        "pre-filled with a sleep kernel so host launch overhead is excluded"
        % (budget[0], budget[2], budget[3], budget[1])
        if device == "cuda" else "CPU perf_counter (runner test only)")
    if timer.rounds > 1:
        meta["timing"] += (f"; each cell's backends timed in {timer.rounds} interleaved rounds, "
                           f"each round 1/{timer.rounds} of a backend's calls, taking turns")
    if device == "cuda" and any(c.suite == "fa-grid" for c in cells):
        try:
            meta["matmul_tflops"] = round(matmul_rate(timer), 1)
            meta["matmul"] = (f"{meta['matmul_tflops']:.1f} TFLOP/s (bf16 C = A B, {MATMUL_N}^3, "
                              "random inputs, timed as the cells are, in their rounds, before them)")
        except Exception as e:  # the run goes on without the rate; the report says it lacks it
            meta["matmul"] = f"not measured ({_err(e)})"
    if any(c.suite == HOST or c.suite in rep.WALL_CLOCK_SUITES for c in cells):
        repeats, n, ncalls = HOST_LOOPS[device]
        sync = "torch.cuda.synchronize()" if device == "cuda" else "nothing (CPU)"
        suites = ", ".join([HOST] + list(rep.WALL_CLOCK_SUITES))
        meta["host_timing"] = (
            f"{suites} suites: the whole Python call by wall clock (perf_counter_ns); back to back "
            f"= {repeats} repeats of {n} calls with no synchronisation, then {sync}, per call "
            f"(median and min of the repeats); synchronised = median of {ncalls} calls, each "
            f"followed by {sync}; the backends take turns")

    total = sum(1 for c in cells for _ in c.backends)
    bar = _progress(args.progress, total)
    rows, fatal = [], None
    for ci, cell in enumerate(cells):
        t_cell = time.time()
        if fatal is not None:
            for n in cell.backends:
                r = base_row(cell, n, backends.get(n))
                r["note"] = f"not run: {fatal}"
                rows.append(r)
            bar.update(len(cell.backends))
            continue
        bar.set_description(f"{cell.suite} {cell.label}")
        ticks = []

        def tick(name):
            ticks.append(name)
            bar.update(1)
        crow, fatal = run_cell(cell, backends, avail, timer, device, l2, mem_cap, tick)
        bar.update(max(0, len(cell.backends) - len(ticks)))
        rows += crow
        bar.cell_done(ci + 1, len(cells), cell, crow, time.time() - t_cell)
        rep.write_json(meta, rows, os.path.join(out_dir, "results.json"))  # partial results
    bar.close()

    meta["wall_s"] = f"{time.time() - t_start:.0f}"
    rep.write_csv(rows, os.path.join(out_dir, "results.csv"))
    images, why = rep.make_plots(rows, out_dir, meta.get("gpu", "").split(" (")[0], args.dtype)
    meta["plots"] = why or ", ".join(images.values())
    rep.write_json(meta, rows, os.path.join(out_dir, "results.json"))
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(rep.render_markdown(meta, rows, images))
    print(rep.terminal_report(rows))
    print(f"\nwrote {out_dir}/results.csv, results.md, results.json"
          + (", " + ", ".join(images.values()) if images else f" ({why})"))
    print(f"wall time {meta['wall_s']} s")
    if fatal is not None:
        print(f"STOPPED EARLY: {fatal}")
        return 2
    return 0


# ---- The merge suite -------------------------------------------------------------------------

# (label, parts, rows T, heads H, head dim D): decode-like (T = batch, one row each) and
# prefill-like (T = tokens) merges of attention states, packed layout ([T, H, D], LSE [H, T]).
MERGE_CELLS = [("decode B=32", 2, 32, 32, 128), ("decode B=256", 2, 256, 32, 128),
               ("prefill T=4k", 2, 4096, 32, 128), ("prefill T=16k", 2, 16384, 32, 128),
               ("prefill T=16k hd64", 2, 16384, 32, 64), ("4-way T=16k", 4, 16384, 32, 128)]
MERGE_TINY = [("tiny 2-way", 2, 64, 4, 64), ("tiny 3-way", 3, 33, 2, 128)]


def run_merge_suite(args, device):
    """hipflash.merge_attn_states, bandwidth: bytes moved (N parts read, one output written,
    LSEs included) per second, against a torch copy (dst.copy_(src)) that moves the same number
    of bytes (read + write), timed the same way (CUDA events, inputs rotated past L2). Each cell
    is checked against an fp32 torch merge first; a FAIL is not timed. Writes OUT/results.json
    and OUT/results.md."""
    hf = ab.import_hipflash(args.hipflash_path)
    dtype = DTYPES[args.dtype]
    out_dir = args.out or os.path.join(HERE, "results", "merge")
    os.makedirs(out_dir, exist_ok=True)
    meta = collect_meta(args, device, args.hipflash_path)
    budget = BUDGETS[args.budget or "full"] if device == "cuda" else (5.0, 20.0, 3, 50)
    timer = Timer(device, *budget)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0
    cells = MERGE_CELLS if device == "cuda" else MERGE_TINY
    cells = ab.select_cells(cells, args.cells, lambda c: c[0], "merge")
    rows = []
    for label, n, T, H, D in cells:
        g = torch.Generator(device=device).manual_seed(zlib.crc32(label.encode()))
        elem = torch.finfo(dtype).bits // 8
        moved = (n + 1) * T * H * D * elem + (n + 1) * H * T * 4
        nsets = max(1, min(16, math.ceil(4 * l2 / moved))) if device == "cuda" else 2
        sets = [(torch.randn(n, T, H, D, device=device, dtype=dtype, generator=g),
                 torch.randn(n, H, T, device=device, generator=g) * 3) for _ in range(nsets)]
        row = {"suite": "merge", "label": label, "parts": n, "T": T, "H": H, "D": D,
               "dtype": args.dtype, "bytes": moved, "status": "ok", "note": ""}
        outs, lses = sets[0]
        out, lse = hf.merge_attn_states(outs, lses)
        w = torch.softmax(lses.float(), dim=0)                      # [n, H, T]
        ref = (w.permute(0, 2, 1)[..., None] * outs.float()).sum(0)  # [T, H, D]
        err = (out.float() - ref).abs().max().item()
        lse_err = (lse - torch.logsumexp(lses.float(), dim=0)).abs().max().item()
        tol = 2 * (ref.to(dtype).float() - ref).abs().max().item() + 1e-5
        if not (err <= tol and lse_err <= 1e-4):
            row.update(status="FAIL", note=f"err {err:.3g} > {tol:.3g} or lse err {lse_err:.3g}")
            rows.append(row)
            continue
        src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
        dst = [torch.empty_like(src) for _ in range(nsets)]
        srcs = [torch.empty_like(src) for _ in range(nsets)]
        t_merge = timer.time(lambda j: hf.merge_attn_states(*sets[j]), nsets)["time_ms"]
        t_copy = timer.time(lambda j: dst[j].copy_(srcs[j]), nsets)["time_ms"]
        row.update(merge_ms=t_merge, copy_ms=t_copy, merge_gbps=moved / t_merge / 1e6,
                   copy_gbps=moved / t_copy / 1e6, of_copy=t_copy / t_merge)
        rows.append(row)
        print(f"{label:22s} merge {row['merge_gbps']:8.1f} GB/s  copy {row['copy_gbps']:8.1f} GB/s"
              f"  {row['of_copy'] * 100:5.1f}% of copy", flush=True)
        del sets, src, dst, srcs
    rep.write_json(meta, rows, os.path.join(out_dir, "results.json"))
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(f"# merge_attn_states bandwidth ({meta.get('gpu', device)}, commit "
                f"{meta['commit']}, {args.dtype})\n\n`{meta['command']}`\n\n"
                "| cell | parts | T | H | D | MB moved | merge GB/s | copy GB/s | % of copy |\n"
                "|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if r["status"] != "ok":
                f.write(f"| {r['label']} | {r['parts']} | {r['T']} | {r['H']} | {r['D']} | "
                        f"{r['bytes'] / 1e6:.1f} | {r['status']}: {r['note']} | | |\n")
                continue
            f.write(f"| {r['label']} | {r['parts']} | {r['T']} | {r['H']} | {r['D']} | "
                    f"{r['bytes'] / 1e6:.1f} | {r['merge_gbps']:.1f} | {r['copy_gbps']:.1f} | "
                    f"{r['of_copy'] * 100:.1f}% |\n")
    print(f"wrote {out_dir}/results.json, results.md")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


MATMUL_N = 8192


def matmul_rate(timer):
    """The bf16 matrix-product rate of this GPU in this run (issue 9 measures the attention
    kernels against it): C = A B at 8192^3 on random data (zeros run faster), timed as every
    cell is (timer, in its rounds), over two input sets; TFLOP/s of the median."""
    n = MATMUL_N
    sets = [(torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
             torch.randn(n, n, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    st = timer.time_in_rounds(lambda i: torch.matmul(*sets[i], out=out), len(sets))
    del sets, out
    torch.cuda.empty_cache()
    return 2.0 * n ** 3 / (st["time_ms"] * 1e-3) / 1e12


def _warm_gpu(ms=600.0):
    """Bring the clocks up before the first cell (about half a second of bf16 matmuls)."""
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.time()
    while (time.time() - t0) * 1e3 < ms:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    del a
    torch.cuda.empty_cache()


class _Plain:
    def __init__(self, enabled, total):
        self.enabled, self.total = enabled, total

    def update(self, n=1):
        pass

    def set_description(self, s):
        pass

    def cell_done(self, i, n, cell, crow, secs):
        if not self.enabled:
            return
        st = " ".join(f"{r['backend']}={_short_status(r)}" for r in crow)
        print(f"[{i}/{n}] {cell.suite} {cell.label} ({secs:.1f}s): {st}", flush=True)

    def close(self):
        pass


class _Bar(_Plain):
    def __init__(self, total):
        from tqdm import tqdm
        self.t = tqdm(total=total, unit="run", dynamic_ncols=True)
        self.enabled = False

    def update(self, n=1):
        self.t.update(n)

    def set_description(self, s):
        self.t.set_description(s[:40])

    def close(self):
        self.t.close()


def _short_status(r):
    if r["status"] == "ok":
        b2b = r.get("b2b_us")
        return f"{r['time_ms']:.3f}ms" + (f"/{b2b:.1f}us-b2b" if b2b is not None else "")
    return r["status"]


def _progress(mode, total):
    if mode in ("auto", "bar"):
        try:
            import tqdm  # noqa: F401
            if mode == "bar" or sys.stderr.isatty():
                return _Bar(total)
        except ImportError:
            pass
    return _Plain(mode != "none", total)


if __name__ == "__main__":
    sys.exit(main())
