// The CPU backend against the fp64 reference (SPEC §3, §6), on host buffers.
#include <ostream>
#include <thread>

#include "test_util.hpp"

namespace hipflash::test {
namespace {

Dense make(const Case& c, uint32_t seed = 7) { return make_dense(c, seed); }

class CpuForward : public ::testing::TestWithParam<Case> {};

TEST_P(CpuForward, MatchesReference) {
  Dense t = make(GetParam());
  t.run();
  const ref::CheckResult r = t.check();
  EXPECT_REF_OK(r);
  EXPECT_EQ(r.rows_checked, GetParam().b * GetParam().hq * GetParam().sq);
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return info.param.name(); }

// ---- The grids ---------------------------------------------------------------------------------

std::vector<Case> odd_lengths() {
  // Odd and tiny lengths, both directions of Sq vs Sk, causal or not, with and without split.
  const std::pair<int64_t, int64_t> lens[] = {{1, 1},    {1, 203}, {2, 5},     {5, 2},   {17, 113},
                                              {113, 17}, {113, 203}, {203, 113}, {203, 203}};
  std::vector<Case> v;
  for (auto [sq, sk] : lens)
    for (bool causal : {false, true})
      for (int splits : {1, 3})
        v.push_back({DType::bf16, 2, sq, sk, 3, 1, 64, causal, -1, -1, splits});
  return v;
}
INSTANTIATE_TEST_SUITE_P(OddLengths, CpuForward, ::testing::ValuesIn(odd_lengths()), case_name);

INSTANTIATE_TEST_SUITE_P(Long, CpuForward, ::testing::Values(
    Case{DType::bf16, 1, 1023, 1023, 1, 1, 64, true, -1, -1, 2},
    Case{DType::f16, 1, 1023, 1023, 1, 1, 64, false, -1, -1, 1},
    Case{DType::bf16, 1, 1, 1023, 2, 1, 128, false, -1, -1, 17}), case_name);

std::vector<Case> head_dims_and_dtypes() {
  std::vector<Case> v;
  for (DType dt : {DType::bf16, DType::f16})
    for (int64_t d : {32, 64, 96, 128, 256})
      v.push_back({dt, 1, 113, 203, 2, 1, d, d % 64 == 0, -1, -1, 2});
  return v;
}
INSTANTIATE_TEST_SUITE_P(HeadDims, CpuForward, ::testing::ValuesIn(head_dims_and_dtypes()), case_name);

INSTANTIATE_TEST_SUITE_P(Gqa, CpuForward, ::testing::Values(  // ratios 1, 3, 6
    Case{DType::bf16, 2, 17, 203, 6, 6, 64, false, -1, -1, 1},
    Case{DType::bf16, 2, 17, 203, 6, 2, 64, true, -1, -1, 3},
    Case{DType::f16, 2, 17, 203, 6, 1, 64, true, -1, -1, 2},
    Case{DType::f16, 1, 1, 203, 6, 1, 128, false, -1, -1, 3}), case_name);

std::vector<Case> windows() {
  const std::pair<int64_t, int64_t> wins[] = {{0, 0}, {5, 0}, {16, 3}, {-1, 7}, {40, -1}, {200, 200}};
  std::vector<Case> v;
  for (auto [wl, wr] : wins)
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{113, 203}, {203, 113}})
      v.push_back({DType::bf16, 1, sq, sk, 2, 1, 64, false, wl, wr, wl == 16 ? 3 : 1});
  v.push_back({DType::f16, 1, 113, 203, 2, 2, 64, true, 16, -1, 2});  // causal + left window
  v.push_back({DType::f16, 1, 113, 203, 2, 2, 64, true, -1, 5, 1});   // causal clamps right to 0
  return v;
}
INSTANTIATE_TEST_SUITE_P(Windows, CpuForward, ::testing::ValuesIn(windows()), case_name);

std::vector<Case> decode() {
  std::vector<Case> v;
  for (int64_t sk : {1, 5, 1023, 4000})
    for (int splits : {1, 2, 3, 17}) v.push_back({DType::bf16, 2, 1, sk, 6, 1, 128, false, -1, -1, splits});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Decode, CpuForward, ::testing::ValuesIn(decode()), case_name);

