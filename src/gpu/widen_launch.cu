// hipflash — the one place that launches the fp8 widening kernel (kernels/fp8): an fp8 call
// that no fp8 kernel takes, before its bf16 kernel.
#include <algorithm>

#include "backend.hpp"
#include "fp8/widen_kernel.hpp"
#include "gpu/device_guard.hpp"

namespace hipflash::gpu {
namespace {

/// Widens one operand into `dst` (its copy's layout: widened_fp8_params).
void widen(fp8::WidenParams w, port::stream_t stream, const char* what) {
  const int64_t rows = w.batch * w.rows;
  if (rows == 0 || w.heads == 0 || w.head_dim == 0) return;
  // A row's (head, piece) index is 32-bit: heads x pieces is bounded by the launcher's checks
  // (at most 256 / 8 pieces a head) far below 2^31 for any head count a tensor can index.
  HIPFLASH_CHECK(w.heads * ((w.head_dim + fp8::kVec - 1) / fp8::kVec) < (int64_t(1) << 31),
                 what, ": too many heads to widen");
  const dim3 grid(unsigned(std::min(rows, fp8::kMaxBlocks)));
  // Whole 8-byte pieces at 8-byte aligned addresses (the GPU's fp8 operands are 16-byte
  // aligned with strides of whole 16 bytes: check_operand_alignment), 16-byte aligned copies.
  if (w.head_dim % fp8::kVec == 0)
    fp8::widen_kernel<true><<<grid, dim3(fp8::kThreads), 0, stream>>>(w);
  else
    fp8::widen_kernel<false><<<grid, dim3(fp8::kThreads), 0, stream>>>(w);
  port::check(port::get_last_error(), what);
}

}  // namespace

FwdParams widen_fp8_operands(const FwdParams& p, void* base, port::stream_t stream) {
  const FwdParams wide = widened_fp8_params(p, base);
  const bool varlen = p.is_varlen();
  struct Operand {
    const void* src;
    int64_t bs, rs, hs;
    const void* dst;
    int64_t rows, heads, group;
    Descale scale, scale2;
    const int32_t* cu;
    const char* what;
  };
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
  const Operand ops[] = {
      {p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, wide.q,
       varlen ? p.total_q : p.seqlen_q, p.heads_q, group, p.q_descale, p.k_descale,
       p.cu_seqlens_q, "widening fp8 q"},
      {p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, wide.k,
       varlen ? p.total_k : p.seqlen_k, p.heads_kv, 1, Descale{}, Descale{}, p.cu_seqlens_k,
       "widening fp8 k"},
      {p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, wide.v,
       varlen ? p.total_k : p.seqlen_k, p.heads_kv, 1, p.v_descale, Descale{}, p.cu_seqlens_k,
       "widening fp8 v"},
  };
  for (const Operand& o : ops) {
    fp8::WidenParams w;
    w.src = static_cast<const uint8_t*>(o.src);
    w.batch_stride = o.bs, w.row_stride = o.rs, w.head_stride = o.hs;
    w.dst = static_cast<uint16_t*>(const_cast<void*>(o.dst));
    w.batch = varlen ? 1 : p.batch;
    w.rows = o.rows, w.heads = o.heads, w.head_dim = p.head_dim, w.group = o.group;
    w.scale = o.scale, w.scale2 = o.scale2;
    // Varlen: a row's sequence is looked up only where a factor differs per sequence.
    const bool per_sequence = o.scale.batch_stride != 0 || o.scale2.batch_stride != 0;
    if (varlen && per_sequence) w.cu_seqlens = o.cu, w.num_seqs = p.batch;
    widen(w, stream, o.what);
  }
  return wide;
}

}  // namespace hipflash::gpu
