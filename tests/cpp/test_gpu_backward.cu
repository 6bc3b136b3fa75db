// The GPU backward (SPEC §7, kernels/bwd): gradients from the device kernels against the CPU
// backward on the same inputs (the CPU backward is checked against fp64 autograd in
// tests/python/test_backward.py, and the GPU one there too), the deterministic path bitwise
// repeatable, varlen rows outside every sequence zero, fully masked rows zero, NaN reaching what
// it touches, and bad calls writing nothing. The gtest binary runs twice in scripts/gpu-check:
// as is (mma.sync kernels on NVIDIA) and with HIPFLASH_BWD_PORTABLE=1 (the portable kernels).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <random>

#include "gpu_test_util.hpp"
#include "hipflash/backward.hpp"
#include "hipflash/detail/selector.hpp"

namespace hipflash::test {
namespace {

struct BwdCase {
  Case c;
  bool deterministic = true;
  std::string name() const { return c.name() + (deterministic ? "_det" : "_atomic"); }
};

/// A dense problem with its forward run on the CPU (out, lse), an upstream gradient and the
/// CPU backward's gradients (the expectation).
struct BwdProblem {
  Dense t;
  HostTensor dout, dq, dk, dv;        // the GPU's results land here (NaN-poisoned first)
  HostTensor dq_cpu, dk_cpu, dv_cpu;  // the CPU backward's
  BwdOptions bo;

  const HostTensor* slopes = nullptr;  // ALiBi's, on the host (run_gpu copies them)

  /// `softcap` / `slopes`: the forward's score modifiers, which the backward then gets too.
  BwdProblem(const Case& c, bool deterministic, uint32_t seed = 7, float softcap = 0.f,
             const HostTensor* alibi_slopes = nullptr)
      : t(c.dtype, c.b, c.sq, c.sk, c.hq, c.hkv, c.d, seed), slopes(alibi_slopes) {
    t.opts.causal = c.causal;
    t.opts.window_left = c.wl;
    t.opts.window_right = c.wr;
    t.opts.num_splits = 1;
    t.opts.softcap = bo.softcap = softcap;
    if (slopes != nullptr) t.opts.alibi_slopes = bo.alibi_slopes = &slopes->ref;
    t.run();
    std::mt19937 rng(seed + 1);
    dout = t.out;
    dout.randomize(rng);
    bo.causal = c.causal;
    bo.window_left = c.wl;
    bo.window_right = c.wr;
    bo.deterministic = deterministic;
    dq = dq_cpu = t.q;
    dk = dk_cpu = t.k;
    dv = dv_cpu = t.v;
    for (HostTensor* g : {&dq, &dk, &dv, &dq_cpu, &dk_cpu, &dv_cpu}) g->fill(kNaN);
    backward(dout.ref, t.q.ref, t.k.ref, t.v.ref, t.out.ref, t.lse.ref, dq_cpu.ref, dk_cpu.ref,
             dv_cpu.ref, bo);
  }

