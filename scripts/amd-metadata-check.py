#!/usr/bin/env python3
"""hipflash — what the AMD compile check verifies in a HIP build folder (scripts/compile-check).

    scripts/amd-metadata-check.py <build dir> "<arch>;<arch>..."

For every object of the hipflash library that carries device code (.hip_fatbin), and for every
arch given, it unbundles the arch's code object with the tools of the build's own clang
(clang-offload-bundler-N, llvm-readelf-N, llvm-objdump-N, llvm-nm-N, llvm-cxxfilt-N, N from
CMAKE_HIP_COMPILER=clang++-N) and reads:

  - the AMDGPU metadata note (llvm-readelf --notes): per kernel .vgpr_count, .agpr_count,
    .sgpr_count, .private_segment_fixed_size (scratch), .vgpr_spill_count, .sgpr_spill_count,
    .uses_dynamic_stack, .group_segment_fixed_size (static LDS), .max_flat_workgroup_size;
  - the disassembly (llvm-objdump -d): v_mfma instructions per kernel symbol (the kernels are
    compiled with -amdgpu-function-calls=false: everything they call is inlined into them);
  - the host side (llvm-nm): one __device_stub__ per kernel the TU instantiates.

It prints one row per (arch, kernel) and exits nonzero if
  - an arch is missing from an object's bundle, or a forward instantiation TU (fwd_*) has no
    kernels for an arch, or a kernel the host side launches has no code for an arch;
  - a kernel of a forward instantiation TU has no v_mfma instruction for an arch (it compiled
    to the trapping stub, or to scalar code) — except an architecture-specific schedule
    (ARCH_SPECIFIC: the gfx950 dualwave kernel) on the other archs, where it must be the stub;
    on its own arch it must also reach the occupancy its design needs (2 waves per SIMD);
  - a kernel of fp8 q, k and v (FwdTraits of DType e4m3) has no fp8 MFMA (v_mfma_*_fp8_fp8) on
    an arch with them (FP8_ARCHS), or is not the trapping stub (no MFMA) on one without;
  - a kernel uses scratch or spills: .private_segment_fixed_size > 0, a nonzero spill count, or
    a dynamic stack.

Occupancy (waves per SIMD) is the smallest of these limits, for gfx90a, gfx94x and gfx950:
  - VGPRs: 512 per lane per SIMD, arch and accumulation VGPRs from one file, allocated in
    granules of 8. .vgpr_count is that unified total (the arch VGPRs rounded up to 4, plus the
    AGPRs), so  waves_vgpr = floor(512 / roundup(.vgpr_count, 8)).
  - SGPRs: 800 per SIMD,  waves_sgpr = floor(800 / .sgpr_count)  (LLVM's table for gfx9).
  - LDS: 64 KiB per CU (160 KiB on gfx950), allocated in 512-byte granules, shared by the
    workgroups resident on the CU's 4 SIMDs. A workgroup of W = .max_flat_workgroup_size
    threads (the launch uses the kernel's launch bound) is ceil(W / 64) waves and needs
    L = roundup(static + dynamic LDS, 512) bytes, so
    waves_lds = floor(floor(LDS_per_CU / L) * ceil(W / 64) / 4).
  - the hardware: 8 waves per SIMD.
The metadata holds only static LDS; the forward kernels take theirs as dynamic shared memory,
whose size the launcher passes at launch (src/gpu/fwd_*_launch.hpp: Tile<hd>::kSmemBytes). This
script evaluates those constants by compiling a few lines host-only with the build's own
compile command (compile_commands.json), so a tile change shows up here without an edit; a
kernel whose dynamic LDS it does not know is shown with '?' and a warning.

Nothing is written outside a temporary folder.
"""
import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Per-arch resources (CDNA2/3/4): VGPRs per lane per SIMD (unified), LDS bytes per CU.
ARCHS = {
    "gfx90a": (512, 64 * 1024),
    "gfx940": (512, 64 * 1024),
    "gfx941": (512, 64 * 1024),
    "gfx942": (512, 64 * 1024),
    "gfx950": (512, 160 * 1024),
}
VGPR_GRANULE, SGPRS_PER_SIMD, LDS_GRANULE = 8, 800, 512
# Metadata keys every kernel must have: a missing one would read as 0 (no scratch, no spill).
REQUIRED = (".name", ".vgpr_count", ".agpr_count", ".sgpr_count", ".vgpr_spill_count",
            ".sgpr_spill_count", ".private_segment_fixed_size", ".group_segment_fixed_size",
            ".max_flat_workgroup_size")
