"""hipflash forward + backward (training step of the attention op) against PyTorch's kernels,
side by side in one process: `attn_bench.py --suite train` (see run_train_suite).

A call is what a training step does with the op: out = attention(q, k, v) with q, k, v requiring
grad, then torch.autograd.grad(out, (q, k, v), dout). Backends:
  hipflash        hipflash.flash_attn_func (LSE saved for the backward), atomic dq (the default)
  hipflash-det    the same with deterministic=True (a separate dq pass)
  torch-flash     F.scaled_dot_product_attention under sdpa_kernel(FLASH_ATTENTION): FA2
  torch-cudnn     F.scaled_dot_product_attention under sdpa_kernel(CUDNN_ATTENTION)
Cells: FlashAttention's grid (B * S = 16k, H * D = 2048, D 64 / 128, S 512 .. 16k, causal and
not), bf16; beside it GQA cells (Hq / Hkv = 4 and 8; the SDPA peers with enable_gqa) and varlen
cells (hipflash only: mixed lengths, 16k tokens), each to compare with the dense cell of the
same token count. TFLOP/s count the forward's 4 B H S^2 D (halved for causal; per sequence for
varlen) times 3.5 (backward = 2.5 forward), as FlashAttention reports them. The backward alone
is timed too (torch.autograd.grad on a saved forward; TFLOP/s of 2.5 forwards).

Correct first: every backend's gradients are checked against an fp32 PyTorch reference on the
first input set (error <= 2 x the bf16 PyTorch error + 1e-3 relative to the largest gradient,
per tensor); a FAIL is not timed. Timing: attn_timing.Timer (CUDA events per call, warm-up,
median; the queue held by a sleep kernel so the host's launch cost stays out), input sets
rotated past L2, fresh random values (never zeros). Then the step as a user runs it, by wall
clock (attn_timing.Timer.host, the backends of a cell taking turns): back to back
(TRAIN_HOST_LOOPS[1] steps issued without synchronising, then a synchronize; median over
TRAIN_HOST_LOOPS[0] repeats) and synchronised (each step followed by a synchronize; median over
TRAIN_HOST_LOOPS[2] steps).
"""

import math
import os
import re
import zlib

import torch

import attn_backends as ab
import attn_report as rep

F = torch.nn.functional
BACKENDS = ["hipflash", "hipflash-det", "torch-flash", "torch-cudnn"]
TRAIN_HOST_LOOPS = (3, 10, 10)  # wall clock: repeats x steps back to back, synchronised steps


def _label(b, s, h, d):
    return f"b{b}_s{s // 1024}k_h{h}_d{d}" if s >= 1024 else f"b{b}_s{s}_h{h}_d{d}"


