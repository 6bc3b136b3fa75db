// hipflash — the one forward epilogue: where every forward schedule's finished rows go.
//
// A finished row is O normalised by its softmax sum plus the row's SoftmaxState (m, l). What
// is written for it, and where, is the same for every schedule and is written here once:
//   - unsplit: out's row, rounded to the element type, columns past head_dim not written; with
//     kReturnLse its LSE at FwdParams::lse_offset (either varlen layout), and in the padded
//     varlen layout the rows past the sequence -inf (write_padded_lse_tail), so the buffer has
//     no undefined entries;
//   - split: the fp32 partial row (kHeadDim wide) and the row's (m, l) at
//     FwdParams::partial_row, which the combine kernel reduces (the same definition the CPU
//     backend uses);
//   - a row with no valid key (fully masked, or an empty key range): O * inv_sum = 0, LSE -inf,
//     state (-inf, 0) — SoftmaxState's rules, not a special case here.
// Schedules differ only in how their register fragments map to (row, column) — the walk over
// the fragment stays with the schedule or its atom — and in how the rows reach memory, which
// is a policy:
//   - FwdEpilogue: from registers to global memory, N consecutive values at a time
//     (row(r, lane_col).put(col, v), .stat(state));
//   - StagedTile: the unsplit tile rounded into shared memory (swizzled rows; panel-major
//     where a TMA store writes it) with its rows' LSEs beside it, then stored by the whole
//     block as 16-byte rows (store), or its LSEs alone where a bulk tensor store writes the
//     rows (store_lse; kernels/sm90_ws).
#pragma once

#include <type_traits>

#include "common/element.hpp"
#include "common/swizzle.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::common {

/// Padded varlen LSE (kReturnLse, non-split): rows [len_q, max_seqlen_q) of this query block
/// are -inf, so the buffer has no undefined entries. Done by the block that owns those rows.
/// `thread` is the caller's thread index (0 .. kThreads - 1), here and below: a persistent
/// kernel passes one read where it is used (atoms/sm90/consumer.hpp thread_index).
template <int kBlockM, int kThreads>
__device__ __forceinline__ void write_padded_lse_tail(const FwdParams& p, int64_t b, int64_t h,
                                                      int64_t m0, int64_t len_q,
                                                      int thread = int(threadIdx.x)) {
  if (!(p.cu_seqlens_q && p.lse_layout == LseLayout::padded)) return;
  for (int r = thread; r < kBlockM; r += kThreads) {
    const int64_t row = m0 + r;
    if (row >= len_q && row < p.seqlen_q)
      p.lse[p.lse_offset(b, h, 0, row)] = detail::kNegInf;  // padded: no sequence offset
  }
}

/// The first step of every forward schedule: a query block that starts past its varlen
/// sequence has no rows — only, for kReturnLse unsplit kernels, its padded LSE rows to write.
/// True when the block is done.
template <class Traits, int kBlockM, int kThreads>
__device__ __forceinline__ bool block_past_sequence(const FwdParams& p, int64_t b, int64_t h,
                                                    int64_t m0, int64_t len_q,
                                                    int thread = int(threadIdx.x)) {
  if (m0 < len_q) return false;
  if constexpr (Traits::kReturnLse && !Traits::kSplit)
    write_padded_lse_tail<kBlockM, kThreads>(p, b, h, m0, len_q, thread);
  return true;
}

