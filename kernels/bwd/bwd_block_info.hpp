// hipflash — the backward's view of the problem (host and device): a sequence's bounds, the
// query rows that see a key block (the dk/dv pass walks them), and the row pointers of the
// gradients. The key range of a query block (the dq pass) is common::BlockInfo's.
#pragma once

#include <cstdint>

#include "common/block_info.hpp"
#include "hipflash/bwd_params.hpp"

namespace hipflash::bwd {

/// Sequence b's bounds (common::SeqBounds) and what the backward asks of them. The lengths are
/// clamped to the call's max_seqlen_q / max_seqlen_k (p.seqlen_q / seqlen_k), which size the
/// grids and the workspace: a varlen sequence longer than declared (validated, but not under
/// graph capture) must not walk rows past its head's workspace rows or wait for a dq rank no
/// tile adds; its rows and keys past them get no gradient. The diagonal stays the sequence's.
/// `clamp` false: the sequence's own lengths, as before the clamp (the portable dk/dv pass: it
/// waits for no rank, but with the clamp clang 22 spilled SGPRs on gfx942 / gfx950; there a
/// sequence longer than declared, under capture, still reads past its head's workspace rows).
struct SeqBounds : common::SeqBounds {
  HIPFLASH_HD SeqBounds(const FwdParams& p, int64_t b, bool clamp = true)
      : common::SeqBounds(p, b) {
    if (clamp && len_q > p.seqlen_q) len_q = p.seqlen_q;
    if (clamp && len_k > p.seqlen_k) len_k = p.seqlen_k;
  }

  /// The query rows [lo, hi) that see at least one key of [n0, n1) under the window (SPEC §3:
  /// row i sees keys [i + diag - left, i + diag + right], -1 unbounded).
  HIPFLASH_HD void rows_seeing(const FwdParams& p, int64_t n0, int64_t n1, int64_t& lo,
                               int64_t& hi) const {
    lo = p.window_right >= 0 ? n0 - diag - p.window_right : 0;
    hi = p.window_left >= 0 ? n1 - 1 - diag + p.window_left + 1 : len_q;
    lo = lo < 0 ? 0 : lo;
    hi = hi > len_q ? len_q : hi;
    if (hi < lo) hi = lo;
  }

  /// The rows of [m0, m0 + bm) that see key j, as [lo, hi] relative to m0 (empty when lo > hi;
  /// lo in [0, bm], hi in [-1, bm - 1]): none for a key past the sequence, else the window's
  /// rows (`masked`: SPEC §3, row i sees key j iff i + diag - left <= j <= i + diag + right) —
  /// common::BlockInfo::key_valid solved for the row, once per key.
  HIPFLASH_HD void rows_seeing_key(const FwdParams& p, int64_t j, int64_t m0, int bm,
                                   bool masked, int& lo, int& hi) const {
    int64_t l = 0, h = int64_t(bm) - 1;
    const int64_t row_of_key = j - diag - m0;  // the row on j's diagonal, relative to m0
    if (j >= len_k) {
      l = bm, h = -1;
    } else if (masked) {
      if (p.window_right >= 0 && row_of_key - p.window_right > l) l = row_of_key - p.window_right;
      if (p.window_left >= 0 && row_of_key + p.window_left < h) h = row_of_key + p.window_left;
    }
    lo = int(l > bm ? bm : l);
    hi = int(h < -1 ? -1 : h);
  }

  /// The first key block (of bn keys) that rows [m0, m0 + bm) see part of (m0 < len_q): with a
  /// left window edge, key block n's last row is n bn + bn - 1 - diag + left (rows_seeing), so
  /// the smallest n with n bn + bn - diag + left > m0; else block 0. The key blocks a row block
  /// sees are consecutive from it (the ordered dq's ranks, bwd_sm90_ws_kernel.hpp).
  HIPFLASH_HD int64_t first_key_block_seeing(const FwdParams& p, int64_t m0, int bn) const {
    if (p.window_left < 0) return 0;
    const int64_t n = common::floor_div(m0 + diag - p.window_left - bn, bn) + 1;
    return n > 0 ? n : 0;
  }

