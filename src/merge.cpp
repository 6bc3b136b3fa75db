// hipflash — merge_attn_states (SPEC §7): validation, MergeParams, then the CPU implementation
// or the GPU kernel (src/gpu/merge_launch.cu), both on the shared softmax state (the combine
// kernel's math, from natural-log LSEs) through MergeParams::total_state / part_state.
#include "hipflash/merge.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "backend.hpp"
#include "hipflash/detail/host_numeric.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/merge_params.hpp"
#include "tensor_checks.hpp"

namespace hipflash {
namespace {

using detail::shape_str;

using detail::SoftmaxState;

void check_tensor(const TensorRef& t, const char* name, int rank, const char* layout) {
  HIPFLASH_CHECK(t.rank == rank, name, " must have rank ", rank, " (", layout, "), got shape ",
                 shape_str(t));
  const char* why = "";
  HIPFLASH_CHECK(detail::indexable(t, &why), name, " with shape ", shape_str(t),
                 " cannot be indexed in 64 bits: ", why);
  detail::check_known_location(t, name);
  HIPFLASH_CHECK(t.data != nullptr || t.numel() == 0, name, " has no data pointer");
}

float load(const void* base, DType dt, int64_t off) {
  return dt == DType::f32 ? static_cast<const float*>(base)[off]
                          : detail::load_as_float(base, off, dt);
}
void store(void* base, DType dt, int64_t off, float v) {
  if (dt == DType::f32) static_cast<float*>(base)[off] = v;
  else detail::store_from_float(base, off, v, dt);
}

/// The CPU merge: per (row, head), the parts' states merged in part order (the GPU kernel's
/// order too), then out = sum_i w_i out_i in fp32 over the live parts, rounded once.
void merge_on_cpu(const MergeParams& p) {
  if (p.rows == 0 || p.heads == 0) return;  // nothing to merge (however many rows without heads)
  std::vector<float> acc(static_cast<size_t>(p.head_dim));
  for (int64_t t = 0; t < p.rows; ++t)
    for (int64_t h = 0; h < p.heads; ++h) {
      // -inf parts are empty (weight 0, never read); a NaN LSE reaches the total and every
      // weight.
      const int64_t row = p.lses_offset(t, h);
      const float shift = p.row_shift(row);
      const SoftmaxState total = p.total_state(row, shift);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < p.parts; ++i) {
        const SoftmaxState part = p.part_state(i, row, shift);
        if (!part.live()) continue;
        const float w = detail::combine_weight(part, total);
        const int64_t o = p.outs_offset(i, t, h);
        for (int64_t d = 0; d < p.head_dim; ++d) acc[size_t(d)] += w * load(p.outs, p.dtype, o + d);
      }
      const int64_t o = p.out_offset(t, h);
      for (int64_t d = 0; d < p.head_dim; ++d) store(p.out, p.dtype, o + d, acc[size_t(d)]);
      if (p.lse) p.lse[p.lse_offset(t, h)] = MergeParams::merged_lse(total, shift);
    }
}

}  // namespace

