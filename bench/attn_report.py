"""Turns the runner's result rows into the terminal table, results.csv, results.md and PNG plots.

No numbers are made here: everything printed or drawn is a field of a row the runner measured.
Shared by attn_bench.py (writing a results directory) and make_report.py (docs/benchmarks.md).
"""

import csv
import json
import math
import os


# Column order of results.csv (one row per cell x backend).
CSV_FIELDS = [
    "suite", "cell", "group", "kind", "B", "Sq", "Sk", "Hq", "Hkv", "D", "causal", "dtype",
    "seqlens", "backend", "peer", "lse", "status", "check", "err_out", "tol_out", "err_lse",
    "time_ms", "p10_ms", "p90_ms", "reps", "nsets", "tflops", "gbps", "b2b_us", "b2b_min_us",
    "sync_us", "kernel", "note",
]

HOST = "host-overhead"

SUITE_TITLES = {
    "fa-grid": "FlashAttention grid (B*S = 16k, H*D = 2048)",
    "head-dims": "Head dims 96 and 256 (B*S = 16k, H = 2048 // D)",
    "decode": "Decode (Sq = 1, GQA 32/8, D = 128)",
    "serving": "Decode from a KV cache: contiguous vs paged (Sq = 1, GQA 32/8, D = 128, LSE)",
    "decode-fp8": "Decode from an fp8 (e4m3) KV cache against a 16-bit one (Sq = 1, GQA 32/8, "
                  "D = 128, LSE)",
    "fwd-fp8": "fp8 forward (float8_e4m3fn q, k, v) against bf16 on the FlashAttention grid "
               "(B*S = 16k, H*D = 2048)",
    "varlen": "Varlen (mixed sequence lengths)",
    "lse-overhead": "LSE overhead (same kernel family, LSE on vs off)",
    HOST: "Host overhead per call",
    "tiny": "Tiny (CPU test of the runner; not a benchmark)",
}
# A paragraph under a suite's heading in results.md / docs/benchmarks.md.
SUITE_NOTES = {
    HOST: "The cost of a call as a user makes it: the whole Python call (argument checks, output "
          "allocation, launch), not only the kernel. *Back to back*: after a warm-up and a "
          "synchronize, calls issued in a tight loop with no synchronisation, then one "
          "synchronize; wall time / calls, median (and min) over the repeats. On a small problem "
          "this is bound by the host: how fast calls can be issued. *Synchronised*: each call "
          "followed by `torch.cuda.synchronize()`, median over the calls: the latency of one "
          "call. *Device*: the kernel time from CUDA events, as in the other tables; *b2b - "
          "device* is what the host costs beyond it (- where the calls are device-bound, back "
          "to back <= device). Ratios: µs per call / the reference peer's (<= 1.00x: at least "
          "as fast; the target for hipflash and hipflash+lse, back to back, is <= 1.00x against "
          "fa2-native). fa2-native (`aten._flash_attention_forward`) has no LSE switch: it "
          "always computes and returns the LSE. Counts in *Host timing* above.",
    "decode": "Each library reads K/V in the layout its users keep a cache in: hipflash, "
              "hipflash+lse and fa2-native [B, Sk, Hkv, D], the SDPA backends a contiguous "
              "[B, Hkv, Sk, D] copy made outside the timing. Layout for layout: "
              "hipflash+lse-bhsd is hipflash with the LSE on that [B, Hkv, Sk, D] copy "
              "(through a [B, Sk, Hkv, D] view: any strides with a contiguous last dimension), "
              "cudnn-sdpa-gqa-bshd is cuDNN with native GQA on the [B, Sk, Hkv, D] tensors "
              "(through [B, Hkv, Sk, D] views). The ratio columns compare hipflash and "
              "hipflash+lse, in their own layout, with the best peer in either layout.",
    "serving": "hipflash+lse reads a contiguous cache (the plain forward: the same decode kernel "
               "and row source, no block table); hipflash-paged1 / -paged16 / -paged256 call "
               "`flash_attn_with_kvcache` on a copy of the same K/V in pages of 1 / 16 / 256 "
               "rows (1: each row gathered through the block table), "
               "scattered by a random permutation, with `cache_seqlens=None` (every sequence "
               "fills its cache, so no lengths tensor is copied back to the host per call). Each "
               "is checked against the reference; paged / contiguous GB/s is the cost of the "
               "block table. fa2-native: contiguous, for reference.",
    "decode-fp8": "hipflash+lse reads the cell's K/V in 16 bits; hipflash-fp8kv reads the same "
                  "values from a float8_e4m3fn cache (`flash_attn_with_kvcache` with k_scale = "
                  "v_scale = 1/16, the cell's K/V being e4m3 values times 1/16), both with the "
                  "LSE, each checked against the same reference. GB/s counts the bytes each "
                  "reads (the fp8 cache: half), so tokens/s fp8 / 16-bit is twice the GB/s "
                  "ratio, and the GB/s ratio is the fp8 kernel's share of the 16-bit one's "
                  "bandwidth.",
    "fwd-fp8": "hipflash (bf16), torch-flash (FA2, bf16) and torch-cudnn (bf16) read the "
               "cell's q, k, v in bf16 (cuDNN's fp8 attention is not reachable from this "
               "PyTorch); hipflash-fp8 reads the same values as float8_e4m3fn "
               "(`flash_attn_func` with q_descale = k_descale = v_descale = 1/16, the cell's "
               "inputs being e4m3 values times 1/16), out bf16, no LSE — each checked against "
               "the same reference, hipflash-fp8 by SPEC §6's fp8 rule (its yardstick the "
               "reference with e4m3 probabilities). TFLOP/s count the same FLOPs for all; "
               "fp8/hipflash is the speed-up of the fp8 call, and %fp8 mm its rate over the "
               "run's `torch._scaled_mm` fp8 GEMM rate (*fp8 matmul rate* above).",
}
SUITE_ORDER = ["fa-grid", "head-dims", "decode", "serving", "decode-fp8", "fwd-fp8", "varlen",
               "lse-overhead", HOST, "tiny"]
