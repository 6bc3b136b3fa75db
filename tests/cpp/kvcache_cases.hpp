// The KV-cache cases shared by the CPU suite (test_kvcache.cpp) and the GPU suite (test_gpu.cu):
// one problem in a contiguous and a paged layout holding the same rows, and its fp64 reference.
#pragma once

#include <algorithm>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace hipflash::test {

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

  /// Each sequence's first lens[b] + appended keys of the contiguous cache packed as a varlen
  /// problem (queries: c.sq rows per sequence), with its cu_seqlens and options.
  struct Packed {
    HostTensor cu_q, cu_k, k, v;
    VarlenOptions opts;
  };
  Packed packed(int64_t appended) const {
    const int64_t B = c.batch(), cap = c.capacity(), row = c.hkv * c.d;
    std::vector<int32_t> lq(static_cast<size_t>(B), int32_t(c.sq)), lk(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) lk[size_t(b)] = int32_t(c.lens[size_t(b)] + appended);
    Packed pk{cu_seqlens(lq), cu_seqlens(lk), {}, {}, {}};
    const int64_t total_k = std::max<int32_t>(pk.cu_k.i32()[B], 0);
    pk.k = HostTensor(c.dt, {total_k, c.hkv, c.d});
    pk.v = HostTensor(c.dt, {total_k, c.hkv, c.d});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < lk[size_t(b)]; ++j)
        for (int64_t x = 0; x < row; ++x) {
          const int64_t dst = (pk.cu_k.i32()[b] + j) * row + x, src = (b * cap + j) * row + x;
          pk.k.set_raw(dst, k_cache.get_raw(src));
          pk.v.set_raw(dst, v_cache.get_raw(src));
        }
    static_cast<FwdOptions&>(pk.opts) = c.options();
    pk.opts.max_seqlen_q = c.sq;
    pk.opts.max_seqlen_k = *std::max_element(lk.begin(), lk.end());
    return pk;
  }

  /// q / out ([B, sq, Hq, D], host or device) seen as varlen rows [B * sq, Hq, D].
  TensorRef varlen_view(const TensorRef& t) const {
    TensorRef v = make_tensor(t.data, c.dt, {c.batch() * c.sq, c.hq, c.d});
    v.loc = t.loc;
    return v;
  }

  /// The fp64 reference of the (appended) contiguous cache: each sequence's first
  /// lens[b] + s_new keys, packed, as a varlen problem.
  ref::CheckResult check(const HostTensor& o, const HostTensor& l, int64_t appended) const {
    Packed pk = packed(appended);
    const ref::Problem prob = ref::Problem::varlen(varlen_view(q.ref), pk.k.ref, pk.v.ref,
                                                   pk.cu_q.i32(), pk.cu_k.i32(), c.batch(), pk.opts);
    return ref::check(prob, varlen_view(o.ref), &l.ref);
  }
};

inline std::string kv_case_name(const KvCase& c) {
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
inline std::string kv_name(const ::testing::TestParamInfo<KvCase>& info) {
  return kv_case_name(info.param);
}
inline void PrintTo(const KvCase& c, std::ostream* os) { *os << kv_case_name(c); }

/// Page sizes 1 .. 256 (powers of two and others), GQA ratios 1, 2, 4, 8, cache lengths 0 .. a few pages (a sequence may
/// be empty; lengths on and off page boundaries) and one of 100k, with and without an append,
/// masks, splits.
inline std::vector<KvCase> kv_grid() {
  std::vector<KvCase> v;
  int i = 0;
  for (int64_t page : {1, 3, 16, 32, 48, 64, 128, 256})  // gathered rows and 16-row groups
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
  KvCase big;  // a long cache (the 0 .. 100k lengths), split-K by the heuristic
  big.page = 256, big.hq = 16, big.hkv = 2, big.d = 128, big.lens = {100000, 0, 4097};
  big.s_new = 1, big.splits = 0;
  v.push_back(big);
  KvCase w;  // sliding window, chunk of queries longer than a sequence's keys
  w.sq = 40, w.hq = 6, w.hkv = 2, w.page = 16, w.lens = {5, 100, 0}, w.s_new = 8;
  w.causal = true, w.wl = 20, w.splits = 2;
  v.push_back(w);
  w.causal = false, w.wl = 7, w.wr = 3, w.dt = DType::f16, w.d = 96;
  v.push_back(w);
  return v;
}
}  // namespace hipflash::test
