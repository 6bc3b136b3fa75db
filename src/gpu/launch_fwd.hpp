// hipflash — the launch every forward kernel shares (internal): the one-dimensional grid of
// (query block, split, head, batch) that BlockInfo decodes, its size check, the kernel's
// dynamic shared memory, and error checks naming the kernel.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "gpu/launch_api.hpp"

namespace hipflash::gpu {

/// Sets kKernel's dynamic shared-memory limit on the current device, once per device: the
/// attribute belongs to the function on each device, so a process that uses two GPUs must set
/// it on both (a per-process flag would leave the second one at the 48 KiB default).
template <auto kKernel>
void set_smem_once_per_device(int bytes, const char* name) {
  static std::atomic<uint64_t> done{0};  // bit d: set on device d; devices >= 64 set it always
  int device = 0;
  port::check(port::get_device(&device), "querying the current device");
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
  port::check(port::set_max_dynamic_smem(kKernel, bytes),
              (std::string("setting the ") + name + " kernel's shared-memory size").c_str());
  done.fetch_or(bit, std::memory_order_acq_rel);
}

/// Launches kKernel(p, num_m_blocks) with Cfg's block (kBlockM rows, kThreads threads,
/// kSmemBytes of dynamic shared memory) on `stream`. `name` names the kernel in errors.
template <class Cfg, auto kKernel>
void launch_fwd_grid(const FwdParams& p, port::stream_t stream, const char* name) {
  const int64_t num_m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t blocks = num_m_blocks * p.num_splits * p.heads_q * p.batch;
  HIPFLASH_CHECK(blocks <= 0x7fffffff, "problem too large for one launch: ", blocks,
                 " thread blocks (batch * heads_q * query blocks * splits) exceed 2^31 - 1");
  set_smem_once_per_device<kKernel>(Cfg::kSmemBytes, name);
  kKernel<<<dim3(unsigned(blocks)), dim3(Cfg::kThreads), Cfg::kSmemBytes, stream>>>(
      p, int(num_m_blocks));
  if (const port::error_t err = port::get_last_error(); err != port::kSuccess)
    port::check(err, (std::string("launching the ") + name + " forward kernel").c_str());
}

}  // namespace hipflash::gpu
