// hipflash — the one place that launches the decode forward kernel. Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "decode/fwd_decode_kernel.hpp"
#include "gpu/launch_fwd.hpp"
#include "hipflash/detail/selector.hpp"

namespace hipflash::gpu {

/// The decode kernel's launch traits (kPaged: the instantiation reading a paged KV cache).
template <class Traits, bool kPaged>
struct DecodeLaunch : NoPrepare {
  using Tile = decode::DecodeTile<Traits::kHeadDim>;
  using Scheduler = decode::Scheduler;
  static constexpr auto kKernel = decode::fwd_decode_kernel<Traits, kPaged>;
  static constexpr const char* kName = kPaged ? "decode (paged KV cache)" : "decode";
  static_assert(Tile::kBlockM == kDecodeMaxRows, "the selector's decode bound is the query block");
  /// Blocks a cluster on sm_90 (launch_fwd): Tile::kCluster heads of a (batch, split) — the kv
  /// heads of a packed GQA decode — where that tuning hook is set and the call has one query
  /// block a (batch, head) and a multiple of kCluster heads (the kernel's clustered_tile maps
  /// a cluster's blocks to them); else 1. Clusters placed without the barrier
  /// (HIPFLASH_DECODE_CLUSTER_STEP=0) take unsplit calls only: a split B = 8 call lost 25% in
  /// them where unsplit B = 32 calls gained 0.1-0.2% on one H200 (docs/design-decisions.md#decode).
  static int cluster(const FwdParams& p, int64_t num_m_blocks) {
    constexpr int n = Tile::kCluster;
    if constexpr (n <= 1) {
      return 1;
    } else {
      if (num_m_blocks != 1 || p.heads_q % n != 0) return 1;
      return Tile::kClusterStep || p.num_splits == 1 ? n : 1;
    }
  }
};

template <class Traits>
void launch_decode_fwd(const FwdParams& p, port::stream_t stream) {
  launch_fwd_paged_or_not<DecodeLaunch, Traits>(p, stream);
}

}  // namespace hipflash::gpu
