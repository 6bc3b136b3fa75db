#!/usr/bin/env python3
"""Where ptxas put the warpgroup-MMA waits of each kernel in an sm_90a cubin, without a
disassembler (the CPU machine has nvcc and ptxas but no cuobjdump / nvdisasm): for every
`wgmma.wait_group 1` (WARPGROUP.DEPBAR.LE gsb0, 0x1) the number of MUFU.EX2 instructions before
the next `wait_group 0`. In the forward's key loop those are the softmax's exponentials that run
while P V is still on the tensor cores; 0 means ptxas hoisted P V's wait above the softmax
(docs/design-decisions.md#fp8-forward). The TU is one a CUDA build generates (build-gpu:
scripts/gpu-check build).

Encodings read (sm_90a, 16-byte instructions, checked against `cuobjdump -sass` of the same
kernels): WARPGROUP.DEPBAR has 0x79c5 in the low 16 bits of the first word and bit 47 set (bit
47 clear: WARPGROUP.ARRIVE), its count in bits 8-15 of the second word; MUFU has opcode 0x308
(low 12 bits of the first word), EX2 being function 8 (bits 8-13 of the second word).

    nvcc -cubin -gencode arch=compute_90a,code=sm_90a -std=c++17 -O3 --use_fast_math \\
      --expt-relaxed-constexpr -DHIPFLASH_HAS_SM90_KERNELS=1 -DHIPFLASH_HEAD_DIM_MASK=3 \\
      -Iinclude -Ikernels -Isrc -x cu build-gpu/instantiations/fwd_sm90_ws_e4m3_hd128.cu \\
      -o /tmp/k.cubin
    python3 bench/probes/wgmma_waits.py /tmp/k.cubin [NAME_SUBSTRING]
"""
import struct
import subprocess
import sys


def sections(data):
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx][4]
    for name, _type, _flags, _addr, off, size in heads:
        yield data[strtab + name:data.index(b"\0", strtab + name)].decode(), off, size


def is_wait(w0, w1, count):
    return (w0 & 0xFFFF) == 0x79C5 and (w0 >> 47) & 1 and ((w1 >> 8) & 0xFF) == count


def is_ex2(w0, w1):
    return (w0 & 0xFFF) == 0x308 and ((w1 >> 8) & 0x3F) == 8


def main():
    data = open(sys.argv[1], "rb").read()
    want = sys.argv[2] if len(sys.argv) > 2 else ""
    for name, off, size in sections(data):
        if not name.startswith(".text.") or want not in name:
            continue
        ins = [struct.unpack_from("<QQ", data, off + i) for i in range(0, size, 16)]
        counts = []
        for i, (w0, w1) in enumerate(ins):
            if not is_wait(w0, w1, 1):
                continue
            j = next((k for k in range(i + 1, len(ins)) if is_wait(*ins[k], 0)), None)
            if j is not None:
                counts.append(sum(1 for k in range(i, j) if is_ex2(*ins[k])))
        kernel = subprocess.run(["c++filt"], input=name[len(".text."):], capture_output=True,
                                text=True).stdout.strip()
        print(f"{kernel[:150]}\n    MUFU.EX2 between each wait_group 1 and the next wait_group 0: "
              f"{counts}")


if __name__ == "__main__":
    main()
