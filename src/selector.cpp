// hipflash — the pure kernel selector and the split heuristic.
#include "hipflash/detail/selector.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace hipflash {

std::string Arch::name() const {
  char buf[32];
  switch (vendor) {
    case nvidia: std::snprintf(buf, sizeof buf, "sm%d", version); return buf;
    case amd: std::snprintf(buf, sizeof buf, "gfx%x", version); return buf;
    case host: return "cpu";
  }
  return "unknown";
}

namespace {

/// Packed GQA decode on the head-group decode kernel (`hd`: the padded head dim)?
bool head_group_decode(const Problem& p, int hd, const Arch& arch, const BuildCaps& caps) {
  if (caps.decode_heads == HeadGroupDecode::off || !p.gqa_decode ||
      p.heads_kv < kDecodeHeadsPerBlock || hd > max_head_dim(KernelKind::decode_heads) ||
      arch.version != 90)
    return false;
  if (caps.decode_heads == HeadGroupDecode::always) return true;
  // Measured at hd128 only: hd64 runs it under HIPFLASH_DECODE_HEADS=1 alone.
  const int64_t tiles = p.batch * ((p.heads_kv + kDecodeHeadsPerBlock - 1) / kDecodeHeadsPerBlock);
  return hd == 128 && tiles >= kDecodeHeadsMinTiles && p.keys >= kDecodeHeadsMinKeys &&
         p.kv_heads_in_rows;
}

}  // namespace

Selection select_kernel(const Problem& p, const Arch& arch, const BuildCaps& caps) {
  Selection sel;
  const int hd = padded_head_dim(p.head_dim);
  if (hd == 0) {
    sel.reason = "head dim " + std::to_string(p.head_dim) +
                 " is not supported; supported head dims are " + supported_head_dims();
    return sel;
  }
  const bool fp8 = p.dtype == DType::e4m3;  // fp8 q, k and v (out bf16)
  if (p.dtype != DType::f16 && p.dtype != DType::bf16 && !fp8) {
    sel.reason = std::string("dtype ") + std::string(dtype_name(p.dtype)) + " is not supported";
    return sel;
  }
  const bool fp8_kv = p.kv_dtype == DType::e4m3;
  sel.key = KernelKey{p.dtype, hd, p.return_lse, p.masked, p.num_splits > 1,
                      fp8_kv ? DType::e4m3 : p.dtype};
  if (arch.vendor == Arch::host) {
    sel.kind = KernelKind::cpu_reference;
    return sel;
  }
  if (!caps.gpu || caps.gpu_vendor != arch.vendor) {
    sel.reason = "this hipflash build has no kernels for " + arch.name() +
                 " (configure with HIPFLASH_GPU=" + (arch.vendor == Arch::nvidia ? "cuda" : "hip") +
                 ")";
    return sel;
  }
  if (!head_dim_in_mask(caps.head_dim_mask, hd)) {
    sel.reason = "head dim " + std::to_string(p.head_dim) + " (kernel hd" + std::to_string(hd) +
                 ") was not built; reconfigure with HIPFLASH_HEAD_DIMS including " +
                 std::to_string(hd);
    return sel;
  }
  // A kernel that has a tile for the head dim and, for a KV cache, reads one (kernels.def).
  const auto serves = [&](KernelKind k) {
    return hd <= max_head_dim(k) && (!p.kv_cache || reads_kv_cache(k));
  };
  if (fp8) {
    // fp8 q, k and v: on NVIDIA the warp-specialised Hopper kernel's fp8 tiles (fp8 wgmma, V
    // transposed in shared memory) for dense and varlen calls whose tensors a TMA map
    // describes; on AMD the generic kernel's MFMA fp8 body (gfx94x, gfx950, dense calls;
    // compile-checked only). Neither adds ALiBi biases. Any other call runs on the bf16 kernel
    // the same call on bf16 copies of q, k and v selects (Problem::widened): slower than an
    // fp8 kernel, not refused.
    const bool amd_fp8 = arch.version == 0x940 || arch.version == 0x941 ||
                         arch.version == 0x942 || arch.version == 0x950;
    if (arch.vendor == Arch::nvidia && arch.version == 90 && caps.sm90_ws &&
        hd <= fp8_max_head_dim(KernelKind::sm90_ws) && !p.kv_cache && p.tma_compatible &&
        !p.alibi) {
      sel.kind = KernelKind::sm90_ws;
    } else if (arch.vendor == Arch::amd && amd_fp8 &&
               hd <= fp8_max_head_dim(KernelKind::generic) && !p.varlen && !p.kv_cache &&
               !p.alibi) {
      sel.kind = KernelKind::generic;
    } else if (p.widened != nullptr) {
      Selection wide = select_kernel(*p.widened, arch, caps);
      wide.widened_fp8 = wide.kind != KernelKind::unsupported;
      if (!wide.widened_fp8)
        wide.reason = "float8_e4m3fn q, k and v, widened to bfloat16 (no fp8 kernel takes this "
                      "call): " + wide.reason;
      return wide;
    } else {
      sel.reason = std::string("float8_e4m3fn q, k and v") +
                   (p.kv_cache ? " with a KV cache: pass bfloat16 or float16 queries (an fp8 "
                                 "cache takes them)"
                               : ": no fp8 kernel takes this call (" + arch.name() +
                                     ", head dim " + std::to_string(p.head_dim) + ")");
    }
    return sel;
  }
  if (arch.vendor == Arch::nvidia) {
    if (arch.version < 80) {
      sel.reason = arch.name() + " is not supported: the generic kernel needs sm_80 or newer";
      return sel;
    }
    // Few query rows per head (decode): the 16-row decode kernel. Otherwise Hopper (sm_90
    // exactly: wgmma does not exist on later archs) runs the TMA warp-specialised kernel for
    // dense and varlen calls whose tensors TMA can describe (but short varlen sequences at head
    // dim 64: kWsVarlenHd64MinMeanRows), the cp.async wgmma kernel for the rest up to head dim
    // 128 (odd strides), where they were built, and everything else the
    // generic mma.sync kernel. A KV cache is read only by the decode and generic loaders
    // (common::PagedRows, a compile-time choice of theirs): such calls never take an sm90 kernel.
    // Packed GQA decode with eight kv heads or more may take the head-group decode kernel, on
    // sm_90 at head dims 64 and 128 (its ring: 192 KiB of shared memory at 128, more than sm_8x
    // gives): where it was measured ahead by default (kDecodeHeadsMin*), every such call
    // with HIPFLASH_DECODE_HEADS=1.
    if (fp8_kv) {
      // An fp8 KV cache (widened by cvt, sm_89 and newer): the decode kernel for up to 16 query
      // rows per kv head, the generic kernel (K / V widened to q's dtype in shared memory) for
      // more — chunked prefill and varlen queries against the cache.
      if (arch.version < kFp8KvMinSm || !arch.fp8_cvt) {
        sel.reason = "an fp8 (float8_e4m3fn) KV cache needs sm_89+ machine code for the GPU (the "
                     "kernels convert it with cvt.e4m3x2): " + arch.name() +
                     (arch.version < kFp8KvMinSm ? std::string(" is older")
                                                 : std::string(" runs this build's code for an "
                                                               "older arch; rebuild with "
                                                               "HIPFLASH_CUDA_ARCHS including it"));
        return sel;
      }
      const KernelKind kind =
          p.query_rows <= kDecodeMaxRows ? KernelKind::decode : KernelKind::generic;
      if (!reads_fp8_kv_cache(kind) || !serves(kind)) {
        sel.reason = std::string("an fp8 (float8_e4m3fn) KV cache: the ") +
                     kernel_kind_name(kind) + " kernel this call needs does not read one at "
                     "head dim " + std::to_string(p.head_dim);
        return sel;
      }
      sel.kind = kind;
      return sel;
    }
    if (p.query_rows <= kDecodeMaxRows)
      sel.kind = head_group_decode(p, hd, arch, caps) ? KernelKind::decode_heads
                                                      : KernelKind::decode;
    else if (arch.version == 90 && caps.sm90_ws && serves(KernelKind::sm90_ws) &&
             p.tma_compatible &&
             !(p.varlen && hd == 64 && p.mean_query_rows < kWsVarlenHd64MinMeanRows &&
               caps.sm90))
      sel.kind = KernelKind::sm90_ws;
    else if (arch.version == 90 && caps.sm90 && serves(KernelKind::sm90))
      sel.kind = KernelKind::sm90;
    else
      sel.kind = KernelKind::generic;
    return sel;
  }
  if (p.kv_cache) {
    sel.reason = "a KV cache (flash_attn_with_kvcache, or varlen queries with a block_table): "
                 "the AMD kernels do not read one yet";
    return sel;
  }
  // AMD: CDNA2/CDNA3/CDNA4 have MFMA. gfx950 runs the dualwave kernel for head dims up to 128
  // where it was built, everything else the generic MFMA kernel (the decode kernel is mma.sync
  // only, so AMD decode runs these too).
  if (arch.version == 0x950 && caps.dualwave && serves(KernelKind::gfx950_dualwave)) {
    sel.kind = KernelKind::gfx950_dualwave;
    return sel;
  }
  if (arch.version == 0x90a || arch.version == 0x940 || arch.version == 0x941 ||
      arch.version == 0x942 || arch.version == 0x950) {
    sel.kind = KernelKind::generic;
    return sel;
  }
  sel.reason = arch.name() + " is not supported: the generic kernel needs MFMA (gfx90a, gfx94x, gfx950)";
  return sel;
}

