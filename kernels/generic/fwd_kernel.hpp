// hipflash — the generic tiled flash-attention forward kernel (FlashAttention-2 schedule).
//
// A thread block owns kBlockM query rows of one (batch, head[, split]); it walks its key blocks
// from last to first, K and V tiles in shared memory, two GEMMs per key block on the matrix
// cores (S = Q K^T, O += P V) around the shared online softmax. Flags (FwdTraits): kReturnLse
// adds the LSE store, kMasked the causal/window mask, kSplit writes fp32 partials for the
// combine kernel. The body is per matrix-core atom:
//   fwd_block_sm80.hpp  NVIDIA mma.sync (sm_80+; an fp8 KV cache from sm_89) — runs on the H200
//   fwd_block_cdna.hpp  AMD MFMA (gfx90a/gfx94x/gfx950; fp8 q, k, v on gfx94x/gfx950) —
//                       compile-checked only
// A target with neither compiles to a trapping stub.
#pragma once

#include "generic/fwd_block_cdna.hpp"
#include "generic/fwd_block_sm80.hpp"
#include "common/scheduler.hpp"
#include "generic/tile_config.hpp"
#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/params.hpp"

namespace hipflash::generic {

/// The map from the launch grid to work tiles; the launcher sizes the grid with it too.
using Scheduler = common::StaticScheduler;

/// kKv: K and V rows at a stride, or through a KV cache's block table (the NVIDIA body only;
/// the launcher never runs a paged one on AMD, where a KV cache is refused).
template <class Traits, common::KvRows kKv = common::KvRows::contiguous>
__global__ void __launch_bounds__(Tile<Traits::kHeadDim>::kThreads)
    fwd_generic_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p, int num_m_blocks) {
#if defined(HIPFLASH_HAS_MMA_SYNC)
  if constexpr (Traits::kDType == DType::e4m3)
    port::trap();  // fp8 q, k, v run on the sm90_ws kernel on NVIDIA (the selector's rule)
  else if constexpr (Traits::kKvDType == DType::e4m3 && !atom::sm80::kHasE4m3Cvt)
    port::trap();  // an fp8 KV cache needs sm_89's cvt; the selector knows (kFp8KvMinSm)
  else
    Scheduler::run([&](int64_t tile) { sm80::fwd_block<Traits, kKv>(p, tile, num_m_blocks); });
#elif defined(HIPFLASH_HAS_MFMA)
  static_assert(kKv == common::KvRows::contiguous, "the CDNA body reads contiguous K/V only");
  if constexpr (Traits::kDType == DType::e4m3)
    Scheduler::run([&](int64_t tile) { cdna::fwd_block_fp8<Traits>(p, tile, num_m_blocks); });
  else
    Scheduler::run([&](int64_t tile) { cdna::fwd_block<Traits>(p, tile, num_m_blocks); });
#else
  port::trap();  // no matrix-core atom for this target
#endif  // atom
}

}  // namespace hipflash::generic