SUITE_METRIC = {"decode": "gbps", "serving": "gbps", "decode-fp8": "gbps",
                HOST: "b2b_us"}  # everything else: tflops
METRIC_UNIT = {"tflops": "TFLOP/s", "gbps": "GB/s", "b2b_us": "µs per call, back to back"}
LOWER_IS_BETTER = {"b2b_us"}
# (no-LSE backend, LSE backend) pairs of the lse-overhead suite
LSE_PAIRS = [("hipflash", "hipflash+lse"), ("torch-cudnn-nolse", "torch-cudnn"),
             ("torch-efficient-nolse", "torch-efficient")]
HF, HF_LSE = "hipflash", "hipflash+lse"
# The peer the host-overhead ratios divide by, the first of these in the cell: FlashAttention-2's
# own entry point (the target), or torch-math in the CPU test of the runner.
HOST_REF = ("fa2-native", "torch-math")
XLABELS = {"fa-grid": "Sequence length", "head-dims": "Sequence length", "decode": "KV length (Sk)",
           "serving": "KV length (Sk)", "decode-fp8": "KV length (Sk)",
           "fwd-fp8": "Sequence length", "tiny": ""}

# Fixed colours, so a backend looks the same in every figure.
COLORS = {
    "hipflash": "#d62728", "hipflash+lse": "#ff9896", "torch-flash": "#1f77b4",
    "torch-cudnn": "#2ca02c", "torch-cudnn-nolse": "#98df8a", "torch-efficient": "#9467bd",
    "torch-efficient-nolse": "#c5b0d5", "flex": "#8c564b", "fa2-native": "#17becf",
    "cudnn-sdpa-gqa": "#bcbd22", "efficient-varlen": "#e377c2", "torch-sdpa": "#7f7f7f",
    "torch-math": "#aec7e8", "hipflash-paged1": "#e6550d", "hipflash-paged16": "#ff7f0e",
    "hipflash-paged256": "#ffbb78",
    "hipflash+lse-bhsd": "#c49c94", "cudnn-sdpa-gqa-bshd": "#dbdb8d", "hipflash-fp8": "#8b0000",
    "hipflash-fp8kv": "#8b0000",
}