int num_splits_heuristic(int64_t work_items, int64_t num_processors, int64_t blocks_per_processor,
                         int64_t num_key_blocks, int max_splits) {
  if (work_items <= 0 || num_processors <= 0 || num_key_blocks <= 1) return 1;
  const int64_t slots = num_processors * std::max<int64_t>(blocks_per_processor, 1);
  // Enough work for most of the resident slots already: splitting only adds the combine pass.
  if (work_items * 10 >= slots * 8) return 1;
  // At least four key blocks per split: shorter splits cost their share of the combine pass
  // (the partial rows written and read back) and of the pipeline's fill for little work.
  const int64_t limit = std::min<int64_t>({max_splits, num_key_blocks / 4, slots});
  if (limit <= 1) return 1;
  // The time of s splits in units of one work item's keys: ceil(items * s / slots) rounds of
  // the resident slots, each 1/s of an item long. Slots, not multiprocessors: one block alone
  // on a multiprocessor reads a paged cache at 0.87-0.90x of a contiguous one, two there at
  // 0.96-1.00x (H200, docs/design-decisions.md#split-k-and-combine), and paged and contiguous
  // calls must split alike (bitwise the same result, SPEC §7).
  auto cost = [&](int64_t s) {
    return double((work_items * s + slots - 1) / slots) / double(s);
  };
  double best = cost(1);
  for (int64_t s = 2; s <= limit; ++s) best = std::min(best, cost(s));
  // The fewest splits within 4% of the best: each split adds partial rows to write and combine.
  for (int64_t s = 1; s <= limit; ++s)
    if (cost(s) <= 1.04 * best) return int(s);
  return int(limit);
}

}  // namespace hipflash
