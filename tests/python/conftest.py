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


# A build limited to some head dims (-DHIPFLASH_HEAD_DIMS, for fast iteration) refuses the others
# by name (the selector's "was not built" error). Its tests of those head dims are skipped with
# that reason rather than failed; a full build (CI's, scripts/gpu-check's) never raises it.
_NOT_BUILT = "was not built; reconfigure with HIPFLASH_HEAD_DIMS"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and call.excinfo is not None \
            and _NOT_BUILT in str(call.excinfo.value):
        report.outcome = "skipped"
        report.longrepr = (str(item.path if hasattr(item, "path") else item.fspath),
                           (item.location[1] or 0) + 1, f"Skipped: {call.excinfo.value}")
