// kvcache_forward (SPEC §7) on the CPU: a paged cache gives bitwise the out and LSE of a
// contiguous cache holding the same rows (page sizes, GQA, cache lengths incl. 0, masks, splits);
// append + attend against the fp64 reference of the appended keys; bad calls refused before
// anything is written.
#include <algorithm>
#include <functional>
#include <numeric>

#include "kvcache_cases.hpp"

namespace hipflash::test {
namespace {

class KvCache : public ::testing::TestWithParam<KvCase> {};

TEST_P(KvCache, PagedEqualsContiguousBitwiseAndMatchesTheReference) {
  const KvCase& c = GetParam();
  KvProblem t(c, 3);
  const HostTensor k_before = t.k_cache;
  HostTensor out_c = t.out, lse_c = t.lse, out_p = t.out, lse_p = t.lse;
  const bool append = c.s_new > 0;
  t.run(false, append, out_c, lse_c);
  t.run(true, append, out_p, lse_p);
  EXPECT_TRUE(out_p.bitwise_equal(out_c)) << "out: paged differs from contiguous";
  EXPECT_TRUE(lse_p.bitwise_equal(lse_c)) << "lse: paged differs from contiguous";
  EXPECT_REF_OK(t.check(out_c, lse_c, c.s_new));
  // The append wrote exactly rows lens[b] .. lens[b] + s_new - 1 of each sequence, in both
  // layouts, with the new rows' bits.
  const int64_t B = c.batch(), cap = c.capacity(), row = c.hkv * c.d, mb = c.max_blocks();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < cap; ++j) {
      const int64_t len = c.lens[size_t(b)];
      const bool is_new = j >= len && j < len + c.s_new;
      const int64_t page = t.table.i32()[b * mb + j / c.page];
      for (int64_t x = 0; x < row; x += 7) {
        const int64_t cont = (b * cap + j) * row + x;
        const float got = t.k_cache.get_raw(cont);
        const float want = is_new ? t.k_new.get_raw((b * c.s_new + j - len) * row + x)
                                  : k_before.get_raw(cont);
        ASSERT_TRUE(got == want || (std::isnan(got) && std::isnan(want)))
            << "k_cache[" << b << ", " << j << "] element " << x;
        if (is_new)
          ASSERT_EQ(t.k_pages.get_raw((page * c.page + j % c.page) * row + x), want)
              << "paged k[" << b << ", " << j << "]";
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Grid, KvCache, ::testing::ValuesIn(kv_grid()), kv_name);

/// Page sizes beyond the grid's (any page size >= 1; the GPU gathers rows for those that are not
/// powers of two from 16): SGLang's 1, odd sizes, and powers of two outside [16, 256].
std::vector<KvCase> any_page_grid() {
  std::vector<KvCase> v;
  int i = 0;
  for (int64_t page : {1, 2, 3, 8, 12, 17, 100, 512}) {
    KvCase c;
    c.dt = i % 2 ? DType::f16 : DType::bf16;
    c.page = page;
    c.hq = 8, c.hkv = 2, c.d = 64;
    c.lens = {int32_t(page * 2 + 3), 0, int32_t(page), 17};
    c.sq = i % 2 ? 5 : 1;
    c.s_new = i % 3 == 1 ? 0 : 3;
    c.causal = i % 2 == 0;
    c.splits = i % 3 == 0 ? 3 : 1;
    c.extra_blocks = i % 2;
    v.push_back(c);
    ++i;
  }
  return v;
}
INSTANTIATE_TEST_SUITE_P(AnyPageSize, KvCache, ::testing::ValuesIn(any_page_grid()), kv_name);

TEST(KvCacheApi, WithoutCacheSeqlensEverySequenceFillsItsCache) {
  KvCase c;
  c.lens = {64, 64};
  c.page = 32;
  KvProblem t(c, 4);
  HostTensor out_p = t.out, lse_p = t.lse, out_c = t.out, lse_c = t.lse;
  KvCacheOptions o = c.options();
  kvcache_forward(t.q.ref, t.k_cache.ref, t.v_cache.ref, nullptr, nullptr, nullptr, nullptr,
                  out_c.ref, &lse_c.ref, o);
  kvcache_forward(t.q.ref, t.k_pages.ref, t.v_pages.ref, nullptr, nullptr, nullptr, &t.table.ref,
                  out_p.ref, &lse_p.ref, o);
  EXPECT_TRUE(out_p.bitwise_equal(out_c));
  EXPECT_TRUE(lse_p.bitwise_equal(lse_c));
  EXPECT_REF_OK(t.check(out_c, lse_c, 0));
}

TEST(KvCacheApi, EqualsTheDenseForwardOnTheSameKeys) {
  // One sequence whose cache is full: the dense forward on the same k/v, bitwise.
  KvCase c;
  c.lens = {200};
  c.page = 16;
  c.causal = true;
  c.sq = 9;
  KvProblem t(c, 5);
  const int64_t cap = c.capacity();
  ASSERT_EQ(cap, 208);
  HostTensor out_k = t.out, lse_k = t.lse, out_d = t.out, lse_d = t.lse;
  t.run(false, false, out_k, lse_k);
  TensorRef k = t.k_cache.ref, v = t.v_cache.ref;
  k.sizes[1] = v.sizes[1] = 200;
  FwdOptions o = c.options();
  forward(t.q.ref, k, v, out_d.ref, &lse_d.ref, o);
  EXPECT_TRUE(out_k.bitwise_equal(out_d));
  EXPECT_TRUE(lse_k.bitwise_equal(lse_d));
}

/// An fp8 cache (float8_e4m3fn K / k_scale, V / v_scale; bfloat16 q and new rows) equals the
/// bfloat16 cache of its dequantised values, appends included (each new row quantised in place,
/// saturating at 448): power-of-two scales make every scaling exact, so out and the LSE agree
/// bitwise, and so do the caches after the append.
TEST(KvCacheApi, Fp8CacheEqualsTheBf16CacheOfItsDequantisedValues) {
  for (bool paged : {false, true}) {
    KvCase c;
    c.sq = 3, c.lens = {37, 5}, c.s_new = 2, c.causal = true, c.splits = 2;
    KvProblem t(c, 5);
    const float ks = 0.5f, vs = 0.25f;
    t.k_new.set_raw(0, 1000.f);  // 2000 after the scale: saturates to 448
    auto e4m3 = [](float x) {
      return e4m3_to_float(float_to_e4m3(std::isnan(x) ? x : std::clamp(x, -448.f, 448.f)));
    };
    // The fp8 cache (and new rows) of a bfloat16 tensor, whose values become the dequantised ones.
    auto quantise = [&](HostTensor& bf, float scale) {
      HostTensor f8(DType::e4m3, {bf.ref.sizes[0], bf.ref.sizes[1], bf.ref.sizes[2],
                                  bf.ref.sizes[3]});
      for (int64_t i = 0; i < bf.ref.numel(); ++i) {
        const float q8 = e4m3(bf.get_raw(i) / scale);
        f8.set_raw(i, q8);
        bf.set_raw(i, q8 * scale);
      }
      return f8;
    };
    HostTensor& kc = paged ? t.k_pages : t.k_cache;
    HostTensor& vc = paged ? t.v_pages : t.v_cache;
    HostTensor k8 = quantise(kc, ks), v8 = quantise(vc, vs);
    HostTensor kn_deq = t.k_new, vn_deq = t.v_new;  // the bf16 run appends dequantised rows
    quantise(kn_deq, ks);
    quantise(vn_deq, vs);
    HostTensor ksr(DType::f32, {1}), vsr(DType::f32, {});
    ksr.f32()[0] = ks, vsr.f32()[0] = vs;
    KvCacheOptions o8 = c.options();
    o8.k_scale = &ksr.ref, o8.v_scale = &vsr.ref;
    HostTensor out8 = t.out, lse8 = t.lse, out = t.out, lse = t.lse;
    const TensorRef* table = paged ? &t.table.ref : nullptr;
    kvcache_forward(t.q.ref, k8.ref, v8.ref, &t.k_new.ref, &t.v_new.ref, &t.seqlens.ref, table,
                    out8.ref, &lse8.ref, o8);
    kvcache_forward(t.q.ref, kc.ref, vc.ref, &kn_deq.ref, &vn_deq.ref, &t.seqlens.ref, table,
                    out.ref, &lse.ref, c.options());
    EXPECT_TRUE(out8.bitwise_equal(out)) << "paged " << paged;
    EXPECT_TRUE(lse8.bitwise_equal(lse)) << "paged " << paged;
    EXPECT_FALSE(out8.all_nan());
    for (int64_t i = 0; i < kc.ref.numel(); ++i) {
      const float k = k8.get_raw(i) * ks, want = kc.get_raw(i);
      ASSERT_TRUE(k == want || (std::isnan(k) && std::isnan(want))) << "k element " << i;
      const float v = v8.get_raw(i) * vs, want_v = vc.get_raw(i);
      ASSERT_TRUE(v == want_v || (std::isnan(v) && std::isnan(want_v))) << "v element " << i;
    }
    if (!paged) EXPECT_EQ(k8.get_raw(37 * c.hkv * c.d), 448.f);  // sequence 0's first new row
  }
}

/// Thrown E (or a subclass) whose message holds `what`, and out untouched.
template <class E>
void expect_refused(const std::string& what, const std::function<void()>& call,
                    const HostTensor& out) {
  try {
    call();
    ADD_FAILURE() << "no exception; expected '" << what << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
  EXPECT_TRUE(out.all_nan()) << what;
}

TEST(KvCacheApi, Fp8CacheScalesAndQueriesAreValidated) {
  KvCase c;
  c.lens = {4};
  KvProblem t(c, 1);
  HostTensor k8(DType::e4m3, {1, c.capacity(), c.hkv, c.d}), v8 = k8;
  HostTensor scale(DType::f32, {1}), wide(DType::f32, {2});
  scale.f32()[0] = 1.f;
  KvCacheOptions o = c.options();
  auto call = [&](const TensorRef& q, const TensorRef& kc, const TensorRef& vc) {
    return [&, q, kc, vc] {
      kvcache_forward(q, kc, vc, nullptr, nullptr, &t.seqlens.ref, nullptr, t.out.ref,
                      &t.lse.ref, o);
    };
  };
  o.k_scale = &scale.ref;
  expect_refused<invalid_argument>("k_scale applies to float8_e4m3fn caches only",
                                   call(t.q.ref, t.k_cache.ref, t.v_cache.ref), t.out);
  o.k_scale = &wide.ref;
  expect_refused<invalid_argument>("k_scale must have shape", call(t.q.ref, k8.ref, v8.ref),
                                   t.out);
  o.k_scale = nullptr;
  expect_refused<dtype_error>("v_cache must have dtype", call(t.q.ref, k8.ref, t.v_cache.ref),
                              t.out);
  TensorRef q8 = t.q.ref;
  q8.dtype = DType::e4m3;
  expect_refused<not_implemented>("float8_e4m3fn queries with a KV cache",
                                  call(q8, k8.ref, v8.ref), t.out);
}

TEST(KvCacheApi, WrittenBuffersMayAliasNothing) {
  // check_written_buffers: what the Python package's own appends are checked with.
  KvCase c;
  c.lens = {5, 9};
  c.s_new = 1;
  KvProblem t(c, 2);
  const TensorRef& kc = t.k_cache.ref;
  const TensorRef& vc = t.v_cache.ref;
  auto refused = [](const std::vector<NamedRef>& w, const std::vector<NamedRef>& r,
                    const std::string& what) {
    try {
      check_written_buffers(w, r);
      ADD_FAILURE() << "no exception; expected '" << what << "'";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  check_written_buffers({{&kc, "k_cache"}, {&vc, "v_cache"}},
                        {{&t.q.ref, "q"}, {&t.k_new.ref, "k"}, {nullptr, "block_table"}});
  refused({{&kc, "k_cache"}, {&kc, "v_cache"}}, {}, "k_cache must not alias v_cache");
  TensorRef row = kc;  // a row of the cache, read as q
  row.sizes[1] = 1;
  refused({{&kc, "k_cache"}}, {{&row, "q"}}, "k_cache must not alias q");
  TensorRef expanded = kc;  // every sequence onto the first one's rows
  expanded.strides[0] = 0;
  refused({{&expanded, "k_cache"}}, {}, "k_cache must not overlap itself");
}

TEST(KvCacheApi, BadCallsAreRefusedBeforeAnythingIsWritten) {
  KvCase c;
  c.lens = {20, 40};
  c.s_new = 2;
  c.page = 16;
  KvProblem t(c, 6);
  const HostTensor k_pages = t.k_pages, k_cache = t.k_cache;
  auto expect = [&](const std::string& what, const std::function<void()>& call) {
    try {
      call();
      ADD_FAILURE() << "no exception; expected '" << what << "'";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_TRUE(t.out.all_nan()) << what;
    EXPECT_TRUE(t.lse.all_nan()) << what;
    EXPECT_TRUE(t.k_pages.bitwise_equal(k_pages)) << what;
    EXPECT_TRUE(t.k_cache.bitwise_equal(k_cache)) << what;
  };
  const KvCacheOptions o = c.options();
  auto paged = [&](const TensorRef& kp, const TensorRef& vp, const TensorRef* table,
                   const TensorRef* lens) {
    kvcache_forward(t.q.ref, kp, vp, &t.k_new.ref, &t.v_new.ref, lens, table, t.out.ref,
                    &t.lse.ref, o);
  };
  {
    HostTensor kp(c.dt, {4, 0, c.hkv, c.d}), vp(c.dt, {4, 0, c.hkv, c.d});
    expect("must be >= 1", [&] { paged(kp.ref, vp.ref, &t.table.ref, &t.seqlens.ref); });
  }
  const int64_t mb = c.max_blocks(), blocks = t.k_pages.ref.sizes[0];
  HostTensor table = t.table;
  table.i32()[1 * mb + 1] = int32_t(blocks);  // sequence 1 uses entries 0..2
  expect("is not a page of the cache", [&] { paged(t.k_pages.ref, t.v_pages.ref, &table.ref, &t.seqlens.ref); });
  table = t.table;
  table.i32()[0] = -1;
  expect("is not a page of the cache", [&] { paged(t.k_pages.ref, t.v_pages.ref, &table.ref, &t.seqlens.ref); });
  HostTensor lens = t.seqlens;
  lens.i32()[1] = int32_t(mb * c.page - 1);  // + 2 new keys: one row too many
  expect("needs", [&] { paged(t.k_pages.ref, t.v_pages.ref, &t.table.ref, &lens.ref); });
  lens.i32()[1] = -3;
  expect("is negative", [&] { paged(t.k_pages.ref, t.v_pages.ref, &t.table.ref, &lens.ref); });
  HostTensor f32_table(DType::f32, {2, mb});
  expect("block_table must have dtype int32", [&] { paged(t.k_pages.ref, t.v_pages.ref, &f32_table.ref, &t.seqlens.ref); });
  HostTensor short_table(DType::i32, {1, mb});
  expect("one row per sequence", [&] { paged(t.k_pages.ref, t.v_pages.ref, &short_table.ref, &t.seqlens.ref); });
  HostTensor long_lens(DType::i32, {3});
  expect("cache_seqlens must have one entry per sequence", [&] { paged(t.k_pages.ref, t.v_pages.ref, &t.table.ref, &long_lens.ref); });
  expect("needs cache_seqlens", [&] { paged(t.k_pages.ref, t.v_pages.ref, &t.table.ref, nullptr); });
  expect("must be given together", [&] {
    kvcache_forward(t.q.ref, t.k_cache.ref, t.v_cache.ref, &t.k_new.ref, nullptr, &t.seqlens.ref,
                    nullptr, t.out.ref, &t.lse.ref, o);
  });
  expect("out must not alias k_cache", [&] {
    TensorRef aliased = t.out.ref;
    aliased.data = t.k_pages.ref.data;
    kvcache_forward(t.q.ref, t.k_pages.ref, t.v_pages.ref, &t.k_new.ref, &t.v_new.ref,
                    &t.seqlens.ref, &t.table.ref, aliased, &t.lse.ref, o);
  });
  // Entries past what a sequence uses are never read: -1 there is fine.
  table = t.table;
  table.i32()[0 * mb + mb - 1] = -1;  // sequence 0 needs ceil(22 / 16) = 2 of mb = 3 entries
  ASSERT_GE(mb, 3);
  HostTensor out = t.out, lse = t.lse;
  kvcache_forward(t.q.ref, t.k_pages.ref, t.v_pages.ref, &t.k_new.ref, &t.v_new.ref,
                  &t.seqlens.ref, &table.ref, out.ref, &lse.ref, o);
  EXPECT_FALSE(out.all_nan());
}

TEST(KvCacheApi, GpuTensorsInABuildWithoutGpuKernelsAreNotImplemented) {
  if (build_info().rfind("cpu (", 0) != 0)
    GTEST_SKIP() << "this build has GPU kernels (" << build_info()
                 << "): tests/cpp/test_gpu.cu covers the GPU KV cache";
  KvCase c;
  c.lens = {3};
  KvProblem t(c, 7);
  TensorRef q = t.q.ref, k = t.k_cache.ref, v = t.v_cache.ref, s = t.seqlens.ref, o = t.out.ref,
            l = t.lse.ref;
  for (TensorRef* r : {&q, &k, &v, &s, &o, &l}) r->loc = {Location::gpu, 0};
  EXPECT_THROW(kvcache_forward(q, k, v, nullptr, nullptr, &s, nullptr, o, &l, c.options()),
               not_implemented);
  EXPECT_TRUE(t.out.all_nan());
}

// Chunked prefill (varlen_paged_forward): each sequence's query rows against the first lens[b]
// rows of its pages, checked against the fp64 reference of those keys; a bad call writes nothing.
TEST(KvCacheApi, ChunkedPrefillMatchesTheReference) {
  for (bool causal : {false, true}) {
    KvCase c;
    c.sq = 5;
    c.lens = {40, 0, 17, 33};
    c.causal = causal;
    KvProblem t(c, 11);
    const int64_t B = c.batch();
    std::vector<int32_t> lq(static_cast<size_t>(B), int32_t(c.sq));
    HostTensor cq = cu_seqlens(lq), ck = cu_seqlens(c.lens);
    VarlenOptions vo;
    static_cast<FwdOptions&>(vo) = c.options();
    vo.max_seqlen_q = c.sq;
    vo.max_seqlen_k = 40;
    const TensorRef qv = t.varlen_view(t.q.ref), ov = t.varlen_view(t.out.ref);
    varlen_paged_forward(qv, t.k_pages.ref, t.v_pages.ref, ov, &t.lse.ref, cq.ref, ck.ref,
                         t.table.ref, vo);
    EXPECT_REF_OK(t.check(t.out, t.lse, 0)) << "causal " << causal;

    HostTensor bad = t.table;
    bad.i32()[0] = int32_t(t.k_pages.ref.sizes[0]);  // sequence 0's first page does not exist
    t.out.fill(kNaN);
    EXPECT_THROW(varlen_paged_forward(qv, t.k_pages.ref, t.v_pages.ref, ov, &t.lse.ref, cq.ref,
                                      ck.ref, bad.ref, vo),
                 invalid_argument);
    EXPECT_TRUE(t.out.all_nan());
  }
}

}  // namespace
}  // namespace hipflash::test
