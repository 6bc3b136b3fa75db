// hipflash — the one place that launches the split-K combine kernel.
#include "combine/combine_kernel.hpp"
#include "backend.hpp"  // device_arch
#include "gpu/launch_api.hpp"
#include "hipflash/detail/static_switch.hpp"

namespace hipflash::gpu {

/// `programmatic`: launched as a programmatic dependent of the split kernel (NVIDIA sm_90+).
template <class T, int kPaddedDim, bool kReturnLse>
static void launch(const FwdParams& p, port::stream_t stream, bool programmatic) {
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;  // one thread block each
  HIPFLASH_CHECK(rows <= 0x7fffffff, "problem too large for one combine launch (", rows,
                 " rows)");
  port::check(port::launch_kernel(combine::combine_kernel<T, kPaddedDim, kReturnLse>,
                                  dim3(unsigned(rows)), dim3(combine::kThreads), 0, stream,
                                  programmatic, p),
              "launching the split-K combine kernel");
}

void launch_combine(const FwdParams& p, int padded_head_dim, port::stream_t stream) {
  using bf16 = port::bf16_t;
  using f16 = port::f16_t;
  int device = 0;
  port::check(port::get_device(&device), "querying the current device");
  const Arch arch = device_arch(device);
  const bool pdl = arch.vendor == Arch::nvidia && arch.version >= 90;
  HIPFLASH_BOOL_SWITCH(p.return_lse, kLse, [&] {
    const bool bf16_in = p.dtype == DType::bf16;
    if (padded_head_dim == 64) {
      bf16_in ? launch<bf16, 64, kLse>(p, stream, pdl) : launch<f16, 64, kLse>(p, stream, pdl);
    } else if (padded_head_dim == 128) {
      bf16_in ? launch<bf16, 128, kLse>(p, stream, pdl) : launch<f16, 128, kLse>(p, stream, pdl);
    } else if (padded_head_dim == 256) {
      bf16_in ? launch<bf16, 256, kLse>(p, stream, pdl) : launch<f16, 256, kLse>(p, stream, pdl);
    } else {
      throw not_implemented("split-K combine: no instantiation for padded head dim " +
                            std::to_string(padded_head_dim));
    }
  });
}

}  // namespace hipflash::gpu