INSTANTIATE_TEST_SUITE_P(Splits, CpuForward, ::testing::Values(  // 17 real splits need >= 17 key blocks
    Case{DType::bf16, 1, 17, 1100, 2, 1, 64, false, -1, -1, 17},
    Case{DType::f16, 1, 17, 1100, 2, 1, 64, true, -1, -1, 17},
    Case{DType::bf16, 1, 33, 1100, 2, 1, 64, false, 100, 0, 5}), case_name);

// ---- Masking corner cases ----------------------------------------------------------------------

TEST(CpuForwardMasks, CausalWithMoreQueriesThanKeysHasEmptyRows) {
  // Bottom-right causal: with Sq = 203 > Sk = 17 the first 186 rows see no key.
  for (int splits : {1, 3}) {
    Dense t = make({DType::bf16, 2, 203, 17, 2, 1, 64, true, -1, -1, splits});
    t.run();
    const ref::CheckResult r = t.check();
    EXPECT_REF_OK(r);
    EXPECT_EQ(r.empty_rows, 2 * 2 * 186);
    // Spot-check the contract directly: out exactly 0, lse exactly -inf, row 186 finite.
    EXPECT_EQ(t.lse.f32()[0], -kInf);
    EXPECT_EQ(t.lse.f32()[185], -kInf);
    EXPECT_TRUE(std::isfinite(t.lse.f32()[186]));
    EXPECT_EQ(t.out.get_raw(0), 0.f);
  }
}

TEST(CpuForwardMasks, WindowThatMissesEveryKey) {
  // Sq = 20, Sk = 5, window (0, 0): row i sees only key i - 15, so rows 0..14 see none.
  Dense t = make({DType::f16, 1, 20, 5, 1, 1, 64, false, 0, 0, 1});
  t.run();
  const ref::CheckResult r = t.check();
  EXPECT_REF_OK(r);
  EXPECT_EQ(r.empty_rows, 15);
}

// ---- Empty problems ----------------------------------------------------------------------------

TEST(CpuForwardEmpty, ZeroBatchOrZeroQueries) {
  for (auto [b, sq] : {std::pair<int64_t, int64_t>{0, 17}, {2, 0}, {0, 0}}) {
    Dense t(DType::bf16, b, sq, 33, 2, 1, 64);
    EXPECT_NO_THROW(t.run());
    EXPECT_TRUE(t.out.all_nan());  // empty tensors: nothing to write (storage is padding only)
    EXPECT_EQ(last_kernel_name(), "cpu_reference");
  }
}

TEST(CpuForwardEmpty, ZeroKeysGivesZeroAndMinusInf) {
  for (int splits : {0, 1, 3}) {
    Dense t(DType::f16, 2, 17, 0, 4, 2, 64);
    t.opts.num_splits = splits;
    t.run();
    for (int64_t i = 0; i < t.out.ref.numel(); ++i) ASSERT_EQ(t.out.get_raw(i), 0.f) << i;
    for (int64_t i = 0; i < t.lse.ref.numel(); ++i) ASSERT_EQ(t.lse.f32()[i], -kInf) << i;
    EXPECT_REF_OK(t.check());
  }
}

// ---- Split count, determinism, options ---------------------------------------------------------

TEST(CpuForwardSplits, ZeroEqualsTheResolvedCountBitwise) {
  const Case cases[] = {{DType::bf16, 1, 1, 1023, 1, 1, 64, false, -1, -1, 0},
                        {DType::f16, 1, 3, 2000, 2, 1, 128, true, -1, -1, 0},
                        {DType::bf16, 2, 113, 203, 2, 1, 64, false, -1, -1, 0}};
  bool saw_split = false;
  for (const Case& c : cases) {
    Dense a = make(c);
    const int resolved = resolve_num_splits(a.q.ref, a.k.ref, a.opts);
    EXPECT_GE(resolved, 1);
    saw_split |= resolved > 1;
    a.run();
    Dense b = make(c);
    b.opts.num_splits = resolved;
    b.run();
    EXPECT_TRUE(a.out.bitwise_equal(b.out)) << c << " resolved " << resolved;
    EXPECT_TRUE(a.lse.bitwise_equal(b.lse)) << c << " resolved " << resolved;
    EXPECT_REF_OK(a.check());
  }
  if (std::thread::hardware_concurrency() > 1) {
    EXPECT_TRUE(saw_split) << "the decode cases should split";
  }
}