  /// The last key block (of bn keys) whose dk/dv walk (KeyBlock's rows, row_lo rounded down to
  /// bm) takes the row block [m0, m0 + bm): the largest n with n bn - diag - right < m0 + bm
  /// under a right window edge, else the sequence's last key block (-1: no keys).
  HIPFLASH_HD int64_t last_key_block_seeing(const FwdParams& p, int64_t m0, int bm,
                                            int bn) const {
    int64_t last = (len_k + bn - 1) / bn - 1;
    if (p.window_right >= 0) {
      const int64_t n = common::floor_div(m0 + bm - 1 + diag + p.window_right, bn);
      if (n < last) last = n;
    }
    return last;
  }

  /// Whether the tile of rows [m0, m0 + bm) and keys [n0, n0 + bn) needs per-element masking:
  /// keys past the sequence, or a window edge inside the tile (common::BlockInfo::needs_mask's
  /// rule for any tile).
  HIPFLASH_HD bool pair_needs_mask(const FwdParams& p, int64_t m0, int bm, int64_t n0, int bn,
                                   bool masked) const {
    if (n0 + bn > len_k) return true;
    if (!masked) return false;
    if (p.window_left >= 0 && n0 < m0 + bm - 1 + diag - p.window_left) return true;
    if (p.window_right >= 0 && n0 + bn - 1 > m0 + diag + p.window_right) return true;
    return false;
  }
};

/// The rows of [m0, m0 + kBM) that see a thread's two keys key0 and key0 + 8 in a dk/dv step
/// (the wgmma and mma.sync passes alike): solved once per step, only in tiles that need a mask
/// (SeqBounds::rows_seeing_key), so that an element's test is two 32-bit compares, or in an
/// unmasked instantiation one flag per key (past the sequence or not).
template <int kBM, bool kMasked>
struct KeyPairRows {
  int lo[2] = {-1, -1}, hi[2] = {kBM, kBM};
  /// Whether the step needs the test at all (SeqBounds::pair_needs_mask: the same for every
  /// thread of the step); false: every row sees every key, and sees() is true throughout.
  bool needed;

