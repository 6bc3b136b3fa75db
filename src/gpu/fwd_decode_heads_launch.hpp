// hipflash — the one place that launches the head-group decode forward kernel. Included only by
// the generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "decode/fwd_decode_heads_kernel.hpp"
#include "gpu/launch_fwd.hpp"
#include "hipflash/detail/selector.hpp"

namespace hipflash::gpu {

/// The head-group decode kernel's launch traits (kKv: where the instantiation reads K / V).
template <class Traits, common::KvRows kKv>
struct DecodeHeadsLaunch : NoPrepare {
  using Tile = decode::DecodeHeadsTile<Traits::kHeadDim>;
  using Scheduler = decode::HeadsScheduler;
  static constexpr auto kKernel = decode::fwd_decode_heads_kernel<Traits, kKv>;
  static constexpr const char* kName =
      kKv == common::KvRows::contiguous ? "head-group decode"
      : kKv == common::KvRows::pages  ? "head-group decode (paged KV cache)"
                                      : "head-group decode (paged KV cache, rows gathered)";
  static_assert(Tile::kBlockM == kDecodeMaxRows, "the selector's decode bound is the query block");
  static_assert(Tile::kHeads == kDecodeHeadsPerBlock, "the selector's kv-head bound is the group");
};

/// The selector gives this kernel packed GQA decode calls only (one query row, no window, head
/// dims 64 and 128): the other instantiations the TU's flag combinations ask for refuse.
template <class Traits>
void launch_decode_heads_fwd(const FwdParams& p, port::stream_t stream) {
  if constexpr (Traits::kMasked || Traits::kHeadDim > max_head_dim(KernelKind::decode_heads)) {
    (void)stream;
    HIPFLASH_CHECK_AS(runtime_error, false, "the head-group decode kernel takes unmasked calls at "
                      "head dims 64 and 128 only (the selector's rule), got head dim ",
                      p.head_dim, p.has_window() ? " with a window" : "");
  } else {
    // Packed (gpu_backend.cu's pack_gqa_decode): a kv head's query heads are its rows, so the
    // call's heads are the kv heads the kernel's warps take.
    HIPFLASH_CHECK_AS(runtime_error,
                      p.seqlen_q <= kDecodeMaxRows && !p.has_window() && p.heads_q == p.heads_kv,
                      "the head-group decode kernel takes packed GQA decode calls only (the "
                      "selector's rule)");
    launch_fwd_paged_or_not<DecodeHeadsLaunch, Traits>(p, stream);
  }
}

}  // namespace hipflash::gpu