TEST(CpuForwardSplits, SplitLseMatchesUnsplit) {
  for (int splits : {2, 3, 17}) {
    Dense a = make({DType::bf16, 1, 40, 1100, 2, 1, 64, true, -1, -1, 1});
    Dense b = make({DType::bf16, 1, 40, 1100, 2, 1, 64, true, -1, -1, splits});
    a.run();
    b.run();
    float worst = 0;
    for (int64_t i = 0; i < a.lse.ref.numel(); ++i)
      worst = std::max(worst, std::abs(a.lse.f32()[i] - b.lse.f32()[i]));
    EXPECT_LE(worst, 1e-4f) << "splits " << splits;
    EXPECT_REF_OK(b.check());
  }
}

TEST(CpuForwardDeterminism, RepeatedRunsAreBitwiseIdentical) {
  for (int splits : {1, 3}) {
    Dense t = make({DType::bf16, 2, 113, 203, 6, 2, 96, true, -1, -1, splits});
    t.run();
    const HostTensor out1 = t.out, lse1 = t.lse;
    for (int rep = 0; rep < 2; ++rep) {
      t.poison();
      t.run();
      EXPECT_TRUE(t.out.bitwise_equal(out1));
      EXPECT_TRUE(t.lse.bitwise_equal(lse1));
    }
  }
}

TEST(CpuForwardOptions, ReturnLseDoesNotChangeOut) {
  Dense a = make({DType::f16, 1, 113, 203, 2, 1, 64, true, -1, -1, 3});
  Dense b = make({DType::f16, 1, 113, 203, 2, 1, 64, true, -1, -1, 3});
  b.opts.return_lse = false;
  a.run();
  b.run();
  EXPECT_TRUE(a.out.bitwise_equal(b.out));
  EXPECT_TRUE(b.lse.all_nan());
}

TEST(CpuForwardOptions, CustomSoftmaxScale) {
  for (float scale : {0.01f, 0.5f, 2.f}) {
    Dense t = make({DType::bf16, 1, 17, 113, 2, 1, 64, false, -1, -1, 2});
    t.opts.softmax_scale = scale;
    t.run();
    EXPECT_REF_OK(t.check()) << "scale " << scale;
  }
}

TEST(CpuForwardOptions, SoftcapMatchesReference) {
  // A cap that bends most scores (2) and Gemma 2's (50), causal or not, split or not: out and
  // the LSE of the capped scores against the fp64 reference.
  for (float cap : {2.f, 50.f})
    for (bool causal : {false, true})
      for (int splits : {1, 3}) {
        Dense t = make({DType::bf16, 2, 37, 113, 4, 2, 64, causal, -1, -1, splits});
        t.opts.softcap = cap;
        t.opts.softmax_scale = 1.f;  // |scores| of several units: tanh is far from linear
        t.run();
        EXPECT_REF_OK(t.check()) << "cap " << cap << " causal " << causal << " splits " << splits;
      }
}

TEST(CpuForwardOptions, SoftcapChangesTheResult) {
  // The cap is not a no-op the reference happens to share: the capped output differs.
  Dense a = make({DType::f16, 1, 17, 64, 2, 1, 64, false, -1, -1, 1});
  Dense b = make({DType::f16, 1, 17, 64, 2, 1, 64, false, -1, -1, 1});
  a.opts.softmax_scale = b.opts.softmax_scale = 1.f;
  b.opts.softcap = 2.f;
  a.run();
  b.run();
  EXPECT_FALSE(a.out.bitwise_equal(b.out));
  EXPECT_FALSE(a.lse.bitwise_equal(b.lse));
  EXPECT_REF_OK(b.check());
}

