// hipflash — the one place that launches the merge_attn_states kernel (kernels/merge).
#include <algorithm>

#include "backend.hpp"
#include "gpu/device_guard.hpp"
#include "merge/merge_kernel.hpp"

namespace hipflash::gpu {
namespace {

template <DType kDType, int kVec>
void launch(const MergeParams& p, port::stream_t stream) {
  const int64_t pieces = std::max<int64_t>(p.head_dim / kVec, 1);  // per (row, head)
  const int64_t items = p.rows * p.heads * pieces;
  if (items == 0) return;
  const int64_t blocks = std::min<int64_t>((items + merge::kThreads - 1) / merge::kThreads,
                                           merge::kMaxBlocks);
  merge::MergeDivisors div;
  div.narrow = merge::kHostDivisions && items < (int64_t(1) << 31) &&
               p.lse_seqlen < (int64_t(1) << 31);
  if (div.narrow) {
    div.pieces = detail::FastDiv(uint32_t(pieces));
    div.heads = detail::FastDiv(uint32_t(p.heads));
    div.lse_seqlen = detail::FastDiv(uint32_t(p.lse_seqlen));
  }
  merge::merge_kernel<kDType, kVec>
      <<<dim3(unsigned(blocks)), dim3(merge::kThreads), 0, stream>>>(p, div);
  port::check(port::get_last_error(), "launching the merge_attn_states kernel");
}

/// Whether every row of outs and out starts on a 16-byte boundary and holds whole vectors.
bool vectorizable(const MergeParams& p, int elems_per_16_bytes) {
  const auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; };
  const int64_t v = elems_per_16_bytes;
  return aligned(p.outs) && aligned(p.out) && p.head_dim > 0 && p.head_dim % v == 0 && p.outs_part_stride % v == 0 &&
         p.outs_row_stride % v == 0 && p.outs_head_stride % v == 0 && p.out_row_stride % v == 0 &&
         p.out_head_stride % v == 0;
}

/// A thread merges 32 bytes of a row (two 16-byte vectors per part: twice the bytes in flight
/// per thread for the same index and LSE work) where the head dim holds whole pairs of
/// vectors, else 16 bytes, else one element (rows not 16-byte aligned).
template <DType kDType>
void launch_dtype(const MergeParams& p, port::stream_t stream) {
  constexpr int kVec = 16 / dtype_size(kDType);
  if (vectorizable(p, kVec) && p.head_dim % (2 * kVec) == 0) launch<kDType, 2 * kVec>(p, stream);
  else if (vectorizable(p, kVec)) launch<kDType, kVec>(p, stream);
  else launch<kDType, 1>(p, stream);
}

}  // namespace

void run_merge(const MergeParams& p, int device, Stream stream_arg) {
  auto stream = static_cast<port::stream_t>(stream_arg);
  ScopedDevice guard(device);
  switch (p.dtype) {
    case DType::bf16: launch_dtype<DType::bf16>(p, stream); break;
    case DType::f16: launch_dtype<DType::f16>(p, stream); break;
    case DType::f32: launch_dtype<DType::f32>(p, stream); break;
    default:
      throw not_implemented(std::string("merge_attn_states: no GPU kernel for dtype ") +
                            std::string(dtype_name(p.dtype)));
  }
}

}  // namespace hipflash::gpu
