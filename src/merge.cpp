// hipflash — merge_attn_states (SPEC §7): validation, then the CPU implementation on the shared
// softmax state (the combine kernel's math, from natural-log LSEs).
#include "hipflash/merge.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "hipflash/detail/host_numeric.hpp"
#include "hipflash/detail/softmax_state.hpp"
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
  HIPFLASH_CHECK(t.data != nullptr || t.numel() == 0, name, " has no data pointer");
}

float load(const TensorRef& t, int64_t off) {
  return t.dtype == DType::f32 ? static_cast<const float*>(t.data)[off]
                               : detail::load_as_float(t.data, off, t.dtype);
}
void store(const TensorRef& t, int64_t off, float v) {
  if (t.dtype == DType::f32) static_cast<float*>(t.data)[off] = v;
  else detail::store_from_float(t.data, off, v, t.dtype);
}

/// Offset of (part i, row t, head h) in an LSE of rank 3 ([N, H, T]) or 4 ([N, B, H, S]); the
/// output LSE has no part dimension (i = -1).
int64_t lse_offset(const TensorRef& l, int64_t i, int64_t t, int64_t h) {
  const int first = i < 0 ? 0 : 1;
  int64_t off = i < 0 ? 0 : i * l.strides[0];
  if (l.rank - first == 2) return off + h * l.strides[first] + t * l.strides[first + 1];
  const int64_t s = l.sizes[first + 2];
  return off + (t / s) * l.strides[first] + h * l.strides[first + 1] + (t % s) * l.strides[first + 2];
}

}  // namespace

void merge_attn_states(const TensorRef& outs, const TensorRef& lses, const TensorRef& out,
                       const TensorRef* lse, Stream) {
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
    HIPFLASH_CHECK(t->strides[t->rank - 1] == 1 || t->sizes[t->rank - 1] <= 1, name,
                   " must have a contiguous last dimension (stride 1)");
  HIPFLASH_CHECK(outs.loc == out.loc && lses.loc == out.loc,
                 "outs, lses and out must be on the same device");
  HIPFLASH_CHECK(detail::self_overlap(out) == detail::Overlap::none, "out must not overlap itself");
  for (auto [t, name] : {std::pair{&outs, "outs"}, {&lses, "lses"}})
    HIPFLASH_CHECK(detail::overlap(out, *t) == detail::Overlap::none, "out must not alias ", name);
  if (lse) {
    const int want = dense ? 3 : 2;
    check_tensor(*lse, "lse", want, dense ? "[batch, heads, seqlen]" : "[heads, rows]");
    HIPFLASH_CHECK_AS(dtype_error, lse->dtype == DType::f32, "lse must have dtype float32, got ",
                      dtype_name(lse->dtype));
    for (int d = 0; d < want; ++d)
      HIPFLASH_CHECK(lse->sizes[d] == lses.sizes[d + 1], "lse must have shape ",
                     "lses.shape[1:], got ", shape_str(*lse));
    HIPFLASH_CHECK(lse->loc == out.loc, "lse must be on the device of out");
    for (auto [t, name] : {std::pair{&outs, "outs"}, {&lses, "lses"}, {&out, "out"}})
      HIPFLASH_CHECK(detail::overlap(*lse, *t) == detail::Overlap::none, "lse must not alias ",
                     name);
  }
  HIPFLASH_CHECK_AS(not_implemented, out.loc.kind == Location::cpu,
                    "merge_attn_states runs on CPU tensors only in this build (no GPU merge "
                    "kernel yet)");

  std::vector<SoftmaxState> part(static_cast<size_t>(n));
  std::vector<float> acc(static_cast<size_t>(dim));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      // The combine kernel's math on states rebuilt from natural-log LSEs: -inf parts are
      // empty (weight 0, never read), NaN reaches the total and every weight.
      SoftmaxState total;
      for (int64_t i = 0; i < n; ++i) {
        part[size_t(i)] = SoftmaxState::from_lse(load(lses, lse_offset(lses, i, t, h)));
        total.merge(part[size_t(i)]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        if (!part[size_t(i)].live()) continue;
        const float w = detail::combine_weight(part[size_t(i)], total);
        const int64_t o = i * outs.strides[0] + t * outs.strides[1] + h * outs.strides[2];
        for (int64_t d = 0; d < dim; ++d) acc[size_t(d)] += w * load(outs, o + d);
      }
      const int64_t o = t * out.strides[0] + h * out.strides[1];
      for (int64_t d = 0; d < dim; ++d) store(out, o + d, acc[size_t(d)]);
      if (lse) static_cast<float*>(lse->data)[lse_offset(*lse, -1, t, h)] = total.lse();
    }
}

}  // namespace hipflash
