#!/usr/bin/env python3
"""Where a kernel's issue slots go, from Nsight Compute's source page (per-SASS-instruction
executed counts and stall samples, `ncu -i REPORT --page source --print-source sass --csv`):
lane-instructions a unit of work (a score: B * H * Sq * Sk for an attention forward) by opcode,
and by region — runs of instructions executed equally often, which in a warp-specialised kernel
separate the consumers' main loop, the producer's per-block work and the per-tile code — with
each region's leading opcodes and share of the stall samples.

    python3 bench/probes/sass_mix.py fp8-sass.csv --units $((4 * 16 * 4096 * 4096))
"""
import argparse
import collections
import csv
import re


def load(path):
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r)
    ix = {h: i for i, h in enumerate(rows[head])}
    def num(r, k):
        return int((r[ix[k]] or "0").replace(",", ""))

    out = []
    for r in rows[head + 1:]:
        if len(r) < len(ix):
            continue
        src = r[ix["Source"]].strip()
        m = re.match(r"(@!?U?P\w+\s+)?([A-Z0-9_.]+)", src)
        out.append((m.group(2) if m else src, num(r, "Instructions Executed"),
                    num(r, "Warp Stall Sampling (All Samples)"), src))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--units", type=float, required=True, help="units of work (scores)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--min-share", type=float, default=0.01,
                    help="smallest share of the executed instructions a region must hold")
    args = ap.parse_args()
    ins = load(args.csv)
    total = sum(n for _, n, _, _ in ins)
    samples = sum(s for _, _, s, _ in ins) or 1
    per = lambda n: 32 * n / args.units
    print(f"{total / 1e6:.1f}M warp instructions, {per(total):.2f} lane-instructions a unit")
    ops, op_stall = collections.Counter(), collections.Counter()
    for op, n, s, _ in ins:
        ops[op.split(".")[0]] += n
        op_stall[op.split(".")[0]] += s
    print(f"\n{'opcode':12s} {'a unit':>7s} {'stalls':>7s}")
    for op, n in ops.most_common(args.top):
        print(f"{op:12s} {per(n):7.3f} {100 * op_stall[op] / samples:6.1f}%")
    regions, cur = [], None
    for k, (op, n, s, _) in enumerate(ins):
        if cur and n == cur["count"]:
            cur["last"] = k
        else:
            cur = {"first": k, "last": k, "count": n}
            regions.append(cur)
    print(f"\n{'lines':>11s} {'runs':>9s} {'a unit':>7s} {'stalls':>7s}  leading opcodes")
    for g in regions:
        body = ins[g["first"]:g["last"] + 1]
        n = sum(x[1] for x in body)
        if n < args.min_share * total:
            continue
        lead = collections.Counter(x[0] for x in body).most_common(5)
        print(f"{g['first']:5d}-{g['last']:5d} {g['count']:9d} {per(n):7.3f} "
              f"{100 * sum(x[2] for x in body) / samples:6.1f}%  "
              + ", ".join(f"{o} {c}" for o, c in lead))


if __name__ == "__main__":
    main()