def varlen_lengths(total, lo, hi, seed):
    """Sequence lengths in [lo, hi], multiples of 64, summing to `total` (the last one takes the
    rest)."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while total - sum(lens) > hi:
        lens.append(int(torch.randint(lo // 64, hi // 64 + 1, (1,), generator=g)) * 64)
    return lens + [total - sum(lens)]


def train_cells(device):
    """(label, batch, seqlen, heads, kv heads, head dim, causal, varlen lengths or None)."""
    if device != "cuda":
        return [("tiny_s64_d64", 2, 64, 2, 2, 64, False, None),
                ("tiny_s64_d64_causal", 2, 64, 2, 2, 64, True, None),
                ("tiny_s64_h4_d64_gqa2_causal", 2, 64, 4, 2, 64, True, None),
                ("tiny_varlen_d64_causal", 1, 128, 2, 2, 64, True, [64, 32, 32])]
    cells = []
    for d in (64, 128):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                cells.append((_label(b, s, h, d) + ("_causal" if causal else ""), b, s, h, h, d,
                              causal, None))
    for d in (64, 128):  # GQA and varlen beside the dense cells of the same tokens
        h = 2048 // d
        for s in (2048, 8192):
            for ratio in (4, 8):
                for causal in (False, True):
                    b = 16384 // s
                    cells.append((_label(b, s, h, d) + f"_gqa{ratio}" + ("_causal" if causal else ""),
                                  b, s, h, h // ratio, d, causal, None))
        for causal in (False, True):
            lens = varlen_lengths(16384, 512, 4096, seed=d)
            cells.append((f"varlen_16k_512-4k_h{h}_d{d}" + ("_causal" if causal else ""), 1,
                          16384, h, h, d, causal, lens))
    return cells


def _sdpa(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION,
               "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[kind]

    def attn(q, k, v, causal):
        gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=causal, **gqa)
        return out.transpose(1, 2)
    return attn


def _attention(name, hf, lens=None):
    """The backend's attention(q, k, v, causal) on [B, S, H, D] tensors; with `lens`, on packed
    [total, H, D] ones, as a varlen user holds them (hipflash's varlen call, cu_seqlens on the
    device from the first call on; the SDPA peers have none)."""
    det = name == "hipflash-det"
    if name in ("hipflash", "hipflash-det") and lens is None:
        return lambda q, k, v, causal: hf.flash_attn_func(q, k, v, causal=causal,
                                                          deterministic=det)
    if name in ("hipflash", "hipflash-det"):
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
        on_device = {}

        def varlen(q, k, v, causal):
            c = on_device.get(q.device)
            if c is None:
                c = on_device[q.device] = cu.to(q.device)
            return hf.flash_attn_varlen_func(q, k, v, c, c, max(lens), max(lens),
                                             causal=causal, deterministic=det)
        return varlen
    if lens is not None:
        raise NotImplementedError("no varlen attention in SDPA")
    return _sdpa(name)


def _reference(q, k, v, dout, causal, dtype, lens=None, heads_per_chunk=4):
    """Gradients of softmax(q k^T / sqrt(D)) v in `dtype` with PyTorch ops ([B, S, H, D]), a
    few heads at a time (the heads are independent; the score matrices of all of them at once
    would not fit at S = 16k); GQA by repeated k / v heads (their gradients summed back); with
    `lens`, each packed sequence of the single batch row on its own."""
    if lens is not None:
        starts = [sum(lens[:i]) for i in range(len(lens))]
        parts = [_reference(*(t[:, a:a + n] for t in (q, k, v, dout)), causal, dtype)
                 for a, n in zip(starts, lens)]
        return tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(3))
    group = q.shape[2] // k.shape[2]
    ke, ve = (t.repeat_interleave(group, dim=2) for t in (k, v))
    chunks = [_reference_chunk(q[:, :, h:h + heads_per_chunk], ke[:, :, h:h + heads_per_chunk],
                               ve[:, :, h:h + heads_per_chunk], dout[:, :, h:h + heads_per_chunk],
                               causal, dtype) for h in range(0, q.shape[2], heads_per_chunk)]
    dq, dk, dv = (torch.cat([c[i] for c in chunks], dim=2) for i in range(3))
    b, s, _, d = dk.shape
    return dq, dk.view(b, s, -1, group, d).sum(3), dv.view(b, s, -1, group, d).sum(3)


def _reference_chunk(q, k, v, dout, causal, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return torch.autograd.grad(out, (q, k, v), dout.to(dtype))


def run_train_suite(args, device, timer, meta, out_dir):
    hf = ab.import_hipflash(args.hipflash_path)
    dtype = torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0
    cells = train_cells(device)
    cells = ab.select_cells(cells, args.cells, lambda c: c[0], "train")
    names = BACKENDS if not args.backends else [b for b in BACKENDS if b in args.backends.split(",")]
    rows = []
    host_loops = TRAIN_HOST_LOOPS if device == "cuda" else (1, 2, 2)
    for label, b, s, h, hkv, d, causal, lens in cells:
        timed = {}  # backend -> (row, run): the checked and timed ones, for the wall clock
        g = torch.Generator(device=device).manual_seed(zlib.crc32(label.encode()))
        per_set = 2 * b * s * (2 * h + 2 * hkv) * d
        nsets = max(1, min(8, math.ceil(3 * l2 / per_set))) if device == "cuda" else 1
        rows_shape = (s,) if lens else (b, s)  # varlen: the packed rows (b is 1)
        sets = [[torch.randn(*rows_shape, n, d, device=device, dtype=dtype, generator=g)
                 for n in (h, hkv, hkv, h)] for _ in range(nsets)]
        for st in sets:
            for t in st[:3]:
                t.requires_grad_()
        sq = sum(n * n for n in lens) if lens else b * s * s  # sum of S^2 over sequences
        flops = 4 * h * sq * d * (0.5 if causal else 1.0) * 3.5
        ref = None
        for name in names:
            row = {"suite": "train", "label": label, "backend": name, "B": b, "S": s, "H": h,
                   "Hkv": hkv, "D": d, "causal": causal, "dtype": "bf16", "status": "ok",
                   "note": "", "varlen": lens}
            rows.append(row)
            try:
                attn = _attention(name, hf, lens)

                def run(j, attn=attn):
                    q, k, v, dout = sets[j]
                    out = attn(q, k, v, causal)
                    return torch.autograd.grad(out, (q, k, v), dout)

                got = run(0)
                if ref is None:
                    q, k, v, dout = (t.view(b, s, *t.shape[-2:]) for t in sets[0])
                    ref = tuple(tuple(g.view(t.shape) for g, t in zip(r, sets[0][:3]))
                                for r in (_reference(q, k, v, dout, causal, torch.float32, lens),
                                          _reference(q, k, v, dout, causal, dtype, lens)))
                for gname, ours, r32, rlp in zip("qkv", got, *ref):
                    err = (ours.float() - r32).abs().max().item()
                    tol = 2 * (rlp.float() - r32).abs().max().item() + 1e-3 * r32.abs().max().item()
                    if not err <= tol:
                        raise AssertionError(f"d{gname}: max|err| {err:.3g} > {tol:.3g}")
            except Exception as e:  # noqa: BLE001 — the row says what went wrong
                row.update(status="FAIL" if isinstance(e, AssertionError) else "n/a",
                           note=str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                print(f"{label:28s} {name:14s} {row['status']}: {row['note']}", flush=True)
                continue
            t = timer.time(run, nsets)["time_ms"]
            # The backward alone: the gradients of a saved forward (its graph kept for reuse).
            outs = [attn(st[0], st[1], st[2], causal) for st in sets]

            def run_bwd(j, outs=outs):
                q, k, v, dout = sets[j]
                return torch.autograd.grad(outs[j], (q, k, v), dout, retain_graph=True)

            tb = timer.time(run_bwd, nsets)["time_ms"]
            del outs
            bwd_flops = flops / 3.5 * 2.5
            row.update(time_ms=t, tflops=flops / t / 1e9, bwd_ms=tb, bwd_tflops=bwd_flops / tb / 1e9)
            timed[name] = (row, run)
            print(f"{label:28s} {name:14s} {t:9.3f} ms  {row['tflops']:7.1f} TFLOP/s  backward "
                  f"{tb:.3f} ms {row['bwd_tflops']:.1f}", flush=True)
        if timed:
            host = timer.host({n: r for n, (_, r) in timed.items()}, nsets, loops=host_loops)
            for n, (row, _) in timed.items():
                row.update(b2b_ms=host[n]["b2b_us"] / 1e3, sync_ms=host[n]["sync_us"] / 1e3)
            print(f"{label:28s} wall clock ms (back to back / synchronised): " +
                  ", ".join(f"{n} {row['b2b_ms']:.3f} / {row['sync_ms']:.3f}"
                            for n, (row, _) in timed.items()), flush=True)
        del sets, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    rep.write_json(meta, rows, os.path.join(out_dir, "results.json"))
    write_md(meta, rows, names, os.path.join(out_dir, "results.md"))
    print(f"wrote {out_dir}/results.json, results.md")
    return 0 if all(r["status"] in ("ok", "n/a") for r in rows) else 1


def _is_grid(r):
    """A cell of FlashAttention's grid (dense, MHA): the cells the geomeans are over."""
    return not r.get("varlen") and r.get("Hkv", r["H"]) == r["H"]