/// N consecutive fp32 values (N = 1, 2, 4 or 8) at dst, in vector stores.
template <int N>
__device__ __forceinline__ void store_f32(float* dst, const float (&v)[N]) {
  if constexpr (N == 1) {
    *dst = v[0];
  } else if constexpr (N == 2) {
    *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
  } else {
    static_assert(N == 4 || N == 8, "store_f32: 1, 2, 4 or 8 values");
#pragma unroll
    for (int i = 0; i < N; i += 4)
      *reinterpret_cast<float4*>(dst + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
  }
}

/// The same values rounded to the element type: pairs packed (pack2), one 4-, 8- or 16-byte
/// store (or one element for N = 1).
template <DType kDT, int N, class T>
__device__ __forceinline__ void store_rounded(T* dst, const float (&v)[N]) {
  if constexpr (N == 1) {
    *dst = port::from_float<T>(v[0]);
  } else if constexpr (N == 2) {
    *reinterpret_cast<uint32_t*>(dst) = pack2<kDT>(v[0], v[1]);
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<kDT>(v[0], v[1]), pack2<kDT>(v[2], v[3]));
  } else {
    static_assert(N == 8, "store_rounded: 1, 2, 4 or 8 values");
    uint4 packed;
    packed.x = pack2<kDT>(v[0], v[1]);
    packed.y = pack2<kDT>(v[2], v[3]);
    packed.z = pack2<kDT>(v[4], v[5]);
    packed.w = pack2<kDT>(v[6], v[7]);
    *reinterpret_cast<uint4*>(dst) = packed;
  }
}

/// The direct policy: a block's finished rows from registers to global memory. `Info` is the
/// schedule's BlockInfo (b, h, split, q_start, len_q, o_rows), held by reference with the
/// params; the one value of its own is the base of out's rows (or of the split's partials),
/// formed once as the kernels did before (per-piece index sums cost ptxas its vector stores).
template <class Traits, class Info>
class FwdEpilogue {
 public:
  using T = element_t<Traits::kOutDType>;

  __device__ __forceinline__ FwdEpilogue(const FwdParams& p, const Info& bi)
      : p_(p), bi_(bi), base_(base(p, bi)) {}

  /// Where sequence row `row` goes, from this lane's first column `lane_col` (row < bi.len_q:
  /// the caller skips the block's other rows).
  class Row {
   public:
    /// N consecutive normalised values of the row from column lane_col + col: the split's
    /// fp32 partial, or out rounded, columns past head_dim not written. `col` is a constant of
    /// the caller's unrolled walk, a multiple of 8 with lane_col < 8 (of 16 with lane_col < 16:
    /// the CDNA walk); head_dim being a multiple of 32, lane_col + col < head_dim exactly when
    /// col < head_dim.
    template <int N>
    __device__ __forceinline__ void put(int col, const float (&v)[N]) const {
      if constexpr (Traits::kSplit)
        store_f32<N>(dst_ + col, v);
      else if (col < int(p_.head_dim))
        store_rounded<Traits::kOutDType, N>(dst_ + col, v);
    }
    /// The row's softmax state: a split's partial state; unsplit, with kReturnLse, its LSE.
    /// By one of the lanes holding the row (several would store the same word).
    __device__ __forceinline__ void stat(const detail::SoftmaxState& s) const {
      if constexpr (Traits::kSplit)
        p_.state_partial[at_] = s;
      else if constexpr (Traits::kReturnLse)
        p_.lse[p_.lse_offset(bi_.b, bi_.h, bi_.q_start, at_)] = s.lse();
    }

   private:
    friend class FwdEpilogue;
    using Dst = std::conditional_t<Traits::kSplit, float, T>;
    __device__ __forceinline__ Row(const FwdParams& p, const Info& bi, int64_t at, Dst* dst)
        : p_(p), bi_(bi), at_(at), dst_(dst) {}
    const FwdParams& p_;
    const Info& bi_;
    const int64_t at_;  ///< the split's partial row, else the sequence row
    Dst* const dst_;    ///< the row's element at lane_col
  };

  __device__ __forceinline__ Row row(int64_t row, int lane_col) const {
    if constexpr (Traits::kSplit) {
      const int64_t prow = p_.partial_row(bi_.split, bi_.b, bi_.h, row);
      return Row(p_, bi_, prow, base_ + prow * Traits::kHeadDim + lane_col);
    } else {
      return Row(p_, bi_, row, base_ + row * p_.o_row_stride + lane_col);
    }
  }

