// hipflash — the one place that launches the varlen unused-rows kernel (kernels/varlen).
#include <algorithm>

#include "backend.hpp"
#include "gpu/device_guard.hpp"
#include "varlen/unused_rows_kernel.hpp"

namespace hipflash::gpu {

void run_seqused_rows(const FwdParams& p, int device, Stream stream_arg) {
  if (p.seqused_q == nullptr || p.batch == 0 || p.heads_q == 0 || p.head_dim == 0) return;
  ScopedDevice guard(device);
  const auto sequences = unsigned(std::min<int64_t>(p.batch, varlen::kMaxSequenceBlocks));
  varlen::unused_rows_kernel<<<dim3(varlen::kBlocksPerSequence, sequences),
                               dim3(varlen::kThreads), 0,
                               static_cast<port::stream_t>(stream_arg)>>>(p);
  port::check(port::get_last_error(), "launching the varlen unused-rows kernel");
}

}  // namespace hipflash::gpu