def _dense_twin(r, grid_labels):
    """The grid cell a GQA or varlen cell compares with: the same head dim, causality and token
    count (16k); for varlen the sequence length nearest its FLOP-weighted mean length."""
    if r.get("varlen"):
        lens = r["varlen"]
        mean = sum(n * n for n in lens) / sum(lens)
        s = min((512, 1024, 2048, 4096, 8192, 16384), key=lambda x: abs(math.log(x / mean)))
        label = _label(16384 // s, s, r["H"], r["D"])
    else:
        label = re.sub(r"_gqa\d+", "", r["label"]).replace("_causal", "")
    label += "_causal" if r["causal"] else ""
    return label if label in grid_labels else None


def write_md(meta, rows, names, path):
    cells = []
    for r in rows:
        if r["label"] not in cells:
            cells.append(r["label"])
    by = {(r["label"], r["backend"]): r for r in rows}
    first = {r["label"]: r for r in reversed(rows)}
    grid = [c for c in cells if _is_grid(first[c])]
    others = [c for c in cells if c not in grid]

    def cell_txt(r, key="tflops"):
        return f"{r[key]:.0f}" if r and r["status"] == "ok" else (r["status"] if r else "")

    def ratio(a, b, key="time_ms"):
        ra, rb = by.get(a), by.get(b)
        if ra and rb and ra["status"] == "ok" and rb["status"] == "ok":
            return rb[key] / ra[key]
        return None

    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None  # noqa: E731
    with open(path, "w") as f:
        f.write(f"# Forward + backward, bf16 ({meta.get('gpu', meta['device'])}, commit "
                f"{meta['commit']})\n\n`{meta['command']}`\n\nTFLOP/s (forward x 3.5); ratios "
                "are time(peer) / time(hipflash): above 1 is hipflash faster.\n\n")
        f.write("| cell | " + " | ".join(names) + " | vs torch-flash | vs torch-cudnn |\n")
        f.write("|---" * (len(names) + 3) + "|\n")
        fa, cd = [], []
        for c in grid:
            rf = ratio((c, "hipflash"), (c, "torch-flash"))
            rc = ratio((c, "hipflash"), (c, "torch-cudnn"))
            fa += [rf] if rf else []
            cd += [rc] if rc else []
            f.write(f"| {c} | " + " | ".join(cell_txt(by.get((c, n))) for n in names) +
                    f" | {f'{rf:.2f}x' if rf else ''} | {f'{rc:.2f}x' if rc else ''} |\n")
        if fa or cd:
            f.write(f"\nGeomean: hipflash vs torch-flash (FA2) "
                    f"{gm(fa):.2f}x (lowest {min(fa):.2f}x), " if fa else "\n")
            f.write(f"vs torch-cudnn {gm(cd):.2f}x (lowest {min(cd):.2f}x).\n" if cd else "\n")
        if others:
            write_beside_dense(f, others, names, by, first, grid, cell_txt)
        write_backward_alone(f, cells, names, by, ratio, gm)
        if any(r.get("b2b_ms") is not None for r in rows):
            write_wall_clock(f, cells, names, by, gm)


def write_beside_dense(f, others, names, by, first, grid, cell_txt):
    """GQA and varlen cells beside the grid cell of the same tokens (issue 40: within 10%)."""
    f.write("\n## GQA and varlen beside the dense cells\n\nTFLOP/s (forward x 3.5); \"dense\": "
            "hipflash on the grid cell of the same head dim, causality and tokens (varlen: the "
            "sequence length nearest its FLOP-weighted mean), and the ratio of TFLOP/s.\n\n")
    f.write("| cell | " + " | ".join(names) + " | dense cell | hipflash there | ratio |\n")
    f.write("|---" * (len(names) + 4) + "|\n")
    for c in others:
        twin = _dense_twin(first[c], set(grid))
        ours, dense = by.get((c, "hipflash")), by.get((twin, "hipflash")) if twin else None
        r = (ours["tflops"] / dense["tflops"] if ours and dense and ours["status"] == "ok"
             and dense["status"] == "ok" else None)
        f.write(f"| {c} | " + " | ".join(cell_txt(by.get((c, n))) for n in names) +
                f" | {twin or ''} | {cell_txt(dense) if dense else ''} | "
                f"{f'{r:.2f}' if r else ''} |\n")


def write_backward_alone(f, cells, names, by, ratio, gm):
    """The backward alone (gradients of a saved forward) and the deterministic mode's cost."""
    if not any(r.get("bwd_ms") is not None for r in by.values()):
        return
    peers = [n for n in ("torch-flash", "torch-cudnn") if n in names]
    f.write("\n## Backward alone\n\nTFLOP/s (2.5 forwards) of torch.autograd.grad on a saved "
            "forward; ratios time(peer) / time(hipflash); \"det cost\": hipflash-det's fwd + bwd "
            "time over hipflash's (deterministic=True).\n\n")
    f.write("| cell | " + " | ".join(names) + " | " + " | ".join(f"vs {p}" for p in peers) +
            " | det cost |\n")
    f.write("|---" * (len(names) + len(peers) + 2) + "|\n")
    rs = {p: [] for p in peers}
    det = []
    for c in cells:
        vals = []
        for p in peers:
            x = ratio((c, "hipflash"), (c, p), "bwd_ms")
            rs[p] += [x] if x else []
            vals.append(f"{x:.2f}x" if x else "")
        d = ratio((c, "hipflash-det"), (c, "hipflash"))
        det += [1 / d] if d else []
        f.write(f"| {c} | " + " | ".join(
            f"{by[(c, n)]['bwd_tflops']:.0f}" if by.get((c, n)) and by[(c, n)].get("bwd_tflops")
            else "" for n in names) + " | " + " | ".join(vals) +
            f" | {f'{1 / d:.2f}' if d else ''} |\n")
    for p in peers:
        if rs[p]:
            f.write(f"\nBackward alone, hipflash vs {p}: {gm(rs[p]):.2f}x (lowest "
                    f"{min(rs[p]):.2f}x).\n")
    if det:
        f.write(f"\nDeterministic mode: fwd + bwd {gm(det):.2f}x the default's time (worst "
                f"{max(det):.2f}x).\n")


def write_wall_clock(f, cells, names, by, gm):
    """The training step as a user runs it, by wall clock: per step back to back and
    synchronised (ms), and hipflash's ratio to each peer (time(peer) / time(hipflash))."""
    def ms(r, key):
        return f"{r[key]:.3f}" if r and r.get(key) is not None else ""

    peers = [n for n in ("torch-flash", "torch-cudnn") if n in names]
    f.write("\n## Wall clock per step, as a user calls it\n\nms per training step (forward + "
            "backward, host work included): back to back / synchronised (each step followed by "
            "a synchronize). Ratios time(peer) / time(hipflash), back to back / synchronised.\n\n")
    f.write("| cell | " + " | ".join(names) + " | " +
            " | ".join(f"vs {p}" for p in peers) + " |\n")
    f.write("|---" * (len(names) + len(peers) + 1) + "|\n")
    ratios = {(p, k): [] for p in peers for k in ("b2b_ms", "sync_ms")}
    for c in cells:
        hf = by.get((c, "hipflash"))
        line = [f"{ms(by.get((c, n)), 'b2b_ms')} / {ms(by.get((c, n)), 'sync_ms')}"
                if by.get((c, n)) and by[(c, n)].get("b2b_ms") is not None else "" for n in names]
        for p in peers:
            pr = by.get((c, p))
            rr = []
            for k in ("b2b_ms", "sync_ms"):
                if hf and pr and hf.get(k) and pr.get(k):
                    ratios[(p, k)].append(pr[k] / hf[k])
                    rr.append(f"{pr[k] / hf[k]:.2f}x")
            line.append(" / ".join(rr))
        f.write(f"| {c} | " + " | ".join(line) + " |\n")
    for p in peers:
        b, s = ratios[(p, "b2b_ms")], ratios[(p, "sync_ms")]
        if b and s:
            f.write(f"\nWall clock, hipflash vs {p}: back to back {gm(b):.2f}x (lowest "
                    f"{min(b):.2f}x), synchronised {gm(s):.2f}x (lowest {min(s):.2f}x).\n")

