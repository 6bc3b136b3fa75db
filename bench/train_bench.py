"""hipflash forward + backward (training step of the attention op) against PyTorch's kernels,
side by side in one process: `attn_bench.py --suite train` (see run_train_suite).

A call is what a training step does with the op: out = attention(q, k, v) with q, k, v requiring
grad, then torch.autograd.grad(out, (q, k, v), dout). Backends:
  hipflash        hipflash.flash_attn_func (LSE saved for the backward), atomic dq (the default)
  hipflash-det    the same with deterministic=True (a separate dq pass)
  torch-flash     F.scaled_dot_product_attention under sdpa_kernel(FLASH_ATTENTION): FA2
  torch-cudnn     F.scaled_dot_product_attention under sdpa_kernel(CUDNN_ATTENTION)
Cells: FlashAttention's grid (B * S = 16k, H * D = 2048, D 64 / 128, S 512 .. 16k, causal and
not), bf16. TFLOP/s count the forward's 4 B H S^2 D (halved for causal) times 3.5 (backward =
2.5 forward), as FlashAttention reports them.

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
import zlib

import torch

import attn_backends as ab
import attn_report as rep

F = torch.nn.functional
BACKENDS = ["hipflash", "hipflash-det", "torch-flash", "torch-cudnn"]
TRAIN_HOST_LOOPS = (3, 10, 10)  # wall clock: repeats x steps back to back, synchronised steps


def train_cells(device):
    if device != "cuda":
        return [("tiny_s64_d64", 2, 64, 2, 64, False), ("tiny_s64_d64_causal", 2, 64, 2, 64, True)]
    cells = []
    for d in (64, 128):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                label = f"b{b}_s{s // 1024}k_h{h}_d{d}" if s >= 1024 else f"b{b}_s{s}_h{h}_d{d}"
                cells.append((label + ("_causal" if causal else ""), b, s, h, d, causal))
    return cells


def _sdpa(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION,
               "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[kind]

    def attn(q, k, v, causal):
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)
    return attn


def _attention(name, hf):
    if name == "hipflash":
        return lambda q, k, v, causal: hf.flash_attn_func(q, k, v, causal=causal)
    if name == "hipflash-det":
        return lambda q, k, v, causal: hf.flash_attn_func(q, k, v, causal=causal,
                                                          deterministic=True)
    return _sdpa(name)


def _reference(q, k, v, dout, causal, dtype, heads_per_chunk=4):
    """Gradients of softmax(q k^T / sqrt(D)) v in `dtype` with PyTorch ops ([B, S, H, D]), a
    few heads at a time (the heads are independent; the score matrices of all of them at once
    would not fit at S = 16k)."""
    chunks = [_reference_chunk(q[:, :, h:h + heads_per_chunk], k[:, :, h:h + heads_per_chunk],
                               v[:, :, h:h + heads_per_chunk], dout[:, :, h:h + heads_per_chunk],
                               causal, dtype) for h in range(0, q.shape[2], heads_per_chunk)]
    return tuple(torch.cat([c[i] for c in chunks], dim=2) for i in range(3))


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
    for label, b, s, h, d, causal in cells:
        timed = {}  # backend -> (row, run): the checked and timed ones, for the wall clock
        g = torch.Generator(device=device).manual_seed(zlib.crc32(label.encode()))
        per_set = 4 * b * s * h * d * 2
        nsets = max(1, min(8, math.ceil(3 * l2 / per_set))) if device == "cuda" else 1
        sets = [[torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g)
                 for _ in range(4)] for _ in range(nsets)]
        for st in sets:
            for t in st[:3]:
                t.requires_grad_()
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * 3.5
        ref = None
        for name in names:
            row = {"suite": "train", "label": label, "backend": name, "B": b, "S": s, "H": h,
                   "D": d, "causal": causal, "dtype": "bf16", "status": "ok", "note": ""}
            rows.append(row)
            try:
                attn = _attention(name, hf)

                def run(j, attn=attn):
                    q, k, v, dout = sets[j]
                    out = attn(q, k, v, causal)
                    return torch.autograd.grad(out, (q, k, v), dout)

                got = run(0)
                if ref is None:
                    q, k, v, dout = sets[0]
                    ref = (_reference(q, k, v, dout, causal, torch.float32),
                           _reference(q, k, v, dout, causal, dtype))
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
            row.update(time_ms=t, tflops=flops / t / 1e9)
            timed[name] = (row, run)
            print(f"{label:28s} {name:14s} {t:9.3f} ms  {row['tflops']:7.1f} TFLOP/s", flush=True)
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


def write_md(meta, rows, names, path):
    cells = []
    for r in rows:
        if r["label"] not in cells:
            cells.append(r["label"])
    by = {(r["label"], r["backend"]): r for r in rows}

    def cell_txt(r):
        return f"{r['tflops']:.0f}" if r and r["status"] == "ok" else (r["status"] if r else "")

    def ratio(a, b):
        ra, rb = by.get(a), by.get(b)
        if ra and rb and ra["status"] == "ok" and rb["status"] == "ok":
            return rb["time_ms"] / ra["time_ms"]
        return None

    with open(path, "w") as f:
        f.write(f"# Forward + backward, bf16 ({meta.get('gpu', meta['device'])}, commit "
                f"{meta['commit']})\n\n`{meta['command']}`\n\nTFLOP/s (forward x 3.5); ratios "
                "are time(peer) / time(hipflash): above 1 is hipflash faster.\n\n")
        f.write("| cell | " + " | ".join(names) + " | vs torch-flash | vs torch-cudnn |\n")
        f.write("|---" * (len(names) + 3) + "|\n")
        fa, cd = [], []
        for c in cells:
            rf = ratio((c, "hipflash"), (c, "torch-flash"))
            rc = ratio((c, "hipflash"), (c, "torch-cudnn"))
            fa += [rf] if rf else []
            cd += [rc] if rc else []
            f.write(f"| {c} | " + " | ".join(cell_txt(by.get((c, n))) for n in names) +
                    f" | {f'{rf:.2f}x' if rf else ''} | {f'{rc:.2f}x' if rc else ''} |\n")
        gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None  # noqa: E731
        if fa or cd:
            f.write(f"\nGeomean: hipflash vs torch-flash (FA2) "
                    f"{gm(fa):.2f}x (lowest {min(fa):.2f}x), " if fa else "\n")
            f.write(f"vs torch-cudnn {gm(cd):.2f}x (lowest {min(cd):.2f}x).\n" if cd else "\n")
        if any(r.get("b2b_ms") is not None for r in rows):
            write_wall_clock(f, cells, names, by, gm)


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