TEST(CpuForwardOptions, AlibiMatchesReference) {
  // Slopes per head ([Hq], BLOOM's geometric ones) and per (batch, head) ([B, Hq]), with a
  // softcap or not, causal or not, split or not, Sq != Sk (the bias is 0 on the bottom-right
  // diagonal): out and the LSE of the biased scores against the fp64 reference.
  for (bool per_batch : {false, true})
    for (float cap : {0.f, 5.f})
      for (bool causal : {false, true})
        for (int splits : {1, 3}) {
          Dense t = make({DType::bf16, 2, 29, 113, 4, 2, 64, causal, -1, -1, splits});
          HostTensor slopes = per_batch ? HostTensor(DType::f32, {2, 4})
                                        : HostTensor(DType::f32, {4});
          for (int64_t i = 0; i < slopes.ref.numel(); ++i)
            slopes.f32()[i] = std::exp2(-8.f * float(i % 4 + 1) / 4.f) * float(1 + i / 4);
          t.opts.alibi_slopes = &slopes.ref;
          t.opts.softcap = cap;
          t.run();
          EXPECT_REF_OK(t.check()) << "per_batch " << per_batch << " cap " << cap << " causal "
                                   << causal << " splits " << splits;
        }
}

TEST(CpuForwardOptions, AlibiChangesTheResult) {
  Dense a = make({DType::f16, 1, 17, 64, 2, 1, 64, false, -1, -1, 1});
  Dense b = make({DType::f16, 1, 17, 64, 2, 1, 64, false, -1, -1, 1});
  HostTensor slopes(DType::f32, {2});
  slopes.f32()[0] = 0.5f, slopes.f32()[1] = 0.25f;
  b.opts.alibi_slopes = &slopes.ref;
  a.run();
  b.run();
  EXPECT_FALSE(a.out.bitwise_equal(b.out));
  EXPECT_REF_OK(b.check());
}

TEST(CpuVarlen, AlibiUsesEachSequencesOwnLengths) {
  Varlen t(DType::bf16, {5, 0, 33}, {9, 4, 40}, 4, 2, 64, LseLayout::packed, 3);
  HostTensor slopes(DType::f32, {3, 4});
  for (int64_t i = 0; i < 12; ++i) slopes.f32()[i] = 0.05f * float(i + 1);
  t.opts.alibi_slopes = &slopes.ref;
  t.opts.causal = true;
  t.run();
  EXPECT_REF_OK(t.check());
}

/// fp8 (float8_e4m3fn q, k, v; bfloat16 out): the scores are q.k * q_descale * k_descale,
/// out is scaled by v_descale, each per tensor or per (batch, kv head). With power-of-two
/// descales every scaling is exact, so the call equals bitwise the bfloat16 call on the
/// dequantised values — which the fp64 reference checks.
TEST(CpuForwardFp8, EqualsTheBf16CallOnDequantisedValues) {
  const int64_t B = 2, Sq = 29, Sk = 113, Hq = 4, Hkv = 2, D = 64;
  for (bool per_head : {false, true})
    for (bool causal : {false, true})
      for (int splits : {1, 3}) {
        Dense f(DType::e4m3, B, Sq, Sk, Hq, Hkv, D, 5);
        f.out = HostTensor(DType::bf16, {B, Sq, Hq, D});
        f.out.fill(kNaN);
        HostTensor qd = per_head ? HostTensor(DType::f32, {B, Hkv}) : HostTensor(DType::f32, {1});
        HostTensor kd = qd, vd = qd;
        for (int64_t i = 0; i < qd.ref.numel(); ++i) {
          qd.f32()[i] = std::exp2(float(i % 3) - 1.f);
          kd.f32()[i] = std::exp2(2.f - float(i % 4));
          vd.f32()[i] = std::exp2(float(i % 2) + 1.f);
        }
        // The descale of element i of a [B, S, H, D] tensor with H heads.
        auto at = [&](HostTensor& t, int64_t i, int64_t s, int64_t h) {
          const int64_t b = i / (s * h * D), hk = (i / D) % h / (h / Hkv);
          return per_head ? t.f32()[b * Hkv + hk] : t.f32()[0];
        };
        Dense r(DType::bf16, B, Sq, Sk, Hq, Hkv, D);
        for (int64_t i = 0; i < f.q.ref.numel(); ++i)
          r.q.set_raw(i, f.q.get_raw(i) * at(qd, i, Sq, Hq));
        for (int64_t i = 0; i < f.k.ref.numel(); ++i) {
          r.k.set_raw(i, f.k.get_raw(i) * at(kd, i, Sk, Hkv));
          r.v.set_raw(i, f.v.get_raw(i) * at(vd, i, Sk, Hkv));
        }
        for (FwdOptions* o : {&f.opts, &r.opts}) o->causal = causal, o->num_splits = splits;
        f.opts.q_descale = &qd.ref, f.opts.k_descale = &kd.ref, f.opts.v_descale = &vd.ref;
        f.run();
        r.run();
        const std::string what = std::string(per_head ? "per head" : "per tensor") +
                                 (causal ? " causal" : "") + " splits " + std::to_string(splits);
        EXPECT_TRUE(f.out.bitwise_equal(r.out)) << what;
        EXPECT_TRUE(f.lse.bitwise_equal(r.lse)) << what;
        EXPECT_REF_OK(r.check()) << what;
      }
}

