"""Running the benchmark: run_cell checks every backend of one cell against the fp32
reference and times the ones that pass (in one window each or in interleaved rounds, then the
host cost of a call for the wall-clock suites), turning a backend's failure into an n/a row and
a lost CUDA context into a fatal error that stops the run; and run_merge_suite, the merge suite
(hipflash.merge_attn_states against a copy of the same bytes), which runs on its own.
"""

import math
import os
import zlib

import torch

import attn_backends as ab
import attn_report as rep
from attn_cells import DTYPES, HOST
from attn_env import collect_meta
from attn_ref import check, reference, reference_varlen
from attn_timing import BUDGETS, Timer, _stats, interleaved_order

HERE = os.path.dirname(os.path.abspath(__file__))


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
                            budget_bytes=_ref_budget(device),
                            fp8=any(backends[n].fp8 for n in todo))
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
            chk = check(out, lse, ref, lse_expected=b.lse, fp8=b.fp8)
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
                _record_time(cell, row, timer.time(run, nsets), b.kv_fraction)
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
        fatal = _time_interleaved(cell, interleaved, rows, timer, nsets, device,
                                  {n: backends[n].kv_fraction for n in interleaved})
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


def _record_time(cell, row, st, kv_fraction=1.0):
    """A timed backend's row: the statistics, TFLOP/s and, for decode-shaped cells, GB/s of the
    K/V it reads (kv_fraction of the cell's: 0.5 for an fp8 cache of a 16-bit cell)."""
    row.update(st)
    row["status"] = "ok"
    t = st["time_ms"] * 1e-3
    row["tflops"] = cell.flops / t / 1e12
    if cell.suite in ("decode", "decode-fp8") or (cell.Sq == 1 and cell.kind == "dense"):
        row["gbps"] = cell.kvbytes * kv_fraction / t / 1e9


def _time_interleaved(cell, runs, rows, timer, nsets, device, kv_fractions):
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
        _record_time(cell, rows[name], _stats(sorted(t)), kv_fractions.get(name, 1.0))
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
