// kvcache_forward (SPEC §7) on the CPU: a paged cache gives bitwise the out and LSE of a
// contiguous cache holding the same rows (page sizes, GQA, cache lengths incl. 0, masks, splits);
// append + attend against the fp64 reference of the appended keys; bad calls refused before
// anything is written.
#include <algorithm>
#include <functional>
#include <numeric>

#include "test_util.hpp"

namespace hipflash::test {
namespace {

struct KvCase {
  DType dt = DType::bf16;
  int64_t sq = 1, hq = 4, hkv = 2, d = 64, page = 16;
  std::vector<int32_t> lens;  ///< cached keys per sequence (before the append)
  int64_t s_new = 0;          ///< appended keys per sequence
  bool causal = false;
  int64_t wl = -1, wr = -1;
  int splits = 1;
  int64_t extra_blocks = 0;  ///< table columns beyond what the longest sequence needs

  int64_t batch() const { return int64_t(lens.size()); }
  int64_t max_blocks() const {
    const int64_t longest = *std::max_element(lens.begin(), lens.end()) + s_new;
    return std::max<int64_t>(1, (longest + page - 1) / page) + extra_blocks;
  }
  int64_t capacity() const { return max_blocks() * page; }
  KvCacheOptions options() const {
    KvCacheOptions o;
    o.causal = causal;
    o.window_left = wl;
    o.window_right = wr;
    o.num_splits = splits;
    o.return_lse = true;
    return o;
  }
};

/// One problem in both layouts: a contiguous cache [B, capacity, Hkv, D] and a paged one whose
/// pages hold the same rows, in shuffled page order, with spare pages and NaN everywhere a call
/// must not read (rows past each sequence's keys, spare pages).
struct KvProblem {
  KvCase c;
  HostTensor q, k_new, v_new, seqlens, out, lse;
  HostTensor k_cache, v_cache, k_pages, v_pages, table;

  explicit KvProblem(const KvCase& kc, uint32_t seed = 1) : c(kc) {
    const int64_t B = c.batch(), cap = c.capacity(), mb = c.max_blocks();
    const int64_t blocks = B * mb + 3;
    std::mt19937 rng(seed);
    q = HostTensor(c.dt, {B, c.sq, c.hq, c.d});
    q.randomize(rng);
    k_new = HostTensor(c.dt, {B, c.s_new, c.hkv, c.d});
    v_new = HostTensor(c.dt, {B, c.s_new, c.hkv, c.d});
    k_new.randomize(rng);
    v_new.randomize(rng);
    seqlens = HostTensor(DType::i32, {B});
    for (int64_t b = 0; b < B; ++b) seqlens.i32()[b] = c.lens[size_t(b)];
    out = HostTensor(c.dt, {B, c.sq, c.hq, c.d});
    lse = HostTensor(DType::f32, {B, c.hq, c.sq});
    out.fill(kNaN);
    lse.fill(kNaN);
    k_cache = HostTensor(c.dt, {B, cap, c.hkv, c.d});
    v_cache = HostTensor(c.dt, {B, cap, c.hkv, c.d});
    k_pages = HostTensor(c.dt, {blocks, c.page, c.hkv, c.d});
    v_pages = HostTensor(c.dt, {blocks, c.page, c.hkv, c.d});
    for (HostTensor* t : {&k_cache, &v_cache, &k_pages, &v_pages}) t->fill(kNaN);
    table = HostTensor(DType::i32, {B, mb});
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    const int64_t row = c.hkv * c.d;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t e = 0; e < mb; ++e) table.i32()[b * mb + e] = ids[size_t(b * mb + e)];
      for (int64_t j = 0; j < c.lens[size_t(b)]; ++j)
        for (int64_t x = 0; x < row; ++x) {
          const int64_t page = table.i32()[b * mb + j / c.page];
          const int64_t cont = (b * cap + j) * row + x, paged = (page * c.page + j % c.page) * row + x;
          const float kv = u(rng), vv = u(rng);
          k_cache.set_raw(cont, kv), k_pages.set_raw(paged, kv);
          v_cache.set_raw(cont, vv), v_pages.set_raw(paged, vv);
        }
    }
  }

  void run(bool paged, bool append, HostTensor& o, HostTensor& l) {
    kvcache_forward(q.ref, paged ? k_pages.ref : k_cache.ref, paged ? v_pages.ref : v_cache.ref,
                    append ? &k_new.ref : nullptr, append ? &v_new.ref : nullptr, &seqlens.ref,
                    paged ? &table.ref : nullptr, o.ref, &l.ref, c.options());
  }