def geomean(values):
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def suite_metric(suite):
    return SUITE_METRIC.get(suite, "tflops")


# ---- Grouping --------------------------------------------------------------------------------


def _ordered_unique(xs):
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def suite_title(rows, suite):
    """SUITE_TITLES' heading of a suite, with the head dim its decode cells ran at (the decode
    and serving suites' --decode-head-dim) where that is not the title's 128."""
    title = SUITE_TITLES.get(suite, suite)
    dims = sorted({str(r.get("D")) for r in rows if r.get("suite") == suite})
    if "D = 128" in title and dims and dims != ["128"]:
        title = title.replace("D = 128", "D = " + " / ".join(dims))
    return title


def suites_in(rows):
    present = {r["suite"] for r in rows}
    return [s for s in SUITE_ORDER if s in present] + sorted(present - set(SUITE_ORDER))


def cells_of(rows, suite):
    """[(cell id, {backend: row})] in run order."""
    cells = {}
    for r in rows:
        if r["suite"] == suite:
            cells.setdefault(r["cell"], {})[r["backend"]] = r
    return list(cells.items())


def backends_of(rows, suite):
    return _ordered_unique(r["backend"] for r in rows if r["suite"] == suite)


def value(row, metric):
    """The row's metric if it is a valid measurement (status ok), else None."""
    if row is None or row.get("status") != "ok":
        return None
    v = row.get(metric)
    if v is None or v == "":
        return None
    v = float(v)
    return v if math.isfinite(v) and v > 0 else None


def _truthy(x):
    return x is True or str(x).lower() in ("true", "1", "yes")


def best_peer(by_backend, metric, lse_only=False):
    """(value, backend) of the best peer in a cell (highest metric), or (None, None)."""
    best, name = None, None
    for b, r in by_backend.items():
        if not _truthy(r.get("peer")):
            continue
        if lse_only and not _truthy(r.get("lse")):
            continue
        v = value(r, metric)
        if v is not None and (best is None or v > best):
            best, name = v, b
    return best, name


def cell_ratios(by_backend, metric):
    """hipflash / best peer and hipflash+lse / best LSE-returning peer (>1: hipflash faster)."""
    out = {}
    for hf, lse_only in ((HF, False), (HF_LSE, True)):
        v = value(by_backend.get(hf), metric)
        bp, bname = best_peer(by_backend, metric, lse_only)
        out[hf] = (v / bp if v and bp else None, bname)
    return out


def lse_overheads(by_backend):
    """{lse backend: (t_lse / t_nolse - 1) or None} from the time medians."""
    out = {}
    for nolse, lse in LSE_PAIRS:
        a, b = value(by_backend.get(nolse), "time_ms"), value(by_backend.get(lse), "time_ms")
        if nolse in by_backend or lse in by_backend:
            out[lse] = (b / a - 1.0) if a and b else None
    return out


def host_ref(by_backend):
    """The backend a host-overhead cell's ratios divide by (the first of HOST_REF in it)."""
    return next((b for b in HOST_REF if b in by_backend), None)


def host_ratio(by_backend, backend, key="b2b_us"):
    """backend's µs per call / the reference peer's, back to back or (key="sync_us")
    synchronised; <= 1: at least as fast. None where either is missing."""
    ref = host_ref(by_backend)
    a = value(by_backend.get(backend), key)
    b = value(by_backend.get(ref), key) if ref else None
    return a / b if a and b else None


def host_excess_us(row):
    """Back-to-back µs per call minus the device µs per call: what the host costs beyond the
    kernel. None where the calls are device-bound (back to back <= device) or not measured."""
    b2b, dev = value(row, "b2b_us"), value(row, "time_ms")
    if b2b is None or dev is None or b2b <= 1e3 * dev:
        return None
    return b2b - 1e3 * dev


