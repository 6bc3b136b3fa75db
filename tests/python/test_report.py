"""bench/make_report.py: the issues' target lines of docs/benchmarks.md, from synthetic rows
whose ratios are known (the report itself needs no torch and no GPU)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import make_report  # noqa: E402


def cell(suite, label, values, D=128, metric="tflops"):
    """Rows of one cell: {backend: value}; None is a failed check (status ok, never a figure)."""
    rows = []
    for backend, v in values.items():
        rows.append({"suite": suite, "cell": f"{suite}:{label}", "label": label, "D": D,
                     "causal": False, "Sq": 1024, "backend": backend,
                     "status": "ok" if v is not None else "FAIL", metric: v})
    return rows


def test_cudnn_line_geomean_and_cells_below_the_floor():
    rows = (cell("fa-grid", "hd64 S=512", {"hipflash+lse": 80.0, "torch-cudnn": 100.0})
            + cell("fa-grid", "hd64 S=1k", {"hipflash+lse": 125.0, "torch-cudnn": 100.0})
            + cell("fa-grid", "hd64 S=2k", {"hipflash+lse": None, "torch-cudnn": 100.0}))
    lines = make_report.peer_target_lines(rows)
    line = next(x for x in lines if "vs torch-cudnn" in x)
    # sqrt(0.8 * 1.25) = 1.00; the failed cell counts nowhere; 0.80x is below the floor.
    assert "geomean 1.00x over 2 cells" in line
    assert "1 below 0.90x (hd64 S=512 0.80x)" in line
    assert "1 at 1.05x or more" in line
    assert line.endswith("not met.")


def test_cudnn_line_met_and_head_dims_against_flash():
    rows = (cell("fa-grid", "hd128 S=4k", {"hipflash+lse": 95.0, "torch-cudnn": 100.0})
            + cell("fa-grid", "hd128 S=8k", {"hipflash+lse": 110.0, "torch-cudnn": 100.0})
            + cell("head-dims", "hd96 S=1k", {"hipflash+lse": 90.0, "torch-flash": 100.0}, D=96)
            + cell("head-dims", "hd256 S=1k", {"hipflash+lse": 130.0, "torch-flash": 100.0},
                   D=256))
    lines = make_report.peer_target_lines(rows)
    assert next(x for x in lines if "vs torch-cudnn" in x).endswith("; met.")
    dims = next(x for x in lines if "head dims 96 and 256" in x)
    assert "1 of 2 cells met, lowest 0.900x (hd96 S=1k); below 1.00x: hd96 S=1k 0.900x." in dims


def test_decode_line_takes_the_faster_cudnn():
    rows = (cell("decode", "B=1 Sk=4k", {"hipflash+lse": 100.0, "torch-cudnn": 90.0,
                                         "cudnn-sdpa-gqa": 125.0}, metric="gbps")
            + cell("decode", "B=8 Sk=4k", {"hipflash+lse": 100.0, "torch-cudnn": 80.0,
                                           "cudnn-sdpa-gqa": None}, metric="gbps"))
    line = next(x for x in make_report.peer_target_lines(rows) if x.startswith("**decode"))
    assert "1 of 2 cells met" in line and "lowest 0.800x (B=1 Sk=4k)" in line
    assert "geomean 1.00x" in line  # sqrt(0.8 * 1.25)


def test_decode_lines_layout_for_layout_and_a_ratio_just_below_one():
    # hipflash+lse in its own layout against every cuDNN (the bshd one included); then each
    # layout on its own: hipflash+lse-bhsd against the bhsd cuDNNs, hipflash+lse against the
    # bshd one. 0.99996x must not read as 1.000x (nor 1.0000x) among the cells below 1.00x.
    rows = (cell("decode", "B=32 Sk=64k", {"hipflash+lse": 99.996, "cudnn-sdpa-gqa": 100.0,
                                           "torch-cudnn": 99.0, "hipflash+lse-bhsd": 101.0,
                                           "cudnn-sdpa-gqa-bshd": 98.0}, metric="gbps")
            + cell("decode", "B=1 Sk=4k", {"hipflash+lse": 100.0, "cudnn-sdpa-gqa": 90.0,
                                           "hipflash+lse-bhsd": 80.0,
                                           "cudnn-sdpa-gqa-bshd": 125.0}, metric="gbps"))
    lines = [x for x in make_report.peer_target_lines(rows) if x.startswith("**decode")]
    head, bhsd, bshd = lines
    assert "0 of 2 cells met" in head and "B=32 Sk=64k 0.99996x" in head
    assert "B=1 Sk=4k 0.800x" in head  # the bshd cuDNN is the fastest cuDNN there
    assert "[B, Hkv, Sk, D]" in bhsd and "1 of 2 cells met" in bhsd
    assert "below 1.00x: B=1 Sk=4k 0.889x." in bhsd  # 80 / 90: the bshd cuDNN is not its peer
    assert "[B, Sk, Hkv, D]" in bshd and "1 of 2 cells met, geomean 0.90x" in bshd
    assert "B=32 Sk=64k" not in bshd.split("below")[1]  # 99.996 / 98 is ahead


def test_fp8_wall_clock_table_gives_the_speedup_over_bf16():
    import attn_report
    rows = []
    for label, t_bf16, t_fp8 in (("hd128 S=4k", 100.0, 50.0), ("hd128 S=8k", 400.0, 320.0)):
        for backend, b2b, sync in (("hipflash", t_bf16, t_bf16 + 10), ("hipflash-fp8", t_fp8, t_fp8 + 10),
                                   ("torch-cudnn", 90.0, 95.0)):
            rows.append({"suite": "fwd-fp8", "cell": f"fwd-fp8:{label}", "label": label,
                         "D": 128, "backend": backend, "status": "ok", "b2b_us": b2b,
                         "sync_us": sync, "peer": backend.startswith("torch")})
    header, body, foot = attn_report.wall_clock_table(rows, "fwd-fp8")
    assert header[-1] == "fp8/hipflash" and "hf+lse / best lse peer" not in header
    assert body[0][-1] == "2.00x / 1.83x" and body[1][-1] == "1.25x / 1.24x"
    assert foot[0][-1] == "1.58x"  # sqrt(2 * 1.25)
