# hipflash — development probe (not a benchmark of record): what a score modifier — the softcap
# (Gemma 2's 50) or ALiBi (BLOOM's slopes) — costs the forward. For each cell (bf16,
# [B, S, H, D], B * S = 16k, H * D = 2048): the modified output checked first against PyTorch's
# fp32 math on two heads (at the timed inputs' scale and with q x 8), then plain and modified
# calls timed in turn with device events, fresh inputs per call from a rotating set, warm-up,
# median over rounds; the ratio modified / plain. --backward: forward + backward calls
# (torch.autograd.grad of a fixed dO) instead of the forward alone. --flex: beside it, what the
# modifier costs PyTorch's FlexAttention (torch.compile(flex_attention), a score_mod of the same
# modifier against none, causal by a block mask; forward only): the peer's ratio.
# Usage (GPU machine, after scripts/gpu-check build):
#   python3 bench/probes/score_mod_probe.py build-gpu/python [--mod softcap|alibi]
#       [--cells S:D[:c],...] [--rounds N] [--backward | --flex | --ncu]
# --ncu: after each cell's check, three plain then three modified calls, untimed, for Nsight
# Compute (e.g. ncu --kernel-name regex:sm90_ws --launch-skip 2 --launch-count 4: the third
# plain call, then the modified ones).
import argparse
import statistics
import sys

import torch

ap = argparse.ArgumentParser()
ap.add_argument("hipflash_path")
ap.add_argument("--cells", default="1024:64,1024:64:c,4096:128,4096:128:c,16384:128:c,1:128")
ap.add_argument("--rounds", type=int, default=7)
ap.add_argument("--calls", type=int, default=20, help="calls per timed window")
ap.add_argument("--mod", choices=("softcap", "alibi"), default="softcap")
ap.add_argument("--softcap", type=float, default=50.0)
ap.add_argument("--backward", action="store_true", help="time forward + backward calls")
ap.add_argument("--ncu", action="store_true",
                help="untimed calls (three plain, three modified a cell) for Nsight Compute")
ap.add_argument("--flex", action="store_true",
                help="also time FlexAttention plain and modified (forward; a peer's ratio)")
args = ap.parse_args()
sys.path.insert(0, args.hipflash_path)
import hipflash as hf  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("score_mod_probe: needs a CUDA GPU (torch.cuda.is_available() is False)")
if args.flex and args.backward:
    sys.exit("score_mod_probe: --flex times forward calls only")


def cells():
    """S:D[:c]; S = 1 is decode against a 16k cache (B = 32, GQA 4)."""
    for spec in args.cells.split(","):
        parts = spec.split(":")
        yield int(parts[0]), int(parts[1]), len(parts) > 2 and parts[2] == "c"


def slopes_of(heads, device):
    """BLOOM's geometric ALiBi slopes 2^(-8 i / heads)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)


def modifier(heads, device):
    """The keyword arguments of a modified call."""
    if args.mod == "softcap":
        return {"softcap": args.softcap}
    return {"alibi_slopes": slopes_of(heads, device)}


def reference(q, k, v, causal, mod):
    """fp32 attention with the modifier on [B, S, H, D] (GQA by repeating k / v)."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    rep = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
    s = qf @ kf.transpose(-1, -2) / q.shape[-1] ** 0.5
    sq, sk = s.shape[-2:]
    if "softcap" in mod:
        s = mod["softcap"] * torch.tanh(s / mod["softcap"])
    if "alibi_slopes" in mod:
        i = torch.arange(sq, device=q.device)[:, None] + sk - sq
        j = torch.arange(sk, device=q.device)[None, :]
        s = s - mod["alibi_slopes"].float()[:, None, None] * (i - j).abs()
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(1, 2)


def timed(fn, sets):
    """Median ms per call over rounds of `calls` calls (device events; input sets rotated)."""
    for i in range(3):
        fn(*sets[i % len(sets)])
    ms = []
    for _ in range(args.rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(args.calls):
            fn(*sets[i % len(sets)])
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end) / args.calls)
    return statistics.median(ms)


