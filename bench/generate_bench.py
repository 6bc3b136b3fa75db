"""Generation with Hugging Face transformers: tokens/s of `model.generate` with hipflash's
attention (`attn_implementation="hipfa"`, hipflash.integrations.transformers) against PyTorch's
SDPA (`"sdpa"`), one model, side by side in one process.

    python3 bench/generate_bench.py --out bench/results/<run>/generate

The model: a random-weight Llama of ~1.2B parameters (hidden 2048, 16 layers, 16 query heads of
128 dims over 4 kv heads, GQA 4), bfloat16, both implementations holding the same weights. The
batch: `--batches` prompts of `--prompt` tokens, left-padded to random lengths in [prompt/2,
prompt] (what batched generation is), then `--new` tokens by greedy decoding (min_new_tokens ==
max_new_tokens, so both run the same number of steps whatever they pick).

Correct first: the prompt's logits of each implementation against the same model in fp32 (the
bfloat16 weights widened, eager attention) at every non-padded position: hipflash's mean error
must stay within 1% of SDPA's (plus 1e-3 absolute); a cell that fails is not timed.
Timing: wall clock (torch.cuda.synchronize around each generate call, what a user waits for),
one warm-up call each, then `--rounds` rounds with the implementations taking turns (order
reversed every round), median. tokens/s counts the generated tokens: batch x new.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_env  # noqa: E402


def _model(transformers, impl, state, args, dtype=torch.bfloat16):
    size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=2) if args.tiny else dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16)
    cfg = transformers.LlamaConfig(vocab_size=32000, num_key_value_heads=args.kv_heads,
                                   max_position_embeddings=8192, **size)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl)
    model = model.to(torch.bfloat16).eval()
    if state is not None:
        model.load_state_dict(state)
    model = model.to(dtype)
    model.generation_config.pad_token_id = 0
    return model


def _prompts(batch, length, vocab, device, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        pad = length - int(torch.randint(length // 2, length + 1, (1,), generator=g))
        mask[b, :pad] = 0
        ids[b, :pad] = 0
    return ids.to(device), mask.to(device)


def _mean_error(model, ref_logits, ids, mask):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    return (logits[valid].float() - ref_logits[valid]).abs().mean().item()


def _generate(model, ids, mask, new):
    torch.cuda.synchronize() if ids.is_cuda else None
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
    torch.cuda.synchronize() if ids.is_cuda else None
    assert out.shape[1] == ids.shape[1] + new, out.shape
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer model of hidden 256 (tests the runner; not a benchmark)")
    ap.add_argument("--out", default=None, help="directory for results.json / results.md")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    args.kv_heads = 1 if args.tiny else 4

    import transformers
    import hipflash.integrations.transformers as hf
    name = hf.register()
    torch.manual_seed(0)
    sdpa = _model(transformers, "sdpa", None, args)
    impls = {"sdpa": sdpa, name: _model(transformers, name, sdpa.state_dict(), args),
             "fp32": _model(transformers, "eager", sdpa.state_dict(), args, torch.float32)}
    meta = {"command": attn_env.command_line(), "commit": attn_env.git_commit(args.commit),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "none (CPU)",
            "model": "tiny Llama (runner test)" if args.tiny else
            "Llama, hidden 2048, 16 layers, 16 heads x 128, 4 kv heads, bf16, random",
            "prompt": args.prompt, "new": args.new, "rounds": args.rounds,
            "device": args.device, "suite": "generate"}
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        ids, mask = _prompts(batch, args.prompt, 32000, args.device, seed=batch)
        with torch.no_grad():  # the reference: the same weights, everything in fp32
            ref = impls["fp32"](input_ids=ids, attention_mask=mask).logits.float()
        err = {n: _mean_error(impls[n], ref, ids, mask) for n in ("sdpa", name)}
        ok = err[name] <= 1.01 * err["sdpa"] + 1e-3
        row = {"batch": batch, "err_sdpa": err["sdpa"], "err_hipflash": err[name],
               "correct": ok}
        if ok:
            for n in ("sdpa", name):
                _generate(impls[n], ids, mask, args.new)  # warm-up
            times = {"sdpa": [], name: []}
            for r in range(args.rounds):
                order = ("sdpa", name) if r % 2 == 0 else (name, "sdpa")
                for n in order:
                    times[n].append(_generate(impls[n], ids, mask, args.new))
            for n, key in (("sdpa", "sdpa"), (name, "hipflash")):
                row[f"{key}_tok_s"] = batch * args.new / statistics.median(times[n])
            row["ratio"] = row["hipflash_tok_s"] / row["sdpa_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    lines = ["## Generation tokens/s against SDPA", "", f"Generation (transformers {meta['transformers']}, torch {meta['torch']}, "
             f"{meta['gpu']}, commit {meta['commit']}): {meta['model']}; prompts of "
             f"{args.prompt} tokens left-padded, {args.new} new tokens, greedy; median of "
             f"{args.rounds} rounds, wall clock.", "", f"`{meta['command']}`", "",
             "| batch | SDPA tok/s | hipflash tok/s | hipflash / SDPA | mean logit error vs "
             "fp32 attention: SDPA | hipflash |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["correct"]:
            lines.append(f"| {r['batch']} | {r['sdpa_tok_s']:.0f} | {r['hipflash_tok_s']:.0f} | "
                         f"{r['ratio']:.2f}x | {r['err_sdpa']:.4f} | {r['err_hipflash']:.4f} |")
        else:
            lines.append(f"| {r['batch']} | - | - | FAIL (not timed) | {r['err_sdpa']:.4f} | "
                         f"{r['err_hipflash']:.4f} |")
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