  HIPFLASH_HD KeyPairRows(const SeqBounds& seq, const FwdParams& p, int64_t m0, int64_t n0,
                          int bn, int64_t key0)
      : needed(seq.pair_needs_mask(p, m0, kBM, n0, bn, kMasked)) {
    if (needed)
      for (int hh = 0; hh < 2; ++hh)
        seq.rows_seeing_key(p, key0 + 8 * hh, m0, kBM, kMasked, lo[hh], hi[hh]);
  }
  /// Whether row m0 + col sees key key0 + 8 hh.
  HIPFLASH_HD bool sees(int col, int hh) const {
    return kMasked ? col >= lo[hh] && col <= hi[hh] : lo[hh] <= hi[hh];
  }
};

/// Row 0 of (batch b, head h) of the sequence starting at row `start` in a dense [B, S, H, D] or
/// varlen [total, H, D] tensor with these strides (varlen: batch stride 0).
template <class T>
HIPFLASH_HD T* rows_of(T* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                       int64_t b, int64_t start, int64_t h) {
  return base + b * batch_stride + start * row_stride + h * head_stride;
}

// Row 0 of (batch b, head h) of the sequence starting at `start` in each operand of the
// backward: q, out, dout and dq take the query start and a query head, k, v, dk and dv the key
// start and a kv head.
template <class T>
HIPFLASH_HD const T* q_rows(const BwdParams& p, int64_t b, int64_t start, int64_t h) {
  return rows_of(static_cast<const T*>(p.q), p.q_batch_stride, p.q_row_stride, p.q_head_stride, b,
                 start, h);
}
template <class T>
HIPFLASH_HD const T* out_rows(const BwdParams& p, int64_t b, int64_t start, int64_t h) {
  return rows_of(static_cast<const T*>(p.out), p.o_batch_stride, p.o_row_stride, p.o_head_stride,
                 b, start, h);
}
template <class T>
HIPFLASH_HD const T* dout_rows(const BwdParams& p, int64_t b, int64_t start, int64_t h) {
  return rows_of(static_cast<const T*>(p.dout), p.do_batch_stride, p.do_row_stride,
                 p.do_head_stride, b, start, h);
}
template <class T>
HIPFLASH_HD T* dq_rows(const BwdParams& p, int64_t b, int64_t start, int64_t h) {
  return rows_of(static_cast<T*>(p.dq), p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, b,
                 start, h);
}
template <class T>
HIPFLASH_HD const T* k_rows(const BwdParams& p, int64_t b, int64_t start, int64_t hk) {
  return rows_of(static_cast<const T*>(p.k), p.k_batch_stride, p.k_row_stride, p.k_head_stride, b,
                 start, hk);
}
template <class T>
HIPFLASH_HD const T* v_rows(const BwdParams& p, int64_t b, int64_t start, int64_t hk) {
  return rows_of(static_cast<const T*>(p.v), p.v_batch_stride, p.v_row_stride, p.v_head_stride, b,
                 start, hk);
}
template <class T>
HIPFLASH_HD T* dk_rows(const BwdParams& p, int64_t b, int64_t start, int64_t hk) {
  return rows_of(static_cast<T*>(p.dk), p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, b,
                 start, hk);
}
template <class T>
HIPFLASH_HD T* dv_rows(const BwdParams& p, int64_t b, int64_t start, int64_t hk) {
  return rows_of(static_cast<T*>(p.dv), p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, b,
                 start, hk);
}

/// dq_accum's element (row, col) of (b, h), in floats from dq_accum. Rows pair r and r + 8 of
/// each 16 (seqlen_rounded is a multiple of 128, so the workspace row and the sequence row agree
/// mod 16): pair g = row % 8 of a 16-row group is 2 x padded_head_dim floats of 16-byte chunks,
/// chunk j holding columns 2j and 2j + 1 of both rows (row r's first), the chunks XOR-swizzled
/// by dq_pair_swizzle(g). A tile of rows is then one contiguous run that the warp-specialised
/// dk/dv pass stages in shared memory with one 16-byte store per pair of its dQ fragment (rows g
/// and g + 8) without bank conflicts, and adds with one bulk reduction (bwd_sm90_ws_kernel.hpp);
/// every writer and the dq conversion go through this index.
/// The chunk swizzle of pair g: pairs 2q and 2q + 1 (a quarter warp's 16-byte stores, served
/// together) differ in bit 2, so their 4 + 4 chunks fill all 8 bank groups.
HIPFLASH_HD constexpr int dq_pair_swizzle(int g) { return ((g & 1) << 2) | (g >> 1); }
HIPFLASH_HD int64_t dq_accum_index(const BwdParams& p, int64_t b, int64_t h, int64_t row,
                                   int col) {
  const int g = int(row) & 7, hh = (int(row) >> 3) & 1;
  return (p.ws_row(b, h, row) - (row & 15)) * p.padded_head_dim + 2 * g * p.padded_head_dim +
         (((col >> 1) ^ dq_pair_swizzle(g)) << 2) + 2 * hh + (col & 1);
}

/// The rotated walk of a deterministic unmasked dk/dv pass (bwd_sm90_ws_kernel.hpp's DkdvWork):
/// a sequence's n key blocks each walk the same `steps` query steps (row blocks x query heads of
/// the group), key block j from step j d (d = kMaxSpacing where steps >= kMaxSpacing n, else 1)
/// and wrapping round, so that when they run side by side they take different row blocks at
/// any one time.
/// Key block j adds its dq term to step x with rank (J - j) mod n, J = min(x / d, n - 1) the last
/// key block whose walk starts at or before x: the order in which the walks reach x (J, J - 1,
/// ..., 0, n - 1, ..., J + 1), at least d steps apart, so no walk waits on another while they
/// keep pace. d stays small so that a row block's Q, dO and dq_accum rows, read by one key
/// block, are still in L2 when the next reaches them: spread steps / n apart, a GQA group's
/// walks (steps = row blocks x 8 heads) came back to a row block 16 steps later, after the grid
/// had read more than L2 holds, and deterministic GQA calls ran 1.35-1.67x the default's time.
/// Applies with distinct starts (n <= steps) and in 32 bits (n steps < 2^32).
struct RotatedWalk {
  static constexpr uint32_t kMaxSpacingLog2 = 1, kMaxSpacing = 1u << kMaxSpacingLog2;
  uint32_t n, steps;