TEST(CpuForwardFp8, DescalesAreOneByDefaultAndScaleTheScores) {
  // No descales: factors of 1. A q_descale of 3 is the same call at 3x the softmax scale.
  Dense a(DType::e4m3, 1, 17, 64, 2, 1, 64, 9), b(DType::e4m3, 1, 17, 64, 2, 1, 64, 9);
  for (Dense* t : {&a, &b}) {
    t->out = HostTensor(DType::bf16, {1, 17, 2, 64});
    t->out.fill(kNaN);
  }
  HostTensor three(DType::f32, {});
  three.f32()[0] = 3.f;
  a.opts.softmax_scale = 0.125f;
  a.opts.q_descale = &three.ref;
  b.opts.softmax_scale = 0.375f;
  a.run();
  b.run();
  EXPECT_TRUE(a.out.bitwise_equal(b.out));
  EXPECT_TRUE(a.lse.bitwise_equal(b.lse));
  EXPECT_FALSE(a.out.all_nan());
}

TEST(CpuForwardFp8, VarlenEachSequenceIsItsDenseCall) {
  // Varlen fp8 with descales per (sequence, kv head): each sequence's rows and LSEs bitwise
  // the dense fp8 call on that sequence alone with its descale row (one split each).
  const std::vector<int32_t> lq = {29, 0, 7, 40}, lk = {113, 5, 40, 17};
  const int64_t Hq = 4, Hkv = 2, D = 64, B = int64_t(lq.size());
  for (bool causal : {false, true}) {
    Varlen t(DType::e4m3, lq, lk, Hq, Hkv, D, LseLayout::packed, 7);
    const int64_t total_q = t.q.ref.sizes[0];
    t.out = HostTensor(DType::bf16, {total_q, Hq, D});
    t.out.fill(kNaN);
    HostTensor qd(DType::f32, {B, Hkv}), kd = qd, vd = qd;
    for (int64_t i = 0; i < B * Hkv; ++i) {
      qd.f32()[i] = 0.5f + 0.25f * float(i);
      kd.f32()[i] = 1.5f - 0.125f * float(i);
      vd.f32()[i] = 0.75f + 0.5f * float(i % 3);
    }
    t.opts.q_descale = &qd.ref, t.opts.k_descale = &kd.ref, t.opts.v_descale = &vd.ref;
    t.opts.causal = causal;
    t.opts.num_splits = 1;
    t.run();
    int64_t q0 = 0, k0 = 0;
    for (int64_t b = 0; b < B; ++b) {
      Dense d(DType::e4m3, 1, lq[b], lk[b], Hq, Hkv, D, 1);
      d.out = HostTensor(DType::bf16, {1, lq[b], Hq, D});
      for (int64_t i = 0; i < lq[b] * Hq * D; ++i) d.q.set_raw(i, t.q.get_raw(q0 * Hq * D + i));
      for (int64_t i = 0; i < lk[b] * Hkv * D; ++i) {
        d.k.set_raw(i, t.k.get_raw(k0 * Hkv * D + i));
        d.v.set_raw(i, t.v.get_raw(k0 * Hkv * D + i));
      }
      HostTensor dq(DType::f32, {1, Hkv}), dk = dq, dv = dq;
      for (int64_t h = 0; h < Hkv; ++h) {
        dq.f32()[h] = qd.f32()[b * Hkv + h];
        dk.f32()[h] = kd.f32()[b * Hkv + h];
        dv.f32()[h] = vd.f32()[b * Hkv + h];
      }
      d.opts.q_descale = &dq.ref, d.opts.k_descale = &dk.ref, d.opts.v_descale = &dv.ref;
      d.opts.causal = causal;
      d.opts.num_splits = 1;
      d.run();
      int64_t differ = 0;
      for (int64_t i = 0; i < lq[b] * Hq * D; ++i) {
        const float x = t.out.get_raw(q0 * Hq * D + i), y = d.out.get_raw(i);
        differ += !(x == y);
      }
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t r = 0; r < lq[b]; ++r) {
          const float x = t.lse.f32()[h * total_q + q0 + r], y = d.lse.f32()[h * lq[b] + r];
          differ += !(x == y || (std::isinf(x) && x == y));
        }
      EXPECT_EQ(differ, 0) << "sequence " << b << (causal ? " causal" : "");
      q0 += lq[b];
      k0 += lk[b];
    }
  }
}

