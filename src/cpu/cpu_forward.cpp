// hipflash — the CPU backend: SPEC §3 on host memory.
//
// Tiled like the GPU kernels: a work item is (batch, head, block of kBlockM query rows); it
// walks key blocks of kBlockN with the shared online-softmax state (detail::SoftmaxState),
// never materialising the score matrix. num_splits > 1 cuts the key range into splits whose
// partial (out, lse) are reduced with the same combine math as the GPU combine kernel.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "../backend.hpp"
#include "hipflash/detail/host_numeric.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "common/kv_source.hpp"

namespace hipflash::cpu {
namespace {

using detail::kLog2e;
using detail::kNegInf;
using detail::SoftmaxState;

constexpr int64_t kBlockM = 16;
constexpr int64_t kBlockN = 64;

/// Row and key bounds of one (batch, head) after varlen offsets.
struct Seq {
  int64_t q_start, k_start, len_q, len_k;
};

Seq sequence(const FwdParams& p, int64_t b) {
  if (!p.is_varlen()) {  // a KV cache's keys: its cached ones and the appended, from its leftpad
    const int64_t pad = p.cache_leftpad ? p.cache_leftpad[b] : 0;
    return {0, pad, p.seqlen_q, (p.seqlens_k ? p.seqlens_k[b] + p.seqlen_k_new : p.seqlen_k) - pad};
  }
  // seqused (validated <= the cu_seqlens lengths): the rows and keys the sequence uses.
  return {p.cu_seqlens_q[b], p.cu_seqlens_k[b],
          p.seqused_q ? p.seqused_q[b] : p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b],
          p.seqused_k ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b]};
}

/// Keys [lo, hi) valid for row i (SPEC §3 masks, bottom-right aligned).
void key_range(const FwdParams& p, const Seq& s, int64_t i, int64_t& lo, int64_t& hi) {
  const int64_t diag = i + s.len_k - s.len_q;
  lo = p.window_left >= 0 ? std::max<int64_t>(0, diag - p.window_left) : 0;
  hi = p.window_right >= 0 ? std::min<int64_t>(s.len_k, diag + p.window_right + 1) : s.len_k;
}

/// Calls fn(k_rows, v_rows) with the row sources (common/kv_source.hpp) of sequence b's keys and
/// values for kv head hk, from its first key (s.k_start: varlen, or a cache's leftpad; a paged
/// cache's sequence starts at its first page, so only its leftpad moves it): pages through the
/// block table for a paged KV cache, rows at a fixed stride otherwise. A paged and a contiguous
/// cache run the same arithmetic on the same values.
template <class Elem, class Fn>
void with_kv_rows(const FwdParams& p, const Seq& s, int64_t b, int64_t hk, Fn&& fn) {
  const auto* k = static_cast<const Elem*>(p.k);
  const auto* v = static_cast<const Elem*>(p.v);
  if (p.block_table) {  // any page size, from the cache's leftpad row (the GPU's gathered rule)
    const int32_t* table = p.block_table_row(b);
    const int64_t pad = p.cache_leftpad ? p.cache_leftpad[b] : 0;
    using R = common::GatheredRows<const Elem>;
    fn(R{k + hk * p.k_head_stride, table, p.k_batch_stride, p.k_row_stride, p.page_div, pad},
       R{v + hk * p.v_head_stride, table, p.v_batch_stride, p.v_row_stride, p.page_div, pad});
    return;
  }
  const int64_t bc = p.cache_batch_idx ? p.cache_batch_idx[b] : b;  // a cache's batch indirection
  fn(common::ContiguousRows<Elem>{k + bc * p.k_batch_stride + s.k_start * p.k_row_stride +
                                      hk * p.k_head_stride, p.k_row_stride},
     common::ContiguousRows<Elem>{v + bc * p.v_batch_stride + s.k_start * p.v_row_stride +
                                      hk * p.v_head_stride, p.v_row_stride});
}

