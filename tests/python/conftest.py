"""pytest setup for the hipflash Python suite.

The package is imported from a CMake build tree (-DHIPFLASH_BUILD_PYTHON=ON):
$HIPFLASH_BUILD_DIR/python, by default <repo>/build/python.
"""
import os
import pathlib
import sys

import pytest

_REPO = pathlib.Path(__file__).resolve().parents[2]
_BUILD = pathlib.Path(os.environ.get("HIPFLASH_BUILD_DIR", _REPO / "build")).resolve()
sys.path.insert(0, str(_BUILD / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # reference.py

import torch  # noqa: E402

# The fp32 reference must be fp32 on GPUs too (no TF32 matmuls).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
if hasattr(torch, "set_float32_matmul_precision"):
    torch.set_float32_matmul_precision("highest")

try:
    import hipflash  # noqa: E402,F401
except ImportError as e:  # a clear message instead of a collection error per file
    raise pytest.UsageError(
        f"cannot import hipflash from {_BUILD / 'python'} ({e}); build with "
        "-DHIPFLASH_BUILD_PYTHON=ON and set HIPFLASH_BUILD_DIR to the build directory"
    )


def pytest_report_header(config):
    return f"hipflash {hipflash.__version__} from {hipflash.__file__}: {hipflash.build_info()}"
