// hipflash — the one place that launches the split-K combine kernel.
#include "combine/combine_kernel.hpp"
#include "gpu/launch_api.hpp"
#include "hipflash/detail/static_switch.hpp"

namespace hipflash::gpu {

template <class T, int kPaddedDim, bool kReturnLse>
static void launch(const FwdParams& p, port::stream_t stream) {
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;  // one thread block each
  HIPFLASH_CHECK(rows <= 0x7fffffff, "problem too large for one combine launch (", rows,
                 " rows)");
  combine::combine_kernel<T, kPaddedDim, kReturnLse>
      <<<dim3(unsigned(rows)), dim3(combine::kThreads), 0, stream>>>(p);
  port::check(port::get_last_error(), "launching the split-K combine kernel");
}

void launch_combine(const FwdParams& p, int padded_head_dim, port::stream_t stream) {
  using bf16 = port::bf16_t;
  using f16 = port::f16_t;
  HIPFLASH_BOOL_SWITCH(p.return_lse, kLse, [&] {
    if (padded_head_dim == 64) {
      p.dtype == DType::bf16 ? launch<bf16, 64, kLse>(p, stream) : launch<f16, 64, kLse>(p, stream);
    } else if (padded_head_dim == 128) {
      p.dtype == DType::bf16 ? launch<bf16, 128, kLse>(p, stream) : launch<f16, 128, kLse>(p, stream);
    } else if (padded_head_dim == 256) {
      p.dtype == DType::bf16 ? launch<bf16, 256, kLse>(p, stream) : launch<f16, 256, kLse>(p, stream);
    } else {
      throw not_implemented("split-K combine: no instantiation for padded head dim " +
                            std::to_string(padded_head_dim));
    }
  });
}

}  // namespace hipflash::gpu