# ---- Formatting ------------------------------------------------------------------------------


def _cell_text(row, metric):
    if row is None:
        return ""
    st = row.get("status")
    if st == "ok":
        v = value(row, metric)
        return _num(v) if v is not None else "?"
    if st == "FAIL":
        return "FAIL"
    return "n/a"


def _num(v):
    """Three significant digits at most, one decimal for >= 10 (TFLOP/s, GB/s, ms)."""
    if v >= 10:
        return f"{v:.1f}"
    if v >= 0.01:
        return f"{v:.3f}".rstrip("0").rstrip(".") if v < 1 else f"{v:.2f}"
    return f"{v:.2e}"


def _fmt_ratio(r):
    return f"{r:.2f}x" if r is not None else "-"


def _fmt_pct(p):
    return f"{100 * p:+.1f}%" if p is not None else "-"


def _fmt_us(v):
    return f"{v:.1f}" if v is not None else "-"


def _cell_label(by_backend):
    r = next(iter(by_backend.values()))
    return r.get("label") or r["cell"]


def host_table(rows):
    """The host-overhead table: a line per cell x backend, µs per call back to back (median and
    min of the repeats), synchronised and on the device, the host's cost beyond the device, and
    the ratios to the reference peer."""
    cells = cells_of(rows, HOST)
    ref = "/".join(_ordered_unique(host_ref(bb) for _, bb in cells if host_ref(bb))) or "?"
    header = ["cell", "backend", "back to back µs", "min µs", "synchronised µs", "device µs",
              "b2b - device µs", f"b2b / {ref}", f"sync / {ref}"]
    body = []
    for _, bb in cells:
        for i, (b, r) in enumerate(bb.items()):
            line = [_cell_label(bb) if i == 0 else "", b]
            if r.get("status") != "ok":
                body.append(line + [_cell_text(r, "b2b_us")] + [""] * 6)
                continue
            dev = value(r, "time_ms")
            body.append(line + [_fmt_us(value(r, k)) for k in ("b2b_us", "b2b_min_us", "sync_us")]
                        + [_fmt_us(1e3 * dev if dev else None), _fmt_us(host_excess_us(r)),
                           _fmt_ratio(host_ratio(bb, b)),
                           _fmt_ratio(host_ratio(bb, b, "sync_us"))])
    return header, body, []


# Suites whose cells are also timed by wall clock per call (Timer.host), besides the host-overhead
# suite: decode and KV-cache decode, where the call's host cost is a visible share of the time,
# and the fp8 forward (its ratio to bf16 as a user's calls see it).
WALL_CLOCK_SUITES = ("decode", "serving", "decode-fp8", "fwd-fp8")

FP8 = "hipflash-fp8"