/// One split of one row block: partial softmax state and unnormalised accumulator per row.
/// score_scale: softmax_scale, times an fp8 call's q and k descales.
template <class Rows>
void attend(const FwdParams& p, const Seq& s, const Rows& k_rows, const Rows& v_rows, int64_t m0,
            int64_t rows, int64_t key_lo, int64_t key_hi, float score_scale, float alibi_slope,
            const std::vector<float>& qf,
            std::vector<SoftmaxState>& state, std::vector<float>& acc,
            std::vector<float>& kf, std::vector<float>& vf, std::vector<float>& x) {
  const int64_t D = p.head_dim;
  for (int64_t n0 = key_lo; n0 < key_hi; n0 += kBlockN) {
    const int64_t cols = std::min(kBlockN, key_hi - n0);
    // K is kept transposed ([D][kBlockN]) so that the score loop runs along contiguous keys.
    for (int64_t j = 0; j < cols; ++j) {
      const auto* kr = k_rows.row(n0 + j);
      const auto* vr = v_rows.row(n0 + j);
      for (int64_t d = 0; d < D; ++d) {
        kf[d * kBlockN + j] = detail::load_as_float(kr, d, p.kv_dtype);
        vf[j * D + d] = detail::load_as_float(vr, d, p.kv_dtype);
      }
    }
    const float scale_log2 = score_scale * kLog2e;
    const detail::Softcap softcap{p.softcap};
    const bool modified = softcap.on() || p.alibi_slopes != nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t lo, hi;
      key_range(p, s, m0 + r, lo, hi);
      // Scores of the whole tile (vectorises along the keys), then the mask.
      std::fill(x.begin(), x.begin() + cols, 0.f);
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qf[r * D + d];
        const float* kd = &kf[d * kBlockN];
        for (int64_t j = 0; j < cols; ++j) x[j] += qd * kd[j];
      }
      float tile_max = kNegInf;
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t key = n0 + j;
        // The scaled score, capped, then ALiBi's bias (SPEC §3), in log2 units.
        const float xs = !modified ? x[j] * scale_log2
                                   : (softcap.apply(x[j] * score_scale) +
                                      detail::alibi_bias(alibi_slope, m0 + r + s.len_k - s.len_q,
                                                         key)) * kLog2e;
        x[j] = key >= lo && key < hi ? xs : kNegInf;
        tile_max = std::max(tile_max, x[j]);
      }
      SoftmaxState& st = state[r];
      const float factor = st.update_max(tile_max);
      float* a = &acc[r * D];
      for (int64_t d = 0; d < D; ++d) a[d] *= factor;
      const float m = SoftmaxState::safe_max(st.m);
      // Every valid key contributes, even when 2^(x - m) underflows to 0: 0 * NaN must stay NaN
      // (SPEC §3). Masked keys contribute nothing.
      const int64_t j_lo = std::max<int64_t>(lo - n0, 0), j_hi = std::min(hi - n0, cols);
      for (int64_t j = j_lo; j < j_hi; ++j) {
        const float pj = detail::fast_exp2(x[j] - m);
        st.l += pj;
        for (int64_t d = 0; d < D; ++d) a[d] += pj * vf[j * D + d];
      }
    }
  }
}

