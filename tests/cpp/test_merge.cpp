// merge_attn_states (SPEC §7) on the CPU: attention over disjoint key sets merged by their LSEs
// equals the attention over all keys; empty parts, NaN, N-way, both LSE layouts, bad calls.
#include <cmath>
#include <functional>

#include "test_util.hpp"

namespace hipflash::test {
namespace {

/// Runs the dense forward of `t` over keys [k0, k1) only, into part `i` of the stacked buffers
/// outs [N, B * Sq, H, D] (q's dtype) and lses [N, B, H, Sq].
void forward_part(const Dense& t, int64_t k0, int64_t k1, HostTensor& outs, HostTensor& lses,
                  int64_t i) {
  TensorRef k = t.k.ref, v = t.v.ref, out = t.out.ref, lse = t.lse.ref;
  for (TensorRef* r : {&k, &v}) {
    r->data = static_cast<uint16_t*>(r->data) + k0 * r->strides[1];
    r->sizes[1] = k1 - k0;
  }
  out.data = static_cast<uint16_t*>(outs.ref.data) + i * outs.ref.strides[0];
  lse.data = static_cast<float*>(lses.ref.data) + i * lses.ref.strides[0];
  FwdOptions opts = t.opts;
  opts.return_lse = true;
  forward(t.q.ref, k, v, out, &lse, opts);
}

/// The merged result of splitting `t`'s keys at `cuts`, checked against the reference of the
/// whole problem (SPEC §6) and its LSE against the unsplit forward's.
void check_split(Dense t, std::vector<int64_t> cuts) {
  const int64_t B = t.q.ref.sizes[0], S = t.q.ref.sizes[1], H = t.q.ref.sizes[2],
                D = t.q.ref.sizes[3], N = int64_t(cuts.size()) - 1;
  const DType dt = t.q.ref.dtype;
  HostTensor outs(dt, {N, B * S, H, D}), lses(DType::f32, {N, B, H, S});
  for (int64_t i = 0; i < N; ++i) forward_part(t, cuts[size_t(i)], cuts[size_t(i) + 1], outs, lses, i);
  HostTensor merged(dt, {B * S, H, D}), lse(DType::f32, {B, H, S});
  merged.fill(kNaN);
  lse.fill(kNaN);
  merge_attn_states(outs.ref, lses.ref, merged.ref, &lse.ref);
  // The merged rows as a [B, S, H, D] output of the whole problem.
  TensorRef as_dense = make_tensor(merged.ref.data, dt, {B, S, H, D});
  EXPECT_REF_OK(ref::check(t.problem(), as_dense, &lse.ref)) << N << " parts";
  t.run();  // the unsplit forward
  float worst = 0.f;
  for (int64_t e = 0; e < lse.ref.numel(); ++e)
    worst = std::max(worst, std::abs(lse.f32()[e] - t.lse.f32()[e]));
  EXPECT_LE(worst, 1e-4f) << N << " parts";
}

TEST(Merge, TwoHalvesEqualTheUnsplitAttention) {
  check_split(make_dense({DType::bf16, 2, 37, 300, 4, 2, 64}, 1), {0, 150, 300});
  check_split(make_dense({DType::f16, 1, 5, 1000, 8, 2, 128}, 2), {0, 17, 1000});
}

TEST(Merge, NWay) {
  check_split(make_dense({DType::bf16, 1, 20, 500, 2, 1, 64}, 3), {0, 64, 100, 101, 380, 500});
}

TEST(Merge, EmptyPartsContributeNothing) {
  // Parts with lse -inf and garbage (NaN) out are never read; all empty gives 0 and -inf.
  const int64_t T = 3, H = 2, D = 8;
  HostTensor outs(DType::f32, {3, T, H, D}), lses(DType::f32, {3, H, T});
  outs.fill(kNaN);
  lses.fill(-kInf);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      if (t == 2) continue;  // row 2: every part empty
      lses.f32()[1 * H * T + h * T + t] = 0.5f;
      for (int64_t d = 0; d < D; ++d) outs.f32()[((1 * T + t) * H + h) * D + d] = float(d);
    }
  HostTensor out(DType::f32, {T, H, D}), lse(DType::f32, {H, T});
  merge_attn_states(outs.ref, lses.ref, out.ref, &lse.ref);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(lse.f32()[h * T + t], t == 2 ? -kInf : 0.5f);
      for (int64_t d = 0; d < D; ++d) EXPECT_EQ(out.f32()[(t * H + h) * D + d], t == 2 ? 0.f : float(d));
    }
  }
}

