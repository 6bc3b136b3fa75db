// The fp64 reference and the SPEC §6 checker themselves: known answers, and failures detected.
#include "test_util.hpp"

namespace hipflash::test {
namespace {

TEST(Reference, IdenticalKeysAverageTheValues) {
  // Every key equal: softmax is uniform over the valid keys, lse = s + ln(n).
  Dense t(DType::f16, 1, 3, 4, 1, 1, 32);
  for (int64_t i = 0; i < 4 * 32; ++i) t.k.set_raw(i, i % 32 == 0 ? 1.f : 0.f);
  for (int64_t i = 0; i < 3 * 32; ++i) t.q.set_raw(i, i % 32 == 0 ? 2.f : 0.f);
  for (int64_t j = 0; j < 4; ++j)
    for (int64_t d = 0; d < 32; ++d) t.v.set_raw(j * 32 + d, float(j + d));
  const ref::Output o = ref::reference_forward(t.problem());
  const double s = 2.0 * double(1.f / std::sqrt(32.f));  // the library default, a float
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(o.lse[size_t(i)], s + std::log(4.0), 1e-12);
    for (int64_t d = 0; d < 32; ++d) EXPECT_NEAR(o.out[size_t(i * 32 + d)], 1.5 + d, 1e-12);
  }
  // Causal, Sq = 3 < Sk = 4: row i sees keys 0..i+1.
  t.opts.causal = true;
  const ref::Output c = ref::reference_forward(t.problem());
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(c.lse[size_t(i)], s + std::log(double(i + 2)), 1e-12);
    EXPECT_NEAR(c.out[size_t(i * 32)], (i + 1) / 2.0, 1e-12);
  }
}

TEST(Reference, MasksAreBottomRightAligned) {
  Dense t(DType::bf16, 1, 3, 5, 1, 1, 64);
  ref::Problem p = t.problem();
  int64_t lo, hi;
  p.window_right = 0;  // causal: j <= i + 2
  p.key_range(0, 0, lo, hi);
  EXPECT_EQ(lo, 0); EXPECT_EQ(hi, 3);
  p.window_left = 1;   // i + 2 - 1 <= j <= i + 2
  p.key_range(0, 2, lo, hi);
  EXPECT_EQ(lo, 3); EXPECT_EQ(hi, 5);
  EXPECT_EQ(p.valid_pairs(), 6.0);
  Dense u(DType::bf16, 1, 5, 3, 1, 1, 64);  // Sq > Sk causal: rows 0, 1 empty
  ref::Problem pu = u.problem();
  pu.window_right = 0;
  pu.key_range(0, 1, lo, hi);
  EXPECT_EQ(lo, hi);
  EXPECT_EQ(pu.valid_pairs(), 6.0);  // 1 + 2 + 3
}

TEST(Checker, AcceptsTheCpuBackendAndRejectsCorruption) {
  Dense t(DType::bf16, 1, 17, 40, 2, 1, 64);
  t.opts.causal = true;
  t.run();
  const ref::CheckResult good = t.check();
  ASSERT_TRUE(good.ok) << good.message;
  EXPECT_GT(good.out_tol, 1e-5);
  EXPECT_EQ(good.message.rfind("PASS", 0), 0u);

  Dense bad_out = t;
  bad_out.out.set_raw(5, bad_out.out.get_raw(5) + 0.25f);
  EXPECT_FALSE(bad_out.check().ok);

  Dense nan_out = t;
  nan_out.out.set_raw(7, kNaN);
  const ref::CheckResult n = nan_out.check();
  EXPECT_FALSE(n.ok);
  EXPECT_EQ(n.nan_count, 1);

  Dense bad_lse = t;
  bad_lse.lse.f32()[3] += 0.01f;
  EXPECT_FALSE(bad_lse.check().ok);

  Dense inf_lse = t;
  inf_lse.lse.f32()[3] = -kInf;
  const ref::CheckResult i = inf_lse.check();
  EXPECT_FALSE(i.ok);
  EXPECT_EQ(i.lse_inf_mismatch, 1);
}

TEST(Checker, EmptyRowsMustBeExactlyZeroAndMinusInf) {
  Dense t(DType::f16, 1, 9, 4, 1, 1, 32);  // causal Sq > Sk: rows 0..4 empty
  t.opts.causal = true;
  t.run();
  ASSERT_TRUE(t.check().ok) << t.check().message;
  Dense finite = t;
  finite.lse.f32()[0] = -1e30f;  // a finite sentinel is not -inf
  EXPECT_FALSE(finite.check().ok);
  Dense nonzero = t;
  nonzero.out.set_raw(0, 1e-6f);
  EXPECT_FALSE(nonzero.check().ok);
}

TEST(Checker, SubsampledRows) {
  Dense t(DType::bf16, 2, 113, 64, 3, 1, 32);
  t.run();
  ref::CheckOptions co;
  co.max_rows = 50;
  const ref::CheckResult r = ref::check(t.problem(), t.out.ref, &t.lse.ref, co);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_LE(r.rows_checked, 51);
  EXPECT_GE(r.rows_checked, 40);
}

TEST(Checker, PaddedVarlenRowsMustBeMinusInf) {
  Varlen t(DType::bf16, {3, 1}, {4, 4}, 1, 1, 32, LseLayout::padded);
  t.run();
  ASSERT_TRUE(t.check().ok) << t.check().message;
  t.lse.f32()[3 + 2] = 0.f;  // sequence 1, padded row 2
  EXPECT_FALSE(t.check().ok);
}

}  // namespace
}  // namespace hipflash::test
