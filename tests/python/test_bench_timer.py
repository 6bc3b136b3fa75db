"""bench/attn_bench.py's timing on the CPU (bench/attn_timing.py; the recorded command,
attn_env.py; the decode cells, attn_cells.py): the interleaved rounds (--rounds) and the
repetition count they share out. The CPU numbers are not benchmarks; what is checked is the
runner's arithmetic and that every backend of a cell is timed once a round, in turn."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import attn_cells  # noqa: E402
import attn_env  # noqa: E402
import attn_timing  # noqa: E402


def test_interleaved_order_rotates_the_first_backend():
    order = attn_timing.interleaved_order(["a", "b", "c"], 4)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert attn_timing.interleaved_order(["a", "b"], 1) == ["a", "b"]


@pytest.mark.parametrize("est_ms", [1e-6, 0.01, 0.3, 1.0, 7.5, 80.0, 1000.0])
def test_one_round_keeps_the_budgets_repetitions(est_ms):
    t = attn_timing.Timer("cpu", *attn_timing.BUDGETS["full"])
    _, rep_ms, lo, hi = attn_timing.BUDGETS["full"]
    # the formula of one window: max(min, min(max, budget / time per call))
    expected = int(min(hi, max(lo, math.ceil(rep_ms / max(est_ms, 1e-3)))))
    assert t._reps(est_ms, 1.0, lo, hi) == expected


@pytest.mark.parametrize("rounds", [2, 3, 4])
def test_rounds_share_the_repetitions(rounds):
    t = attn_timing.Timer("cpu", *attn_timing.BUDGETS["full"], rounds=rounds)
    _, _, lo, hi = attn_timing.BUDGETS["full"]
    share = 1.0 / rounds
    for est_ms in (1e-6, 0.5, 2.0, 1000.0):
        whole = t._reps(est_ms, 1.0, lo, hi)
        part = t._reps(est_ms, share, lo, hi)
        assert part >= 1
        # rounds windows together: the one window's count, up to a rounding a window
        assert whole <= rounds * part <= whole + rounds


def test_cpu_samples_are_sorted_per_call_times():
    calls = []
    t = attn_timing.Timer("cpu", 1.0, 5.0, 3, 50, rounds=2)
    ts = t.samples(lambda j: calls.append(j), 2, share=0.5, first=False)
    assert ts == sorted(ts) and 2 <= len(ts) <= 25
    assert set(calls) <= {0, 1}  # the input sets, rotated


def test_runner_times_every_backend_in_rounds(tmp_path):
    """The tiny CPU suite (every suite's toy cells) with --rounds 3: every checked backend
    timed, its repetitions the sum of its rounds, the wall-clock cells' host columns filled
    after the rounds, and the meta data saying how it was timed."""
    build = Path(os.environ.get("HIPFLASH_BUILD_DIR", BENCH.parent / "build")) / "python"
    proc = subprocess.run([sys.executable, str(BENCH / "attn_bench.py"), "--suite", "tiny",
                           "--device", "cpu", "--rounds", "3", "--hipflash-path", str(build),
                           "--out", str(tmp_path), "--progress", "none"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert "3 interleaved rounds" in res["meta"]["timing"]
    timed = [r for r in res["rows"] if r["status"] == "ok"]
    assert {r["backend"] for r in timed} >= {"hipflash", "hipflash+lse"}
    for r in timed:
        assert r["reps"] >= 3 and r["time_ms"] > 0  # at least one call a round
    host = [r for r in timed if r["suite"] == "host-overhead"]
    assert host and all(r.get("b2b_us") for r in host)


def test_rounds_must_be_positive():
    proc = subprocess.run([sys.executable, str(BENCH / "attn_bench.py"), "--rounds", "0",
                           "--dry-run"], capture_output=True, text=True)
    assert proc.returncode != 0 and "at least 1" in proc.stderr


@pytest.mark.parametrize("rounds", [1, 3])
def test_time_in_rounds_runs_the_cells_windows(rounds):
    """A reference timed apart from the cells (the matmul rate) runs `rounds` windows, the
    first with the full warm-up: with rounds 1 exactly time()'s single window."""
    calls = []
    t = attn_timing.Timer("cpu", 1.0, 6.0, 3, 60, rounds=rounds)
    windows = []
    real = t.samples

    def spy(run, nsets, share=1.0, first=True):
        windows.append((share, first))
        return real(run, nsets, share=share, first=first)

    t.samples = spy
    st = t.time_in_rounds(lambda j: calls.append(j), 2)
    assert windows == [(1.0 / rounds, r == 0) for r in range(rounds)]
    assert st["time_ms"] >= 0 and set(calls) <= {0, 1}


def test_the_recorded_command_carries_the_librarys_switches():
    env = {"HIPFLASH_DECODE_HEADS": "1", "HIPFLASH_COMMIT": "abc", "PATH": "/bin",
           "HIPFLASH_DISABLE_SM90_WS": "1"}
    cmd = attn_env.command_line(env, ["bench/attn_bench.py", "--suite", "decode"])
    words = cmd.split()
    assert words[:2] == ["HIPFLASH_DECODE_HEADS=1", "HIPFLASH_DISABLE_SM90_WS=1"]
    assert words[-3:] == ["bench/attn_bench.py", "--suite", "decode"]
    assert "HIPFLASH_COMMIT" not in cmd and "PATH" not in cmd
    assert attn_env.command_line({}, ["x.py"]).split()[1:] == ["x.py"]


@pytest.mark.parametrize("suite", ["decode", "serving"])
def test_decode_head_dim_reaches_the_cells_labels_and_title(suite):
    import attn_report  # noqa: E402  (bench/, on the path above)

    default = attn_cells.build_suite(suite, "bf16", False)
    hd64 = attn_cells.build_suite(suite, "bf16", False, decode_dim=64)
    assert {c.D for c in default} == {128} and {c.D for c in hd64} == {64}
    assert [c.label + " hd64" for c in default] == [c.label for c in hd64]
    rows = [{"suite": suite, "D": c.D} for c in hd64]
    assert "D = 64" in attn_report.suite_title(rows, suite)
    rows128 = [{"suite": suite, "D": c.D} for c in default]
    assert attn_report.suite_title(rows128, suite) == attn_report.SUITE_TITLES[suite]