def wall_clock_table(rows, suite):
    """A suite's calls by wall clock, as a user makes them: µs per call back to back /
    synchronised for every backend; hipflash+lse's ratio to the best LSE-returning peer in each
    (time(peer) / time(hipflash+lse): >1 is hipflash faster); for the paged caches, their cost
    against the contiguous one (time(contiguous) / time(paged)); for the fp8 forward, its speed
    over bf16 hipflash's (time(hipflash) / time(hipflash-fp8)). None when the run has no
    wall-clock rows for the suite."""
    cells = cells_of(rows, suite)
    if not any(value(r, "b2b_us") for _, bb in cells for r in bb.values()):
        return None
    names = backends_of(rows, suite)
    has_lse = HF_LSE in names
    paged = [b for b in names if b.startswith("hipflash-paged")] if has_lse else []
    fp8 = FP8 in names and HF in names

    def best_lse_peer(bb, key):  # the lowest time among LSE-returning peers
        ts = [(value(r, key), b) for b, r in bb.items()
              if _truthy(r.get("peer")) and _truthy(r.get("lse")) and value(r, key)]
        return min(ts) if ts else (None, None)

    def both(a, b):  # time(a) / time(b), back to back / synchronised
        out = []
        for key in ("b2b_us", "sync_us"):
            t_a, t_b = value(a, key), value(b, key)
            out.append(t_a / t_b if t_a and t_b else None)
        return out

    header = (["cell  [µs: back to back / synchronised]"] + names +
              (["hf+lse / best lse peer"] if has_lse else []) +
              [f"{b[len('hipflash-'):]}/contiguous (back to back)" for b in paged] +
              (["fp8/hipflash"] if fp8 else []))
    body, ratios = [], {k: [] for k in ["lse", "fp8"] + paged}
    for _, bb in cells:
        line = [_cell_label(bb)]
        for b in names:
            r = bb.get(b)
            b2b, sync = value(r, "b2b_us"), value(r, "sync_us")
            line.append(f"{_fmt_us(b2b)} / {_fmt_us(sync)}" if b2b else _cell_text(r, "b2b_us"))
        hf = bb.get(HF_LSE)
        if has_lse:
            txt = []
            for key in ("b2b_us", "sync_us"):
                t_hf, (t_peer, _) = value(hf, key), best_lse_peer(bb, key)
                rat = t_peer / t_hf if t_hf and t_peer else None
                if key == "b2b_us":
                    ratios["lse"].append(rat)
                txt.append(_fmt_ratio(rat))
            line.append(" / ".join(txt) if any(t != "-" for t in txt) else "-")
        for b in paged:
            t_c, t_p = value(hf, "b2b_us"), value(bb.get(b), "b2b_us")
            ratios[b].append(t_c / t_p if t_c and t_p else None)
            line.append(_fmt_ratio(ratios[b][-1]))
        if fp8:
            rats = both(bb.get(HF), bb.get(FP8))
            ratios["fp8"].append(rats[0])
            line.append(" / ".join(_fmt_ratio(r) for r in rats))
        body.append(line)
    foot = [["geomean (back to back)"] + [""] * len(names) +
            ([_fmt_ratio(geomean(ratios["lse"]))] if has_lse else []) +
            [_fmt_ratio(geomean(ratios[b])) for b in paged] +
            ([_fmt_ratio(geomean(ratios["fp8"]))] if fp8 else [])]
    return header, body, foot




