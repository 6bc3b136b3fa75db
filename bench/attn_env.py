"""What a benchmark run records about where it ran: the commit (--commit, $HIPFLASH_COMMIT or
git), the command line with the library's HIPFLASH_* switches, and the run's meta data (GPU,
driver, CUDA, cuDNN, torch, Triton and hipflash versions) that heads results.json and results.md.
"""

import datetime
import os
import platform
import shlex
import subprocess
import sys

import torch

import attn_backends as ab

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sh(cmd, cwd=None):
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
        return r.stdout.strip() if r.returncode == 0 else ""
    except Exception:
        return ""


def git_commit(arg):
    if arg:
        return arg
    if os.environ.get("HIPFLASH_COMMIT"):
        return os.environ["HIPFLASH_COMMIT"]
    sha = _sh(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO)
    if not sha:
        return "unknown (no git; pass --commit or HIPFLASH_COMMIT)"
    dirty = _sh(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO)
    return sha + ("-dirty" if dirty else "")


def command_line(environ=os.environ, argv=None):
    """The command as run: the library's run-time switches (HIPFLASH_*, which change the kernels
    it picks) in front of the interpreter and its arguments. HIPFLASH_COMMIT is recorded apart."""
    switches = [f"{k}={v}" for k, v in sorted(environ.items())
                if k.startswith("HIPFLASH_") and k != "HIPFLASH_COMMIT"]
    words = [os.path.basename(sys.executable)] + (sys.argv if argv is None else argv)
    return " ".join(shlex.quote(a) for a in switches + words)


def collect_meta(args, device, hf_path):
    m = {"device": device, "suite": args.suite, "dtype": args.dtype,
         "command": command_line(),
         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
         "torch": torch.__version__, "python": platform.python_version(),
         "commit": git_commit(args.commit)}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        m["gpu"] = f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB" + \
            (f", L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB)"
             if getattr(p, "L2_cache_size", 0) else ")")
        m["cuda"] = torch.version.cuda or ""
        drv = _sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        m["driver"] = drv.splitlines()[0] if drv else "unknown (nvidia-smi not answering)"
        try:
            m["cudnn"] = str(torch.backends.cudnn.version())
        except Exception:
            pass
    else:
        m["gpu"] = f"none (CPU: {platform.processor() or platform.machine()}, " \
                   f"{os.cpu_count()} threads)"
    try:
        import triton
        m["triton"] = triton.__version__
    except Exception:
        pass
    try:
        hf = ab.import_hipflash(hf_path)
        info = getattr(hf, "build_info", lambda: "")()
        m["hipflash"] = f"{getattr(hf, '__version__', '?')} {info}".strip()
    except Exception as e:
        m["hipflash"] = f"not importable ({str(e)[:200]})"
    return m
