"""hipflash as a Python package: setuptools drives the project's own CMake build.

    python3 -m venv --system-site-packages .venv          # Debian: sees python3-torch
    .venv/bin/pip install --no-build-isolation .

`--no-build-isolation` is required: the extension is compiled against the torch of the
interpreter that runs pip (an isolated build environment has no torch, and nothing may be
downloaded). The wheel holds python/hipflash/*.py and the module `hipflash._C` that CMake builds
into <cmake build>/python/hipflash/ (python/CMakeLists.txt).

Environment:
  HIPFLASH_CMAKE_ARGS     extra CMake arguments, shell-quoted, applied last, e.g.
                          "-DHIPFLASH_GPU=none" or "-DHIPFLASH_CUDA_ARCHS=90a -DHIPFLASH_HEAD_DIMS=128"
  HIPFLASH_JOBS           build jobs (else CMAKE_BUILD_PARALLEL_LEVEL, else `build_ext -j`,
                          else os.cpu_count())
  HIPFLASH_PIP_BUILD_DIR  where the build goes (default: build-pip/ in the source tree). CMake
                          builds in <it>/cmake-<python>-<hash of the interpreter and the CMake
                          arguments>, kept for incremental rebuilds; setuptools' own folders and
                          the egg-info go beside it.
"""

import hashlib
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent
BUILD_BASE = pathlib.Path(os.environ.get("HIPFLASH_PIP_BUILD_DIR", "").strip() or
                          ROOT / "build-pip").resolve()


def project_version():
    """The version of CMakeLists.txt's project() command: the one place it is written."""
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"project\s*\(\s*hipflash\s+VERSION\s+([0-9][0-9.]*)", text)
    if not m:
        raise RuntimeError("hipflash: no `project(hipflash VERSION x.y.z ...)` in CMakeLists.txt")
    return m.group(1)


def check_torch():
    """hipflash compiles against the torch of the interpreter that builds it: say so clearly
    when there is none (typically: an isolated build environment, without --no-build-isolation).

    torch is deliberately not an install requirement. The module works only with the torch it
    was built against, which a version requirement cannot reliably pin (a CUDA wheel's torch
    says 2.11.0+cu130 but pip sees it installed as 2.11.0, so `torch==2.11.0+cu130` is not
    found), and a requirement pip finds unsatisfied makes it try to download torch. The package
    imports torch first thing anyway."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"hipflash: {sys.executable} cannot import torch ({e}). hipflash is compiled against "
            "the torch of the interpreter that builds it: install torch first, then run "
            "`pip install --no-build-isolation .` with that interpreter (on Debian: a venv made "
            "with --system-site-packages, which sees python3-torch)."
        ) from None


def cmake_program():
    found = shutil.which("cmake")
    if found:
        return found
    try:  # the `cmake` wheel, if the interpreter has one
        import cmake

        return str(pathlib.Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except ImportError:
        raise RuntimeError("hipflash: cmake (>= 3.25) not found on PATH") from None


class CMakeExtension(Extension):
    """An extension module that CMake builds; setuptools only copies it."""

    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def run(self):
        for ext in self.extensions:
            self.build_cmake(ext)

    def jobs(self):
        for var in ("HIPFLASH_JOBS", "CMAKE_BUILD_PARALLEL_LEVEL"):
            if os.environ.get(var, "").strip():
                return int(os.environ[var])
        return self.parallel or os.cpu_count() or 1

    def build_cmake(self, ext):
        user_args = shlex.split(os.environ.get("HIPFLASH_CMAKE_ARGS", ""))
        args = [
            "-DCMAKE_BUILD_TYPE=" + ("Debug" if self.debug else "Release"),
            "-DHIPFLASH_BUILD_PYTHON=ON",
            "-DHIPFLASH_BUILD_TESTS=OFF",
            "-DHIPFLASH_BUILD_BENCH=OFF",
            "-DHIPFLASH_BUILD_TOOLS=OFF",
            "-DPython3_EXECUTABLE=" + sys.executable,
        ] + user_args  # last, so that they win

        # One folder per interpreter (a venv's torch is not another's) and per set of arguments:
        # a CMake cache never sees its backend or its torch change under it.
        key = "\n".join([sys.prefix, sys.executable] + args)
        tag = sysconfig.get_config_var("SOABI") or "py"
        build_dir = BUILD_BASE / f"cmake-{tag}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
        build_dir.mkdir(parents=True, exist_ok=True)

        cmake = cmake_program()
        generator = []
        if not (build_dir / "CMakeCache.txt").exists() and shutil.which("ninja"):
            generator = ["-G", "Ninja"]  # an existing folder keeps the generator it was made with
        self.announce(f"hipflash: configuring {build_dir}", level=2)
        subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir)] + generator + args,
                       check=True)
        subprocess.run([cmake, "--build", str(build_dir), "--target", "hipflash_python",
                        "-j", str(self.jobs())], check=True)

        # The module CMake wrote next to its copy of the package (_C.<SOABI>.so), to the place
        # setuptools installs it from (or to python/hipflash/ for an in-place build).
        built_pkg = build_dir / "python" / "hipflash"
        short = ext.name.rsplit(".", 1)[-1]
        modules = sorted(p for p in built_pkg.glob(short + ".*") if p.suffix in (".so", ".pyd"))
        if len(modules) != 1:
            raise RuntimeError(f"hipflash: expected one {short} module in {built_pkg}, "
                               f"found {[p.name for p in modules]}")
        dest = pathlib.Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.copy_file(str(modules[0]), str(dest))


check_torch()
BUILD_BASE.mkdir(parents=True, exist_ok=True)  # egg_info wants its egg_base to exist
setup(
    name="hipflash",
    version=project_version(),
    description="Flash-attention forward kernels (CPU, NVIDIA, AMD) that can also return the LSE",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.8",
    packages=["hipflash", "hipflash.compat", "hipflash.compat.flash_attn",
              "hipflash.compat.flash_attn.layers", "hipflash.integrations"],
    package_dir={"hipflash": "python/hipflash", "hipflash.compat": "python/hipflash/compat",
                 "hipflash.compat.flash_attn": "python/hipflash/compat/flash_attn",
                 "hipflash.compat.flash_attn.layers":
                     "python/hipflash/compat/flash_attn/layers",
                 "hipflash.integrations": "python/hipflash/integrations"},
    ext_modules=[CMakeExtension("hipflash._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
    # setuptools' own folders beside CMake's: not in build/ (scripts/test's CMake tree), and no
    # egg-info in python/.
    options={"build": {"build_base": str(BUILD_BASE)},
             "egg_info": {"egg_base": str(BUILD_BASE)}},
)