def suite_table(rows, suite, meta=None):
    """(header, body rows, footer rows) of one suite's table, as strings."""
    if suite == HOST:
        return host_table(rows)
    metric = suite_metric(suite)
    unit = METRIC_UNIT[metric]
    cells = cells_of(rows, suite)
    if suite == "lse-overhead":
        names = backends_of(rows, suite)
        header = ["cell"] + [f"{b} ms" for b in names] + \
            [f"{lse} overhead" for _, lse in LSE_PAIRS if lse in names]
        body, per_pair = [], {lse: [] for _, lse in LSE_PAIRS}
        for cid, bb in cells:
            ov = lse_overheads(bb)
            line = [_cell_label(bb)]
            for b in names:
                r = bb.get(b)
                v = value(r, "time_ms")
                line.append(f"{v:.3f}" if v is not None else _cell_text(r, "time_ms"))
            for _, lse in LSE_PAIRS:
                if lse in names:
                    line.append(_fmt_pct(ov.get(lse)))
                    if ov.get(lse) is not None:
                        per_pair[lse].append(1.0 + ov[lse])
            body.append(line)
        foot = ["geomean"] + [""] * len(names)
        for _, lse in LSE_PAIRS:
            if lse in names:
                g = geomean(per_pair[lse])
                foot.append(_fmt_pct(g - 1.0) if g is not None else "-")
        return header, body, [foot]

    names = backends_of(rows, suite)
    has_hf = HF in names or HF_LSE in names
    # serving: each paged cache against the contiguous one (hipflash+lse), cell by cell
    paged = [b for b in names if b.startswith("hipflash-paged")] if HF_LSE in names else []
    header = ["cell"] + [f"{b}" for b in names] + ["best peer"]
    if has_hf:
        header += ["hipflash/best", "hf+lse/best lse peer"]
    header += [f"{b[len('hipflash-'):]}/contiguous" for b in paged]
    # fwd-fp8: the fp8 call against bf16 hipflash, and its share of the run's fp8 GEMM rate
    fp8 = FP8 in names and HF in names
    mm8 = (meta or {}).get("scaled_mm_tflops") if fp8 else None
    if fp8:
        header += ["fp8/hipflash"] + (["%fp8 mm"] if mm8 else [])
    body, r_hf, r_lse, r_paged = [], [], [], {b: [] for b in paged}
    r_fp8, r_fp8_2k = [], []
    for cid, bb in cells:
        line = [_cell_label(bb)] + [_cell_text(bb.get(b), metric) for b in names]
        bp, bname = best_peer(bb, metric)
        line.append(f"{bname} {_num(bp)}" if bp else "-")
        if has_hf:
            rat = cell_ratios(bb, metric)
            line += [_fmt_ratio(rat[HF][0]), _fmt_ratio(rat[HF_LSE][0])]
            r_hf.append(rat[HF][0])
            r_lse.append(rat[HF_LSE][0])
        for b in paged:
            a, c = value(bb.get(b), metric), value(bb.get(HF_LSE), metric)
            r_paged[b].append(a / c if a and c else None)
            line.append(_fmt_ratio(r_paged[b][-1]))
        if fp8:
            a, c = value(bb.get(FP8), metric), value(bb.get(HF), metric)
            r = a / c if a and c else None
            r_fp8.append(r)
            if (bb.get(FP8) or {}).get("Sq", 0) >= 2048:
                r_fp8_2k.append(r)
            line.append(_fmt_ratio(r))
            if mm8:
                line.append(f"{100 * a / mm8:.0f}%" if a else "-")
        body.append(line)
    foot = []
    if has_hf:
        g1, g2 = geomean(r_hf), geomean(r_lse)
        n1 = sum(1 for x in r_hf if x)
        n2 = sum(1 for x in r_lse if x)
        foot.append(["geomean"] + [""] * (len(names) + 1) +
                    [f"{_fmt_ratio(g1)} ({n1})", f"{_fmt_ratio(g2)} ({n2})"] +
                    [_fmt_ratio(geomean(r_paged[b])) for b in paged] +
                    ([_fmt_ratio(geomean(r_fp8))] if fp8 else []) + ([""] if mm8 else []))
        if fp8:
            foot.append(["geomean S >= 2k"] + [""] * (len(names) + 3) +
                        [_fmt_ratio(geomean(r_fp8_2k))] + ([""] if mm8 else []))
    header[0] = f"cell  [{unit}]"
    return header, body, foot


def _plain(header, body, foot):
    allrows = [header] + body + foot
    w = [max(len(str(r[i])) for r in allrows if i < len(r)) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(x).rjust(w[i]) if i else str(x).ljust(w[i])  # noqa: E731
                              for i, x in enumerate(r))
    sep = "-" * (sum(w) + 2 * (len(w) - 1))
    lines = [fmt(header), sep] + [fmt(r) for r in body]
    if foot:
        lines += [sep] + [fmt(r) for r in foot]
    return "\n".join(lines)


def _md(header, body, foot):
    esc = lambda x: str(x).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(h) for h in header) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for r in body:
        lines.append("| " + " | ".join(esc(x) for x in r) + " |")
    for r in foot:
        lines.append("| " + " | ".join(f"**{esc(x)}**" if x else "" for x in r) + " |")
    return "\n".join(lines)


def terminal_report(rows, meta=None):
    out = []
    for s in suites_in(rows):
        out.append(f"\n== {suite_title(rows, s)} ==")
        out.append(_plain(*suite_table(rows, s, meta)))
    problems = _problem_lines(rows)
    if problems:
        out.append("\nFAIL / n/a:")
        out += ["  " + p for p in problems]
    return "\n".join(out)