void run_block(const FwdParams& p, int64_t b, int64_t h, int64_t m0) {
  const Seq s = sequence(p, b);
  const int64_t D = p.head_dim;
  const int64_t rows = std::max<int64_t>(0, std::min(kBlockM, s.len_q - m0));
  if (rows <= 0) return;
  // An fp8 call's descales (1 otherwise): into the scores' scale, and out's.
  const int64_t hk = h / (p.heads_q / p.heads_kv);
  const float score_scale = p.softmax_scale * p.q_descale.at(b, hk) * p.k_descale.at(b, hk);
  const float v_scale = p.v_descale.at(b, hk);

  const auto* qbase = static_cast<const char*>(p.q);
  std::vector<float> qf(static_cast<size_t>(rows * D));
  const int64_t q_off = b * p.q_batch_stride + s.q_start * p.q_row_stride + h * p.q_head_stride;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d)
      qf[r * D + d] = detail::load_as_float(qbase, q_off + (m0 + r) * p.q_row_stride + d, p.dtype);

  // Key range the block can need (union over its rows), cut into num_splits chunks of whole
  // key blocks.
  int64_t lo_first, hi_first, lo_last, hi_last;
  key_range(p, s, m0, lo_first, hi_first);
  key_range(p, s, m0 + rows - 1, lo_last, hi_last);
  const int64_t key_lo = std::max<int64_t>(0, std::min(lo_first, lo_last));
  const int64_t key_hi = std::min(s.len_k, std::max(hi_first, hi_last));
  const int64_t splits = std::max(1, p.num_splits);
  const int64_t key_blocks = (s.len_k + kBlockN - 1) / kBlockN;
  const int64_t blocks_per_split = std::max<int64_t>(1, (key_blocks + splits - 1) / splits);

  std::vector<float> acc(static_cast<size_t>(rows * D)), kf(size_t(kBlockN * D)), vf(size_t(kBlockN * D)),
      x(static_cast<size_t>(kBlockN));
  std::vector<SoftmaxState> state(static_cast<size_t>(rows));
  std::vector<float> out_total(static_cast<size_t>(rows * D), 0.f);
  std::vector<SoftmaxState> total(static_cast<size_t>(rows));
  std::vector<float> part_out;
  std::vector<SoftmaxState> part_state;
  if (splits > 1) {
    part_out.resize(size_t(splits * rows * D));
    part_state.resize(size_t(splits * rows));
  }
  for (int64_t sp = 0; sp < splits; ++sp) {
    const int64_t lo = std::max(key_lo, sp * blocks_per_split * kBlockN);
    const int64_t hi = std::min(key_hi, (sp + 1) * blocks_per_split * kBlockN);
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(state.begin(), state.end(), SoftmaxState{});
    if (lo < hi) {
      auto run = [&](const auto& kr, const auto& vr) {
        attend(p, s, kr, vr, m0, rows, lo, hi, score_scale, p.alibi_slope(b, h), qf, state, acc,
               kf, vf, x);
      };
      if (p.kv_dtype == DType::e4m3)
        with_kv_rows<uint8_t>(p, s, b, hk, run);
      else
        with_kv_rows<uint16_t>(p, s, b, hk, run);
    }
    if (splits == 1) {
      total = state;
      out_total = acc;
      break;
    }
    // Partial result of this split, as the GPU split kernels write it: out normalised by the
    // split's own sum, and the split's softmax state.
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = SoftmaxState::inv_sum(state[r].l);
      for (int64_t d = 0; d < D; ++d) part_out[(sp * rows + r) * D + d] = acc[r * D + d] * inv;
      part_state[sp * rows + r] = state[r];
    }
  }
  // Normalisation of out_total: 1/l unsplit; the combine's output is already normalised.
  std::vector<float> inv(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) inv[r] = SoftmaxState::inv_sum(total[r].l);
  if (splits > 1) {
    // Combine (SPEC §3) with the combine kernel's math: total = merge of the splits' states,
    // out = sum of w_s out_s over the splits that saw a key.
    for (int64_t r = 0; r < rows; ++r) {
      SoftmaxState t;
      for (int64_t sp = 0; sp < splits; ++sp) t.merge(part_state[sp * rows + r]);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const SoftmaxState& st = part_state[sp * rows + r];
        if (!st.live()) continue;
        const float w = detail::combine_weight(st, t);
        for (int64_t d = 0; d < D; ++d) out_total[r * D + d] += w * part_out[(sp * rows + r) * D + d];
      }
      total[r] = t;
      inv[r] = 1.f;
    }
  }

  auto* obase = static_cast<char*>(p.out);
  const int64_t o_off = b * p.o_batch_stride + s.q_start * p.o_row_stride + h * p.o_head_stride;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < D; ++d)
      detail::store_from_float(obase, o_off + (m0 + r) * p.o_row_stride + d,
                               out_total[r * D + d] * inv[r] * v_scale, p.out_dtype);
    if (p.return_lse) p.lse[p.lse_offset(b, h, s.q_start, m0 + r)] = total[r].lse();
  }
}

}  // namespace