TEST(CpuForwardOptions, StridedViews) {
  // q, k, v as views of one packed QKV buffer [B, S, 3, H, D]; out as a view with a row gap.
  const int64_t B = 2, S = 113, H = 4, D = 64;
  const DType dt = DType::bf16;
  const int64_t row = 3 * H * D;
  HostTensor qkv = HostTensor::strided(dt, {B, S, 3 * H, D}, {S * row, row, D, 1}, B * S * row);
  std::mt19937 rng(3);
  qkv.randomize(rng);
  auto view = [&](int which) {
    TensorRef t = qkv.ref;
    t.data = static_cast<uint16_t*>(qkv.ref.data) + which * H * D;
    t.sizes[2] = H;
    return t;
  };
  const TensorRef q = view(0), k = view(1), v = view(2);
  HostTensor out = HostTensor::strided(dt, {B, S, H, D}, {S * (H * D + 8), H * D + 8, D, 1},
                                       B * S * (H * D + 8));
  out.fill(kNaN);
  HostTensor lse(DType::f32, {B, H, S});
  FwdOptions opts;
  opts.return_lse = true;
  opts.causal = true;
  opts.num_splits = 2;
  forward(q, k, v, out.ref, &lse.ref, opts);
  EXPECT_REF_OK(ref::check(ref::Problem::dense(q, k, v, opts), out.ref, &lse.ref));
  // The row gaps of out are untouched.
  for (int64_t r = 0; r < B * S; ++r)
    for (int64_t g = 0; g < 8; ++g) ASSERT_TRUE(std::isnan(out.get_raw(r * (H * D + 8) + H * D + g)));
}

// ---- Varlen ------------------------------------------------------------------------------------

struct VarlenCase {
  std::vector<int32_t> lq, lk;
  bool causal;
  int splits;
};

TEST(CpuVarlen, ZeroLengthSequencesBothLayouts) {
  const VarlenCase cases[] = {
      {{5, 0, 17, 1, 0}, {7, 3, 0, 203, 0}, false, 1},
      {{5, 0, 17, 1, 0}, {7, 3, 0, 203, 0}, true, 3},
      {{113, 2, 0}, {203, 5, 9}, true, 2},   // Sq > Sk within a sequence: empty causal rows
      {{203, 1}, {17, 1100}, true, 17},
      {{0, 0}, {0, 0}, false, 1},             // nothing at all
  };
  for (const VarlenCase& c : cases)
    for (LseLayout layout : {LseLayout::padded, LseLayout::packed}) {
      Varlen t(DType::bf16, c.lq, c.lk, 6, 2, 64, layout);
      t.opts.causal = c.causal;
      t.opts.num_splits = c.splits;
      t.run();
      const ref::CheckResult r = t.check();
      EXPECT_REF_OK(r) << " layout " << int(layout) << " causal " << c.causal;
      if (layout == LseLayout::padded && !c.lq.empty()) {
        // A zero-length sequence's padded rows are all -inf (checked by ref::check too).
        for (size_t b = 0; b < c.lq.size(); ++b)
          if (c.lq[b] == 0 && t.opts.max_seqlen_q > 0) {
            EXPECT_EQ(t.lse.f32()[b * 6 * t.opts.max_seqlen_q], -kInf);
          }
      }
    }
}