def _problem_lines(rows):
    """Deduplicated reasons for every FAIL and n/a."""
    lines, seen = [], set()
    for r in rows:
        if r.get("status") == "ok":
            continue
        note = str(r.get("note") or "").strip()
        if r.get("status") == "FAIL":
            lines.append(f"FAIL {r['backend']} @ {r.get('label') or r['cell']}: {note}")
            continue
        key = (r["backend"], note[:160])
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"n/a  {r['backend']} (first at {r.get('label') or r['cell']}): {note[:300]}")
    return lines


# ---- Files -----------------------------------------------------------------------------------


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return v


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in CSV_FIELDS})


def write_json(meta, rows, path):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)


def read_json(path):
    with open(path) as f:
        d = json.load(f)
    return d["meta"], d["rows"]


def meta_lines(meta):
    keys = [("gpu", "GPU"), ("driver", "Driver"), ("torch", "PyTorch"), ("cuda", "CUDA (torch)"),
            ("cudnn", "cuDNN"), ("triton", "Triton"), ("hipflash", "hipflash build"),
            ("commit", "Commit"), ("date", "Date (UTC)"), ("suite", "Suite"),
            ("dtype", "dtype"), ("timing", "Timing"), ("host_timing", "Host timing"),
            ("matmul", "bf16 matmul rate"), ("scaled_mm", "fp8 matmul rate"),
            ("wall_s", "Run time (s)")]
    lines = []
    for k, name in keys:
        if meta.get(k) not in (None, ""):
            lines.append(f"- **{name}**: {meta[k]}")
    lines.append(f"- **Command**: `{meta.get('command', '?')}`")
    return lines


def render_markdown(meta, rows, images, image_prefix="", heading="#"):
    """The results page: environment, one table per suite, FAIL/n/a reasons, the plots."""
    md = [f"{heading} hipflash attention benchmark: results", ""]
    if meta.get("device") != "cuda":
        md += ["> **Not a GPU run** (device: %s). These are CPU timings of the runner's test "
               "mode; they are not benchmark results." % meta.get("device"), ""]
    md += meta_lines(meta) + [""]
    md += ["Metric: TFLOP/s = 4*B*H*D*(valid query-key pairs) / median time (causal counts only "
           "the unmasked pairs, bottom-right aligned); decode GB/s = K and V bytes "
           "(2*B*Hkv*Sk*D*2) / median time. Ratios: hipflash / best peer in the cell (>1 means "
           "hipflash is faster); hipflash+lse is compared with the best peer that also returns "
           "the LSE. A FAIL (wrong result against the fp32 reference) or n/a is never timed "
           "into a ratio. The geomean is over the cells where both sides ran; the count is in "
           "parentheses.", ""]
    for s in suites_in(rows):
        md += [f"{heading}# {suite_title(rows, s)}", ""]
        if s in SUITE_NOTES:
            md += [SUITE_NOTES[s], ""]
        md += [_md(*suite_table(rows, s, meta)), ""]
        wall = wall_clock_table(rows, s) if s in WALL_CLOCK_SUITES else None
        if wall:
            md += ["Wall clock per call, as a user makes it (`Timer.host`: back to back = calls "
                   "issued with no synchronisation, then one synchronize, per call; synchronised "
                   "= each call followed by a synchronize):", "", _md(*wall), ""]
        if s in images:
            md += [f"![{s}]({image_prefix}{images[s]})", ""]
    probs = _problem_lines(rows)
    if probs:
        md += [f"{heading}# FAIL and n/a", ""] + [f"- {p}" for p in probs] + [""]
    md += [f"{heading}# hipflash kernels", "",
           "The kernel each hipflash call ran (`hipflash.last_kernel_name()`, read after the "
           "checked call).", ""]
    kernels = {}
    for r in rows:
        if r.get("kernel"):
            kernels.setdefault(r["kernel"], []).append(f"{r['suite']} {r.get('label') or r['cell']}")
    if kernels:
        md += ["| kernel | cells |", "|---|---|"]
        md += [f"| `{k}` | {', '.join(_ordered_unique(v))} |" for k, v in kernels.items()]
    else:
        md += ["(no hipflash kernel ran)"]
    return "\n".join(md) + "\n"


