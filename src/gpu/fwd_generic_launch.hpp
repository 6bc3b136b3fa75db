// hipflash — the one place that launches the generic forward kernel. Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "generic/fwd_kernel.hpp"
#include "gpu/launch_fwd.hpp"

namespace hipflash::gpu {

/// The generic kernel's launch traits (kKv: where the instantiation reads K / V).
template <class Traits, common::KvRows kKv>
struct GenericLaunch : NoPrepare {
  using Tile = generic::Tile<Traits::kHeadDim>;
  using Scheduler = generic::Scheduler;
  static constexpr auto kKernel = generic::fwd_generic_kernel<Traits, kKv>;
  static constexpr const char* kName =
      kKv == common::KvRows::contiguous ? "generic"
      : kKv == common::KvRows::pages  ? "generic (paged KV cache)"
                                      : "generic (paged KV cache, rows gathered)";
};

template <class Traits>
void launch_generic_fwd(const FwdParams& p, port::stream_t stream) {
#if defined(HIPFLASH_PLATFORM_NVIDIA)
  launch_fwd_paged_or_not<GenericLaunch, Traits>(p, stream);
#else
  HIPFLASH_CHECK_AS(not_implemented, p.block_table == nullptr,
                    "the AMD generic kernel does not read a paged KV cache");
  launch_fwd<GenericLaunch<Traits, common::KvRows::contiguous>>(p, stream);
#endif  // HIPFLASH_PLATFORM_NVIDIA
}

}  // namespace hipflash::gpu