MAX_WAVES_PER_SIMD, SIMDS_PER_CU, WAVE_SIZE = 8, 4, 64

# Dynamic LDS a kernel is launched with, by demangled kernel name: (regex, C++ expression of
# the regex's groups, header that defines it), evaluated by probe_constants(); kernels launched
# with none map to "0".
DYNAMIC_LDS = [
    (r"generic::fwd_generic_kernel<hipflash::FwdTraits<[^,]+, (\d+),",
     "hipflash::generic::Tile<{0}>::kSmemBytes", "generic/tile_config.hpp"),
    (r"gfx950::fwd_dualwave_kernel<hipflash::FwdTraits<[^,]+, (\d+),",
     "hipflash::gfx950::DualwaveTile<{0}>::kSmemBytes", "gfx950/dualwave_schedule.hpp"),
    (r"combine::combine_kernel<", "0", None),  # src/gpu/combine_launch.cu: <<<..., 0, stream>>>
    (r"merge::merge_kernel<", "0", None),  # src/gpu/merge_launch.cu: <<<..., 0, stream>>>
    (r"kvcache::append_kernel", "0", None),  # src/gpu/kvcache_launch.cu: <<<..., 0, stream>>>
]

# Architecture-specific schedules: compiled into every arch of a build (a trapping stub where the
# instructions do not exist, never selected there), so MFMA code is required on their arch only,
# and the stub must be one elsewhere. With the occupancy their design needs there.
ARCH_SPECIFIC = {"fwd_dualwave_": ("gfx950", 2)}  # kernel name prefix: (arch, min waves/SIMD)
FP8_ARCHS = ("gfx940", "gfx941", "gfx942", "gfx950")  # the archs with fp8 MFMA

failures = []


def fail(msg):
    failures.append(msg)
    print(f"amd-metadata-check: FAIL: {msg}", file=sys.stderr)


def run(cmd, **kw):
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True,
                          **kw).stdout


def cache_value(build, key):
    for line in (build / "CMakeCache.txt").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split("=", 1)[1]
    sys.exit(f"amd-metadata-check: {key} is not in {build}/CMakeCache.txt")


def parse_metadata(notes):
    """The kernels of llvm-readelf --notes' AMDGPU metadata (YAML): a list of {key: scalar}."""
    kernels, cur, in_kernels = [], None, False
    for line in notes.splitlines():
        if line.startswith("amdhsa.kernels:"):
            in_kernels = True
            continue
        if in_kernels and re.match(r"^\S", line):  # the next top-level key (or '...')
            in_kernels = False
        if not in_kernels:
            continue
        m = re.match(r"^  - \.(\w+):\s*(.*)$", line)  # the first key of a kernel
        if m:
            cur = {}
            kernels.append(cur)
        else:
            m = re.match(r"^    \.(\w+):\s*(.*)$", line)  # a key of the kernel (not nested)
        if m and cur is not None and m.group(2) != "":
            cur["." + m.group(1)] = m.group(2).strip()
    return kernels


def mfma_per_symbol(disasm, only=""):
    """v_mfma instructions per kernel symbol (those whose mnemonic contains `only`)."""
    counts, cur = {}, None
    for line in disasm.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if m:
            cur = m.group(1)
            counts.setdefault(cur, 0)
        elif cur is not None and re.search(r"\bv_mfma\w*" + re.escape(only), line):
            counts[cur] += 1
    return counts


def stub_to_kernel(mangled):
    """_ZN...33__device_stub__fwd_generic_kernelI... -> _ZN...18fwd_generic_kernelI..."""
    m = re.search(r"(\d+)__device_stub__", mangled)
    if not m:
        return None
    n = int(m.group(1))
    return mangled[: m.start()] + str(n - 15) + mangled[m.start() + len(m.group(1)) + 15:]


def dtype_names():
    text = (ROOT / "include/hipflash/types.hpp").read_text()
    m = re.search(r"enum class DType[^{]*\{([^}]*)\}", text)
    names = {}
    if m:
        for item in m.group(1).split(","):
            k = re.match(r"\s*(\w+)\s*=\s*(\d+)", item)
            if k:
                names[k.group(2)] = k.group(1)
    return names