  void run_gpu() {
    DeviceTensor q(t.q), k(t.k), v(t.v), out(t.out), lse(t.lse), d_out(dout);
    DeviceTensor g_q(dq), g_k(dk), g_v(dv);
    BwdOptions on_gpu = bo;
    std::unique_ptr<DeviceTensor> d_slopes;
    if (slopes != nullptr) {
      d_slopes = std::make_unique<DeviceTensor>(*slopes);
      on_gpu.alibi_slopes = &d_slopes->ref;
    }
    backward(d_out.ref, q.ref, k.ref, v.ref, out.ref, lse.ref, g_q.ref, g_k.ref, g_v.ref, on_gpu);
    sync();
    g_q.download(dq);
    g_k.download(dk);
    g_v.download(dv);
  }
};

/// max |a - b| over the storage, against tol * max |b| (+ a floor for all-zero gradients). NaN
/// must sit exactly where the expectation has it — or, with `nan_superset`, at least there:
/// a NaN operand row also reaches, through the tile's matrix product (0 * NaN), gradients of
/// pairs the mask excludes, as the dense fp64 autograd formulation does.
::testing::AssertionResult close(const HostTensor& a, const HostTensor& b, DType dt,
                                 const char* what, bool nan_superset = false) {
  const float rtol = dt == DType::bf16 ? 2e-2f : 5e-3f;
  float worst = 0, scale = 0;
  const int64_t n = a.storage_elems();
  for (int64_t i = 0; i < n; ++i) {
    const float x = a.get_raw(i), y = b.get_raw(i);
    if (std::isnan(x) && (std::isnan(y) || nan_superset)) continue;
    if (std::isnan(x) != std::isnan(y))
      return ::testing::AssertionFailure() << what << ": NaN mismatch at storage element " << i
                                           << " (gpu " << x << ", cpu " << y << ")";
    worst = std::max(worst, std::abs(x - y));
    scale = std::max(scale, std::abs(y));
  }
  if (worst <= rtol * scale + 1e-4f) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": max |gpu - cpu| = " << worst
                                       << " > " << rtol << " * max |cpu| (" << scale << ")";
}

/// The varlen backward of a forward-run problem on the GPU; the gradients land in dq, dk, dv.
void run_gpu_varlen_backward(const Varlen& t, const HostTensor& dout, const VarlenBwdOptions& bo,
                             HostTensor& dq, HostTensor& dk, HostTensor& dv) {
  DeviceTensor q(t.q), k(t.k), v(t.v), out(t.out), lse(t.lse), d_out(dout), cq(t.cu_q),
      ck(t.cu_k), g_q(dq), g_k(dk), g_v(dv);
  varlen_backward(d_out.ref, q.ref, k.ref, v.ref, out.ref, lse.ref, cq.ref, ck.ref, g_q.ref,
                  g_k.ref, g_v.ref, bo);
  sync();
  g_q.download(dq);
  g_k.download(dk);
  g_v.download(dv);
}

/// A forward-run varlen problem's backward on the CPU (the expectation: dq_c, dk_c, dv_c) and
/// on the GPU (dq, dk, dv), all NaN-poisoned first, for an upstream gradient drawn from `seed`.
struct VarlenBwdRun {
  HostTensor dout, dq, dk, dv, dq_c, dk_c, dv_c;

