"""The benchmark's cells and suites: a Cell is one problem shape (dense or varlen, its head
counts, dtype, causal mask, FLOP and byte counts) with the backends to time on it, and the suite
builders (fa_grid, decode, serving, host_overhead, varlen, build_suite) make the lists of cells
that attn_bench.py --suite NAME runs, with the backend groups each suite compares.
"""

import math
import random
from dataclasses import dataclass, field
from typing import List, Optional

import torch

import attn_report as rep
from attn_ref import attn_flops, kv_bytes, valid_pairs

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
HF = ["hipflash", "hipflash+lse"]
DENSE_PEERS = ["torch-flash", "torch-cudnn", "torch-efficient"]
DECODE_PEERS = ["fa2-native", "cudnn-sdpa-gqa", "torch-flash", "torch-cudnn", "torch-efficient"]
# The decode suite's layout-for-layout pair: hipflash on cuDNN's [B, Hkv, Sk, D] memory, cuDNN on
# hipflash's [B, Sk, Hkv, D] (each through a view; the headline ratios stay each in its own).
DECODE_LAYOUTS = ["hipflash+lse-bhsd", "cudnn-sdpa-gqa-bshd"]
VARLEN_PEERS = ["fa2-native", "efficient-varlen"]
LSE_OVERHEAD = ["hipflash", "hipflash+lse", "torch-cudnn-nolse", "torch-cudnn",
                "torch-efficient-nolse", "torch-efficient"]
# fa2-native has no LSE switch (aten._flash_attention_forward always returns the LSE).
HOST_OVERHEAD = HF + ["fa2-native", "torch-cudnn-nolse", "torch-cudnn"]
# The serving suite: contiguous (the plain forward) vs paged caches, all with the LSE.
SERVING = ["hipflash+lse", "hipflash-paged1", "hipflash-paged16", "hipflash-paged256", "fa2-native"]
# The fp8 KV cache against the 16-bit one (issue 43): the same K/V values, both with the LSE.
DECODE_FP8 = ["hipflash+lse", "hipflash-fp8kv"]
# bf16 hipflash, cuDNN and FA2 beside it
FWD_FP8 = ["hipflash", "hipflash-fp8", "torch-flash", "torch-cudnn"]
HOST = rep.HOST  # the suite whose cells also get the host timing (Timer.host)


@dataclass
class Cell:
    suite: str
    kind: str            # "dense" or "varlen"
    B: int
    Sq: int
    Sk: int
    Hq: int
    Hkv: int
    D: int
    causal: bool
    dtype: str
    backends: List[str]
    label: str = ""      # row name in the tables
    group: str = ""      # subplot
    xlabel: str = ""     # x tick in the subplot
    cu_q: Optional[List[int]] = None
    cu_k: Optional[List[int]] = None
    seed: int = 0
    flops: int = 0
    kvbytes: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.D)

    @property
    def total_q(self):
        return self.cu_q[-1]

    @property
    def total_k(self):
        return self.cu_k[-1]

    @property
    def max_q(self):
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:]))

    @property
    def max_k(self):
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:]))

    @property
    def id(self):
        return f"{self.suite}:{self.label}"

    def finish(self):
        if self.kind == "varlen":
            pairs = sum(valid_pairs(q1 - q0, k1 - k0, self.causal)
                        for q0, q1, k0, k1 in zip(self.cu_q, self.cu_q[1:], self.cu_k, self.cu_k[1:]))
            self.flops = attn_flops(1, self.Hq, self.D, pairs)
            self.kvbytes = kv_bytes(1, self.Hkv, self.total_k, self.D)
        else:
            self.flops = attn_flops(self.B, self.Hq, self.D,
                                    valid_pairs(self.Sq, self.Sk, self.causal))
            self.kvbytes = kv_bytes(self.B, self.Hkv, self.Sk, self.D)
        return self


