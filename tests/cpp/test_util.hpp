// hipflash tests — host buffers, random inputs and a few helpers shared by the suites.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "hipflash/detail/host_numeric.hpp"
#include "hipflash/hipflash.hpp"
#include "reference.hpp"  // the fp64 oracle (tests/cpp)

namespace hipflash::test {

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
inline constexpr float kInf = std::numeric_limits<float>::infinity();

/// Owning host storage for a TensorRef. Elements are stored as raw 16- or 32-bit words.
struct HostTensor {
  std::vector<uint32_t> words;  // over-allocated; 4-byte aligned for every dtype
  TensorRef ref;

  HostTensor() = default;
  HostTensor(DType dt, std::initializer_list<int64_t> sizes) {
    ref = make_tensor(nullptr, dt, sizes);
    allocate(ref.numel());
  }
  /// A view with the given strides into storage of `storage_elems` elements.
  static HostTensor strided(DType dt, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                            int64_t storage_elems) {
    HostTensor t;
    t.ref.dtype = dt;
    t.ref.rank = int(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
      t.ref.sizes[i] = sizes[i];
      t.ref.strides[i] = strides[i];
    }
    t.allocate(storage_elems);
    return t;
  }
  void allocate(int64_t elems) {
    words.assign(size_t(elems * dtype_size(ref.dtype) + 3) / 4 + 1, 0u);
    ref.data = words.data();
  }
  HostTensor(const HostTensor& o) : words(o.words), ref(o.ref) {
    ref.data = reinterpret_cast<char*>(words.data()) + o.base() * dtype_size(o.ref.dtype);
  }
  HostTensor& operator=(const HostTensor& o) {
    if (this != &o) {
      words = o.words;
      ref = o.ref;
      ref.data = reinterpret_cast<char*>(words.data()) + o.base() * dtype_size(o.ref.dtype);
    }
    return *this;
  }
  HostTensor(HostTensor&&) = default;  // the vector keeps its buffer: ref.data stays valid
  HostTensor& operator=(HostTensor&&) = default;
  int64_t storage_elems() const {
    return int64_t(words.size()) * 4 / dtype_size(ref.dtype);
  }
  TensorRef* ptr() { return &ref; }
  float* f32() { return reinterpret_cast<float*>(words.data()); }
  int32_t* i32() { return reinterpret_cast<int32_t*>(words.data()); }

  /// Fills the whole storage (view or not) with `x`.
  void fill(float x) {
    const int64_t n = storage_elems();
    for (int64_t i = 0; i < n; ++i) set_raw(i, x);
  }
  void set_raw(int64_t i, float x) {
    if (ref.dtype == DType::f32) f32()[i] = x;
    else if (ref.dtype == DType::i32) i32()[i] = int32_t(x);
    else detail::store_from_float(words.data(), i, x, ref.dtype);
  }
  float get_raw(int64_t i) const {
    if (ref.dtype == DType::f32) return reinterpret_cast<const float*>(words.data())[i];
    return detail::load_as_float(words.data(), i, ref.dtype);
  }
  /// Uniform(-1, 1) values at the elements the view covers (storage outside stays as is).
  void randomize(std::mt19937& rng, float scale = 1.f) {
    std::uniform_real_distribution<float> u(-scale, scale);
    for_each_offset([&](int64_t off) { set_raw(off, u(rng)); });
  }
  /// Element index of ref.data in the storage (views may start past the storage's start).
  int64_t base() const {
    return (static_cast<const char*>(ref.data) - reinterpret_cast<const char*>(words.data())) /
           dtype_size(ref.dtype);
  }
  /// Calls f(storage index) for every element of the view.
  template <class F>
  void for_each_offset(F&& f) const {
    int64_t idx[4] = {0, 0, 0, 0};
    const int64_t n = ref.numel();
    for (int64_t e = 0; e < n; ++e) {
      int64_t off = base();
      for (int d = 0; d < ref.rank; ++d) off += idx[d] * ref.strides[d];
      f(off);
      for (int d = ref.rank - 1; d >= 0; --d) {
        if (++idx[d] < ref.sizes[d]) break;
        idx[d] = 0;
      }
    }
  }
  bool all_nan() const {
    bool all = true;
    const int64_t n = storage_elems();
    for (int64_t i = 0; i < n && all; ++i) all = std::isnan(get_raw(i));
    return all;
  }
  bool bitwise_equal(const HostTensor& o) const { return words == o.words; }
};

inline HostTensor cu_seqlens(const std::vector<int32_t>& lens) {
  HostTensor t(DType::i32, {int64_t(lens.size()) + 1});
  int32_t acc = 0;
  t.i32()[0] = 0;
  for (size_t i = 0; i < lens.size(); ++i) t.i32()[i + 1] = (acc += lens[i]);
  return t;
}

/// A dense problem with its buffers: q/k/v random, out and lse NaN-poisoned.
struct Dense {
  HostTensor q, k, v, out, lse;
  FwdOptions opts;

  Dense(DType dt, int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hkv, int64_t d,
        uint32_t seed = 1)
      : q(dt, {b, sq, hq, d}), k(dt, {b, sk, hkv, d}), v(dt, {b, sk, hkv, d}),
        out(dt, {b, sq, hq, d}), lse(DType::f32, {b, hq, sq}) {
    std::mt19937 rng(seed);
    q.randomize(rng);
    k.randomize(rng);
    v.randomize(rng);
    poison();
    opts.return_lse = true;
  }
  void poison() {
    out.fill(kNaN);
    lse.fill(kNaN);
  }
  void run() { forward(q.ref, k.ref, v.ref, out.ref, opts.return_lse ? &lse.ref : nullptr, opts); }
  ref::Problem problem() const { return ref::Problem::dense(q.ref, k.ref, v.ref, opts); }
  ref::CheckResult check() const {
    return ref::check(problem(), out.ref, opts.return_lse ? &lse.ref : nullptr);
  }
};

/// A varlen problem: per-sequence lengths, packed q/k/v.
struct Varlen {
  std::vector<int32_t> lens_q, lens_k;
  HostTensor cu_q, cu_k, q, k, v, out, lse;
  VarlenOptions opts;