def flex_times(sets, causal, hq, hkv, mod):
    """FlexAttention's ms per call plain and with `mod` as a score_mod (layout [B, H, S, D]; the
    same scale), and its modified output's max error against reference() on the first set."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    bhsd = [tuple(t.detach().transpose(1, 2) for t in qkv) for qkv in sets]
    sq, sk = bhsd[0][0].shape[2], bhsd[0][1].shape[2]
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, qi, kv: qi + sk - sq >= kv, None, None, sq, sk,
                                       device="cuda")
    if "softcap" in mod:
        cap = mod["softcap"]

        def score_mod(score, b, h, qi, kv):
            return cap * torch.tanh(score / cap)
    else:
        slopes = mod["alibi_slopes"].float()

        def score_mod(score, b, h, qi, kv):
            return score - slopes[h] * (qi + sk - sq - kv).abs()

    def run(score_mod):
        return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    enable_gqa=hq != hkv)
    # The check as hipflash's: batch 0, query heads 0 and 1 (and their kv heads) against fp32.
    q, k, v = sets[0]
    nk = 1 if hq != hkv else 2
    with torch.no_grad():
        got = run(score_mod)(*bhsd[0]).transpose(1, 2)[:1, :, :2]
    mod2 = {"alibi_slopes": mod["alibi_slopes"][:2]} if "alibi_slopes" in mod else mod
    want = reference(q[:1, :, :2], k[:1, :, :nk], v[:1, :, :nk], causal, mod2)
    err = (got.float() - want).abs().max().item()
    return timed(run(None), bhsd), timed(run(score_mod), bhsd), err


torch.manual_seed(0)
print(f"{'cell':24s} {'plain ms':>9s} {args.mod + ' ms':>10s} {'ratio':>6s} {'err':>8s} {'err q*8':>8s}  kernel")
for s, d, causal in cells():
    if s == 1:
        b, hq, hkv, sk = 32, 32, 8, 16384
    else:
        b, hq, hkv, sk = 16384 // s, 2048 // d, 2048 // d, s
    sets = [tuple(torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                  .requires_grad_(args.backward)
                  for n, h in ((s, hq), (sk, hkv), (sk, hkv))) for _ in range(3)]
    dout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)

    def call(q, k, v, **kw):
        out = hf.flash_attn_func(q, k, v, causal=causal, **kw)
        if args.backward:
            torch.autograd.grad(out, (q, k, v), dout)
    label = f"S={s} D={d}{' causal' if causal else ''}"
    q, k, v = sets[0]
    nk = 1 if hq != hkv else 2  # two query heads (of one kv head under GQA)
    q1, k1, v1 = q[:1, :, :2], k[:1, :, :nk], v[:1, :, :nk]
    # The check at the timed inputs' scale and with q x 8 (scores of std ~8: the cap's bend).
    errs = []
    for q_gain in (1, 8):
        mod1 = modifier(2, q.device)
        with torch.no_grad():
            got = hf.flash_attn_func(q1 * q_gain, k1, v1, causal=causal, **mod1)
        want = reference(q1 * q_gain, k1, v1, causal, mod1)
        errs.append((got.float() - want).abs().max().item())
    err = max(errs)
    if not err <= 2e-2:
        print(f"{label:24s} max|out - ref| {err:.3g}: not timed")
        continue
    mod = modifier(hq, q.device)
    if args.ncu:
        for kw in ({}, {}, {}, mod, mod, mod):
            call(*sets[0], **kw)
        torch.cuda.synchronize()
        print(f"{label:24s} checked ({err:.2e}); three plain and three {args.mod} calls made")
        continue
    plain = timed(call, sets)
    capped = timed(lambda q, k, v: call(q, k, v, **mod), sets)
    print(f"{label:24s} {plain:9.3f} {capped:10.3f} {capped / plain:6.3f} {errs[0]:8.2e} {errs[1]:8.2e}  "
          f"{hf.last_kernel_name()}", flush=True)
    if args.flex:
        flex_plain, flex_mod, flex_err = flex_times(sets, causal, hq, hkv, mod)
        print(f"{'  flex (peer)':24s} {flex_plain:9.3f} {flex_mod:10.3f} "
              f"{flex_mod / flex_plain:6.3f} {flex_err:8.2e} {'':8s}  flex_attention", flush=True)
    del sets, q, k, v, q1, k1, v1
    torch.cuda.empty_cache()
