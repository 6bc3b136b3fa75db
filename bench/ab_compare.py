#!/usr/bin/env python3
"""Side-by-side table of attn_bench.py runs of several builds (scripts/gpu-ab).

    python3 bench/ab_compare.py NAME=RESULTS_DIR [NAME=RESULTS_DIR ...] [--ref NAME]

Each RESULTS_DIR holds the results.json of one run. Per cell and build it prints hipflash's
TFLOP/s (or GB/s for decode cells) with the LSE off / on; with --ref, each build's change
against the reference build (median over the reference's runs when several share its name
prefix, e.g. base.1 and base.2 for --ref base). Runs of the same build are told apart by a
suffix .N (base.1, base.2, tree.1, ...): the summary line is the geometric mean of
build / reference over the cells both ran. A hipflash row that failed its check is marked
FAIL and left out. The peers' columns are not compared: each run times them again, and their
spread between runs is the noise floor to read the builds' differences against (cuDNN's
column is printed for the first run of each build).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

OURS = ("hipflash", "hipflash+lse")
PEER = "torch-cudnn"


def load(path: Path) -> dict[str, dict[str, float | str]]:
    """cell -> backend -> metric (TFLOP/s or GB/s), 'FAIL' for a failed hipflash check."""
    rows = json.loads((path / "results.json").read_text())["rows"]
    out: dict[str, dict[str, float | str]] = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        metric = r.get("tflops") if r.get("tflops") is not None else r.get("gbps")
        if metric is None:
            continue
        cell = f"{r['suite']}:{r['label']}"
        # attn_bench rows carry their check; the train suite's rows are "ok" only once their
        # gradients passed (bench/train_bench.py), so they have none.
        ok = r.get("check", "PASS") == "PASS" or r["backend"] not in OURS
        out.setdefault(cell, {})[r["backend"]] = float(metric) if ok else "FAIL"
    return out


def build_of(run: str) -> str:
    return re.sub(r"\.\d+$", "", run)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="NAME=DIR")
    ap.add_argument("--ref", help="the reference build (a run name without its number)")
    args = ap.parse_args()
    runs = []
    for spec in args.runs:
        name, _, d = spec.partition("=")
        path = Path(d)
        if not (path / "results.json").is_file():
            print(f"{name}: no results.json in {d} (the run failed or timed out)")
            continue
        runs.append((name, load(path)))
    if not runs:
        return 1
    builds = list(dict.fromkeys(build_of(n) for n, _ in runs))
    cells = list(dict.fromkeys(c for _, t in runs for c in t))

    def metric(build: str, cell: str, backend: str) -> float | str | None:
        vals = [t[cell][backend] for n, t in runs
                if build_of(n) == build and backend in t.get(cell, {})]
        if any(v == "FAIL" for v in vals):
            return "FAIL"
        return statistics.median(vals) if vals else None

    def fmt(v: float | str | None) -> str:
        return "-" if v is None else v if isinstance(v, str) else f"{v:.0f}"

    if not cells:
        print("no cells in any run (did AB_CELLS match none?)")
        return 1
    width = max(len(c) for c in cells) + 2
    print(f"{'cell':<{width}}" + "".join(f"{b:>20}" for b in builds) + f"{PEER:>12}")
    ratios: dict[str, list[float]] = {b: [] for b in builds}
    for cell in cells:
        line = f"{cell:<{width}}"
        for b in builds:
            off, on = (metric(b, cell, k) for k in OURS)
            text = f"{fmt(off)} / {fmt(on)}"
            if args.ref and b != args.ref:
                r_off, r_on = (metric(args.ref, cell, k) for k in OURS)
                pairs = [(x, y) for x, y in ((off, r_off), (on, r_on))
                         if isinstance(x, float) and isinstance(y, float)]
                if pairs:
                    change = [x / y for x, y in pairs]
                    ratios[b] += change
                    text += f" {100 * (statistics.mean(change) - 1):+.0f}%"
            line += f"{text:>20}"
        first = next((t[cell].get(PEER) for _, t in runs if cell in t), None)
        print(line + f"{fmt(first):>12}")
    if args.ref:
        summary = [f"{b}: {100 * (math.exp(statistics.mean(map(math.log, v))) - 1):+.1f}%"
                   for b, v in ratios.items() if v and b != args.ref]
        print(f"geomean against {args.ref} (LSE off and on): " + ", ".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