  VarlenBwdRun(const Varlen& t, uint32_t seed)
      : dout(t.out), dq(t.q), dk(t.k), dv(t.v), dq_c(t.q), dk_c(t.k), dv_c(t.v) {
    std::mt19937 rng(seed);
    dout.randomize(rng);
    for (HostTensor* g : {&dq, &dk, &dv, &dq_c, &dk_c, &dv_c}) g->fill(kNaN);
  }
  /// The backward's options for `t` (its lengths and LSE layout), causal or not.
  static VarlenBwdOptions options(const Varlen& t, bool causal, bool deterministic) {
    VarlenBwdOptions bo;
    bo.causal = causal;
    bo.deterministic = deterministic;
    bo.max_seqlen_q = t.opts.max_seqlen_q;
    bo.max_seqlen_k = t.opts.max_seqlen_k;
    bo.lse_layout = t.opts.lse_layout;
    return bo;
  }
  /// `on_gpu`: `bo` with device pointers where it holds host ones (ALiBi's slopes).
  void run(const Varlen& t, const VarlenBwdOptions& bo, const VarlenBwdOptions& on_gpu) {
    varlen_backward(dout.ref, t.q.ref, t.k.ref, t.v.ref, t.out.ref, t.lse.ref, t.cu_q.ref,
                    t.cu_k.ref, dq_c.ref, dk_c.ref, dv_c.ref, bo);
    run_gpu_varlen_backward(t, dout, on_gpu, dq, dk, dv);
  }
};

class GpuBackward : public GpuParam<BwdCase> {};

TEST_P(GpuBackward, MatchesTheCpuBackward) {
  const BwdCase& bc = GetParam();
  BwdProblem pb(bc.c, bc.deterministic);
  pb.run_gpu();
  EXPECT_TRUE(close(pb.dq, pb.dq_cpu, bc.c.dtype, "dq"));
  EXPECT_TRUE(close(pb.dk, pb.dk_cpu, bc.c.dtype, "dk"));
  EXPECT_TRUE(close(pb.dv, pb.dv_cpu, bc.c.dtype, "dv"));
}

std::vector<BwdCase> bwd_grid() {
  // (Sq, Sk): odd lengths, Sq != Sk both ways (causal then leaves rows with no key), one block,
  // several blocks of every tile.
  const std::pair<int64_t, int64_t> lens[] = {{1, 1}, {37, 50}, {130, 129}, {257, 100}, {512, 512}};
  const std::pair<int64_t, int64_t> heads[] = {{4, 4}, {4, 2}, {6, 1}};
  std::vector<BwdCase> v;
  int i = 0;
  for (int64_t d : {32, 64, 96, 128, 256})
    for (auto [sq, sk] : lens)
      for (bool causal : {false, true}) {
        auto [hq, hkv] = heads[i % 3];
        const DType dt = i % 2 ? DType::f16 : DType::bf16;
        v.push_back({Case{dt, 2, sq, sk, hq, hkv, d, causal}, i % 4 != 1});
        ++i;
      }
  // Sliding windows (both sides, right only, left only), GQA, both dq paths; hd64 and hd128
  // take the wgmma dk/dv pass (its 128- and 64-row steps), hd256 the mma.sync one.
  for (bool det : {true, false}) {
    v.push_back({Case{DType::bf16, 1, 300, 333, 4, 2, 128, false, 40, 7}, det});
    v.push_back({Case{DType::bf16, 1, 200, 180, 2, 1, 64, false, -1, 0}, det});
    v.push_back({Case{DType::f16, 1, 150, 150, 2, 2, 256, false, 0, 16}, det});
    v.push_back({Case{DType::bf16, 1, 300, 333, 4, 2, 128, false, 40, -1}, det});
    v.push_back({Case{DType::f16, 1, 333, 300, 4, 1, 64, false, 70, 9}, det});
    v.push_back({Case{DType::bf16, 2, 1024, 1024, 2, 1, 128, true}, det});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Grid, GpuBackward, ::testing::ValuesIn(bwd_grid()),
                         [](const ::testing::TestParamInfo<BwdCase>& info) { return info.param.name(); });

// The softcap and ALiBi (per head or per (batch, head)) in the backward: on Hopper the
// warp-specialised dk/dv pass's score-modifier instantiation (deterministic masked calls: the
// portable kernels), against the CPU backward — causal and not, GQA (masked: over slices of a
// group), Sq != Sk both ways, both dq paths, head dims 64 and 128.
TEST_F(Gpu, BackwardScoreModifiersMatchTheCpu) {
  int i = 0;
  for (const int64_t d : {64, 128})
    for (const bool causal : {false, true})
      for (const bool det : {false, true})
        for (const int mods : {1, 2, 3}) {  // softcap, ALiBi, both
          const bool per_batch = i % 2 == 1;
          const auto [sq, sk] = i / 3 % 2 == 0 ? std::pair<int64_t, int64_t>{300, 333}
                                               : std::pair<int64_t, int64_t>{257, 200};
          const Case c{i % 4 == 3 ? DType::f16 : DType::bf16, 2, sq, sk, 4, 2, d, causal};
          HostTensor slopes =
              per_batch ? HostTensor(DType::f32, {2, 4}) : HostTensor(DType::f32, {4});
          for (int64_t j = 0; j < slopes.ref.numel(); ++j)
            slopes.f32()[j] = std::exp2(-8.f * float(j % 4 + 1) / 4.f) * float(1 + j / 4);
          BwdProblem pb(c, det, 7 + i, mods & 1 ? 5.f : 0.f, mods & 2 ? &slopes : nullptr);
          pb.run_gpu();
          const std::string what = c.name() + (det ? " det" : " atomic") + " mods " +
                                   std::to_string(mods) + (per_batch ? " per batch" : "");
          EXPECT_TRUE(close(pb.dq, pb.dq_cpu, c.dtype, ("dq " + what).c_str()));
          EXPECT_TRUE(close(pb.dk, pb.dk_cpu, c.dtype, ("dk " + what).c_str()));
          EXPECT_TRUE(close(pb.dv, pb.dv_cpu, c.dtype, ("dv " + what).c_str()));
          ++i;
        }
  // A sliding window (masked, both sides), both modifiers, both dq paths.
  for (const bool det : {false, true}) {
    const Case c{DType::bf16, 1, 300, 333, 4, 2, 128, false, 40, 7};
    HostTensor slopes(DType::f32, {4});
    for (int64_t j = 0; j < 4; ++j) slopes.f32()[j] = 0.02f * float(j + 1);
    BwdProblem pb(c, det, 29, 5.f, &slopes);
    pb.run_gpu();
    EXPECT_TRUE(close(pb.dq, pb.dq_cpu, c.dtype, "dq window")) << det;
    EXPECT_TRUE(close(pb.dk, pb.dk_cpu, c.dtype, "dk window")) << det;
    EXPECT_TRUE(close(pb.dv, pb.dv_cpu, c.dtype, "dv window")) << det;
  }
}

// Varlen with both modifiers, ALiBi per (batch, head): each sequence's own lengths set its
// diagonal (Sq < Sk and Sq > Sk); causal and not, both dq paths.
TEST_F(Gpu, VarlenBackwardScoreModifiersMatchTheCpu) {
  for (const bool causal : {false, true})
    for (const bool det : {false, true}) {
      Varlen t(DType::bf16, {37, 200, 5}, {60, 129, 40}, 4, 2, 128, LseLayout::packed, 17);
      HostTensor slopes(DType::f32, {3, 4});
      for (int64_t j = 0; j < 12; ++j) slopes.f32()[j] = 0.03f * float(j + 1);
      t.opts.causal = causal;
      t.opts.softcap = 5.f;
      t.opts.alibi_slopes = &slopes.ref;
      t.run();
      VarlenBwdRun r(t, 5);
      VarlenBwdOptions bo = VarlenBwdRun::options(t, causal, det);
      bo.softcap = 5.f;
      bo.alibi_slopes = &slopes.ref;
      DeviceTensor d_slopes(slopes);
      VarlenBwdOptions on_gpu = bo;
      on_gpu.alibi_slopes = &d_slopes.ref;
      r.run(t, bo, on_gpu);
      EXPECT_TRUE(close(r.dq, r.dq_c, DType::bf16, "dq")) << "causal " << causal << " det " << det;
      EXPECT_TRUE(close(r.dk, r.dk_c, DType::bf16, "dk")) << "causal " << causal << " det " << det;
      EXPECT_TRUE(close(r.dv, r.dv_c, DType::bf16, "dv")) << "causal " << causal << " det " << det;
    }
}

TEST_F(Gpu, BackwardDeterministicIsBitwiseRepeatable) {
  // Causal GQA hd128, and a sliding window with a left edge at hd64 (a row block's first key
  // block is not block 0: on Hopper the ordered dq's ranks start there).
  for (const Case& c : {Case{DType::bf16, 2, 700, 900, 8, 2, 128, true},
                        Case{DType::bf16, 1, 1000, 1000, 4, 4, 64, false, 300, 0}}) {
    BwdProblem pb(c, true);
    pb.run_gpu();
    EXPECT_TRUE(close(pb.dq, pb.dq_cpu, c.dtype, "dq"));
    EXPECT_TRUE(close(pb.dk, pb.dk_cpu, c.dtype, "dk"));
    EXPECT_TRUE(close(pb.dv, pb.dv_cpu, c.dtype, "dv"));
    const HostTensor dq1 = pb.dq, dk1 = pb.dk, dv1 = pb.dv;
    DeviceTensor q(pb.t.q), k(pb.t.k), v(pb.t.v), out(pb.t.out), lse(pb.t.lse), d_out(pb.dout);
    DeviceTensor g_q(pb.dq), g_k(pb.dk), g_v(pb.dv);
    for (int run = 0; run < 50; ++run) {
      backward(d_out.ref, q.ref, k.ref, v.ref, out.ref, lse.ref, g_q.ref, g_k.ref, g_v.ref, pb.bo);
      sync();
      g_q.download(pb.dq);
      g_k.download(pb.dk);
      g_v.download(pb.dv);
      ASSERT_TRUE(pb.dq.bitwise_equal(dq1)) << "run " << run;
      ASSERT_TRUE(pb.dk.bitwise_equal(dk1)) << "run " << run;
      ASSERT_TRUE(pb.dv.bitwise_equal(dv1)) << "run " << run;
    }
  }
}

TEST_F(Gpu, BackwardRowsWithNoKeyHaveZeroGradients) {
  // Causal with Sq > Sk: the first Sq - Sk rows see no key (LSE -inf).
  for (bool det : {true, false}) {
    BwdProblem pb(Case{DType::bf16, 1, 300, 100, 2, 2, 64, true}, det);
    pb.run_gpu();
    EXPECT_TRUE(close(pb.dq, pb.dq_cpu, DType::bf16, "dq"));
    for (int64_t i = 0; i < 200; ++i)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t d = 0; d < 64; ++d)
          ASSERT_EQ(pb.dq.get_raw(pb.dq.base() + i * pb.dq.ref.strides[1] + h * pb.dq.ref.strides[2] + d), 0.f)
              << "row " << i;
  }
}

TEST_F(Gpu, BackwardNanReachesWhatItTouches) {
  // A NaN in one query row: its dq row, every dk / dv row it sees are NaN (as on the CPU); the
  // other query rows' dq stay finite.
  for (bool det : {true, false}) {
    Case c{DType::bf16, 1, 64, 80, 2, 1, 64, true};
    BwdProblem base(c, det);
    Dense t = base.t;
    t.q.set_raw(t.q.base() + 20 * t.q.ref.strides[1] + 3, kNaN);  // row 20, head 0
    t.poison();
    t.run();
    BwdProblem pb = base;
    pb.t = t;
    for (HostTensor* g : {&pb.dq_cpu, &pb.dk_cpu, &pb.dv_cpu}) g->fill(kNaN);
    backward(pb.dout.ref, t.q.ref, t.k.ref, t.v.ref, t.out.ref, t.lse.ref, pb.dq_cpu.ref,
             pb.dk_cpu.ref, pb.dv_cpu.ref, pb.bo);
    pb.run_gpu();
    EXPECT_TRUE(close(pb.dq, pb.dq_cpu, DType::bf16, "dq", true));
    EXPECT_TRUE(close(pb.dk, pb.dk_cpu, DType::bf16, "dk", true));
    EXPECT_TRUE(close(pb.dv, pb.dv_cpu, DType::bf16, "dv", true));
    EXPECT_TRUE(std::isnan(pb.dq.get_raw(pb.dq.base() + 20 * pb.dq.ref.strides[1])));
    EXPECT_FALSE(std::isnan(pb.dq.get_raw(pb.dq.base() + 19 * pb.dq.ref.strides[1])));
  }
}

TEST_F(Gpu, VarlenBackwardMatchesTheCpuAndZeroesRowsOutsideSequences) {
  for (LseLayout layout : {LseLayout::padded, LseLayout::packed})
    for (bool det : {true, false}) {
      Varlen t(DType::bf16, {0, 37, 130, 5}, {10, 60, 129, 0}, 4, 2, 96, layout, 11);
      t.opts.causal = true;
      t.run();
      VarlenBwdRun r(t, 3);
      const VarlenBwdOptions bo = VarlenBwdRun::options(t, true, det);
      r.run(t, bo, bo);
      EXPECT_TRUE(close(r.dq, r.dq_c, DType::bf16, "dq")) << int(layout) << det;
      EXPECT_TRUE(close(r.dk, r.dk_c, DType::bf16, "dk")) << int(layout) << det;
      EXPECT_TRUE(close(r.dv, r.dv_c, DType::bf16, "dv")) << int(layout) << det;
    }
}

TEST_F(Gpu, VarlenDeterministicBackwardFinishesOverUnevenHeads) {
  // A deterministic unmasked varlen call whose first sequence has one key block fewer than the
  // device has multiprocessors and whose second has two: the shape under which a block that
  // takes both short tiles of a head from a tile counter would wait on the one queued behind
  // it (a rotated walk's tile waits on later key blocks of its head; review of 6c362cc). It
  // must finish, agree with the atomic path and repeat bitwise. The forward is not run (its
  // cost on the CPU at 17k rows): random out, a constant LSE keeps every P small and finite.
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const int32_t first = int32_t(std::max(sms - 1, 1)) * kBwdSm90WsBlockN;
  Varlen t(DType::bf16, {first, 256}, {first, 256}, 1, 1, 64, LseLayout::padded, 23);
  std::mt19937 rng(29);
  t.out.randomize(rng);
  t.lse.fill(8.f);
  HostTensor dout = t.out;
  dout.randomize(rng);
  VarlenBwdOptions bo;
  bo.max_seqlen_q = t.opts.max_seqlen_q;
  bo.max_seqlen_k = t.opts.max_seqlen_k;
  bo.lse_layout = LseLayout::padded;
  HostTensor dq[3] = {t.q, t.q, t.q}, dk[3] = {t.k, t.k, t.k}, dv[3] = {t.v, t.v, t.v};
  for (int run = 0; run < 3; ++run) {  // deterministic twice, then atomic
    for (HostTensor* g : {&dq[run], &dk[run], &dv[run]}) g->fill(kNaN);
    bo.deterministic = run < 2;
    run_gpu_varlen_backward(t, dout, bo, dq[run], dk[run], dv[run]);
  }
  EXPECT_TRUE(dq[0].bitwise_equal(dq[1]) && dk[0].bitwise_equal(dk[1]) &&
              dv[0].bitwise_equal(dv[1]));
  EXPECT_TRUE(close(dq[0], dq[2], DType::bf16, "dq"));
  EXPECT_TRUE(close(dk[0], dk[2], DType::bf16, "dk"));
  EXPECT_TRUE(close(dv[0], dv[2], DType::bf16, "dv"));
}

TEST_F(Gpu, VarlenBackwardKeepsTheNextSequencesNanOut) {
  // NaN in the first query, key, value and upstream-gradient rows of sequence 1. Sequence 0's
  // last query and key blocks end inside sequence 1 (a block load reads its rows): its gradients
  // stay finite; sequence 1's are the CPU's, NaN for NaN.
  for (bool det : {true, false}) {
    Varlen t(DType::bf16, {37, 50}, {45, 60}, 2, 2, 64, LseLayout::packed, 13);
    const int64_t q1 = 37, k1 = 45;  // sequence 1's first rows
    auto poison_row = [](HostTensor& x, int64_t row) {
      x.set_raw(x.base() + row * x.ref.strides[0] + 5, kNaN);  // head 0, column 5
    };
    poison_row(t.q, q1);
    poison_row(t.k, k1);
    poison_row(t.v, k1);
    t.run();
    std::mt19937 rng(4);
    HostTensor dout = t.out;
    dout.randomize(rng);
    poison_row(dout, q1);
    HostTensor dq = t.q, dk = t.k, dv = t.v, dq_c = t.q, dk_c = t.k, dv_c = t.v;
    for (HostTensor* g : {&dq, &dk, &dv, &dq_c, &dk_c, &dv_c}) g->fill(kNaN);
    VarlenBwdOptions bo;
    bo.deterministic = det;
    bo.max_seqlen_q = t.opts.max_seqlen_q;
    bo.max_seqlen_k = t.opts.max_seqlen_k;
    bo.lse_layout = LseLayout::packed;
    varlen_backward(dout.ref, t.q.ref, t.k.ref, t.v.ref, t.out.ref, t.lse.ref, t.cu_q.ref,
                    t.cu_k.ref, dq_c.ref, dk_c.ref, dv_c.ref, bo);
    run_gpu_varlen_backward(t, dout, bo, dq, dk, dv);
    EXPECT_TRUE(close(dq, dq_c, DType::bf16, "dq", true)) << det;
    EXPECT_TRUE(close(dk, dk_c, DType::bf16, "dk", true)) << det;
    EXPECT_TRUE(close(dv, dv_c, DType::bf16, "dv", true)) << det;
    auto finite_rows = [](const HostTensor& g, int64_t rows) {
      for (int64_t i = 0; i < rows * g.ref.strides[0]; ++i)
        if (!std::isfinite(g.get_raw(g.base() + i))) return false;
      return true;
    };
    EXPECT_TRUE(finite_rows(dq, q1)) << "sequence 0's dq, det " << det;
    EXPECT_TRUE(finite_rows(dk, k1) && finite_rows(dv, k1)) << "sequence 0's dk / dv, det " << det;
  }
}

TEST_F(Gpu, VarlenBackwardRowsOutsideSequencesAreZero) {
  // cu_seqlens starting past row 0 and ending before the last row.
  Varlen t(DType::f16, {20, 33}, {20, 40}, 2, 2, 64, LseLayout::packed, 5);
  const int32_t total_q = int32_t(t.q.ref.sizes[0]), total_k = int32_t(t.k.ref.sizes[0]);
  HostTensor cu_q(DType::i32, {3}), cu_k(DType::i32, {3});
  cu_q.i32()[0] = 3, cu_q.i32()[1] = 23, cu_q.i32()[2] = total_q - 4;
  cu_k.i32()[0] = 2, cu_k.i32()[1] = 22, cu_k.i32()[2] = total_k - 1;
  t.cu_q = cu_q;
  t.cu_k = cu_k;
  t.opts.max_seqlen_q = 30;
  t.opts.max_seqlen_k = 37;
  t.run();
  std::mt19937 rng(9);
  HostTensor dout = t.out;
  dout.randomize(rng);
  HostTensor dq = t.q, dk = t.k, dv = t.v;
  for (HostTensor* g : {&dq, &dk, &dv}) g->fill(kNaN);
  VarlenBwdOptions bo;
  bo.max_seqlen_q = 30;
  bo.max_seqlen_k = 37;
  bo.lse_layout = LseLayout::packed;
  bo.deterministic = false;
  run_gpu_varlen_backward(t, dout, bo, dq, dk, dv);
  auto row_is = [](const HostTensor& g, int64_t r, bool zero) {
    for (int64_t i = 0; i < g.ref.sizes[1] * g.ref.sizes[2]; ++i) {
      const float x = g.get_raw(g.base() + r * g.ref.strides[0] + i);
      if (zero ? x != 0.f : std::isnan(x)) return false;
    }
    return true;
  };
  for (int64_t r : {0, 1, 2}) EXPECT_TRUE(row_is(dq, r, true)) << "dq row " << r;
  for (int64_t r = total_q - 4; r < total_q; ++r) EXPECT_TRUE(row_is(dq, r, true)) << "dq row " << r;
  for (int64_t r : {0, 1}) EXPECT_TRUE(row_is(dk, r, true) && row_is(dv, r, true)) << "row " << r;
  EXPECT_TRUE(row_is(dk, total_k - 1, true) && row_is(dv, total_k - 1, true));
  for (int64_t r = 3; r < total_q - 4; ++r) EXPECT_TRUE(row_is(dq, r, false)) << "dq row " << r;
}

TEST_F(Gpu, BackwardEmptyProblems) {
  // No query rows: dk / dv are zero (no row sees a key); no keys: dq is zero; no batch: nothing.
  for (bool det : {true, false}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{0, 70}, {50, 0}}) {
      BwdProblem pb(Case{DType::bf16, 2, sq, sk, 4, 2, 64}, det);
      pb.run_gpu();
      EXPECT_TRUE(close(pb.dq, pb.dq_cpu, DType::bf16, "dq")) << sq << "x" << sk;
      EXPECT_TRUE(close(pb.dk, pb.dk_cpu, DType::bf16, "dk")) << sq << "x" << sk;
      EXPECT_TRUE(close(pb.dv, pb.dv_cpu, DType::bf16, "dv")) << sq << "x" << sk;
    }
    BwdProblem none(Case{DType::bf16, 0, 10, 10, 2, 2, 64}, det);
    none.run_gpu();  // launches nothing, writes nothing
    EXPECT_TRUE(none.dq.all_nan() && none.dk.all_nan() && none.dv.all_nan());
  }
}

