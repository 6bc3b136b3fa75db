// The online-softmax state and the split-K combine math (include/hipflash/detail/softmax_state.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/detail/softmax_state.hpp"

namespace hipflash::detail {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

/// Natural-log log-sum-exp of natural-unit scores, in double.
double lse_ref(const std::vector<float>& s) {
  double m = -kInf;
  for (float x : s) m = std::max(m, double(x));
  if (m == -kInf) return -kInf;
  double l = 0;
  for (float x : s) l += std::exp(double(x) - m);
  return m + std::log(l);
}

/// Folds natural-unit scores into a state the way the kernels do: a tile max, then the sum.
SoftmaxState fold(const std::vector<float>& s) {
  SoftmaxState st;
  float tile_max = -kInf;
  for (float x : s) tile_max = std::max(tile_max, x * kLog2e);
  st.update_max(tile_max);
  const float m = SoftmaxState::safe_max(st.m);
  for (float x : s) st.l += fast_exp2(x * kLog2e - m);
  return st;
}

TEST(SoftmaxState, EmptyStateIsMinusInfNotNaN) {
  SoftmaxState st;
  EXPECT_EQ(st.lse(), -kInf);
  EXPECT_EQ(SoftmaxState::lse_of(5.f, 0.f), -kInf);
  EXPECT_EQ(SoftmaxState::lse_of(-kInf, 0.f), -kInf);
  EXPECT_EQ(SoftmaxState::inv_sum(0.f), 0.f);
  EXPECT_EQ(SoftmaxState::safe_max(-kInf), 0.f);
  EXPECT_EQ(SoftmaxState::safe_max(3.f), 3.f);
}

TEST(SoftmaxState, LseOfIsNaturalLogWithBase2State) {
  // m = 3, l = 1: 2^3 = e^(3 ln 2).
  EXPECT_NEAR(SoftmaxState::lse_of(3.f, 1.f), 3.0 * std::log(2.0), 1e-6);
  // m = 0, l = 4: ln 4.
  EXPECT_NEAR(SoftmaxState::lse_of(0.f, 4.f), std::log(4.0), 1e-6);
}

TEST(SoftmaxState, RescaleNeverNaN) {
  EXPECT_EQ(SoftmaxState::rescale(-kInf, -kInf), 0.f);  // empty -> empty: sum stays 0
  EXPECT_EQ(SoftmaxState::rescale(-kInf, 2.f), 0.f);
  EXPECT_EQ(SoftmaxState::rescale(2.f, 2.f), 1.f);
  EXPECT_NEAR(SoftmaxState::rescale(1.f, 3.f), 0.25f, 1e-7);
}

TEST(SoftmaxState, UpdateMaxOnAllMaskedTile) {
  SoftmaxState st;
  const float r = st.update_max(-kInf);
  EXPECT_FALSE(std::isnan(r));
  EXPECT_EQ(st.l, 0.f);
  EXPECT_EQ(st.lse(), -kInf);
}

TEST(SoftmaxState, FoldMatchesLogSumExp) {
  const std::vector<float> s = {0.5f, -2.f, 3.25f, 1.f, -0.75f};
  EXPECT_NEAR(fold(s).lse(), lse_ref(s), 1e-5);
  const std::vector<float> big = {1000.f, 1000.f, 999.f};  // no overflow
  EXPECT_NEAR(fold(big).lse(), lse_ref(big), 1e-3);
  const std::vector<float> small = {-1000.f, -1001.f};  // no underflow to -inf
  EXPECT_NEAR(fold(small).lse(), lse_ref(small), 1e-3);
}

TEST(SoftmaxState, MergeEqualsFoldOfUnion) {
  const std::vector<float> a = {0.5f, -2.f, 3.25f}, b = {1.f, -0.75f, 4.5f, 0.f};
  std::vector<float> ab = a;
  ab.insert(ab.end(), b.begin(), b.end());
  for (bool swap : {false, true}) {
    SoftmaxState x = fold(swap ? b : a);
    const SoftmaxState y = fold(swap ? a : b);
    const float lx = x.l, ly = y.l;
    const auto w = x.merge(y);
    EXPECT_NEAR(x.lse(), lse_ref(ab), 1e-5);
    EXPECT_NEAR(x.l, lx * w.self + ly * w.other, 1e-5);
  }
}

TEST(SoftmaxState, MergeWithEmpty) {
  const SoftmaxState a = fold({1.f, 2.f});
  SoftmaxState x = a;
  const auto w = x.merge(SoftmaxState{});
  EXPECT_EQ(w.self, 1.f);
  EXPECT_EQ(w.other, 0.f);
  EXPECT_EQ(x.m, a.m);
  EXPECT_EQ(x.l, a.l);

  SoftmaxState e;
  const auto w2 = e.merge(a);
  EXPECT_EQ(w2.self, 0.f);
  EXPECT_EQ(w2.other, 1.f);
  EXPECT_EQ(e.lse(), a.lse());

  SoftmaxState both;
  const auto w3 = both.merge(SoftmaxState{});
  EXPECT_FALSE(std::isnan(w3.self) || std::isnan(w3.other));
  EXPECT_EQ(both.l, 0.f);
  EXPECT_EQ(both.lse(), -kInf);
}

TEST(SoftmaxState, FromLseRoundTrips) {
  for (float lse : {-30.f, -1.5f, 0.f, 2.25f, 80.f}) {
    EXPECT_NEAR(SoftmaxState::from_lse(lse).lse(), lse, 1e-5f * std::max(1.f, std::abs(lse)));
  }
  const SoftmaxState e = SoftmaxState::from_lse(-kInf);
  EXPECT_EQ(e.l, 0.f);
  EXPECT_EQ(e.m, -kInf);
  EXPECT_EQ(e.lse(), -kInf);
}

/// The split-K combine as the combine kernel does it: total = merge of the splits' states,
/// out = sum over the live splits of combine_weight(state_s, total) * out_s.
struct Combined {
  float lse;
  float out;
  float weight_sum;
};
Combined combine(const std::vector<SoftmaxState>& states, const std::vector<float>& outs) {
  SoftmaxState total;
  for (const SoftmaxState& st : states) total.merge(st);
  Combined c{total.lse(), 0.f, 0.f};
  for (size_t s = 0; s < states.size(); ++s) {
    if (!states[s].live()) continue;  // an empty split's row is never read
    const float w = combine_weight(states[s], total);
    c.out += w * outs[s];
    c.weight_sum += w;
  }
  return c;
}
Combined combine(const std::vector<float>& lses, const std::vector<float>& outs) {
  std::vector<SoftmaxState> states;
  for (float l : lses) states.push_back(SoftmaxState::from_lse(l));
  return combine(states, outs);
}

/// A split's state as a kernel builds it: x_j = s_j * scale * log2(e), in order.
SoftmaxState state_of(const std::vector<float>& scores, float scale) {
  SoftmaxState st;
  for (float s : scores) {
    const float x = s * scale * kLog2e;
    st.update_max(x);
    st.l += fast_exp2(x - SoftmaxState::safe_max(st.m));
  }
  return st;
}

TEST(Combine, WeightsAreSoftmaxOfSplitLse) {
  const std::vector<float> lses = {1.f, 2.5f, -0.5f};
  const Combined c = combine(lses, {10.f, 20.f, 30.f});
  const double total = std::log(std::exp(1.0) + std::exp(2.5) + std::exp(-0.5));
  EXPECT_NEAR(c.lse, total, 1e-5);
  EXPECT_NEAR(c.weight_sum, 1.f, 1e-6);
  const double want = (10 * std::exp(1.0) + 20 * std::exp(2.5) + 30 * std::exp(-0.5)) /
                      (std::exp(1.0) + std::exp(2.5) + std::exp(-0.5));
  EXPECT_NEAR(c.out, want, 1e-4);
}

TEST(Combine, EquivalentToUnsplitSoftmax) {
  // Scores split into three chunks; the per-chunk (out, lse) combined equals the whole.
  const std::vector<std::vector<float>> chunks = {{0.1f, 2.f}, {-1.f, 0.3f, 0.7f}, {3.f}};
  const std::vector<std::vector<float>> vals = {{1.f, -2.f}, {0.5f, 4.f, -1.f}, {2.f}};
  std::vector<float> lses, outs, all_s, all_v;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const double l = lse_ref(chunks[c]);
    double o = 0;
    for (size_t j = 0; j < chunks[c].size(); ++j) o += std::exp(chunks[c][j] - l) * vals[c][j];
    lses.push_back(float(l));
    outs.push_back(float(o));
    all_s.insert(all_s.end(), chunks[c].begin(), chunks[c].end());
    all_v.insert(all_v.end(), vals[c].begin(), vals[c].end());
  }
  const double l = lse_ref(all_s);
  double o = 0;
  for (size_t j = 0; j < all_s.size(); ++j) o += std::exp(all_s[j] - l) * all_v[j];
  const Combined c = combine(lses, outs);
  EXPECT_NEAR(c.lse, l, 1e-5);
  EXPECT_NEAR(c.out, o, 1e-5);
}