TEST(Merge, NanReachesWhatItTouches) {
  const int64_t T = 2, H = 1, D = 4;
  HostTensor outs(DType::f32, {2, T, H, D}), lses(DType::f32, {2, H, T});
  for (int64_t e = 0; e < outs.ref.numel(); ++e) outs.f32()[e] = 1.f;
  lses.f32()[0] = 0.f, lses.f32()[1] = 0.f;    // part 0, rows 0, 1
  lses.f32()[2] = kNaN, lses.f32()[3] = -30.f;  // part 1: row 0 NaN, row 1 far below
  outs.f32()[((1 * T + 1) * H) * D + 2] = kNaN;  // part 1, row 1, column 2: weight ~1e-13
  HostTensor out(DType::f32, {T, H, D}), lse(DType::f32, {H, T});
  merge_attn_states(outs.ref, lses.ref, out.ref, &lse.ref);
  EXPECT_TRUE(std::isnan(lse.f32()[0]));
  for (int64_t d = 0; d < D; ++d) EXPECT_TRUE(std::isnan(out.f32()[d]));  // row 0: all NaN
  EXPECT_FALSE(std::isnan(lse.f32()[1]));
  for (int64_t d = 0; d < D; ++d)
    EXPECT_EQ(std::isnan(out.f32()[(1 * H) * D + d]), d == 2) << d;  // only column 2 of row 1
}

TEST(Merge, WeightsAreSoftmaxOfTheLses) {
  const double l0 = 1.0, l1 = 2.5, l2 = -0.5;
  HostTensor outs(DType::f32, {3, 1, 1, 1}), lses(DType::f32, {3, 1, 1});
  outs.f32()[0] = 10.f, outs.f32()[1] = 20.f, outs.f32()[2] = 30.f;
  lses.f32()[0] = float(l0), lses.f32()[1] = float(l1), lses.f32()[2] = float(l2);
  HostTensor out(DType::f32, {1, 1, 1}), lse(DType::f32, {1, 1});
  merge_attn_states(outs.ref, lses.ref, out.ref, &lse.ref);
  const double z = std::exp(l0) + std::exp(l1) + std::exp(l2);
  EXPECT_NEAR(lse.f32()[0], std::log(z), 1e-6);
  EXPECT_NEAR(out.f32()[0], (10 * std::exp(l0) + 20 * std::exp(l1) + 30 * std::exp(l2)) / z, 1e-4);
}

TEST(Merge, BadCallsAreRefusedBeforeAnythingIsWritten) {
  HostTensor outs(DType::bf16, {2, 3, 2, 8}), lses(DType::f32, {2, 2, 3});
  HostTensor out(DType::bf16, {3, 2, 8}), lse(DType::f32, {2, 3});
  out.fill(kNaN);
  auto expect = [&](const std::string& what, const std::function<void()>& call, bool dtype = false) {
    try {
      call();
      ADD_FAILURE() << "no exception; expected '" << what << "'";
    } catch (const dtype_error& e) {
      EXPECT_TRUE(dtype) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    } catch (const invalid_argument& e) {
      EXPECT_FALSE(dtype) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    } catch (const not_implemented& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_TRUE(out.all_nan());
  };
  HostTensor small_lse(DType::f32, {2, 2, 2});
  expect("does not match outs", [&] { merge_attn_states(outs.ref, small_lse.ref, out.ref, &lse.ref); });
  HostTensor f16_out(DType::f16, {3, 2, 8});
  expect("out must have the dtype of outs", [&] { merge_attn_states(outs.ref, lses.ref, f16_out.ref, &lse.ref); }, true);
  expect("out must not alias outs", [&] {
    TensorRef o = out.ref;
    o.data = outs.ref.data;
    merge_attn_states(outs.ref, lses.ref, o, &lse.ref);
  });
  expect("must be on the same device", [&] {
    TensorRef a = outs.ref;
    a.loc = {Location::gpu, 0};
    merge_attn_states(a, lses.ref, out.ref, &lse.ref);
  });
  expect("lse must be on the device of out", [&] {
    TensorRef d = lse.ref;
    d.loc = {Location::gpu, 0};
    merge_attn_states(outs.ref, lses.ref, out.ref, &d);
  });
}

TEST(Merge, GpuTensorsInABuildWithoutGpuKernelsAreNotImplemented) {
  if (build_info().rfind("cpu (", 0) != 0)
    GTEST_SKIP() << "this build has GPU kernels (" << build_info()
                 << "): tests/cpp/test_gpu.cu covers the GPU merge";
  HostTensor outs(DType::bf16, {2, 3, 2, 8}), lses(DType::f32, {2, 2, 3});
  HostTensor out(DType::bf16, {3, 2, 8}), lse(DType::f32, {2, 3});
  out.fill(kNaN);
  TensorRef a = outs.ref, b = lses.ref, c = out.ref, d = lse.ref;
  for (TensorRef* r : {&a, &b, &c, &d}) r->loc = {Location::gpu, 0};
  try {
    merge_attn_states(a, b, c, &d);
    ADD_FAILURE() << "no exception";
  } catch (const not_implemented& e) {
    EXPECT_NE(std::string(e.what()).find("without GPU kernels"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(out.all_nan());
}

}  // namespace
}  // namespace hipflash::test