def short_name(demangled, dtypes):
    """fwd_<kind>_<dtype>_hd<D>[_masked][_splitk|_lse] for FwdTraits kernels (the TU and
    last_kernel_name() spelling), else the demangled name without namespaces and arguments."""
    demangled = re.sub(r"^void ", "", demangled)
    m = re.match(r"(?:\w+::)*fwd_(\w+)_kernel<hipflash::FwdTraits<\(hipflash::DType\)(\d+), "
                 r"(\d+), (true|false), (true|false), (true|false)"
                 r"(?:, \(hipflash::DType\)(\d+))?>>\(", demangled)
    if m:
        kind, dt, hd, lse, masked, split, kv = m.groups()
        s = f"fwd_{kind}_{dtypes.get(dt, 'dtype' + dt)}"
        s += f"_kv{dtypes.get(kv, 'dtype' + kv)}" if kv not in (None, dt) else ""
        s += f"_hd{hd}"
        s += "_masked" if masked == "true" else ""
        s += "_splitk" if split == "true" else "_lse" if lse == "true" else ""
        return s
    s = re.sub(r"\(.*\)$", "", demangled)
    return re.sub(r"\b(?:hipflash|generic|combine|merge|kvcache|gpu)::", "", s)


def probe_constants(build, exprs, tmp):
    """Evaluates integer C++ constant expressions {name: (expr, header)} with the build's compile
    command of a HIP TU, host only, to LLVM IR. Returns {name: int}; {} if that fails."""
    if not exprs:
        return {}
    db = build / "compile_commands.json"
    if not db.exists():
        print(f"amd-metadata-check: WARNING: no {db} (configure with "
              "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON): dynamic LDS unknown", file=sys.stderr)
        return {}
    entry = next((e for e in json.loads(db.read_text())
                  if "/instantiations/fwd_" in e["file"]), None)
    if entry is None:
        return {}
    src, out = tmp / "probe.hip", tmp / "probe.ll"
    lines = [f'#include "{h}"' for h in sorted({h for _, h in exprs.values() if h})]
    lines += [f'extern "C" __attribute__((used)) const int {n} = ({e});'
              for n, (e, _) in exprs.items()]
    src.write_text("\n".join(lines) + "\n")
    args, cmd = shlex.split(entry["command"]), []
    skip = 0
    for a in args:
        if skip:
            skip -= 1
        elif a in ("-o", "-MT", "-MF"):
            skip = 1
        elif a in ("-c", "-MD", "-MMD", entry["file"]):
            pass
        else:
            cmd.append(a)
    cmd += ["--cuda-host-only", "-S", "-emit-llvm", "-w", "-o", str(out), str(src)]
    try:
        run(cmd, cwd=entry["directory"])
    except subprocess.CalledProcessError as e:
        print(f"amd-metadata-check: WARNING: evaluating the kernels' dynamic LDS failed "
              f"(update DYNAMIC_LDS in {Path(__file__).name}?):\n{e.stderr}", file=sys.stderr)
        return {}
    ir = out.read_text()
    return {n: int(v) for n, v in
            re.findall(r"^@(\w+) = [^\n]*?constant i32 (-?\d+)", ir, re.M)}


