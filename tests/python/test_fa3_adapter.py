"""scripts/fa3-tests' plugin (tests/fa3_adapter/fa3_plugin.py) on a stand-in for FlashAttention 3's
test file: its shims (flash_attn_interface is hipflash's FA3 module, FA2's rotary helper), the
deselected tests, NotImplementedError counted as a skip with hipflash's reason, the report."""
import json
import os
import subprocess
import sys
import textwrap

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

STAND_IN = textwrap.dedent('''
    import torch
    from flash_attn_interface import flash_attn_func
    from flash_attn.layers.rotary import apply_rotary_emb
    from test_util import helper  # the checkout's hopper/ is on sys.path

    def test_runs():
        q = torch.randn(1, 8, 2, 64).to(torch.bfloat16)
        assert flash_attn_func(q, q, q).shape == q.shape and helper() == 1

    def test_refused():
        q = torch.randn(1, 8, 2, 64).to(torch.bfloat16)
        flash_attn_func(q, q, q, qv=q)  # hipflash has no qv

    def test_fails():
        assert False

    def test_rotary_offsets():
        x = torch.randn(2, 5, 3, 8)
        cos, sin = torch.randn(20, 2), torch.randn(20, 2)
        whole = apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 4]))
        cu = torch.tensor([0, 5, 10], dtype=torch.int32)
        packed = apply_rotary_emb(x.reshape(10, 3, 8), cos, sin, cu_seqlens=cu,
                                  seqlen_offsets=torch.tensor([0, 4]))
        assert torch.equal(whole.reshape(10, 3, 8), packed)
        assert torch.equal(whole[..., 4:], x[..., 4:])  # past rotary_dim: untouched
        assert torch.equal(whole[0, 0], apply_rotary_emb(x, cos, sin)[0, 0])

    def test_flash3_bw_compatibility():
        assert False, "deselected"
''')


def test_plugin_counts_passed_failed_and_refused(tmp_path):
    hopper = tmp_path / "hopper"
    hopper.mkdir()
    (hopper / "test_flash_attn.py").write_text(STAND_IN)
    (hopper / "test_util.py").write_text("def helper():\n    return 1\n")
    (hopper / "flash_attn_interface.py").write_text("raise ImportError('the CUDA extension')\n")
    report = tmp_path / "report.json"
    build = os.environ.get("HIPFLASH_BUILD_DIR", "build")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, build, "python"), os.path.join(ROOT, "tests", "fa3_adapter")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "fa3_plugin", "--import-mode=importlib",
                        "-p", "no:cacheprovider", "--fa3-hopper", str(hopper), "--fa3-report",
                        str(report), "-q", "test_flash_attn.py"],
                       cwd=hopper, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr  # test_fails
    got = json.loads(report.read_text())
    assert got["by_test"] == {"test_runs": {"passed": 1}, "test_refused": {"skipped": 1},
                              "test_fails": {"failed": 1}, "test_rotary_offsets": {"passed": 1}}, got
    (reason, count), = got["skipped_by_reason"].items()
    assert count == 1 and reason.startswith("hipflash refuses: ") and "qv" in reason, reason
    assert any("test_flash3_bw_compatibility" in k for k in got["deselected"]), got
    assert "FlashAttention 3's tests against hipflash" in r.stdout
