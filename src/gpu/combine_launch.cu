// hipflash — the one place that launches the split-K combine kernel.
#include "combine/combine_kernel.hpp"
#include "gpu/device_guard.hpp"
#include "gpu/launch_api.hpp"
#include "hipflash/detail/static_switch.hpp"

namespace hipflash::gpu {

/// Launched as a programmatic dependent of the split kernel where the combine kernel's code on
/// this device waits for it: its binary was built from sm_90+ code (griddepcontrol.wait). An
/// sm_80 build JIT-compiled for a newer GPU has no wait and launches plainly. Cached per device
/// and kernel.
template <auto kKernel>
static void launch_programmatic(int64_t blocks, const FwdParams& p, port::stream_t stream) {
  static PerDeviceBit waits;
  int device = 0;
  port::check(port::get_device(&device), "querying the current device");
  const bool programmatic =
      waits.get(device, [] { return port::waits_for_prerequisite_grids(kKernel); });
  port::check(port::launch_kernel(kKernel, dim3(unsigned(blocks)), dim3(combine::kThreads), 0,
                                  stream, programmatic, p),
              "launching the split-K combine kernel");
}

/// Up to kRowSplits splits: a warp per row (a wide decode batch's rows in one wave of blocks);
/// more: a block per row. The two give bitwise the same result.
template <class T, int kPaddedDim, bool kReturnLse>
static void launch(const FwdParams& p, port::stream_t stream) {
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  HIPFLASH_CHECK(rows <= 0x7fffffff, "problem too large for one combine launch (", rows,
                 " rows)");
  if (p.num_splits <= combine::kRowSplits)
    launch_programmatic<combine::combine_rows_kernel<T, kPaddedDim, kReturnLse>>(
        (rows + combine::kWarps - 1) / combine::kWarps, p, stream);
  else
    launch_programmatic<combine::combine_kernel<T, kPaddedDim, kReturnLse>>(rows, p, stream);
}

void launch_combine(const FwdParams& p, int padded_head_dim, port::stream_t stream) {
  using bf16 = port::bf16_t;
  using f16 = port::f16_t;
  HIPFLASH_BOOL_SWITCH(p.return_lse, kLse, [&] {
    const bool bf16_in = p.dtype == DType::bf16;
    if (padded_head_dim == 64) {
      bf16_in ? launch<bf16, 64, kLse>(p, stream) : launch<f16, 64, kLse>(p, stream);
    } else if (padded_head_dim == 128) {
      bf16_in ? launch<bf16, 128, kLse>(p, stream) : launch<f16, 128, kLse>(p, stream);
    } else if (padded_head_dim == 256) {
      bf16_in ? launch<bf16, 256, kLse>(p, stream) : launch<f16, 256, kLse>(p, stream);
    } else {
      throw not_implemented("split-K combine: no instantiation for padded head dim " +
                            std::to_string(padded_head_dim));
    }
  });
}

}  // namespace hipflash::gpu
