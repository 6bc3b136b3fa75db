// hipflash — the one fp64 reference of SPEC §3 and the checker of SPEC §6.
//
// Header-only, host memory, no tiling: for each query row, the valid keys per the masks, the
// scores and their exp-sum in double, out = sum p v / sum p, lse = ln sum exp(s). A row with no
// valid key has out 0 and lse -inf. Used by the C++ tests, hipflash-run and the benchmarks; a
// test helper, not part of the installed API.
//
//   auto prob = ref::Problem::dense(q, k, v, opts);          // host TensorRefs, any strides
//   ref::CheckResult r = ref::check(prob, out, &lse);        // SPEC §6; r.ok, r.message
//
// The low-precision twin ref_lp of §6 (FlashAttention's rule, attention_ref(upcast=False)) is
// the same math with every intermediate tensor rounded to the input dtype: the scaled score
// s_ij, the normalised probability p_ij and the output are each rounded once to bf16/f16, and
// sum_j p_ij v_j is accumulated in double. The tolerance on out is 2 * max|ref_lp - ref| + 1e-5
// over the checked rows, where ref is the fp64 result (playing the part of FA's fp32 reference).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "hipflash/detail/host_numeric.hpp"
#include "hipflash/forward.hpp"
#include "hipflash/types.hpp"

namespace hipflash::ref {

inline constexpr double kNegInf = -std::numeric_limits<double>::infinity();

/// Rounds x to `t` (bf16 / f16) and back, as the device would store it.
inline double round_to(double x, DType t) {
  const float f = static_cast<float>(x);
  return t == DType::bf16 ? detail::bf16_to_float(detail::float_to_bf16(f))
                          : detail::f16_to_float(detail::float_to_f16(f));
}

/// One attention call on host memory: the same TensorRefs (and options) as forward() /
/// varlen_forward(). Dense q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]; varlen q [total_q, Hq, D],
/// k/v [total_k, Hkv, D] with cu_seqlens int32 [B + 1]. Any strides; last dim stride 1.
struct Problem {
  TensorRef q, k, v;
  const int32_t* cu_seqlens_q = nullptr;  ///< varlen when non-null
  const int32_t* cu_seqlens_k = nullptr;
  int64_t batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  int64_t max_seqlen_q = 0;  ///< dense Sq; varlen max_seqlen_q (rows of a padded lse)
  double softmax_scale = 1.0;
  double softcap = 0.0;  ///< > 0: scores capped to softcap * tanh(score / softcap)
  /// ALiBi slopes (host fp32 [Hq] or [B, Hq], alibi_batch_stride 0 for [Hq]) or nullptr: row i's
  /// score of key j gets -slope * |i + Sk - Sq - j| after the cap.
  const float* alibi = nullptr;
  int64_t alibi_batch_stride = 0;
  int64_t window_left = -1, window_right = -1;  ///< causal folded in as right = 0

  static Problem dense(const TensorRef& q, const TensorRef& k, const TensorRef& v,
                       const FwdOptions& opts = {}) {
    Problem p;
    p.q = q; p.k = k; p.v = v;
    p.batch = q.sizes[0];
    p.max_seqlen_q = q.sizes[1];
    p.heads_q = q.sizes[2];
    p.heads_kv = k.sizes[2];
    p.head_dim = q.sizes[3];
    p.set_options(opts);
    return p;
  }

  static Problem varlen(const TensorRef& q, const TensorRef& k, const TensorRef& v,
                        const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, int64_t batch,
                        const VarlenOptions& opts) {
    Problem p;
    p.q = q; p.k = k; p.v = v;
    p.cu_seqlens_q = cu_seqlens_q;
    p.cu_seqlens_k = cu_seqlens_k;
    p.batch = batch;
    p.max_seqlen_q = opts.max_seqlen_q;
    p.heads_q = q.sizes[1];
    p.heads_kv = k.sizes[1];
    p.head_dim = q.sizes[2];
    p.set_options(opts);
    return p;
  }

