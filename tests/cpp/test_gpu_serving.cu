// The GPU suite's serving paths (CUDA builds): merge_attn_states and the KV cache (append,
// contiguous and paged reads, chunked prefill) on the GPU against the CPU backend and the fp64
// reference (SPEC §7). Every test skips, with the reason, when no GPU is usable.
#include <cuda_runtime.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>

#include "gpu_test_util.hpp"
#include "kvcache_cases.hpp"

namespace hipflash::test {
namespace {

// ---- merge_attn_states on the GPU (SPEC §7) ----------------------------------------------------
//
// The GPU merge against the CPU merge over the same inputs: the same sequence of softmax-state
// operations (MergeParams::total_state), so they differ only by the device's exp2/log2 and fused
// multiply-adds: NaN, +-inf and -inf LSEs at exactly the same places, finite values within a
// rounding step of the output dtype.

struct MergeCase {
  DType dt;
  int64_t parts, batch, seqlen, heads, dim;
  bool dense;          ///< lses [N, B, H, S] (else packed [N, H, T], T = B * S)
  int64_t offset = 0;  ///< elements before outs' first element (1: misaligned, scalar path)
  std::string name() const {
    return std::string(dtype_name(dt)) + "_n" + std::to_string(parts) + "_b" + std::to_string(batch) +
           "_s" + std::to_string(seqlen) + "_h" + std::to_string(heads) + "_d" + std::to_string(dim) +
           (dense ? "_dense" : "_packed") + (offset ? "_off" + std::to_string(offset) : "");
  }
};

/// The inputs and both results of one merge.
struct MergeData {
  HostTensor outs, lses, out, lse;
  MergeData(const MergeCase& c, uint32_t seed) {
    const int64_t T = c.batch * c.seqlen, N = c.parts, H = c.heads, D = c.dim;
    outs = HostTensor::strided(c.dt, {N, T, H, D}, {T * H * D, H * D, D, 1}, N * T * H * D + c.offset);
    outs.fill(kNaN);  // storage outside the view: poison
    outs.ref.data = static_cast<char*>(outs.ref.data) + c.offset * dtype_size(c.dt);
    std::mt19937 rng(seed);
    outs.randomize(rng, 2.f);
    lses = c.dense ? HostTensor(DType::f32, {N, c.batch, H, c.seqlen}) : HostTensor(DType::f32, {N, H, T});
    out = HostTensor(c.dt, {T, H, D});
    lse = c.dense ? HostTensor(DType::f32, {c.batch, H, c.seqlen}) : HostTensor(DType::f32, {H, T});
    out.fill(kNaN);
    lse.fill(kNaN);
    // LSEs in [-6, 6]; every 7th entry an empty part (-inf); every (row, head) with
    // (t + h) % 11 == 3 has every part empty.
    std::uniform_real_distribution<float> u(-6.f, 6.f);
    const int64_t n_lse = lses.ref.numel();
    for (int64_t e = 0; e < n_lse; ++e) lses.f32()[e] = e % 7 == 5 ? -kInf : u(rng);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          if ((t + h) % 11 == 3) lses.f32()[lse_index(c, i, t, h)] = -kInf;
  }
  static int64_t lse_index(const MergeCase& c, int64_t i, int64_t t, int64_t h) {
    const int64_t T = c.batch * c.seqlen;
    return c.dense ? ((i * c.batch + t / c.seqlen) * c.heads + h) * c.seqlen + t % c.seqlen
                   : (i * c.heads + h) * T + t;
  }
};

/// Runs the merge of d's inputs on the GPU; out and lse come back into d's host buffers.
void run_gpu_merge(MergeData& d, bool return_lse = true) {
  DeviceTensor outs(d.outs), lses(d.lses), out(d.out), lse(d.lse);
  merge_attn_states(outs.ref, lses.ref, out.ref, return_lse ? &lse.ref : nullptr);
  sync();
  out.download(d.out);
  lse.download(d.lse);
}

/// Element by element over the whole storage (guard words included): NaN and infinities at the
/// same places, finite values within `rel` * max(1, |cpu|).
::testing::AssertionResult same_up_to_rounding(const HostTensor& gpu, const HostTensor& cpu,
                                               float rel) {
  const int64_t n = cpu.storage_elems();
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    const float g = gpu.get_raw(i), c = cpu.get_raw(i);
    bool ok;
    if (std::isnan(c) || std::isnan(g)) ok = std::isnan(c) && std::isnan(g);
    else if (std::isinf(c) || std::isinf(g)) ok = g == c;
    else ok = std::abs(g - c) <= rel * std::max(1.f, std::abs(c));
    if (!ok && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << n << " elements differ; first at "
                                       << first << ": gpu " << gpu.get_raw(first) << " cpu "
                                       << cpu.get_raw(first);
}

float merge_tolerance(DType dt) {
  return dt == DType::bf16 ? 8e-3f : dt == DType::f16 ? 1e-3f : 1e-5f;  // ~2 ulp of the dtype
}

class GpuMerge : public GpuParam<MergeCase> {};

TEST_P(GpuMerge, MatchesTheCpuMerge) {
  const MergeCase& c = GetParam();
  MergeData gpu(c, 11), cpu(c, 11);
  run_gpu_merge(gpu);
  merge_attn_states(cpu.outs.ref, cpu.lses.ref, cpu.out.ref, &cpu.lse.ref);
  EXPECT_TRUE(same_up_to_rounding(gpu.out, cpu.out, merge_tolerance(c.dt))) << "out";
  EXPECT_TRUE(same_up_to_rounding(gpu.lse, cpu.lse, 1e-5f)) << "lse";
  // Without an lse buffer the LSE stays untouched (NaN poison) and out is the same.
  MergeData no_lse(c, 11);
  run_gpu_merge(no_lse, false);
  EXPECT_TRUE(no_lse.lse.all_nan());
  EXPECT_TRUE(no_lse.out.bitwise_equal(gpu.out)) << "out differs without an lse buffer";
}

std::string merge_case_name(const ::testing::TestParamInfo<MergeCase>& info) {
  return info.param.name();
}

/// Two-way and N-way (past the kernel's batch of parts in flight, up to kMaxMergeParts),
/// dense and packed LSEs, every dtype, vector path (head dims 64, 128, 96, 40) and scalar path
/// (head dims 36 and 1, a misaligned view).
std::vector<MergeCase> merge_grid() {
  return {
      {DType::bf16, 2, 2, 37, 4, 64, true},     {DType::f16, 2, 1, 300, 8, 128, false},
      {DType::f32, 2, 3, 5, 2, 128, true},      {DType::bf16, 3, 2, 17, 6, 96, false},
      {DType::f16, 5, 1, 64, 4, 40, true},      {DType::bf16, 9, 2, 33, 2, 128, true},
      {DType::f32, 17, 1, 20, 3, 64, false},    {DType::bf16, kMaxMergeParts, 1, 7, 2, 64, false},
      {DType::bf16, 2, 1, 50, 3, 36, true},     {DType::f16, 4, 2, 9, 5, 1, false},
      {DType::bf16, 2, 2, 31, 4, 128, true, 1}, {DType::f32, 3, 1, 40, 2, 64, false, 3},
      {DType::bf16, 1, 2, 16, 2, 64, true},     {DType::f16, 2, 0, 16, 2, 64, true},
  };
}
INSTANTIATE_TEST_SUITE_P(Grid, GpuMerge, ::testing::ValuesIn(merge_grid()), merge_case_name);

TEST_F(Gpu, MergeNanReachesWhatItTouchesAndEmptyPartsAreNeverUsed) {
  const int64_t T = 4, H = 2, D = 64;
  MergeCase c{DType::bf16, 2, 1, T, H, D, false};
  MergeData d(c, 3);
  auto lse_at = [&](int64_t i, int64_t t, int64_t h) -> float& {
    return d.lses.f32()[MergeData::lse_index(c, i, t, h)];
  };
  auto out_at = [&](int64_t i, int64_t t, int64_t h, int64_t e) {
    return d.outs.base() + ((i * T + t) * H + h) * D + e;
  };
  for (int64_t h = 0; h < H; ++h) {
    lse_at(0, 0, h) = kNaN, lse_at(1, 0, h) = 0.f;  // row 0: a NaN LSE: every column NaN
    lse_at(0, 1, h) = 0.f, lse_at(1, 1, h) = -30.f;  // row 1: a NaN at weight ~1e-13
    d.outs.set_raw(out_at(1, 1, h, 5), kNaN);
    lse_at(0, 2, h) = -kInf, lse_at(1, 2, h) = 1.f;  // row 2: part 0 empty, its out NaN
    for (int64_t e = 0; e < D; ++e) d.outs.set_raw(out_at(0, 2, h, e), kNaN);
    lse_at(0, 3, h) = -kInf, lse_at(1, 3, h) = -kInf;  // row 3: both empty
  }
  MergeData cpu = d;
  run_gpu_merge(d);
  merge_attn_states(cpu.outs.ref, cpu.lses.ref, cpu.out.ref, &cpu.lse.ref);
  EXPECT_TRUE(same_up_to_rounding(d.out, cpu.out, merge_tolerance(c.dt)));
  EXPECT_TRUE(same_up_to_rounding(d.lse, cpu.lse, 1e-5f));
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_TRUE(std::isnan(d.lse.f32()[h * T + 0]));
    EXPECT_FALSE(std::isnan(d.lse.f32()[h * T + 1]));
    EXPECT_NEAR(d.lse.f32()[h * T + 2], 1.f, 1e-6f);
    EXPECT_EQ(d.lse.f32()[h * T + 3], -kInf);
    for (int64_t e = 0; e < D; ++e) {
      const int64_t o = (0 * H + h) * D + e;
      EXPECT_TRUE(std::isnan(d.out.get_raw(o))) << e;                           // row 0
      EXPECT_EQ(std::isnan(d.out.get_raw(o + 1 * H * D)), e == 5) << e;          // row 1
      EXPECT_EQ(d.out.get_raw(o + 2 * H * D), d.outs.get_raw(out_at(1, 2, h, e)));  // row 2
      EXPECT_EQ(d.out.get_raw(o + 3 * H * D), 0.f) << e;                        // row 3
    }
  }
}

TEST_F(Gpu, MergeOfForwardPartsEqualsTheUnsplitAttention) {
  // Parts from the CPU forward over key ranges, merged on the GPU: the attention over all keys
  // (SPEC §6 against the reference of the whole problem).
  for (auto [dt, d, cuts] : {std::tuple<DType, int64_t, std::vector<int64_t>>{DType::bf16, 64, {0, 150, 300}},
                             {DType::f16, 128, {0, 17, 64, 65, 300}}}) {
    Dense t = make_dense({dt, 2, 37, 300, 4, 2, d, false, -1, -1, 1}, 7);
    const int64_t B = 2, S = 37, H = 4, N = int64_t(cuts.size()) - 1;
    HostTensor outs(dt, {N, B * S, H, d}), lses(DType::f32, {N, B, H, S});
    for (int64_t i = 0; i < N; ++i) {
      TensorRef k = t.k.ref, v = t.v.ref, out = t.out.ref, lse = t.lse.ref;
      for (TensorRef* r : {&k, &v}) {
        r->data = static_cast<uint16_t*>(r->data) + cuts[size_t(i)] * r->strides[1];
        r->sizes[1] = cuts[size_t(i) + 1] - cuts[size_t(i)];
      }
      out.data = static_cast<uint16_t*>(outs.ref.data) + i * outs.ref.strides[0];
      lse.data = static_cast<float*>(lses.ref.data) + i * lses.ref.strides[0];
      FwdOptions o = t.opts;
      o.return_lse = true;
      forward(t.q.ref, k, v, out, &lse, o);
    }
    HostTensor merged(dt, {B * S, H, d}), lse(DType::f32, {B, H, S});
    merged.fill(kNaN);
    lse.fill(kNaN);
    {
      DeviceTensor o(outs), l(lses), r(merged), rl(lse);
      merge_attn_states(o.ref, l.ref, r.ref, &rl.ref);
      sync();
      r.download(merged);
      rl.download(lse);
    }
    const TensorRef as_dense = make_tensor(merged.ref.data, dt, {B, S, H, d});
    EXPECT_REF_OK(ref::check(t.problem(), as_dense, &lse.ref)) << N << " parts";
  }
}

TEST_F(Gpu, MergeGridStrideLoopCoversEveryRow) {
  // More pieces than the kernel's capped grid has threads (kMaxBlocks x 256 = 2^24): head dim 1
  // takes the scalar path, one piece per (row, head).
  const MergeCase c{DType::bf16, 2, 1, int64_t(1) << 20, 17, 1, false};
  MergeData gpu(c, 5), cpu(c, 5);
  run_gpu_merge(gpu);
  merge_attn_states(cpu.outs.ref, cpu.lses.ref, cpu.out.ref, &cpu.lse.ref);
  EXPECT_TRUE(same_up_to_rounding(gpu.out, cpu.out, merge_tolerance(c.dt))) << "out";
  EXPECT_TRUE(same_up_to_rounding(gpu.lse, cpu.lse, 1e-5f)) << "lse";
}

TEST_F(Gpu, MergeBadCallsWriteNothing) {
  MergeData d({DType::bf16, 2, 1, 8, 2, 64, false}, 1);
  DeviceTensor outs(d.outs), lses(d.lses), out(d.out), lse(d.lse);
  TensorRef short_lses = lses.ref;
  short_lses.sizes[2] = 7;
  EXPECT_THROW(merge_attn_states(outs.ref, short_lses, out.ref, &lse.ref), invalid_argument);
  EXPECT_THROW(merge_attn_states(outs.ref, lses.ref, out.ref, &d.lse.ref), invalid_argument);  // host lse
  TensorRef aliased = out.ref;
  aliased.data = outs.ref.data;
  EXPECT_THROW(merge_attn_states(outs.ref, lses.ref, aliased, &lse.ref), invalid_argument);
  sync();
  out.download(d.out);
  lse.download(d.lse);
  EXPECT_TRUE(d.out.all_nan());
  EXPECT_TRUE(d.lse.all_nan());
}

// ---- KV cache on the GPU (SPEC §7) -------------------------------------------------------------
//
// The append kernel, then the decode / generic kernel reading K/V through common::PagedRows or
// GatheredRows (paged: a power of two from 16 rows, or any other page size) or ContiguousRows: a paged
// and a contiguous cache give bitwise the same out and LSE, the appended caches equal the CPU
// append bitwise, and the result matches the fp64 reference of the appended keys.

class GpuKvCache : public GpuParam<KvCase> {};

TEST_P(GpuKvCache, PagedEqualsContiguousAndMatchesTheReference) {
  const KvCase& c = GetParam();
  KvProblem t(c, 3);
  const bool append = c.s_new > 0;
  HostTensor out_c = t.out, lse_c = t.lse, out_p = t.out, lse_p = t.lse;
  HostTensor kc = t.k_cache, vc = t.v_cache, kp = t.k_pages, vp = t.v_pages;
  {
    DeviceTensor q(t.q), kn(t.k_new), vn(t.v_new), lens(t.seqlens), table(t.table);
    DeviceTensor dkc(kc), dvc(vc), dkp(kp), dvp(vp), oc(out_c), lc(lse_c), op(out_p), lp(lse_p);
    const KvCacheOptions o = c.options();
    kvcache_forward(q.ref, dkc.ref, dvc.ref, append ? &kn.ref : nullptr,
                    append ? &vn.ref : nullptr, &lens.ref, nullptr, oc.ref, &lc.ref, o);
    kvcache_forward(q.ref, dkp.ref, dvp.ref, append ? &kn.ref : nullptr,
                    append ? &vn.ref : nullptr, &lens.ref, &table.ref, op.ref, &lp.ref, o);
    sync();
    // Only the decode and generic kernels read K/V through a row source (common::PagedRows).
    EXPECT_TRUE(last_kernel_name().rfind("fwd_decode_", 0) == 0 ||
                last_kernel_name().rfind("fwd_generic_", 0) == 0)
        << last_kernel_name();
    for (auto [d, h] : {std::pair{&dkc, &kc}, {&dvc, &vc}, {&dkp, &kp}, {&dvp, &vp},
                        {&oc, &out_c}, {&lc, &lse_c}, {&op, &out_p}, {&lp, &lse_p}})
      d->download(*h);
  }
  EXPECT_TRUE(out_p.bitwise_equal(out_c)) << "out: paged differs from contiguous";
  EXPECT_TRUE(lse_p.bitwise_equal(lse_c)) << "lse: paged differs from contiguous";
  // The CPU append of the same rows, bitwise.
  HostTensor out_cpu = t.out, lse_cpu = t.lse;
  t.run(false, append, out_cpu, lse_cpu);
  t.run(true, append, out_cpu, lse_cpu);
  EXPECT_TRUE(kc.bitwise_equal(t.k_cache) && vc.bitwise_equal(t.v_cache)) << "contiguous append";
  EXPECT_TRUE(kp.bitwise_equal(t.k_pages) && vp.bitwise_equal(t.v_pages)) << "paged append";
  EXPECT_REF_OK(t.check(out_c, lse_c, c.s_new));
}

INSTANTIATE_TEST_SUITE_P(Grid, GpuKvCache, ::testing::ValuesIn(kv_grid()), kv_name);

TEST_F(Gpu, KvCacheLongDecodeSplitsAndGqaPacking) {
  // Decode (Sq 1, GQA 32/8 packed into one block) over long paged caches, split-K by the
  // heuristic: paged == contiguous bitwise, and the reference on a subset of rows.
  KvCase c;
  c.sq = 1, c.hq = 32, c.hkv = 8, c.d = 128, c.page = 256, c.splits = 0, c.s_new = 1;
  c.lens = {9000, 3, 4000};
  KvProblem t(c, 9);
  HostTensor out_c = t.out, lse_c = t.lse, out_p = t.out, lse_p = t.lse;
  HostTensor kc = t.k_cache, vc = t.v_cache;
  {
    DeviceTensor q(t.q), kn(t.k_new), vn(t.v_new), lens(t.seqlens), table(t.table);
    DeviceTensor dkc(kc), dvc(vc), dkp(t.k_pages), dvp(t.v_pages), oc(out_c), lc(lse_c),
        op(out_p), lp(lse_p);
    const KvCacheOptions o = c.options();
    kvcache_forward(q.ref, dkc.ref, dvc.ref, &kn.ref, &vn.ref, &lens.ref, nullptr, oc.ref,
                    &lc.ref, o);
    kvcache_forward(q.ref, dkp.ref, dvp.ref, &kn.ref, &vn.ref, &lens.ref, &table.ref, op.ref,
                    &lp.ref, o);
    sync();
    for (auto [d, h] : {std::pair{&dkc, &kc}, {&dvc, &vc}, {&oc, &out_c}, {&lc, &lse_c},
                        {&op, &out_p}, {&lp, &lse_p}})
      d->download(*h);
  }
  EXPECT_TRUE(out_p.bitwise_equal(out_c));
  EXPECT_TRUE(lse_p.bitwise_equal(lse_c));
  t.k_cache = kc;
  t.v_cache = vc;
  EXPECT_REF_OK(t.check(out_c, lse_c, c.s_new));
}

// Chunked prefill on the GPU (varlen_paged_forward): varlen queries against the first lens[b]
// rows of each sequence's pages match the fp64 reference, and give bitwise the out and LSE of
// varlen_forward on the same keys packed contiguously where both calls run the same kernel
// (short chunks: decode; on Hopper a long chunk of packed keys runs an sm90 kernel, the paged
// call the generic one — then both are checked against the reference).
TEST_F(Gpu, ChunkedPrefillEqualsPackedKeysAndMatchesTheReference) {
  int i = 0;
  for (int64_t sq : {3, 70})
    for (int64_t page : {1, 7, 16, 256})
      for (bool causal : {false, true}) {
        KvCase c;
        c.sq = sq, c.hq = 8, c.hkv = 2, c.d = i % 2 ? 128 : 64, c.page = page;
        c.dt = i % 3 ? DType::bf16 : DType::f16;
        c.lens = {int32_t(2 * page + 5), 0, int32_t(page), 90};
        c.causal = causal, c.splits = i % 2 ? 0 : 2;
        ++i;
        KvProblem t(c, 21 + uint32_t(i));
        KvProblem::Packed pk = t.packed(0);
        for (LseLayout layout : {LseLayout::padded, LseLayout::packed}) {
          pk.opts.lse_layout = layout;
          const int64_t total_q = c.batch() * c.sq;
          HostTensor lse = layout == LseLayout::padded ? t.lse : HostTensor(DType::f32, {c.hq, total_q});
          lse.fill(kNaN);
          HostTensor out_p = t.out, lse_p = lse, out_c = t.out, lse_c = lse;
          std::string kernel, packed_kernel;
          {
            DeviceTensor q(t.q), kp(t.k_pages), vp(t.v_pages), table(t.table), cq(pk.cu_q),
                ck(pk.cu_k), k(pk.k), v(pk.v), op(out_p), lp(lse_p), oc(out_c), lc(lse_c);
            varlen_paged_forward(t.varlen_view(q.ref), kp.ref, vp.ref,
                                 t.varlen_view(op.ref), &lp.ref, cq.ref, ck.ref,
                                 table.ref, pk.opts);
            kernel = last_kernel_name();
            varlen_forward(t.varlen_view(q.ref), k.ref, v.ref,
                           t.varlen_view(oc.ref), &lc.ref, cq.ref, ck.ref, pk.opts);
            packed_kernel = last_kernel_name();
            sync();
            for (auto [d, h] : {std::pair{&op, &out_p}, {&lp, &lse_p}, {&oc, &out_c}, {&lc, &lse_c}})
              d->download(*h);
          }
          const std::string what = kv_case_name(c) + (layout == LseLayout::padded ? " padded" : " packed");
          EXPECT_TRUE(kernel.rfind(sq <= 16 ? "fwd_decode_" : "fwd_generic_", 0) == 0)
              << what << ": " << kernel;
          if (kernel == packed_kernel) {
            EXPECT_TRUE(out_p.bitwise_equal(out_c)) << what << ": out, paged differs from packed";
            EXPECT_TRUE(lse_p.bitwise_equal(lse_c)) << what << ": lse, paged differs from packed";
          } else if (layout == LseLayout::padded) {
            EXPECT_REF_OK(t.check(out_c, lse_c, 0)) << what << " (packed keys, " << packed_kernel << ")";
          }
          if (layout == LseLayout::padded) EXPECT_REF_OK(t.check(out_p, lse_p, 0)) << what;
        }
      }
}

TEST_F(Gpu, KvCacheBadCallsWriteNothing) {
  KvCase c;
  c.lens = {20, 40};
  c.s_new = 2;
  KvProblem t(c, 6);
  DeviceTensor q(t.q), kn(t.k_new), vn(t.v_new), table(t.table), kp(t.k_pages), vp(t.v_pages),
      out(t.out), lse(t.lse);
  HostTensor lens = t.seqlens;
  lens.i32()[1] = int32_t(c.capacity() - 1);  // + 2 new keys: past the capacity
  DeviceTensor dlens(lens);
  EXPECT_THROW(kvcache_forward(q.ref, kp.ref, vp.ref, &kn.ref, &vn.ref, &dlens.ref, &table.ref,
                               out.ref, &lse.ref, c.options()),
               invalid_argument);
  EXPECT_THROW(kvcache_forward(q.ref, kp.ref, vp.ref, &kn.ref, &vn.ref, &t.seqlens.ref,
                               &table.ref, out.ref, &lse.ref, c.options()),
               invalid_argument);  // host cache_seqlens
  sync();
  HostTensor back = t.k_pages, out_back = t.out;
  kp.download(back);
  out.download(out_back);
  EXPECT_TRUE(back.bitwise_equal(t.k_pages));
  EXPECT_TRUE(out_back.all_nan());
}

}  // namespace
}  // namespace hipflash::test