TEST(Combine, EmptySplitHasZeroWeight) {
  const Combined c = combine({-kInf, 0.5f, -kInf}, {12345.f, 7.f, -999.f});
  EXPECT_NEAR(c.lse, 0.5f, 1e-6);
  EXPECT_NEAR(c.out, 7.f, 1e-5);
  EXPECT_EQ(combine_weight(SoftmaxState{}, SoftmaxState::from_lse(0.5f)), 0.f);
}

TEST(Combine, AllSplitsEmptyGivesZeroAndMinusInf) {
  const Combined c = combine({-kInf, -kInf, -kInf}, {0.f, 0.f, 0.f});
  EXPECT_EQ(c.lse, -kInf);
  EXPECT_EQ(c.out, 0.f);
  EXPECT_EQ(c.weight_sum, 0.f);
  EXPECT_FALSE(std::isnan(c.lse) || std::isnan(c.out));
}

TEST(Combine, TiedHugeScoresAreWeightedExactly) {
  // q = k = 1e4 (bf16-exact), D = 64: every score is 6.4e9 * scale. Split A holds 16 tied keys,
  // split B 9: the exact weights are 16/25 and 9/25. An fp32 LSE of ~1e9 keeps no bits of
  // log(16) or log(9) and would weigh them 1/2 : 1/2.
  const float scale = 0.125f, s = 6.4e9f;
  const SoftmaxState a = state_of(std::vector<float>(16, s), scale);
  const SoftmaxState b = state_of(std::vector<float>(9, s), scale);
  const Combined c = combine({a, b}, {1.f, 0.f});
  EXPECT_NEAR(c.out, 16.f / 25.f, 1e-6f);
  EXPECT_NEAR(c.weight_sum, 1.f, 1e-6f);
  EXPECT_NEAR(c.lse, double(s) * scale + std::log(25.0), 1e-6 * double(s) * scale);
}

