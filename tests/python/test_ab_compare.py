"""bench/ab_compare.py: the table scripts/gpu-ab prints for an A/B of builds."""
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "bench" / "ab_compare.py"


def write_run(path, cells):
    """cells: {label: (hipflash, hipflash+lse, cudnn)}; a metric of None is a failed check."""
    rows = []
    for label, metrics in cells.items():
        for backend, value in zip(("hipflash", "hipflash+lse", "torch-cudnn"), metrics):
            rows.append({"suite": "fa-grid", "label": label, "backend": backend, "status": "ok",
                         "check": "PASS" if value is not None else "FAIL",
                         "tflops": value if value is not None else 1.0, "gbps": None})
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    return path


def compare(*args):
    out = subprocess.run([sys.executable, str(TOOL), *map(str, args)], check=True,
                         capture_output=True, text=True).stdout
    return out.splitlines()


def line_of(lines, cell):
    return next(line for line in lines if line.startswith(f"fa-grid:{cell} "))


def test_change_against_the_median_of_the_reference_runs(tmp_path):
    base1 = write_run(tmp_path / "b1", {"hd128 S=1k": (100.0, 90.0, 120.0)})
    base2 = write_run(tmp_path / "b2", {"hd128 S=1k": (110.0, 100.0, 118.0)})
    base3 = write_run(tmp_path / "b3", {"hd128 S=1k": (102.0, 92.0, 119.0)})
    tree = write_run(tmp_path / "t1", {"hd128 S=1k": (112.2, 101.2, 121.0)})
    lines = compare(f"base.1={base1}", f"base.2={base2}", f"base.3={base3}", f"bn176.1={tree}",
                    "--ref", "base")
    row = line_of(lines, "hd128 S=1k")
    assert "102 / 92" in row  # the reference's median over its three runs
    assert "112 / 101 +10%" in row  # (112.2 / 102 + 101.2 / 92) / 2 = 1.10
    assert lines[-1] == "geomean against base (LSE off and on): bn176: +10.0%"


def test_failed_check_is_marked_and_left_out_of_the_geomean(tmp_path):
    base = write_run(tmp_path / "b", {"a": (100.0, 100.0, 1.0), "b": (100.0, 100.0, 1.0)})
    tree = write_run(tmp_path / "t", {"a": (None, 120.0, 1.0), "b": (80.0, 80.0, 1.0)})
    lines = compare(f"base={base}", f"tree={tree}", "--ref", "base")
    assert "FAIL / 120 +20%" in line_of(lines, "a")
    assert "80 / 80 -20%" in line_of(lines, "b")
    # geomean of 1.2, 0.8, 0.8 (the failed row is not a ratio): 0.768 ** (1 / 3) = 0.916
    assert lines[-1].endswith("tree: -8.4%")


def test_missing_run_is_reported_not_fatal(tmp_path):
    base = write_run(tmp_path / "b", {"a": (100.0, 100.0, 1.0)})
    lines = compare(f"base={base}", f"tree={tmp_path / 'absent'}", "--ref", "base")
    assert lines[0].startswith("tree: no results.json")
    assert "100 / 100" in line_of(lines, "a")