  bool is_varlen() const { return cu_seqlens_q != nullptr; }
  int64_t q_start(int64_t b) const { return is_varlen() ? cu_seqlens_q[b] : 0; }
  int64_t k_start(int64_t b) const { return is_varlen() ? cu_seqlens_k[b] : 0; }
  int64_t seqlen_q(int64_t b) const {
    return is_varlen() ? int64_t(cu_seqlens_q[b + 1]) - cu_seqlens_q[b] : q.sizes[1];
  }
  int64_t seqlen_k(int64_t b) const {
    return is_varlen() ? int64_t(cu_seqlens_k[b + 1]) - cu_seqlens_k[b] : k.sizes[1];
  }

  /// Element offset of (batch b, row i of that sequence, head h, 0) in a q/out-shaped view.
  static int64_t offset(const TensorRef& t, bool varlen, int64_t b, int64_t row, int64_t h) {
    return varlen ? row * t.strides[0] + h * t.strides[1]
                  : b * t.strides[0] + row * t.strides[1] + h * t.strides[2];
  }
  int64_t q_offset(const TensorRef& t, int64_t b, int64_t i, int64_t h) const {
    return offset(t, is_varlen(), b, q_start(b) + i, h);
  }
  int64_t k_offset(const TensorRef& t, int64_t b, int64_t j, int64_t h) const {
    return offset(t, is_varlen(), b, k_start(b) + j, h);
  }

  /// Valid keys [lo, hi) of row i of sequence b (SPEC §3, bottom-right aligned); may be empty.
  void key_range(int64_t b, int64_t i, int64_t& lo, int64_t& hi) const {
    const int64_t sk = seqlen_k(b), diag = i + sk - seqlen_q(b);
    lo = window_left >= 0 ? std::max<int64_t>(0, diag - window_left) : 0;
    hi = window_right >= 0 ? std::min<int64_t>(sk, diag + window_right + 1) : sk;
    if (hi < lo) hi = lo;
  }

  /// Number of (row, key) pairs that pass the masks, over all heads: the FLOP count of the
  /// call is 4 * D * valid_pairs() (two matmuls).
  double valid_pairs() const {
    double n = 0;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < seqlen_q(b); ++i) {
        int64_t lo, hi;
        key_range(b, i, lo, hi);
        n += double(hi - lo);
      }
    return n * double(heads_q);
  }

 private:
  void set_options(const FwdOptions& opts) {
    softmax_scale = opts.softmax_scale ? double(*opts.softmax_scale)
                                       : double(1.f / std::sqrt(float(head_dim)));
    softcap = opts.softcap;
    if (opts.alibi_slopes) {
      alibi = static_cast<const float*>(opts.alibi_slopes->data);
      alibi_batch_stride = opts.alibi_slopes->rank == 2 ? opts.alibi_slopes->strides[0] : 0;
    }
    window_left = opts.window_left;
    window_right = opts.causal ? 0 : opts.window_right;
  }
};

/// The reference of one query row.
struct Row {
  std::vector<double> out;     ///< fp64 result, D values
  std::vector<double> out_lp;  ///< ref_lp: the same math rounded to the dtype (see top)
  double lse = kNegInf;        ///< natural log; -inf when no key is valid
  bool empty = true;           ///< no valid key
};

/// K and V of one (batch, kv head) converted to float once (exact), reused by its rows.
struct KvSlice {
  int64_t b = -1, hk = -1;
  std::vector<float> k, v;  ///< [seqlen_k, D]

  void load(const Problem& p, int64_t b_, int64_t hk_) {
    if (b_ == b && hk_ == hk) return;
    b = b_;
    hk = hk_;
    const int64_t sk = p.seqlen_k(b), D = p.head_dim;
    k.resize(size_t(sk * D));
    v.resize(size_t(sk * D));
    for (int64_t j = 0; j < sk; ++j) {
      const int64_t ko = p.k_offset(p.k, b, j, hk), vo = p.k_offset(p.v, b, j, hk);
      for (int64_t d = 0; d < D; ++d) {
        k[size_t(j * D + d)] = detail::load_as_float(p.k.data, ko + d, p.k.dtype);
        v[size_t(j * D + d)] = detail::load_as_float(p.v.data, vo + d, p.v.dtype);
      }
    }
  }
};

