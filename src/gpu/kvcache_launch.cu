// hipflash — the one place that launches the KV-cache append kernel (kernels/kvcache).
#include <algorithm>

#include "backend.hpp"
#include "gpu/device_guard.hpp"
#include "kvcache/append_kernel.hpp"

namespace hipflash::gpu {

int kvcache_append_code_version() { return port::code_version(kvcache::append_kernel); }

void run_kvcache_append(const FwdParams& p, const TensorRef& k_new, const TensorRef& v_new,
                        int device, Stream stream_arg) {
  kvcache::AppendParams a;
  a.cache = p;
  a.k_new = k_new.data;
  a.v_new = v_new.data;
  int i = 0;
  for (const TensorRef* t : {&k_new, &v_new}) {
    a.new_batch_stride[i] = t->strides[0];
    a.new_row_stride[i] = t->strides[1];
    a.new_head_stride[i] = t->strides[2];
    ++i;
  }
  a.s_new = k_new.sizes[1];
  const int64_t items = 2 * p.batch * a.s_new * p.heads_kv * p.head_dim;
  if (items == 0) return;
  const int64_t blocks = std::min<int64_t>((items + kvcache::kThreads - 1) / kvcache::kThreads,
                                           kvcache::kMaxBlocks);
  ScopedDevice guard(device);
  kvcache::append_kernel<<<dim3(unsigned(blocks)), dim3(kvcache::kThreads), 0,
                           static_cast<port::stream_t>(stream_arg)>>>(a);
  port::check(port::get_last_error(), "launching the KV-cache append kernel");
}

}  // namespace hipflash::gpu
