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
run_merge_suite), serving (decode Sq 1, GQA 32/8, D 128, B 1/8/32, Sk 4k-64k, LSE on: the
contiguous cache against paged caches of 1-, 16- and 256-row pages, fa2-native for reference) and
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

The runner is split by responsibility: attn_cells.py (the cells and suites), attn_timing.py
(Timer, budgets, the matmul rate), attn_run.py (checking and timing a cell; the merge suite),
attn_env.py (commit, command line, the run's meta data); this file parses the arguments, runs
the cells with a progress display and writes the results (attn_report.py).
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

import attn_backends as ab  # noqa: E402
import attn_report as rep  # noqa: E402
from attn_cells import DTYPES, HOST, build_suite  # noqa: E402
from attn_env import collect_meta  # noqa: E402
from attn_run import _err, base_row, run_cell, run_merge_suite  # noqa: E402
from attn_timing import (BUDGETS, HOST_LOOPS, MATMUL_N, Timer, _warm_gpu,  # noqa: E402
                         matmul_rate, scaled_mm_rate)


# ---- Main ------------------------------------------------------------------------------------


def _positive_int(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: a count of at least 1")
    return n


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="quick",
                    choices=["quick", "full", "fa-grid", "head-dims", "dev", "decode", "varlen",
                             "lse-overhead", HOST, "serving", "decode-fp8", "fwd-fp8", "tiny",
                             "merge",
                             "train"])
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
    if device == "cuda" and any(c.suite == "fwd-fp8" for c in cells):
        try:
            meta["scaled_mm_tflops"] = round(scaled_mm_rate(timer), 1)
            meta["scaled_mm"] = (f"{meta['scaled_mm_tflops']:.1f} TFLOP/s (torch._scaled_mm, "
                                 f"e4m3 x e4m3 -> bf16, {MATMUL_N}^3, timed as the cells are)")
        except Exception as e:
            meta["scaled_mm"] = f"not measured ({_err(e)})"
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
    print(rep.terminal_report(rows, meta))
    print(f"\nwrote {out_dir}/results.csv, results.md, results.json"
          + (", " + ", ".join(images.values()) if images else f" ({why})"))
    print(f"wall time {meta['wall_s']} s")
    if fatal is not None:
        print(f"STOPPED EARLY: {fatal}")
        return 2
    return 0


# ---- Progress ------------------------------------------------------------------------------


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