# ---- Plots -----------------------------------------------------------------------------------


def _bar_label(y, signed):
    if signed:
        return f"{y:+.1f}"
    return f"{y:.0f}" if abs(y) >= 10 else _num(abs(y))


def _short(n):
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def make_plots(rows, outdir, gpu_name="", dtype="bf16"):
    """One PNG per suite (grouped bars, FlashAttention's figure style). Returns ({suite: file},
    reason-if-skipped)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return {}, f"matplotlib not available ({e}); plots skipped"
    files = {}
    for s in suites_in(rows):
        fname = s.replace("-", "_") + ".png"
        try:
            if _plot_suite(plt, rows, s, os.path.join(outdir, fname), gpu_name, dtype):
                files[s] = fname
        except Exception as e:  # a plot must never cost the results
            print(f"warning: plot for {s} failed: {e}")
    return files, ""


def _plot_suite(plt, rows, suite, path, gpu_name, dtype):
    cells = cells_of(rows, suite)
    if not cells:
        return False
    if suite == "lse-overhead":
        series = [lse for _, lse in LSE_PAIRS]
        groups = {"": [(_cell_label(bb), {k: (100 * v if v is not None else None)
                                         for k, v in lse_overheads(bb).items()})
                       for _, bb in cells]}
        ylabel, title = "LSE overhead (%)", "Cost of returning the LSE"
    else:
        metric = suite_metric(suite)
        series = [b for b in backends_of(rows, suite)
                  if any(value(bb.get(b), metric) for _, bb in cells)]
        groups = {}
        for _, bb in cells:
            r = next(iter(bb.values()))
            x = r.get("xlabel") or _cell_label(bb)
            groups.setdefault(r.get("group") or "", []).append(
                (x, {b: value(bb.get(b), metric) for b in series}))
        ylabel = (f"{METRIC_UNIT[metric]} (lower is better)" if metric in LOWER_IS_BETTER
                  else f"Speed ({METRIC_UNIT[metric]})")
        title = suite_title(rows, suite)
    if not series:
        return False
    n = len(groups)
    ncols = 1 if n == 1 else 2
    nrows = (n + ncols - 1) // ncols
    most_x = max(len(pts) for pts in groups.values())
    width_in = max(7.5, 1.25 * most_x) if ncols == 1 else 7.5
    fig, axes = plt.subplots(nrows, ncols, figsize=(width_in * ncols, 4.2 * nrows),
                             squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, (gname, pts) in zip(axes.flat, groups.items()):
        xs = [p[0] for p in pts]
        k = len(series)
        width = 0.8 / k
        for si, b in enumerate(series):
            ys = [p[1].get(b) for p in pts]
            pos = [i + (si - (k - 1) / 2) * width for i in range(len(xs))]
            bars = ax.bar(pos, [y if y is not None else 0 for y in ys], width,
                          label=b, color=COLORS.get(b))
            for rect, y in zip(bars, ys):
                if y is None:
                    continue
                ax.annotate(_bar_label(y, suite == "lse-overhead"),
                            (rect.get_x() + rect.get_width() / 2, max(y, 0)),
                            ha="center", va="bottom", fontsize=6, rotation=90,
                            xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels(xs, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_xlabel(XLABELS.get(suite, ""))
        ax.set_title(gname, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        top = max([p[1].get(b) or 0 for p in pts for b in series] + [1e-9])
        ax.set_ylim(min(0, min([p[1].get(b) or 0 for p in pts for b in series])), top * 1.2)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(series), 6), fontsize=8,
               bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(f"{title} - {gpu_name} {dtype}", y=1.0 + 0.04 * (1 + (len(series) > 6)),
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return True