  /// After the rows: the padded layout's LSE tail of this query block (kReturnLse, unsplit;
  /// every varlen schedule calls it, `thread` in 0 .. kThreads - 1).
  template <int kBlockM, int kThreads>
  __device__ __forceinline__ void finish(int64_t m0, int thread = int(threadIdx.x)) const {
    if constexpr (Traits::kReturnLse && !Traits::kSplit)
      write_padded_lse_tail<kBlockM, kThreads>(p_, bi_.b, bi_.h, m0, bi_.len_q, thread);
  }

 private:
  using Dst = typename Row::Dst;
  /// The split's partials, or out's rows of the block's (batch, head).
  __device__ __forceinline__ static Dst* base(const FwdParams& p, const Info& bi) {
    if constexpr (Traits::kSplit)
      return p.out_partial;
    else
      return bi.template o_rows<T>(p);
  }
  const FwdParams& p_;
  const Info& bi_;
  Dst* const base_;
};

/// The staging policy of unsplit tiles: the block's rows rounded into shared memory, a
/// [rows][kChunks * 8] tile in staged_swizzle<kChunks, kPanelRows> order at sO, and with
/// kReturnLse each row's LSE at sL[row]; then stored by the block as 16-byte rows, whatever
/// the fragment layout that staged them. The caller synchronises between the two halves.
template <class Traits, int kChunks, int kPanelRows = 0>
struct StagedTile {
  using T = element_t<Traits::kOutDType>;
  T* sO;
  float* sL;

  /// Two normalised values of tile row `srow` at column 8 chunk + e (e even).
  __device__ __forceinline__ void put2(int srow, int chunk, int e, float x, float y) const {
    *reinterpret_cast<uint32_t*>(sO + staged_swizzle<kChunks, kPanelRows>(srow, chunk) + e) =
        pack2<Traits::kOutDType>(x, y);
  }
  /// Tile row `srow`'s LSE, by every lane holding part of the row, the same value to the same
  /// word: a store by one lane would be a divergent branch, whose reconvergence and exposed
  /// lg2 latency cost 1-2% of a short-row kernel (docs/design-decisions.md#lse-cost).
  __device__ __forceinline__ void lse(int srow, float value) const {
    if constexpr (Traits::kReturnLse) sL[srow] = value;
  }

  /// The staged LSEs of rows [0, kRows), one row a thread, to the rows from m0; then, with
  /// kVarlen, the padded layout's tail. `thread`: the caller's index among kThreads.
  template <int kRows, int kThreads, bool kVarlen, class Info>
  __device__ __forceinline__ void store_lse(const FwdParams& p, const Info& bi, int64_t m0,
                                            int thread) const {
    if constexpr (Traits::kReturnLse) {
      const int r = thread;
      if (r < kRows && m0 + r < bi.len_q) p.lse[p.lse_offset(bi.b, bi.h, bi.q_start, m0 + r)] = sL[r];
      if constexpr (kVarlen)
        write_padded_lse_tail<kRows, kThreads>(p, bi.b, bi.h, m0, bi.len_q, thread);
    }
  }

  /// Staged rows [0, kRows) to out's rows from m0 (those < len_q) in 16-byte pieces, columns
  /// past head_dim not written; then their LSEs (store_lse).
  template <int kRows, int kThreads, bool kVarlen, class Info>
  __device__ __forceinline__ void store(const FwdParams& p, const Info& bi, int64_t m0,
                                        int thread = int(threadIdx.x)) const {
    T* gO = bi.template o_rows<T>(p);
    const int head_dim = int(p.head_dim);  // read once: one predicate per piece, no branch
    constexpr int kTotal = kRows * kChunks;
#pragma unroll
    for (int i = 0; i < kTotal / kThreads; ++i) {
      const int idx = thread + i * kThreads;
      const int r = idx / kChunks, c = idx % kChunks;
      if (m0 + r < bi.len_q && c * 8 < head_dim)
        *reinterpret_cast<uint4*>(gO + (m0 + r) * p.o_row_stride + c * 8) =
            *reinterpret_cast<const uint4*>(sO + staged_swizzle<kChunks, kPanelRows>(r, c));
    }
    store_lse<kRows, kThreads, kVarlen>(p, bi, m0, thread);
  }
};

}  // namespace hipflash::common