/// fp64 reference (and ref_lp) of row i of sequence b, query head h.
inline Row reference_row(const Problem& p, int64_t b, int64_t h, int64_t i, KvSlice& kv) {
  const int64_t D = p.head_dim;
  const DType dt = p.q.dtype;
  Row r;
  r.out.assign(size_t(D), 0.0);
  r.out_lp.assign(size_t(D), 0.0);
  int64_t lo, hi;
  p.key_range(b, i, lo, hi);
  if (lo >= hi) return r;
  r.empty = false;
  kv.load(p, b, h / (p.heads_q / p.heads_kv));

  std::vector<double> q(static_cast<size_t>(D));
  const int64_t qo = p.q_offset(p.q, b, i, h);
  for (int64_t d = 0; d < D; ++d) q[size_t(d)] = detail::load_as_float(p.q.data, qo + d, dt);

  const size_t n = size_t(hi - lo);
  std::vector<double> s(n), s_lp(n);
  double m = kNegInf, m_lp = kNegInf;
  for (size_t j = 0; j < n; ++j) {
    const float* kj = &kv.k[size_t((lo + int64_t(j)) * D)];
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += q[size_t(d)] * double(kj[d]);
    s[j] = dot * p.softmax_scale;
    if (p.softcap > 0) s[j] = p.softcap * std::tanh(s[j] / p.softcap);
    if (p.alibi) {
      const double diag = double(i + p.seqlen_k(b) - p.seqlen_q(b)), key = double(lo) + double(j);
      s[j] -= double(p.alibi[b * p.alibi_batch_stride + h]) * std::abs(diag - key);
    }
    s_lp[j] = round_to(s[j], dt);
    m = std::max(m, s[j]);
    m_lp = std::max(m_lp, s_lp[j]);
  }
  double l = 0, l_lp = 0;
  for (size_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    s_lp[j] = std::exp(s_lp[j] - m_lp);
    l += s[j];
    l_lp += s_lp[j];
  }
  for (size_t j = 0; j < n; ++j) {
    const float* vj = &kv.v[size_t((lo + int64_t(j)) * D)];
    const double pj = s[j] / l, pj_lp = round_to(s_lp[j] / l_lp, dt);
    for (int64_t d = 0; d < D; ++d) {
      r.out[size_t(d)] += pj * double(vj[d]);
      r.out_lp[size_t(d)] += pj_lp * double(vj[d]);
    }
  }
  for (auto& x : r.out_lp) x = round_to(x, dt);
  r.lse = m + std::log(l);
  return r;
}

/// The whole reference, contiguous: out in q's logical shape ([B, Sq, Hq, D] or
/// [total_q, Hq, D]; varlen rows outside every sequence stay 0) and lse [B, Hq, Sq] (dense) or
/// [Hq, total_q] (varlen, packed).
struct Output {
  std::vector<double> out, lse;
};

inline Output reference_forward(const Problem& p) {
  Output o;
  const int64_t rows = p.is_varlen() ? p.q.sizes[0] : p.batch * p.max_seqlen_q;
  o.out.assign(size_t(rows * p.heads_q * p.head_dim), 0.0);
  o.lse.assign(size_t(rows * p.heads_q), kNegInf);
  KvSlice kv;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (int64_t i = 0; i < p.seqlen_q(b); ++i) {
        const Row r = reference_row(p, b, h, i, kv);
        const int64_t row = p.is_varlen() ? p.q_start(b) + i : b * p.max_seqlen_q + i;
        std::copy(r.out.begin(), r.out.end(), o.out.begin() + (row * p.heads_q + h) * p.head_dim);
        o.lse[size_t(p.is_varlen() ? h * rows + row : (b * p.heads_q + h) * p.max_seqlen_q + i)] =
            r.lse;
      }
  return o;
}