def _k(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def fa_grid(seqlens, dims, causals, dtype, backends, suite="fa-grid"):
    """FlashAttention's benchmark grid: B*S = 16k tokens, H*D = 2048."""
    cells = []
    for D in dims:
        for causal in causals:
            for S in seqlens:
                B, H = 16384 // S, 2048 // D
                cm = " causal" if causal else ""
                cells.append(Cell(suite, "dense", B, S, S, H, H, D, causal, dtype, list(backends),
                                  label=f"hd{D} S={_k(S)}{cm}",
                                  group=f"head dim {D}, {'causal' if causal else 'non-causal'}",
                                  xlabel=_k(S)).finish())
    return cells


def decode(seqlens_k, batches, dtype, backends, suite="decode", D=128):
    """Decode: one query token, GQA 32 query heads over 8 KV heads, D 128 (the issue's; another
    head dim is named in the labels)."""
    cells = []
    hd = "" if D == 128 else f" hd{D}"
    for B in batches:
        for Sk in seqlens_k:
            cells.append(Cell(suite, "dense", B, 1, Sk, 32, 8, D, False, dtype, list(backends),
                              label=f"B={B} Sk={_k(Sk)}{hd}", group=f"batch {B}",
                              xlabel=_k(Sk)).finish())
    return cells


def serving(seqlens_k, batches, dtype, backends, suite="serving", D=128):
    """Decode against a KV cache (Sq 1, GQA 32/8, D 128, LSE on): the contiguous cache (the
    plain forward, whose decode kernel reads the same row source) against paged caches of 1-,
    16- and 256-row pages (hipflash.flash_attn_with_kvcache with a block table)."""
    return decode(seqlens_k, batches, dtype, backends, suite, D)


def host_overhead(dtype, backends, decode_batches, decode_shape=(4096, 32, 8, 128)):
    """Host overhead per call: a tiny dense problem (B 1, S 128, 8 heads, D 64: a few µs of GPU
    work, so issuing the call is what costs) and decode at the decode suite's shape (Sk, Hq, Hkv,
    D) = decode_shape for each batch. One plot, a bar group per cell."""
    Sk, Hq, Hkv, D = decode_shape
    cells = [Cell(HOST, "dense", 1, 128, 128, 8, 8, 64, False, dtype, list(backends),
                  label="dense B=1 S=128 hd64")]
    cells += [Cell(HOST, "dense", B, 1, Sk, Hq, Hkv, D, False, dtype, list(backends),
                   label=f"decode B={B} Sk={_k(Sk)}") for B in decode_batches]
    for c in cells:
        c.xlabel = c.label
        c.finish()
    return cells


def varlen_lengths(total, lo, hi, seed):
    """Deterministic mixed lengths in [lo, hi] summing to `total`."""
    rng = random.Random(seed)
    lens = []
    while sum(lens) < total:
        lens.append(min(rng.randint(lo, hi), total - sum(lens)))
    return lens


def varlen(configs, dims, causals, dtype, backends, suite="varlen"):
    cells = []
    for name, total, lo, hi in configs:
        lens = varlen_lengths(total, lo, hi, seed=len(name) * 7919 + total)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        for D in dims:
            for causal in causals:
                H = 2048 // D
                cm = " causal" if causal else ""
                c = Cell(suite, "varlen", len(lens), max(lens), max(lens), H, H, D, causal,
                         dtype, list(backends),
                         label=f"{name} hd{D}{cm}", group="", cu_q=list(cu), cu_k=list(cu),
                         xlabel=f"{name}\nhd{D}{cm}")
                c.extra["seqlens"] = f"{len(lens)} seqs, {min(lens)}..{max(lens)}, total {total}"
                cells.append(c.finish())
    return cells


def build_suite(name, dtype, flex, decode_dim=128):
    """Cells of a suite. flex: include FlexAttention on the fa-grid cells of head dim 128.
    decode_dim: the head dim of the decode and serving suites' cells."""
    def with_flex(cells):
        for c in cells:
            if c.D == 128:
                c.backends.append("flex")
        return cells

    full_grid = fa_grid([512, 1024, 2048, 4096, 8192, 16384], [64, 128], [False, True], dtype,
                        HF + DENSE_PEERS)
    full_decode = decode([4096, 8192, 16384, 32768, 65536, 131072], [1, 8, 32], dtype,
                         HF + DECODE_PEERS + DECODE_LAYOUTS, D=decode_dim)
    full_varlen = varlen([("mixed 128..4k", 16384, 128, 4096), ("short 16..512", 16384, 16, 512)],
                         [64, 128], [False, True], dtype, HF + VARLEN_PEERS)
    full_lse = (fa_grid([1024, 4096, 16384], [128], [False], dtype, LSE_OVERHEAD, "lse-overhead")
                + decode([32768], [8], dtype, LSE_OVERHEAD, "lse-overhead"))
    # Head dims outside the FA grid that the Hopper issue names (96 and 256, against FA2).
    head_dims = fa_grid([1024, 4096, 16384], [96, 256], [False, True], dtype, HF + DENSE_PEERS,
                        "head-dims")
    if name == "fa-grid":
        return with_flex(full_grid) if flex else full_grid
    if name == "head-dims":
        return head_dims
    if name == "dev":  # kernel work on Hopper: part of the grid, hd96 and hd256, < 1 min
        return fa_grid([1024, 4096, 16384], [64, 128], [False, True], dtype, HF + DENSE_PEERS) \
            + fa_grid([4096], [96, 256], [False, True], dtype, HF + DENSE_PEERS, "head-dims") \
            + fa_grid([4096], [128], [False], dtype, LSE_OVERHEAD, "lse-overhead")
    if name == "decode":
        return full_decode
    if name == "serving":  # run on its own (not part of full): paged KV-cache decode
        return serving([4096, 8192, 16384, 32768, 65536], [1, 8, 32], dtype, SERVING,
                       D=decode_dim)
    if name == "decode-fp8":  # run on its own: the fp8 KV cache, cells of e4m3 values
        cells = decode([4096, 16384, 32768, 65536, 131072], [1, 8, 32], dtype, DECODE_FP8,
                       "decode-fp8", D=decode_dim)
        for c in cells:
            c.extra["e4m3_kv"] = True
        return cells
    if name == "fwd-fp8":  # run on its own: fp8 q, k, v on the FA grid, cells of e4m3 values
        cells = fa_grid([512, 1024, 2048, 4096, 8192, 16384], [64, 128], [False, True], dtype,
                        FWD_FP8, "fwd-fp8")
        for c in cells:
            c.extra["e4m3_qkv"] = True
        return cells
    if name == "varlen":
        return full_varlen
    full_host = host_overhead(dtype, HOST_OVERHEAD, [1, 8])
    if name == "lse-overhead":
        return full_lse
    if name == HOST:
        return full_host
    if name == "full":
        return (with_flex(full_grid) if flex else full_grid) + head_dims + full_decode \
            + full_varlen + full_lse + full_host
    if name == "quick":
        grid = fa_grid([1024, 4096, 16384], [64, 128], [False, True], dtype, HF + DENSE_PEERS)
        return (with_flex(grid) if flex else grid) \
            + decode([8192, 131072], [1, 32], dtype, HF + DECODE_PEERS) \
            + varlen([("mixed 128..4k", 16384, 128, 4096)], [128], [False, True], dtype,
                     HF + VARLEN_PEERS) \
            + fa_grid([4096], [128], [False], dtype, LSE_OVERHEAD, "lse-overhead") \
            + decode([32768], [8], dtype, LSE_OVERHEAD, "lse-overhead") \
            + host_overhead(dtype, HOST_OVERHEAD, [1])
    if name == "tiny":  # CPU: every suite kind and code path, at toy sizes
        peers = ["torch-sdpa", "torch-math"]
        cells = []
        for causal in (False, True):
            for S in (128, 256):
                cells.append(Cell("fa-grid", "dense", 2, S, S, 4, 4, 64, causal, dtype,
                                  HF + peers, label=f"hd64 S={S}{' causal' if causal else ''}",
                                  group=f"head dim 64, {'causal' if causal else 'non-causal'}",
                                  xlabel=str(S)).finish())
        for Sk in (512, 1024):
            cells.append(Cell("decode", "dense", 2, 1, Sk, 8, 2, 64, False, dtype,
                              HF + DECODE_LAYOUTS[:1] + peers,
                              label=f"B=2 Sk={Sk}", group="batch 2", xlabel=str(Sk)).finish())
        cells += varlen([("mixed 16..200", 600, 16, 200)], [64], [False, True], dtype,
                        HF + ["torch-math"])
        cells.append(Cell("serving", "dense", 2, 1, 512, 8, 2, 64, False, dtype,
                          SERVING[:3] + ["torch-math"], label="B=2 Sk=512", group="batch 2",
                          xlabel="512").finish())
        fp8 = Cell("fwd-fp8", "dense", 2, 256, 256, 4, 4, 64, True, dtype,
                   ["hipflash", "hipflash-fp8", "torch-math"], label="hd64 S=256 causal",
                   group="head dim 64, causal", xlabel="256").finish()
        fp8.extra["e4m3_qkv"] = True
        cells.append(fp8)
        lse = Cell("lse-overhead", "dense", 2, 256, 256, 4, 4, 64, False, dtype,
                   ["hipflash", "hipflash+lse", "torch-sdpa", "torch-math"], label="hd64 S=256",
                   xlabel="256").finish()
        return cells + [lse] + host_overhead(dtype, HF + peers, [1], decode_shape=(512, 8, 2, 64))
    raise SystemExit(f"unknown suite {name!r}")