TEST_F(Gpu, BackwardBadCallsWriteNothing) {
  BwdProblem pb(Case{DType::bf16, 1, 40, 40, 2, 2, 64}, true);
  DeviceTensor q(pb.t.q), k(pb.t.k), v(pb.t.v), out(pb.t.out), lse(pb.t.lse), d_out(pb.dout);
  DeviceTensor g_q(pb.dq), g_k(pb.dk), g_v(pb.dv);
  auto expect_refused = [&](TensorRef dq, const std::string& what) {
    try {
      backward(d_out.ref, q.ref, k.ref, v.ref, out.ref, lse.ref, dq, g_k.ref, g_v.ref, pb.bo);
      ADD_FAILURE() << "no exception; expected '" << what << "'";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    sync();
    HostTensor dk = pb.dk, dv = pb.dv;
    g_k.download(dk);
    g_v.download(dv);
    EXPECT_TRUE(dk.all_nan() && dv.all_nan()) << what;
  };
  TensorRef misaligned = g_q.ref;  // 2 bytes in: the storage is over-allocated, never touched
  misaligned.data = static_cast<char*>(misaligned.data) + 2;
  expect_refused(misaligned, "dq must be 16-byte aligned");
  TensorRef shape = g_q.ref;
  shape.sizes[1] = 39;
  expect_refused(shape, "dq must have the shape of q");
  TensorRef q_alias = q.ref;
  expect_refused(q_alias, "dq must not alias q");
}

}  // namespace
}  // namespace hipflash::test