void merge_attn_states(const TensorRef& outs, const TensorRef& lses, const TensorRef& out,
                       const TensorRef* lse, Stream stream) {
  check_tensor(outs, "outs", 4, "[parts, rows, heads, head_dim]");
  check_tensor(out, "out", 3, "[rows, heads, head_dim]");
  HIPFLASH_CHECK(lses.rank == 3 || lses.rank == 4, "lses must have rank 3 ([parts, heads, rows]) "
                 "or 4 ([parts, batch, heads, seqlen]), got shape ", shape_str(lses));
  check_tensor(lses, "lses", lses.rank, lses.rank == 3 ? "[parts, heads, rows]"
                                                       : "[parts, batch, heads, seqlen]");
  const int64_t n = outs.sizes[0], rows = outs.sizes[1], heads = outs.sizes[2],
                dim = outs.sizes[3];
  HIPFLASH_CHECK(n >= 1 && n <= kMaxMergeParts, "merge_attn_states takes 1 to ", kMaxMergeParts,
                 " parts, got ", n);
  HIPFLASH_CHECK_AS(dtype_error,
                    outs.dtype == DType::bf16 || outs.dtype == DType::f16 ||
                        outs.dtype == DType::f32,
                    "outs must have dtype bfloat16, float16 or float32, got ",
                    dtype_name(outs.dtype));
  HIPFLASH_CHECK_AS(dtype_error, out.dtype == outs.dtype, "out must have the dtype of outs (",
                    dtype_name(outs.dtype), "), got ", dtype_name(out.dtype));
  HIPFLASH_CHECK_AS(dtype_error, lses.dtype == DType::f32, "lses must have dtype float32, got ",
                    dtype_name(lses.dtype));
  const bool dense = lses.rank == 4;
  const int64_t lse_heads = dense ? lses.sizes[2] : lses.sizes[1];
  const int64_t lse_rows = dense ? lses.sizes[1] * lses.sizes[3] : lses.sizes[2];
  HIPFLASH_CHECK(lses.sizes[0] == n && lse_heads == heads && lse_rows == rows,
                 "lses ", shape_str(lses), " does not match outs ", shape_str(outs),
                 dense ? " ([parts, batch, heads, seqlen] with batch * seqlen = rows)"
                       : " ([parts, heads, rows])");
  HIPFLASH_CHECK(out.sizes[0] == rows && out.sizes[1] == heads && out.sizes[2] == dim,
                 "out must have shape [rows, heads, head_dim] = [", rows, ", ", heads, ", ", dim,
                 "], got ", shape_str(out));
  for (auto [t, name] : {std::pair{&outs, "outs"}, {&out, "out"}})
    HIPFLASH_CHECK(detail::last_dim_contiguous(*t), name,
                   " must have a contiguous last dimension (stride 1)");
  HIPFLASH_CHECK(outs.loc == out.loc && lses.loc == out.loc,
                 "outs, lses and out must be on the same device");
  detail::check_no_self_overlap(out, "out");
  for (auto [t, name] : {std::pair{&outs, "outs"}, {&lses, "lses"}})
    detail::check_disjoint(out, "out", *t, name);
  if (lse) {
    const int want = dense ? 3 : 2;
    check_tensor(*lse, "lse", want, dense ? "[batch, heads, seqlen]" : "[heads, rows]");
    HIPFLASH_CHECK_AS(dtype_error, lse->dtype == DType::f32, "lse must have dtype float32, got ",
                      dtype_name(lse->dtype));
    for (int d = 0; d < want; ++d)
      HIPFLASH_CHECK(lse->sizes[d] == lses.sizes[d + 1], "lse must have shape ",
                     "lses.shape[1:], got ", shape_str(*lse));
    HIPFLASH_CHECK(lse->loc == out.loc, "lse must be on the device of out");
    detail::check_no_self_overlap(*lse, "lse");
    for (auto [t, name] : {std::pair{&outs, "outs"}, {&lses, "lses"}, {&out, "out"}})
      detail::check_disjoint(*lse, "lse", *t, name);
  }

  MergeParams p;
  p.outs = outs.data;
  p.lses = static_cast<const float*>(lses.data);
  p.out = out.data;
  p.lse = lse ? static_cast<float*>(lse->data) : nullptr;
  p.parts = n, p.rows = rows, p.heads = heads, p.head_dim = dim;
  p.dtype = outs.dtype;
  p.outs_part_stride = outs.strides[0], p.outs_row_stride = outs.strides[1];
  p.outs_head_stride = outs.strides[2];
  p.out_row_stride = out.strides[0], p.out_head_stride = out.strides[1];
  // Dense [N, B, H, S]: row t is (t / S, t % S). Packed [N, H, T]: one "batch" of T rows.
  p.lses_part_stride = lses.strides[0];
  if (dense) {
    p.lse_seqlen = std::max<int64_t>(lses.sizes[3], 1);
    p.lses_batch_stride = lses.strides[1], p.lses_head_stride = lses.strides[2];
    p.lses_row_stride = lses.strides[3];
  } else {
    p.lse_seqlen = std::max<int64_t>(rows, 1);
    p.lses_head_stride = lses.strides[1], p.lses_row_stride = lses.strides[2];
  }
  if (lse) {
    if (dense) {
      p.lse_batch_stride = lse->strides[0], p.lse_head_stride = lse->strides[1];
      p.lse_row_stride = lse->strides[2];
    } else {
      p.lse_head_stride = lse->strides[0], p.lse_row_stride = lse->strides[1];
    }
  }

  if (out.loc.kind == Location::gpu) {
    gpu::run_merge(p, out.loc.index, stream);
    return;
  }
  merge_on_cpu(p);  // (Location::cpu: check_tensor refuses any other kind)
}

}  // namespace hipflash
