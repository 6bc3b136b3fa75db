"""How the benchmark times a call: Timer (CUDA events per call behind a sleep kernel, or
perf_counter on the CPU; a window's warm-up and repetitions; the wall-clock host cost of a call,
Timer.host), the budgets of the quick and full suites, the order of interleaved timing windows
(--rounds), and the bf16 matrix-product rate the attention kernels are held against, with the
warm-up that brings the GPU's clocks up before the first cell.
"""

import math
import statistics
import time

import torch


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


def interleaved_order(names, rounds):
    """The order of the timing windows with `rounds` rounds: every backend once a round, the
    round's first backend rotating, so that no backend always follows the same one."""
    names = list(names)
    return [n for r in range(rounds) for n in names[r % len(names):] + names[:r % len(names)]]


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


def scaled_mm_rate(timer):
    """The fp8 (e4m3) matrix-product rate of this GPU in this run, through torch._scaled_mm
    (per-tensor scales 1, bf16 out; B column-major, as it requires), measured as matmul_rate."""
    n = MATMUL_N
    one = torch.ones((), device="cuda")

    def fp8(x):
        return x.to(torch.float8_e4m3fn)
    sets = [(fp8(torch.randn(n, n, device="cuda")), fp8(torch.randn(n, n, device="cuda")).t())
            for _ in range(2)]
    st = timer.time_in_rounds(
        lambda i: torch._scaled_mm(*sets[i], scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        len(sets))
    del sets
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
