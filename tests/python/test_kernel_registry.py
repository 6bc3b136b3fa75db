"""The kernel registry (include/hipflash/detail/kernels.def) and what is derived from it outside
C++: docs/architecture.md's kernel table, and CMake's instantiation list (read back from a
configured build's generated TUs when one is at HIPFLASH_BUILD_DIR)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kernel-table"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_docs_table_is_the_registrys():
    r = _run("--check")
    assert r.returncode == 0, r.stderr


def test_table_lists_every_kernel_kind():
    kinds = re.findall(r"^HIPFLASH_KERNEL\((\w+),", (ROOT / "include/hipflash/detail/kernels.def")
                       .read_text(), re.M)
    table = _run().stdout
    assert kinds and all(f"| `{k}` |" in table for k in kinds)


def test_stale_table_is_reported(tmp_path, monkeypatch):
    # The check compares, not just finds the markers: a table edited by hand fails it.
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("kernel_table", str(SCRIPT))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("kernel_table", loader))
    loader.exec_module(mod)
    doc = tmp_path / "architecture.md"
    doc.write_text(f"x\n{mod.BEGIN}\n| stale |\n{mod.END}\ny\n")
    monkeypatch.setattr(mod, "DOC", doc)
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    assert mod.main(["kernel-table", "--check"]) == 1
    assert mod.main(["kernel-table", "--write"]) == 0
    assert mod.main(["kernel-table", "--check"]) == 0
    assert doc.read_text().startswith("x\n") and doc.read_text().endswith("y\n")


def test_cmake_instantiates_the_registered_kernels():
    build = Path(os.environ.get("HIPFLASH_BUILD_DIR", ROOT / "build"))
    gen = build / "instantiations"
    if not gen.is_dir():
        pytest.skip(f"no GPU build at {build} (a CPU build generates no instantiation TUs)")
    launchers = set(re.findall(r"^HIPFLASH_KERNEL\(\w+, (\w+),",
                               (ROOT / "include/hipflash/detail/kernels.def").read_text(), re.M))
    # fwd_<launcher>[_kv8]_<dtype>_hd<D>.cu (kv8: the fp8 KV cache's instantiation; e4m3: fp8 q/k/v)
    files = [f.name for f in gen.glob("fwd_*.cu")]
    names = [re.match(r"fwd_(\w+?)(?:_kv8)?_(?:f16|bf16|e4m3)_hd\d+\.cu$", f) for f in files]
    assert all(names), [f for f, m in zip(files, names) if not m]
    built = {m[1] for m in names}
    assert built and built <= launchers, built - launchers
    assert "generic" in built