def occupancy(arch, vgprs, sgprs, lds, wg_size):
    vgpr_file, lds_per_cu = ARCHS[arch]
    limits = {"waves": MAX_WAVES_PER_SIMD}
    v = -(-max(vgprs, 1) // VGPR_GRANULE) * VGPR_GRANULE
    limits["vgpr"] = vgpr_file // v
    limits["sgpr"] = SGPRS_PER_SIMD // max(sgprs, 1)
    if lds is not None and lds > 0:
        per_wg = -(-lds // LDS_GRANULE) * LDS_GRANULE
        waves_per_wg = -(-wg_size // WAVE_SIZE)
        limits["lds"] = (lds_per_cu // per_wg) * waves_per_wg // SIMDS_PER_CU
    waves = min(limits.values())
    limiter = ",".join(k for k, w in limits.items() if w == waves and k != "waves") or "max"
    return waves, limiter


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build", type=Path)
    ap.add_argument("archs", help='";"-separated, e.g. "gfx942;gfx950"')
    a = ap.parse_args()
    build, archs = a.build.resolve(), [x for x in re.split(r"[;\s]+", a.archs) if x]
    for arch in archs:
        if arch not in ARCHS:
            sys.exit(f"amd-metadata-check: no occupancy model for {arch} (known: {list(ARCHS)})")
    compiler = cache_value(build, "CMAKE_HIP_COMPILER")
    m = re.search(r"clang\+\+-(\d+)$", compiler)
    if not m:
        sys.exit(f"amd-metadata-check: cannot tell the LLVM version of {compiler}")
    ver = m.group(1)
    tools = {}
    for t in ("clang-offload-bundler", "llvm-objcopy", "llvm-readelf", "llvm-objdump", "llvm-nm",
              "llvm-cxxfilt"):
        tools[t] = shutil.which(f"{t}-{ver}")
        if not tools[t]:
            sys.exit(f"amd-metadata-check: no {t}-{ver} (apt-get install llvm-{ver} "
                     f"clang-tools-{ver}; scripts/setup does)")

    objs = sorted((build / "CMakeFiles/hipflash.dir").rglob("*.o"))
    rows, n_fwd_tus = [], 0
    with tempfile.TemporaryDirectory() as tmpname:
        tmp = Path(tmpname)
        for obj in objs:
            fatbin = tmp / "fatbin"
            run([tools["llvm-objcopy"], "-O", "binary", "--only-section=.hip_fatbin", obj, fatbin])
            if fatbin.stat().st_size == 0:
                continue  # a host-only (CXX) object
            tu = obj.name.removesuffix(".o")
            forward = tu.startswith("fwd_")
            n_fwd_tus += forward
            stubs = {stub_to_kernel(s.split()[-1])
                     for s in run([tools["llvm-nm"], "--defined-only", obj]).splitlines()
                     if "__device_stub__" in s} - {None}
            targets = run([tools["clang-offload-bundler"], "-list", "-type=o",
                           f"-input={fatbin}"]).split()
            for arch in archs:
                target = next((t for t in targets
                               if re.search(rf"^hip\w*-amdgcn-amd-amdhsa-\w*-{arch}(:|$)", t)),
                              None)
                if target is None:
                    fail(f"{tu}: no {arch} code object in the bundle ({' '.join(targets)})")
                    continue
                co = tmp / f"{arch}.co"
                run([tools["clang-offload-bundler"], "-unbundle", "-type=o", f"-input={fatbin}",
                     f"-targets={target}", f"-output={co}"])
                kernels = parse_metadata(run([tools["llvm-readelf"], "--notes", co]))
                disasm = run([tools["llvm-objdump"], "-d", co])
                mfma = mfma_per_symbol(disasm)
                mfma_fp8 = mfma_per_symbol(disasm, "fp8_fp8")
                if forward and not kernels:
                    fail(f"{tu}: no kernels for {arch}")
                for missing in sorted(stubs - {k.get(".name") for k in kernels}):
                    fail(f"{tu}: {arch}: no code for {missing}, which the host side launches")
                for k in kernels:
                    missing = [key for key in REQUIRED if key not in k]
                    if missing:
                        fail(f"{tu}: {arch}: kernel {k.get('.name', '?')} has no "
                             f"{' '.join(missing)} in its metadata")
                        continue
                    rows.append((arch, tu, forward, k, mfma.get(k[".name"], 0),
                                 mfma_fp8.get(k[".name"], 0)))

        # Names, and the dynamic LDS each kernel is launched with.
        names = sorted({r[3][".name"] for r in rows})
        demangled = dict(zip(names, run([tools["llvm-cxxfilt"]], input="\n".join(names))
                             .splitlines())) if names else {}
        exprs, dyn_of, key_of = {}, {}, {}
        for name in names:
            for rx, expr, header in DYNAMIC_LDS:
                mm = re.search(rx, demangled[name])
                if mm:
                    e = expr.format(*mm.groups())
                    key = key_of.setdefault(e, f"hipflash_probe_{len(key_of)}")
                    exprs[key], dyn_of[name] = (e, header), key
                    break
        values = probe_constants(build, exprs, tmp)

    dtypes = dtype_names()
    hdr = ("arch", "kernel", "VGPR", "AGPR", "SGPR", "scratch", "LDS", "WG", "waves/SIMD",
           "MFMA", "TU")
    table = []
    unknown_lds = set()
    rows.sort(key=lambda r: (r[0], r[1], short_name(demangled[r[3][".name"]], dtypes)))
    for arch, tu, forward, k, n_mfma, n_fp8 in rows:
        name = k[".name"]
        g = lambda key: int(k.get(key, 0))  # noqa: E731
        vgpr, agpr, sgpr = g(".vgpr_count"), g(".agpr_count"), g(".sgpr_count")
        scratch, static_lds, wg = (g(".private_segment_fixed_size"),
                                   g(".group_segment_fixed_size"), g(".max_flat_workgroup_size"))
        dyn = values.get(dyn_of.get(name))
        if dyn is None:
            unknown_lds.add(short_name(demangled[name], dtypes))
            lds, lds_txt = None, f"{static_lds}+?"
        else:
            lds, lds_txt = static_lds + dyn, str(static_lds + dyn)
        waves, limiter = occupancy(arch, vgpr, sgpr, lds if lds is not None else static_lds, wg)
        spills = g(".vgpr_spill_count") + g(".sgpr_spill_count")
        dyn_stack = k.get(".uses_dynamic_stack", "false") == "true"
        short = short_name(demangled[name], dtypes)
        if scratch > 0 or spills > 0 or dyn_stack:
            fail(f"{arch} {short}: scratch {scratch} bytes, {g('.vgpr_spill_count')} VGPR and "
                 f"{g('.sgpr_spill_count')} SGPR spills, dynamic stack {dyn_stack}")
        only = next((v for k_, v in ARCH_SPECIFIC.items() if short.startswith(k_)), None)
        fp8 = forward and "_e4m3_" in tu  # the fp8 instantiation TUs (fwd_<kernel>_e4m3_hd<D>)
        if fp8 and arch not in FP8_ARCHS:
            if n_mfma != 0:
                fail(f"{arch} {short}: {n_mfma} v_mfma instructions in what must be the stub of "
                     "an arch without fp8 MFMA")
        elif only and arch != only[0]:
            if n_mfma != 0:
                fail(f"{arch} {short}: {n_mfma} v_mfma instructions in what must be the {only[0]}-only stub")
        elif forward and n_mfma == 0:
            fail(f"{arch} {short} ({tu}): no v_mfma instruction")
        elif fp8 and n_fp8 == 0:
            fail(f"{arch} {short} ({tu}): fp8 q, k, v but no fp8 MFMA (v_mfma_*_fp8_fp8)")
        elif only and waves < only[1]:
            fail(f"{arch} {short}: {waves} waves per SIMD ({limiter}), the design needs {only[1]}")
        table.append((arch, short, str(vgpr - agpr), str(agpr), str(sgpr), str(scratch), lds_txt,
                      str(wg), f"{waves}{'' if lds is not None else '?'} ({limiter})",
                      str(n_mfma), tu.removesuffix(".cu")))

    widths = [max(len(x) for x in col) for col in zip(hdr, *table)] if table else []
    right = {2, 3, 4, 5, 6, 7, 9}
    for row in [hdr] + table:
        print("  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    if unknown_lds:
        print("amd-metadata-check: WARNING: dynamic LDS unknown for "
              f"{', '.join(sorted(unknown_lds))}: occupancy from static LDS only ('?')",
              file=sys.stderr)
    print("  VGPR = arch VGPRs (.vgpr_count - .agpr_count); LDS = static + dynamic bytes per\n"
          "  workgroup; WG = threads per workgroup; MFMA = v_mfma instructions in the kernel")
    n_fwd = sum(1 for r in rows if r[2])
    if n_fwd_tus == 0:
        fail(f"no forward instantiation objects under {build}/CMakeFiles/hipflash.dir")
    if failures:
        print(f"amd-metadata-check: {len(failures)} failure(s) in {build.name} "
              f"({';'.join(archs)})", file=sys.stderr)
        return 1
    print(f"amd-metadata-check: {build.name} (clang {ver}): {len(archs)} archs "
          f"({', '.join(archs)}) x {len(table) // len(archs)} kernels ({n_fwd // len(archs)} "
          f"forward, from {n_fwd_tus} TUs): every forward kernel has MFMA code (fp8 ones fp8 MFMA), none uses "
          f"scratch or spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