/// What check() found. Errors are maxima over the checked rows.
struct CheckResult {
  bool ok = true;
  std::string message;           ///< "PASS ..." or the first reason of failure
  double max_out_err = 0;        ///< max |out - ref|
  double max_lp_err = 0;         ///< max |ref_lp - ref|
  double out_tol = 1e-5;         ///< 2 * max_lp_err + 1e-5
  double max_lse_err = 0;        ///< max |lse - ref_lse| over finite rows
  double max_lse_rel = 0;        ///< max |lse - ref_lse| / max(1, |ref_lse|)
  int64_t rows_checked = 0;
  int64_t empty_rows = 0;        ///< checked rows with no valid key
  int64_t nan_count = 0;         ///< NaN in out or lse (anywhere in the sequences' rows)
  int64_t lse_inf_mismatch = 0;  ///< rows where lse is -inf exactly when it must not be, or not
};

struct CheckOptions {
  LseLayout lse_layout = LseLayout::padded;  ///< varlen only
  int64_t max_rows = 0;  ///< check at most this many (batch, head, row) triples, spread evenly
                         ///< (the NaN scan always covers every row); 0 = all
  double lse_tol = 1e-3;  ///< abs/rel
  /// The inputs hold NaN on purpose (SPEC §3): out and lse must be NaN exactly where the fp64
  /// reference is, and match it elsewhere. Otherwise any NaN is a failure.
  bool nan_inputs = false;
};

namespace detail_check {
inline void fail(CheckResult& r, const std::string& why) {
  if (r.ok) r.message = why;
  r.ok = false;
}
inline std::string fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", x);
  return buf;
}
}  // namespace detail_check

