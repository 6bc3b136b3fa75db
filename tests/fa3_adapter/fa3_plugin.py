"""A pytest plugin that runs FlashAttention 3's own test file (hopper/test_flash_attn.py of a
flash-attention checkout, never copied here) against hipflash.compat.flash_attn_interface.

    scripts/fa3-tests --fa3 <flash-attention checkout> [--sample N] [pytest args]

What it does, before FA3's file is imported:
  * `flash_attn_interface` is hipflash's FA3 compatibility module (it must win over the
    checkout's own hopper/flash_attn_interface.py, which needs FA3's CUDA extension);
  * `flash_attn.layers.rotary.apply_rotary_emb` (FA2's Triton rotary, which the test file uses
    for its reference) is a PyTorch version here (hipflash._rotary.rotate);
  * <checkout>/hopper goes on sys.path for its pure-PyTorch helpers (test_util, padding).
At collection: the race-condition test (a 70 GiB allocation, 1000 backward passes a case) and
the check of FA3's own torch.ops schemas are deselected, with the reason in the summary;
--fa3-sample N keeps one case in N (by a hash of its id: the same cases every run).
At run time a case hipflash refuses (NotImplementedError: a feature it does not have) is
reported as skipped with that message, so the counts read passed / failed / skipped by reason.
The summary (and --fa3-report FILE, JSON, rewritten after every case) groups the outcomes by
test and by skip reason.
"""
import collections
import json
import os
import sys
import types
import zlib

import pytest
import torch

DESELECT = {
    "test_flash_attn_race_condition": "allocates 70 GiB and runs 1000 backward passes a case",
    "test_flash3_bw_compatibility": "checks FlashAttention 3's own torch.ops schemas",
}


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """FA2's flash_attn.layers.rotary.apply_rotary_emb in PyTorch: x (batch, seqlen, h, d), or
    (total, h, d) with cu_seqlens; row s of sequence b at position s + seqlen_offsets[b]."""
    from hipflash._rotary import rotate
    if cu_seqlens is not None:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=x.device), lens)
        row = torch.arange(x.shape[0], device=x.device) - cu_seqlens.long()[seq]
        off = seqlen_offsets[seq].long() if torch.is_tensor(seqlen_offsets) else seqlen_offsets
        out = rotate(x[None], cos, sin, (row + off)[None], interleaved)[0]
    else:
        b, s = x.shape[0], x.shape[1]
        off = (seqlen_offsets.long() if torch.is_tensor(seqlen_offsets)
               else torch.full((b,), int(seqlen_offsets), device=x.device, dtype=torch.long))
        out = rotate(x, cos, sin, off[:, None] + torch.arange(s, device=x.device)[None], interleaved)
    if inplace:
        x.copy_(out)
        return x
    return out


def _install(hopper_dir):
    import hipflash.compat.flash_attn_interface as fa3
    sys.modules["flash_attn_interface"] = fa3
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []
    layers = types.ModuleType("flash_attn.layers")
    layers.__path__ = []
    rotary = types.ModuleType("flash_attn.layers.rotary")
    rotary.apply_rotary_emb = apply_rotary_emb
    pkg.layers, layers.rotary = layers, rotary
    sys.modules.update({"flash_attn": pkg, "flash_attn.layers": layers,
                        "flash_attn.layers.rotary": rotary})
    sys.path.insert(0, hopper_dir)


def pytest_addoption(parser):
    g = parser.getgroup("fa3", "FlashAttention 3's test file against hipflash")
    g.addoption("--fa3-hopper", default=os.environ.get("FA3_HOPPER_DIR"),
                help="the checkout's hopper/ directory (its test_util.py and padding.py)")
    g.addoption("--fa3-sample", type=int, default=1, help="keep one case in N (default: all)")
    g.addoption("--fa3-report", default=None, help="write the counts as JSON to this file")


_outcomes = collections.defaultdict(collections.Counter)  # test function -> outcome -> count
_skips = collections.Counter()                            # skip reason -> count
_deselected = collections.Counter()


def pytest_configure(config):
    hopper = config.getoption("--fa3-hopper")
    if not hopper or not os.path.isfile(os.path.join(hopper, "test_util.py")):
        raise pytest.UsageError("--fa3-hopper (or FA3_HOPPER_DIR) must name a flash-attention "
                                f"checkout's hopper/ directory, got {hopper!r}")
    _install(os.path.abspath(hopper))


def pytest_collection_modifyitems(config, items):
    n = max(1, config.getoption("--fa3-sample"))
    keep, drop = [], []
    for item in items:
        name = item.originalname or item.name
        if name in DESELECT:
            _deselected[f"{name}: {DESELECT[name]}"] += 1
            drop.append(item)
        elif n > 1 and zlib.crc32(item.nodeid.encode()) % n:
            _deselected[f"sampled out (one case in {n} kept)"] += 1
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if call.excinfo is not None and call.excinfo.errisinstance(NotImplementedError):
        msg = str(call.excinfo.value).splitlines()[0] if str(call.excinfo.value) else "?"
        rep.outcome = "skipped"
        rep.longrepr = (str(item.fspath), item.location[1] or 0, f"hipflash refuses: {msg}")
    if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
        name = item.originalname or item.name
        kind = rep.outcome if rep.when == "call" or rep.outcome == "skipped" else "error"
        _outcomes[name][kind] += 1
        if rep.outcome == "skipped":
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            _skips[reason[:160]] += 1
        _write_report(item.config)  # after every case: a run cut short keeps its counts


def _write_report(config):
    path = config.getoption("--fa3-report")
    if not path:
        return
    total = sum(_outcomes.values(), collections.Counter())
    with open(path, "w") as f:
        json.dump({"by_test": {k: dict(v) for k, v in _outcomes.items()},
                   "total": dict(total), "skipped_by_reason": dict(_skips),
                   "deselected": dict(_deselected)}, f, indent=1)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    w = terminalreporter
    w.section("FlashAttention 3's tests against hipflash")
    for name, c in sorted(_outcomes.items()):
        w.line(f"{name}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    total = sum(_outcomes.values(), collections.Counter())
    w.line("total: " + ", ".join(f"{k} {v}" for k, v in sorted(total.items())))
    for reason, count in _skips.most_common():
        w.line(f"  skipped {count}: {reason}")
    for reason, count in _deselected.items():
        w.line(f"  deselected {count}: {reason}")
    _write_report(config)