  HIPFLASH_HD static bool applies(int64_t n, int64_t steps) {
    return n > 0 && steps > 0 && n <= steps && n * steps <= int64_t(UINT32_MAX);
  }
  /// log2 of d, the steps between consecutive key blocks' starts (a shift, no division in the
  /// kernel's walk).
  HIPFLASH_HD uint32_t spacing_log2() const {
    return steps >= kMaxSpacing * n ? kMaxSpacingLog2 : 0u;
  }
  /// The step key block j's walk starts at.
  HIPFLASH_HD uint32_t first(uint32_t j) const { return j << spacing_log2(); }
  /// Key block j's rank among the dq terms added to step x.
  HIPFLASH_HD uint32_t rank(uint32_t x, uint32_t j) const {
    const uint32_t started = x >> spacing_log2();
    const uint32_t last = started < n - 1 ? started : n - 1;
    return (last + n - j) % n;
  }
};

/// How a dk/dv pass numbers its tiles (key block, kv head, batch): the key block fastest (a
/// head's key blocks side by side: they share its Q, dO and dq rows in L2), fastest with the
/// last key block first (the same, each head's lightest causal block first: the deterministic
/// dq's order for masked calls, bwd_sm90_ws_kernel.hpp; `side_by_side` heads at a time, key
/// block major among them), or slowest (every head's heaviest causal blocks start first).
enum class KeyOrder : int { kFastest, kFastestLastFirst, kSlowest };

/// What one block of a dk/dv pass owns: key block n_block (keys [n0, n0 + block_n)) of kv head
/// hk of batch b, and the query rows [row_lo, row_hi) that see those keys (row_lo rounded down
/// to the pass's query step block_m), walked for `groups` query heads from h0: all of the kv
/// head's, or (`heads_per_tile` > 0, a divisor of Hq / Hkv) one slice of them — the pass then
/// numbers (kv head, slice) pairs where it numbers kv heads, the slices of a kv head adjacent.
/// Tile `linear` in the grid's order `order`; kFastestLastFirst takes `side_by_side` (batch,
/// kv head, slice) units' key blocks together: key block J of each unit, then J - 1, ...
struct KeyBlock {
  int n_block;
  int64_t hk, b;
  SeqBounds seq;
  int64_t n0, groups, h0, row_lo = 0, row_hi = 0;

  HIPFLASH_HD KeyBlock(const FwdParams& p, int64_t linear, int num_n_blocks, KeyOrder order,
                       int block_n, int block_m, bool clamp = true, int64_t heads_per_tile = 0,
                       int64_t side_by_side = 1)
      : KeyBlock(p, place(p, linear, num_n_blocks, order, heads_per_tile, side_by_side), block_n,
                 block_m, clamp) {}

  /// Whether the block lies past its sequence's keys (a shorter varlen sequence): no work.
  HIPFLASH_HD bool past_keys() const { return n0 >= seq.len_k; }

 private:
  struct Place {
    int n_block;
    int64_t hk, b, h0, heads;
  };
  HIPFLASH_HD static Place place(const FwdParams& p, int64_t linear, int num_n_blocks,
                                 KeyOrder order, int64_t heads_per_tile, int64_t side_by_side) {
    const int64_t group = p.heads_q / p.heads_kv;
    const int64_t heads = heads_per_tile > 0 ? heads_per_tile : group, slices = group / heads;
    const int64_t units = p.batch * p.heads_kv * slices;  // (batch, kv head, slice)
    int64_t unit = order == KeyOrder::kSlowest ? linear % units : linear / num_n_blocks;
    Place at;
    at.n_block = int(order == KeyOrder::kSlowest   ? linear / units
                     : order == KeyOrder::kFastest ? linear % num_n_blocks
                                                   : num_n_blocks - 1 - linear % num_n_blocks);
    if (order == KeyOrder::kFastestLastFirst && side_by_side > 1) {  // the last group fewer
      const int64_t u0 = linear / (side_by_side * num_n_blocks) * side_by_side;
      const int64_t width = units - u0 < side_by_side ? units - u0 : side_by_side;
      const int64_t at_in = linear - u0 * num_n_blocks;
      unit = u0 + at_in % width;
      at.n_block = int(num_n_blocks - 1 - at_in / width);
    }
    at.b = unit / (p.heads_kv * slices);
    at.hk = unit / slices % p.heads_kv;
    at.h0 = at.hk * group + unit % slices * heads;
    at.heads = heads;
    return at;
  }
  HIPFLASH_HD KeyBlock(const FwdParams& p, const Place& at, int block_n, int block_m, bool clamp)
      : n_block(at.n_block),
        hk(at.hk),
        b(at.b),
        seq(p, at.b, clamp),
        n0(int64_t(at.n_block) * block_n),
        groups(at.heads),
        h0(at.h0) {
    seq.rows_seeing(p, n0, n0 + block_n, row_lo, row_hi);
    row_lo = row_lo / block_m * block_m;
  }
};

}  // namespace hipflash::bwd