/// SPEC §6 on host buffers: `out` like q (bf16/f16, any strides); `lse` fp32 [B, Hq, Sq]
/// (dense, varlen padded) or [Hq, total_q] (varlen packed), or nullptr to skip the LSE.
inline CheckResult check(const Problem& p, const TensorRef& out, const TensorRef* lse,
                         const CheckOptions& co = {}) {
  using detail_check::fail;
  using detail_check::fmt;
  CheckResult res;
  const int64_t D = p.head_dim;
  const bool packed = p.is_varlen() && co.lse_layout == LseLayout::packed;
  auto lse_at = [&](int64_t b, int64_t h, int64_t i) -> float {
    const auto* base = static_cast<const float*>(lse->data);
    return packed ? base[h * lse->strides[0] + (p.q_start(b) + i) * lse->strides[1]]
                  : base[b * lse->strides[0] + h * lse->strides[1] + i * lse->strides[2]];
  };
  auto out_at = [&](int64_t b, int64_t h, int64_t i, int64_t d) {
    return double(detail::load_as_float(out.data, p.q_offset(out, b, i, h) + d, out.dtype));
  };

  // No NaN anywhere: every row of every sequence, plus padded LSE rows (which must be -inf).
  int64_t total_rows = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    total_rows += p.seqlen_q(b) * p.heads_q;
    for (int64_t h = 0; h < p.heads_q; ++h) {
      for (int64_t i = 0; i < p.seqlen_q(b); ++i) {
        for (int64_t d = 0; d < D; ++d) res.nan_count += std::isnan(out_at(b, h, i, d));
        if (lse) res.nan_count += std::isnan(lse_at(b, h, i));
      }
      if (lse && p.is_varlen() && !packed)
        for (int64_t i = p.seqlen_q(b); i < p.max_seqlen_q; ++i)
          if (lse_at(b, h, i) != -std::numeric_limits<float>::infinity()) {
            ++res.lse_inf_mismatch;
            fail(res, "padded lse row " + std::to_string(i) + " of sequence " + std::to_string(b) +
                          " (length " + std::to_string(p.seqlen_q(b)) + ") is not -inf");
          }
    }
  }
  if (res.nan_count && !co.nan_inputs) fail(res, std::to_string(res.nan_count) + " NaN in out/lse");

  // The checked rows: all, or max_rows spread evenly over the flattened (b, h, i) space.
  const int64_t step =
      co.max_rows > 0 && total_rows > co.max_rows ? (total_rows + co.max_rows - 1) / co.max_rows : 1;
  KvSlice kv;
  int64_t flat = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t hk = 0; hk < p.heads_kv; ++hk)  // kv-major so that KvSlice is reused
      for (int64_t h = hk * (p.heads_q / p.heads_kv); h < (hk + 1) * (p.heads_q / p.heads_kv); ++h)
        for (int64_t i = 0; i < p.seqlen_q(b); ++i, ++flat) {
          if (flat % step != 0 && flat != total_rows - 1) continue;
          const Row r = reference_row(p, b, h, i, kv);
          ++res.rows_checked;
          res.empty_rows += r.empty;
          for (int64_t d = 0; d < D; ++d) {
            const double o = out_at(b, h, i, d);
            if (r.empty && o != 0.0)
              fail(res, "row " + std::to_string(i) + " of batch " + std::to_string(b) + " head " +
                            std::to_string(h) + " has no valid key but out != 0");
            if (co.nan_inputs && std::isnan(o) != std::isnan(r.out[size_t(d)]))
              fail(res, "out[" + std::to_string(d) + "] of row " + std::to_string(i) + " (batch " +
                            std::to_string(b) + ", head " + std::to_string(h) + ") is " + fmt(o) +
                            ", the reference " + fmt(r.out[size_t(d)]));
            if (!std::isnan(o)) res.max_out_err = std::max(res.max_out_err, std::abs(o - r.out[size_t(d)]));
            res.max_lp_err = std::max(res.max_lp_err, std::abs(r.out_lp[size_t(d)] - r.out[size_t(d)]));
          }
          if (!lse) continue;
          const double l = lse_at(b, h, i);
          if (co.nan_inputs && std::isnan(l) != std::isnan(r.lse))
            fail(res, "lse of row " + std::to_string(i) + " (batch " + std::to_string(b) +
                          ", head " + std::to_string(h) + ") is " + fmt(l) + ", the reference " +
                          fmt(r.lse));
          if (std::isnan(l) || std::isnan(r.lse)) continue;
          if ((l == kNegInf) != r.empty) {
            ++res.lse_inf_mismatch;
            fail(res, "lse of row " + std::to_string(i) + " (batch " + std::to_string(b) +
                          ", head " + std::to_string(h) + ") is " + fmt(l) + ", expected " +
                          fmt(r.lse));
            continue;
          }
          if (r.empty) continue;
          const double e = std::abs(l - r.lse);
          res.max_lse_err = std::max(res.max_lse_err, e);
          res.max_lse_rel = std::max(res.max_lse_rel, e / std::max(1.0, std::abs(r.lse)));
        }

  res.out_tol = 2 * res.max_lp_err + 1e-5;
  if (res.max_out_err > res.out_tol)
    fail(res, "max |out - ref| = " + fmt(res.max_out_err) + " exceeds 2 * max |ref_lp - ref| + 1e-5 = " +
                  fmt(res.out_tol));
  if (res.max_lse_rel > co.lse_tol)
    fail(res, "max |lse - ref| = " + fmt(res.max_lse_err) + " exceeds " + fmt(co.lse_tol) + " (abs/rel)");
  if (res.ok)
    res.message = "PASS: out err " + fmt(res.max_out_err) + " <= tol " + fmt(res.out_tol) +
                  ", lse err " + fmt(res.max_lse_err) + ", " + std::to_string(res.rows_checked) +
                  " rows checked";
  return res;
}

}  // namespace hipflash::ref