int num_threads() {
  static const int n = [] {
    unsigned hc = std::thread::hardware_concurrency();
    return hc == 0 ? 1 : int(std::min(hc, 64u));
  }();
  return n;
}

void run_forward(const FwdParams& p) {
  // Varlen: the work is the longest sequence's blocks, whatever max_seqlen_q says (it may pad
  // far beyond); the padded LSE's rows past each sequence's length are -inf.
  int64_t rows_q = p.seqlen_q;
  if (p.is_varlen()) {
    rows_q = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      const Seq s = sequence(p, b);
      rows_q = std::max(rows_q, s.len_q);
      if (p.return_lse && p.lse_layout == LseLayout::padded)
        for (int64_t h = 0; h < p.heads_q; ++h)
          std::fill_n(p.lse + p.lse_offset(b, h, 0, s.len_q), p.seqlen_q - s.len_q, kNegInf);
      // seqused_q: the sequence's rows past the used ones take part in nothing: out 0, LSE -inf.
      const int64_t rows = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
      for (int64_t r = s.len_q; r < rows; ++r)
        for (int64_t h = 0; h < p.heads_q; ++h) {
          const int64_t o = (s.q_start + r) * p.o_row_stride + h * p.o_head_stride;
          for (int64_t d = 0; d < p.head_dim; ++d)
            detail::store_from_float(p.out, o + d, 0.f, p.out_dtype);
          if (p.return_lse && p.lse_layout == LseLayout::packed)
            p.lse[p.lse_offset(b, h, s.q_start, r)] = kNegInf;
        }
    }
  }
  const int64_t m_blocks = (rows_q + kBlockM - 1) / kBlockM;
  const int64_t items = p.batch * p.heads_q * m_blocks;
  parallel_for(items, [&](int64_t it) {
    const int64_t mb = it % m_blocks;
    const int64_t h = (it / m_blocks) % p.heads_q;
    const int64_t b = it / (m_blocks * p.heads_q);
    run_block(p, b, h, mb * kBlockM);
  });
}

void parallel_for(int64_t items, const std::function<void(int64_t)>& fn) {
  if (items <= 0) return;
  std::atomic<int64_t> next{0};
  std::mutex error_mu;
  std::exception_ptr error;  // the first failure of any worker (e.g. bad_alloc), rethrown here
  auto fail = [&](std::exception_ptr e) {
    next = items;  // stop the others early
    std::lock_guard<std::mutex> lock(error_mu);
    if (!error) error = std::move(e);
  };
  // The calling thread polls the interrupt check after its first item, then at most every
  // kPoll.
  const InterruptCheck check = interrupt_check();
  constexpr auto kPoll = std::chrono::milliseconds(20);
  auto worker = [&](bool polls) {
    auto last_poll = std::chrono::steady_clock::now() - kPoll;
    try {
      for (int64_t it; (it = next.fetch_add(1)) < items;) {
        fn(it);
        if (polls && std::chrono::steady_clock::now() - last_poll >= kPoll) {
          last_poll = std::chrono::steady_clock::now();
          if (check()) throw interrupted("hipflash: the call was interrupted (its outputs are partly written)");
        }
      }
    } catch (...) {
      fail(std::current_exception());
    }
  };
  const int n = int(std::min<int64_t>(num_threads(), items));
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(worker, false);
  worker(check != nullptr);
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

namespace {
std::atomic<InterruptCheck> g_interrupt_check{nullptr};
}  // namespace

InterruptCheck interrupt_check() { return g_interrupt_check.load(std::memory_order_acquire); }

}  // namespace hipflash::cpu

namespace hipflash {
void set_interrupt_check(InterruptCheck check) {
  cpu::g_interrupt_check.store(check, std::memory_order_release);
}
}  // namespace hipflash
