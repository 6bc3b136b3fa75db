"""bench/generate_bench.py's batch: left-padded prompts of lengths in [prompt / 2, prompt], the
padding token 0 and mask 0 before each prompt (the model-level run needs transformers and a GPU:
scripts on the device run it)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import generate_bench  # noqa: E402


def test_prompts_are_left_padded_to_lengths_in_range():
    ids, mask = generate_bench._prompts(16, 64, 32000, "cpu", seed=3)
    assert ids.shape == mask.shape == (16, 64)
    lens = mask.sum(-1)
    assert ((lens >= 32) & (lens <= 64)).all() and lens.unique().numel() > 1
    for b in range(16):
        pad = 64 - int(lens[b])
        assert (mask[b, :pad] == 0).all() and (mask[b, pad:] == 1).all()  # left padding
        assert (ids[b, :pad] == 0).all() and (ids[b, pad:] >= 3).all()
    again, _ = generate_bench._prompts(16, 64, 32000, "cpu", seed=3)
    assert torch.equal(ids, again)  # one batch per seed: both implementations see it
