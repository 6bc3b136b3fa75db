// hipflash GPU tests — the split-K combine's two launch shapes (kernels/combine): on the same
// partial rows a warp per row and a block per row give bitwise the same out and LSE, and both
// give the host's combine in the kernels' order (SoftmaxState's merge and combine_weight, the
// partial sums per group s % kGroups, docs/lse_contract.md): empty splits left out whatever
// their rows hold, every split empty -> out 0 and LSE -inf, a NaN sum or a NaN partial element
// reaching what it touches, padded varlen rows -inf in the padded LSE layout. Rows built to
// cancel (+X and -X in one group, or in groups around a small term) make a different order of
// the sums visible through the 16-bit outputs.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "combine/combine_kernel.hpp"
#include "gpu/launch_api.hpp"
#include "gpu_test_util.hpp"
#include "hipflash/detail/host_numeric.hpp"
#include "hipflash/detail/softmax_state.hpp"

namespace hipflash::test {
namespace {

using detail::SoftmaxState;

/// A device array, uploaded from / downloaded to a host vector.
template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceArray(const std::vector<T>& host) : n(host.size()) {
    CUDA_CHECK(cudaMalloc(&ptr, n * sizeof(T)));
    CUDA_CHECK(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  ~DeviceArray() {
    const cudaError_t e = cudaFree(ptr);
    if (e != cudaSuccess) ADD_FAILURE() << "cudaFree: " << cudaGetErrorString(e);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

struct CombineCase {
  const char* name;
  DType dtype;
  int head_dim, splits;
  bool varlen, lse;
  LseLayout lse_layout = LseLayout::padded;
};

/// What a row's partials hold (by row index): the kinds every launch must treat alike.
enum class RowKind { live, empty_splits, all_empty, nan_sum, nan_element, cancel };
constexpr int kRowKinds = 6;
RowKind row_kind(int64_t r) { return RowKind(r % kRowKinds); }

/// Split s of a row of kind `kind` saw no key (its partial row then holds NaN, never read):
/// split 0, and split 5 where there are six or more (a group's second split).
bool split_empty(RowKind kind, int s, int splits) {
  if (kind == RowKind::all_empty) return true;
  return kind == RowKind::empty_splits && splits > 1 && (s == 0 || (s == 5 && splits >= 6));
}

/// A cancelling row's partial element: +X and -X in one group with a small term in another
/// (five splits or more), or +X, 1, -X in groups 0, 1, 2 (three or four splits): summed in
/// another order the small term is lost or kept where the kernels' order keeps or loses it.
float cancel_value(int s, int splits) {
  constexpr float kX = 67108864.f;  // 2^26: w * X is exact for every weight here
  if (splits >= 5) return s == 0 ? kX : s == 4 ? -kX : s == 1 ? 1.f : 0.f;
  if (splits >= 3) return s == 0 ? kX : s == 2 ? -kX : s == 1 ? 1.f : 0.f;
  return s == 0 ? 1.f : 0.f;
}

class GpuCombine : public Gpu, public ::testing::WithParamInterface<CombineCase> {};

TEST_P(GpuCombine, LaunchShapesAgreeBitwiseAndWithTheHost) {
  const CombineCase c = GetParam();
  const int64_t batch = 3, heads = 5, rows = 7;  // rows: Sq, or varlen's max_seqlen_q
  const std::vector<int32_t> lens{7, 2, 5};      // varlen: sequence b has lens[b] rows
  const int padded = c.head_dim <= 64 ? 64 : c.head_dim <= 128 ? 128 : 256;
  const int64_t part_rows = int64_t(c.splits) * batch * heads * rows;

  FwdParams p;
  p.dtype = p.out_dtype = c.dtype;  // (the combine writes out_dtype)
  p.batch = batch, p.heads_q = heads, p.heads_kv = heads, p.seqlen_q = rows;
  p.head_dim = c.head_dim, p.num_splits = c.splits, p.return_lse = c.lse;
  std::vector<int32_t> cu{0};
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  const int64_t total_q = c.varlen ? cu.back() : batch * rows;
  p.o_batch_stride = c.varlen ? 0 : rows * heads * c.head_dim;
  p.o_row_stride = heads * c.head_dim, p.o_head_stride = c.head_dim;
  p.lse_layout = c.lse_layout;
  if (c.lse_layout == LseLayout::packed)  // [Hq, total_q]
    p.lse_batch_stride = 0, p.lse_head_stride = total_q, p.lse_row_stride = 1;
  else  // [B, Hq, Sq]
    p.lse_batch_stride = heads * rows, p.lse_head_stride = rows, p.lse_row_stride = 1;
  const size_t lse_size = size_t(c.lse_layout == LseLayout::packed ? heads * total_q
                                                                   : batch * heads * rows);

  // Partials: normalised outputs around 1 and states whose maxima differ by up to ~40 (base 2),
  // so that the weights span many binades; the rows' kinds as row_kind says.
  std::mt19937 rng(1234u + 17u * unsigned(c.splits) + unsigned(c.head_dim));
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> key_sum(0.5f, 60.f);
  std::vector<float> out_part(size_t(part_rows) * size_t(padded));
  for (float& x : out_part) x = normal(rng);
  std::vector<SoftmaxState> states(static_cast<size_t>(part_rows));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < rows; ++r)
        for (int s = 0; s < c.splits; ++s) {
          const int64_t pr = p.partial_row(s, b, h, r);
          float* part = &out_part[size_t(pr * padded)];
          SoftmaxState& st = states[size_t(pr)];
          st.m = 8.f * normal(rng), st.l = key_sum(rng);
          const RowKind kind = row_kind((b * heads + h) * rows + r);
          if (split_empty(kind, s, c.splits)) {
            st = SoftmaxState{};
            for (int d = 0; d < padded; ++d) part[d] = kNaN;
          }
          if (kind == RowKind::nan_sum && s == c.splits - 1) st.l = kNaN;
          if (kind == RowKind::nan_element && s == c.splits / 2) part[c.head_dim - 1] = kNaN;
          if (kind == RowKind::cancel) {
            st.m = 0.f, st.l = 1.f;  // equal weights
            for (int d = 0; d < padded; ++d) part[d] = cancel_value(s, c.splits);
          }
        }

  DeviceArray<float> d_part(out_part);
  DeviceArray<SoftmaxState> d_states(states);
  DeviceArray<int32_t> d_cu(cu);
  p.out_partial = d_part.ptr, p.state_partial = d_states.ptr;
  p.cu_seqlens_q = c.varlen ? d_cu.ptr : nullptr;

  // Each shape into outputs poisoned with a finite value, so that an expected NaN or -inf can
  // only come from the kernel.
  const uint16_t poison16 = c.dtype == DType::bf16 ? 0x4049 : 0x4248;  // 3.14 in each dtype
  const float poison_lse = 12345.f;
  const std::vector<uint16_t> out_poison(size_t(total_q * heads * c.head_dim), poison16);
  const std::vector<float> lse_poison(lse_size, poison_lse);
  auto run = [&](gpu::CombineShape shape, std::vector<uint16_t>& out, std::vector<float>& lse) {
    DeviceArray<uint16_t> d_out(out_poison);
    DeviceArray<float> d_lse(lse_poison);
    p.out = d_out.ptr;
    p.lse = c.lse ? d_lse.ptr : nullptr;
    gpu::launch_combine(p, padded, nullptr, shape);
    sync();
    out = d_out.download();
    lse = d_lse.download();
  };
  std::vector<uint16_t> out_warp, out_block, out_auto;
  std::vector<float> lse_warp, lse_block, lse_auto;
  run(gpu::CombineShape::warp_per_row, out_warp, lse_warp);
  run(gpu::CombineShape::block_per_row, out_block, lse_block);
  run(gpu::CombineShape::by_split_count, out_auto, lse_auto);
  ASSERT_EQ(0, std::memcmp(out_warp.data(), out_block.data(), out_warp.size() * sizeof(uint16_t)))
      << "the two launch shapes' outputs differ";
  ASSERT_EQ(0, std::memcmp(lse_warp.data(), lse_block.data(), lse_warp.size() * sizeof(float)))
      << "the two launch shapes' LSEs differ";
  EXPECT_EQ(out_auto, out_warp);  // up to kRowSplits splits: the warp per row
  EXPECT_EQ(0, std::memcmp(lse_auto.data(), lse_warp.data(), lse_warp.size() * sizeof(float)));

  // The host's combine of the same partials, in the kernels' order.
  const float out_tol = c.dtype == DType::bf16 ? 1.f / 128 : 1.f / 1024;  // an element's ulp
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < rows; ++r) {
        const std::string where = "b " + std::to_string(b) + " h " + std::to_string(h) +
                                  " row " + std::to_string(r);
        const int64_t len = c.varlen ? lens[size_t(b)] : rows;
        const int64_t q_start = c.varlen ? cu[size_t(b)] : 0;
        if (r >= len) {  // a padded varlen row: -inf in the padded layout; no output row
          if (c.lse && c.lse_layout == LseLayout::padded)
            EXPECT_EQ(lse_warp[size_t(p.lse_offset(b, h, 0, r))], -kInf) << where;
          continue;
        }
        SoftmaxState total;
        for (int s = 0; s < c.splits; ++s) total.merge(states[size_t(p.partial_row(s, b, h, r))]);
        const RowKind kind = row_kind((b * heads + h) * rows + r);
        if (c.lse) {
          const float got_lse = lse_warp[size_t(p.lse_offset(b, h, q_start, r))];
          if (kind == RowKind::nan_sum) EXPECT_TRUE(std::isnan(got_lse)) << where;
          else if (kind == RowKind::all_empty) EXPECT_EQ(got_lse, -kInf) << where;
          else EXPECT_NEAR(got_lse, total.lse(), 1e-5f * (1.f + std::fabs(total.lse()))) << where;
        }
        for (int d = 0; d < c.head_dim; ++d) {
          float group[combine::kGroups] = {};
          float terms = 0.f;  // sum of |w_s out_s|: the scale of the rounding
          for (int s = 0; s < c.splits; ++s) {
            const int64_t pr = p.partial_row(s, b, h, r);
            if (!states[size_t(pr)].live()) continue;
            const float t = detail::combine_weight(states[size_t(pr)], total) *
                            out_part[size_t(pr * padded + d)];
            group[s % combine::kGroups] += t;
            terms += std::fabs(t);
          }
          float want = 0.f;
          for (float g : group) want += g;
          const int64_t o = b * p.o_batch_stride + (q_start + r) * p.o_row_stride +
                            h * p.o_head_stride + d;
          const float got = detail::load_as_float(out_warp.data(), o, c.dtype);
          const bool nan_here = kind == RowKind::nan_sum ||
                                (kind == RowKind::nan_element && d == c.head_dim - 1);
          const std::string at = where + " col " + std::to_string(d);
          if (nan_here) {
            EXPECT_TRUE(std::isnan(got)) << at;
          } else if (kind == RowKind::all_empty) {
            EXPECT_EQ(got, 0.f) << at;
          } else {
            ASSERT_FALSE(std::isnan(got)) << at;
            // A cancelling row's terms are exact: no slack for them (a different order of the
            // sums moves its result by a whole weight).
            const float slack = kind == RowKind::cancel ? 0.f : 1e-6f * terms;
            EXPECT_NEAR(got, want, out_tol * std::fabs(want) + slack + 1e-6f) << at;
          }
        }
      }
}

// Every split count the warp-per-row kernel takes, both dtypes, every workspace pitch (hd96's
// columns end inside the 128 pitch), dense and varlen, LSE on and off, both LSE layouts.
const CombineCase kCases[] = {
    {"bf16_hd128_s1", DType::bf16, 128, 1, false, true},
    {"f16_hd128_s2", DType::f16, 128, 2, false, true},
    {"bf16_hd64_s3_varlen", DType::bf16, 64, 3, true, true},
    {"f16_hd128_s4_nolse", DType::f16, 128, 4, false, false},
    {"bf16_hd96_s5_varlen_packed_lse", DType::bf16, 96, 5, true, true, LseLayout::packed},
    {"f16_hd64_s6", DType::f16, 64, 6, false, true},
    {"bf16_hd128_s7_varlen", DType::bf16, 128, 7, true, true},
    {"f16_hd256_s8", DType::f16, 256, 8, false, true},
    {"bf16_hd128_s8_varlen_packed_lse", DType::bf16, 128, 8, true, true, LseLayout::packed},
};
INSTANTIATE_TEST_SUITE_P(Shapes, GpuCombine, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<CombineCase>& info) {
                           return std::string(info.param.name);
                         });

/// More splits than a warp's row holds: the warp-per-row shape is refused before any launch.
TEST_F(Gpu, WarpPerRowCombineRefusesNineSplits) {
  FwdParams p;
  p.dtype = DType::bf16, p.batch = 1, p.heads_q = 1, p.heads_kv = 1, p.seqlen_q = 1;
  p.head_dim = 128, p.num_splits = combine::kRowSplits + 1;
  EXPECT_THROW(gpu::launch_combine(p, 128, nullptr, gpu::CombineShape::warp_per_row),
               std::exception);
}

}  // namespace
}  // namespace hipflash::test