  /// The fp64 reference of the (appended) contiguous cache: each sequence's first
  /// lens[b] + s_new keys, packed, as a varlen problem.
  ref::CheckResult check(const HostTensor& o, const HostTensor& l, int64_t appended) const {
    const int64_t B = c.batch(), cap = c.capacity(), row = c.hkv * c.d;
    std::vector<int32_t> lq(static_cast<size_t>(B), int32_t(c.sq)), lk(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) lk[size_t(b)] = int32_t(c.lens[size_t(b)] + appended);
    HostTensor cq = cu_seqlens(lq), ck = cu_seqlens(lk);
    const int64_t total_k = std::max<int32_t>(ck.i32()[B], 0);
    HostTensor kp(c.dt, {total_k, c.hkv, c.d}), vp(c.dt, {total_k, c.hkv, c.d});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < lk[size_t(b)]; ++j)
        for (int64_t x = 0; x < row; ++x) {
          const int64_t dst = (ck.i32()[b] + j) * row + x, src = (b * cap + j) * row + x;
          kp.set_raw(dst, k_cache.get_raw(src));
          vp.set_raw(dst, v_cache.get_raw(src));
        }
    VarlenOptions vo;
    static_cast<FwdOptions&>(vo) = c.options();
    vo.max_seqlen_q = c.sq;
    vo.max_seqlen_k = *std::max_element(lk.begin(), lk.end());
    const TensorRef qv = make_tensor(q.ref.data, c.dt, {B * c.sq, c.hq, c.d});
    const TensorRef ov = make_tensor(o.ref.data, c.dt, {B * c.sq, c.hq, c.d});
    const ref::Problem prob = ref::Problem::varlen(qv, kp.ref, vp.ref, cq.i32(), ck.i32(), B, vo);
    return ref::check(prob, ov, &l.ref);
  }
};

std::string kv_case_name(const KvCase& c) {
  std::string s = std::string(c.dt == DType::bf16 ? "bf16" : "f16") + "_sq" + std::to_string(c.sq) +
                  "_h" + std::to_string(c.hq) + "x" + std::to_string(c.hkv) + "_d" +
                  std::to_string(c.d) + "_page" + std::to_string(c.page) + "_len";
  for (int32_t l : c.lens) s += "_" + std::to_string(l);
  s += "_new" + std::to_string(c.s_new);
  if (c.causal) s += "_causal";
  auto bound = [](int64_t w) { return w < 0 ? std::string("inf") : std::to_string(w); };
  if (c.wl >= 0 || c.wr >= 0) s += "_win" + bound(c.wl) + "x" + bound(c.wr);
  return s + "_splits" + std::to_string(c.splits);
}
std::string kv_name(const ::testing::TestParamInfo<KvCase>& info) { return kv_case_name(info.param); }
void PrintTo(const KvCase& c, std::ostream* os) { *os << kv_case_name(c); }

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

/// Page sizes 16 .. 256, GQA ratios 1, 2, 4, 8, cache lengths 0 .. a few pages (a sequence may
/// be empty; lengths on and off page boundaries), with and without an append, masks, splits.
std::vector<KvCase> kv_grid() {
  std::vector<KvCase> v;
  int i = 0;
  for (int64_t page : {16, 32, 64, 128, 256})
    for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{4, 4}, {8, 2}, {8, 1}}) {
      KvCase c;
      c.dt = i % 2 ? DType::f16 : DType::bf16;
      c.page = page;
      c.hq = hq, c.hkv = hkv;
      c.d = i % 3 == 2 ? 128 : 64;
      c.lens = {int32_t(page * 2 + 3), 0, int32_t(page), 17};
      c.sq = i % 4 == 3 ? 5 : 1;
      c.s_new = i % 3 == 1 ? 0 : (i % 2 ? 4 : 1);
      c.causal = i % 2 == 0;
      c.splits = i % 3 == 0 ? 3 : i % 3 == 1 ? 0 : 1;
      c.extra_blocks = i % 2;
      v.push_back(c);
      ++i;
    }
  KvCase w;  // sliding window, chunk of queries longer than a sequence's keys
  w.sq = 40, w.hq = 6, w.hkv = 2, w.page = 16, w.lens = {5, 100, 0}, w.s_new = 8;
  w.causal = true, w.wl = 20, w.splits = 2;
  v.push_back(w);
  w.causal = false, w.wl = 7, w.wr = 3, w.dt = DType::f16, w.d = 96;
  v.push_back(w);
  return v;
}
INSTANTIATE_TEST_SUITE_P(Grid, KvCache, ::testing::ValuesIn(kv_grid()), kv_name);

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
  for (int64_t bad_page : {8, 24, 512}) {
    HostTensor kp(c.dt, {4, bad_page, c.hkv, c.d}), vp(c.dt, {4, bad_page, c.hkv, c.d});
    expect("power of two in [16, 256]", [&] { paged(kp.ref, vp.ref, &t.table.ref, &t.seqlens.ref); });
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

TEST(KvCacheApi, GpuTensorsAreNotImplementedYet) {
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

}  // namespace
}  // namespace hipflash::test
