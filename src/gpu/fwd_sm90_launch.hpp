// hipflash — the one place that launches the sm90 (Hopper, wgmma) forward kernel. Included only
// by the generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "gpu/launch_api.hpp"
#include "sm90/fwd_sm90_kernel.hpp"

namespace hipflash::gpu {

template <class Traits>
void launch_sm90_fwd(const FwdParams& p, port::stream_t stream) {
  using Cfg = sm90::Tile<Traits::kHeadDim>;
  const int64_t num_m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t blocks = num_m_blocks * p.num_splits * p.heads_q * p.batch;
  HIPFLASH_CHECK(blocks <= 0x7fffffff, "problem too large for one launch: ", blocks,
                 " thread blocks (batch * heads_q * query blocks * splits) exceed 2^31 - 1");
  auto kernel = sm90::fwd_sm90_kernel<Traits>;
  static const port::error_t attr = port::set_max_dynamic_smem(kernel, Cfg::kSmemBytes);
  port::check(attr, "setting the sm90 kernel's shared-memory size");
  kernel<<<dim3(unsigned(blocks)), dim3(Cfg::kThreads), Cfg::kSmemBytes, stream>>>(
      p, int(num_m_blocks));
  port::check(port::get_last_error(), "launching the sm90 forward kernel");
}

}  // namespace hipflash::gpu