  Varlen(DType dt, std::vector<int32_t> lq, std::vector<int32_t> lk, int64_t hq, int64_t hkv,
         int64_t d, LseLayout layout, uint32_t seed = 1)
      : lens_q(std::move(lq)), lens_k(std::move(lk)), cu_q(cu_seqlens(lens_q)),
        cu_k(cu_seqlens(lens_k)) {
    const int64_t tq = cu_q.i32()[lens_q.size()], tk = cu_k.i32()[lens_k.size()];
    const int64_t b = int64_t(lens_q.size());
    opts.max_seqlen_q = lens_q.empty() ? 0 : *std::max_element(lens_q.begin(), lens_q.end());
    opts.max_seqlen_k = lens_k.empty() ? 0 : *std::max_element(lens_k.begin(), lens_k.end());
    opts.lse_layout = layout;
    opts.return_lse = true;
    q = HostTensor(dt, {tq, hq, d});
    k = HostTensor(dt, {tk, hkv, d});
    v = HostTensor(dt, {tk, hkv, d});
    out = HostTensor(dt, {tq, hq, d});
    lse = layout == LseLayout::padded ? HostTensor(DType::f32, {b, hq, opts.max_seqlen_q})
                                      : HostTensor(DType::f32, {hq, tq});
    std::mt19937 rng(seed);
    q.randomize(rng);
    k.randomize(rng);
    v.randomize(rng);
    out.fill(kNaN);
    lse.fill(kNaN);
  }
  void run() {
    varlen_forward(q.ref, k.ref, v.ref, out.ref, opts.return_lse ? &lse.ref : nullptr, cu_q.ref,
                   cu_k.ref, opts);
  }
  ref::Problem problem() const {
    auto* cq = reinterpret_cast<const int32_t*>(cu_q.words.data());
    auto* ck = reinterpret_cast<const int32_t*>(cu_k.words.data());
    return ref::Problem::varlen(q.ref, k.ref, v.ref, cq, ck, int64_t(lens_q.size()), opts);
  }
  ref::CheckResult check() const {
    ref::CheckOptions co;
    co.lse_layout = opts.lse_layout;
    return ref::check(problem(), out.ref, opts.return_lse ? &lse.ref : nullptr, co);
  }
};

/// The cases of the mask-bookkeeping tests (tests of BlockInfo and the backward's bounds against
/// the per-element rule): one batch and head of FwdParams for every (len_q, len_k), window —
/// none, one side, both, a left bound one or ten keys back, wider than the sequences — and mask
/// flag (unmasked calls have no window); body(p, masked).
template <class Body>
void for_each_mask_case(std::initializer_list<int64_t> lens_q,
                        std::initializer_list<int64_t> lens_k, Body&& body) {
  const std::pair<int64_t, int64_t> windows[] = {{-1, -1}, {-1, 0}, {3, -1}, {0, 0},
                                                 {5, 2},   {-1, 6}, {20, 0}, {1, -1},
                                                 {10, -1}, {1000, 1000}};
  for (int64_t len_q : lens_q)
    for (int64_t len_k : lens_k)
      for (auto [wl, wr] : windows)
        for (bool masked : {false, true}) {
          if (!masked && (wl >= 0 || wr >= 0)) continue;
          FwdParams p;
          p.batch = 1, p.heads_q = p.heads_kv = 1, p.head_dim = 64, p.num_splits = 1;
          p.seqlen_q = len_q, p.seqlen_k = len_k;
          p.window_left = wl, p.window_right = wr;
          body(p, masked);
        }
}

/// One dense case of the numerics grids (CPU and GPU suites). Windows: -1 unbounded; causal
/// folds in as right = 0.
struct Case {
  DType dtype = DType::bf16;
  int64_t b = 1, sq = 1, sk = 1, hq = 1, hkv = 1, d = 64;
  bool causal = false;
  int64_t wl = -1, wr = -1;
  int splits = 1;

  std::string name() const {
    std::string s = std::string(dtype == DType::bf16 ? "bf16" : "f16") + "_b" + std::to_string(b) +
                    "_sq" + std::to_string(sq) + "_sk" + std::to_string(sk) + "_h" +
                    std::to_string(hq) + "x" + std::to_string(hkv) + "_d" + std::to_string(d);
    if (causal) s += "_causal";
    if (wl >= 0 || wr >= 0)
      s += "_win" + (wl < 0 ? std::string("inf") : std::to_string(wl)) + "x" +
           (wr < 0 ? std::string("inf") : std::to_string(wr));
    return s + "_splits" + std::to_string(splits);
  }
  friend std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name(); }
};

/// The host problem of a Case, inputs drawn from `seed`.
inline Dense make_dense(const Case& c, uint32_t seed) {
  Dense t(c.dtype, c.b, c.sq, c.sk, c.hq, c.hkv, c.d, seed);
  t.opts.causal = c.causal;
  t.opts.window_left = c.wl;
  t.opts.window_right = c.wr;
  t.opts.num_splits = c.splits;
  return t;
}

}  // namespace hipflash::test


/// EXPECT that a ref::CheckResult passed, printing its message otherwise.
#define EXPECT_REF_OK(res) EXPECT_TRUE((res).ok) << (res).message
