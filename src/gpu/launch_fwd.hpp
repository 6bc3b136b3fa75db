// hipflash — the launch every forward kernel shares (internal): the one-dimensional grid of
// (query block, split, head, batch) that BlockInfo decodes, its size check, the kernel's
// dynamic shared memory, and error checks naming the kernel.
#pragma once

#include <string>

#include "gpu/launch_api.hpp"

namespace hipflash::gpu {

/// Launches kKernel(p, num_m_blocks) with Cfg's block (kBlockM rows, kThreads threads,
/// kSmemBytes of dynamic shared memory) on `stream`. `name` names the kernel in errors.
template <class Cfg, auto kKernel>
void launch_fwd_grid(const FwdParams& p, port::stream_t stream, const char* name) {
  const int64_t num_m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t blocks = num_m_blocks * p.num_splits * p.heads_q * p.batch;
  HIPFLASH_CHECK(blocks <= 0x7fffffff, "problem too large for one launch: ", blocks,
                 " thread blocks (batch * heads_q * query blocks * splits) exceed 2^31 - 1");
  static const port::error_t attr = port::set_max_dynamic_smem(kKernel, Cfg::kSmemBytes);
  if (attr != port::kSuccess)
    port::check(attr, (std::string("setting the ") + name + " kernel's shared-memory size").c_str());
  kKernel<<<dim3(unsigned(blocks)), dim3(Cfg::kThreads), Cfg::kSmemBytes, stream>>>(
      p, int(num_m_blocks));
  if (const port::error_t err = port::get_last_error(); err != port::kSuccess)
    port::check(err, (std::string("launching the ") + name + " forward kernel").c_str());
}

}  // namespace hipflash::gpu