TEST(CpuVarlen, MatchesDensePerSequence) {
  // Each varlen sequence equals a dense call on that sequence alone, bitwise.
  const std::vector<int32_t> lq = {17, 1, 40}, lk = {203, 9, 40};
  Varlen t(DType::f16, lq, lk, 3, 1, 96, LseLayout::packed, 11);
  t.opts.causal = true;
  t.opts.num_splits = 1;
  t.run();
  for (size_t b = 0; b < lq.size(); ++b) {
    const int64_t q0 = t.cu_q.i32()[b], k0 = t.cu_k.i32()[b];
    Dense d(DType::f16, 1, lq[b], lk[b], 3, 1, 96);
    for (int64_t i = 0; i < lq[b] * 3 * 96; ++i) d.q.set_raw(i, t.q.get_raw(q0 * 3 * 96 + i));
    for (int64_t i = 0; i < lk[b] * 96; ++i) {
      d.k.set_raw(i, t.k.get_raw(k0 * 96 + i));
      d.v.set_raw(i, t.v.get_raw(k0 * 96 + i));
    }
    d.opts.causal = true;
    d.opts.num_splits = 1;
    d.run();
    for (int64_t i = 0; i < lq[b] * 3 * 96; ++i)
      ASSERT_EQ(d.out.get_raw(i), t.out.get_raw(q0 * 3 * 96 + i));
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t i = 0; i < lq[b]; ++i)
        ASSERT_EQ(d.lse.f32()[h * lq[b] + i], t.lse.f32()[h * t.q.ref.sizes[0] + q0 + i]);
  }
}

TEST(CpuVarlen, CuSeqlensNotStartingAtZero) {
  // Sequences inside larger buffers: rows outside [cu[0], cu[B]) are neither read nor written.
  for (LseLayout layout : {LseLayout::padded, LseLayout::packed}) {
    const DType dt = DType::bf16;
    HostTensor q(dt, {12, 2, 64}), k(dt, {11, 1, 64}), v(dt, {11, 1, 64}), out(dt, {12, 2, 64});
    HostTensor cq(DType::i32, {3}), ck(DType::i32, {3});
    const int32_t cuq[] = {2, 5, 9}, cuk[] = {1, 8, 10};
    std::copy(cuq, cuq + 3, cq.i32());
    std::copy(cuk, cuk + 3, ck.i32());
    std::mt19937 rng(4);
    q.randomize(rng);
    k.fill(kNaN);  // key rows 0 and 10 lie outside every sequence
    v.fill(kNaN);
    for (int64_t i = 64; i < 10 * 64; ++i) k.set_raw(i, std::uniform_real_distribution<float>(-1, 1)(rng));
    for (int64_t i = 64; i < 10 * 64; ++i) v.set_raw(i, std::uniform_real_distribution<float>(-1, 1)(rng));
    out.fill(kNaN);
    HostTensor lse = layout == LseLayout::padded ? HostTensor(DType::f32, {2, 2, 4})
                                                 : HostTensor(DType::f32, {2, 12});
    lse.fill(kNaN);
    VarlenOptions opts;
    opts.return_lse = true;
    opts.causal = true;
    opts.num_splits = 2;
    opts.max_seqlen_q = 4;
    opts.max_seqlen_k = 7;
    opts.lse_layout = layout;
    varlen_forward(q.ref, k.ref, v.ref, out.ref, &lse.ref, cq.ref, ck.ref, opts);
    ref::CheckOptions co;
    co.lse_layout = layout;
    EXPECT_REF_OK(ref::check(ref::Problem::varlen(q.ref, k.ref, v.ref, cuq, cuk, 2, opts), out.ref,
                             &lse.ref, co));
    for (int64_t i : {0, 1, 9, 10, 11})
      for (int64_t e = 0; e < 2 * 64; ++e) ASSERT_TRUE(std::isnan(out.get_raw(i * 128 + e))) << i;
  }
}

TEST(CpuVarlen, LargerMaxSeqlenPadsWithMinusInf) {
  Varlen t(DType::bf16, {3, 5}, {4, 4}, 2, 2, 32, LseLayout::padded);
  t.opts.max_seqlen_q = 8;  // larger than any sequence (up to total_q): extra rows are -inf
  t.lse = HostTensor(DType::f32, {2, 2, 8});
  t.lse.fill(kNaN);
  t.run();
  EXPECT_REF_OK(t.check());
}

}  // namespace
}  // namespace hipflash::test