TEST(Combine, NanInOneSplitReachesOutAndLse) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const SoftmaxState good = state_of({0.5f, 1.f}, 1.f);
  const SoftmaxState bad = state_of({0.25f, nan}, 1.f);  // a NaN score: its sum turns NaN
  EXPECT_TRUE(std::isnan(bad.l));
  EXPECT_TRUE(std::isnan(bad.lse()));
  EXPECT_TRUE(bad.live());
  for (const auto& order : {std::vector<SoftmaxState>{good, bad}, {bad, good},
                            {SoftmaxState{}, bad, good}}) {
    const Combined c = combine(order, std::vector<float>(order.size(), 1.f));
    EXPECT_TRUE(std::isnan(c.lse));
    EXPECT_TRUE(std::isnan(c.out));
  }
  // A NaN partial output (NaN in v) is never weighed away, even where its weight underflows.
  const SoftmaxState tiny = state_of({-1000.f}, 1.f), big = state_of({1000.f}, 1.f);
  EXPECT_EQ(combine_weight(tiny, [&] { SoftmaxState t = tiny; t.merge(big); return t; }()), 0.f);
  EXPECT_TRUE(std::isnan(combine({tiny, big}, {nan, 1.f}).out));
  // An all-NaN row (a NaN query): every score NaN, the max stays -inf.
  EXPECT_TRUE(std::isnan(state_of({nan, nan}, 1.f).lse()));
  EXPECT_EQ(SoftmaxState::inv_sum(0.f), 0.f);
  EXPECT_TRUE(std::isnan(SoftmaxState::inv_sum(nan)));
}

TEST(KernelTraits, SplitImpliesLseAndNamesDescribeTheKernel) {
  using Split = FwdTraits<DType::bf16, 128, false, true, true>;
  static_assert(Split::kReturnLse, "split-K always writes partial LSE");
  using Plain = FwdTraits<DType::f16, 64, false, false, false>;
  static_assert(!Plain::kReturnLse, "no LSE unless asked");
  EXPECT_EQ((KernelKey{DType::bf16, 128, true, true, false}.name()), "bf16_hd128_masked_lse");
  EXPECT_EQ((KernelKey{DType::f16, 64, false, false, false}.name()), "fp16_hd64");
  EXPECT_EQ((KernelKey{DType::bf16, 256, false, false, true}.name()), "bf16_hd256_splitk");
}

}  // namespace
}  // namespace hipflash::detail
