// hipflash — the one place that launches the split-K combine kernels (kernels/combine).
#include "combine/combine_kernel.hpp"
#include "common/element.hpp"
#include "gpu/device_guard.hpp"
#include "gpu/launch_api.hpp"
#include "hipflash/detail/static_switch.hpp"

namespace hipflash::gpu {

/// Launched as a programmatic dependent of the split kernel where the combine kernel's code on
/// this device waits for it (dependent_launch).
template <auto kKernel>
static void launch_programmatic(int64_t blocks, const FwdParams& p, port::stream_t stream) {
  port::check(port::launch_kernel(kKernel, dim3(unsigned(blocks)), dim3(combine::kThreads), 0,
                                  stream, dependent_launch<kKernel>(), p),
              "launching the split-K combine kernel");
}

/// Launches the combine in `shape`. by_split_count takes a warp per row up to kRowSplits splits
/// (a wide decode batch's rows then fit one wave of blocks) and a block per row beyond. The two
/// give bitwise the same result, so the choice is the launch's, not the selector's.
template <class T, int kPaddedDim, bool kReturnLse>
static void launch(const FwdParams& p, port::stream_t stream, CombineShape shape) {
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  HIPFLASH_CHECK(rows <= 0x7fffffff, "problem too large for one combine launch (", rows,
                 " rows)");
  HIPFLASH_CHECK(shape != CombineShape::warp_per_row || p.num_splits <= combine::kRowSplits,
                 "the warp-per-row combine takes up to ", combine::kRowSplits, " splits, got ",
                 p.num_splits);
  if (shape == CombineShape::by_split_count)
    shape = p.num_splits <= combine::kRowSplits ? CombineShape::warp_per_row
                                                : CombineShape::block_per_row;
  if (shape == CombineShape::warp_per_row)
    launch_programmatic<combine::combine_rows_kernel<T, kPaddedDim, kReturnLse>>(
        (rows + combine::kWarps - 1) / combine::kWarps, p, stream);
  else
    launch_programmatic<combine::combine_kernel<T, kPaddedDim, kReturnLse>>(rows, p, stream);
}

void launch_combine(const FwdParams& p, int padded_head_dim, port::stream_t stream,
                    CombineShape shape) {
  HIPFLASH_DTYPE_SWITCH(p.out_dtype, kDT, [&] {  // bf16 for fp8 inputs
    HIPFLASH_HEADDIM_SWITCH(padded_head_dim, kPadded, [&] {
      HIPFLASH_BOOL_SWITCH(p.return_lse, kReturnLse, [&] {
        launch<common::element_t<kDT>, kPadded, kReturnLse>(p, stream, shape);
      });
    });
  });
}

}  // namespace hipflash::gpu
