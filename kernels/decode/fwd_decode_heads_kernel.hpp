// hipflash — the head-group decode forward kernel (NVIDIA sm_80+, mma.sync).
//
// GQA decode (one query row; the query heads of a kv head packed into the rows of one 16-row
// MMA tile, gpu_backend.cu's pack_gqa_decode) with every kv head of a batch in one block: warp
// w owns kv head (group * kHeads + w) — its 16 query rows, its online-softmax state and its O
// accumulator — and every key of a stage. The block's cp.async ring copies a stage's key rows
// whole (consecutive threads, consecutive 16-byte chunks across the heads), so a cache whose
// heads are adjacent ([B, Sk, Hkv, D]) is read front to back; the decode kernel's block per kv
// head reads a 1/Hkv slice of every row, which the DRAM opens once per slice. Work tiles are
// (split, head group, batch); splits fill the SMs (the split heuristic counts the groups). Same
// FwdParams, BlockInfo (a warp's head), row sources (contiguous or paged) and epilogue layout
// as the decode kernel; unmasked calls only (a packed GQA decode has no window).
#pragma once

#include <type_traits>

#include "atoms/sm80.hpp"
#include "common/block_info.hpp"
#include "common/element.hpp"
#include "common/epilogue.hpp"
#include "common/scheduler.hpp"
#include "common/softmax.hpp"
#include "decode/decode_tile.hpp"
#include "decode/warp_keys.hpp"
#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/params.hpp"

namespace hipflash::decode {

#if defined(HIPFLASH_HAS_MMA_SYNC)

/// Row copies for TileRows' read-ahead of a paged cache's entries: a thread's copies lie
/// kKeyStep rows apart (TileRows::kRowStep), from row threadIdx.x / (kChunks kHeads) on.
template <class Cfg>
struct HeadsCopyShape {
  static constexpr int kChunks = Cfg::kChunks;
  static constexpr int kThreads = Cfg::kKeyStep * Cfg::kChunks;
  static constexpr int kFirstRowThreads = Cfg::kChunks * Cfg::kHeads;
};

/// This thread's copies of one stage: key rows [row0, row0 + kBlockN) of its head (src: that
/// head's rows, resolved through `rows`) into the head's swizzled tile `dst`. Rows >= len,
/// columns >= head_dim and a head past the call's (ok false) copy nothing (zero-filled).
template <class Cfg, class T, class Src, class Resolved>
__device__ __forceinline__ void load_head_rows(T* dst, const Src& src, const Resolved& rows,
                                               int64_t row0, int64_t len, int head_dim, bool ok) {
  // A stage's rows are one run of a contiguous or grouped source (one resolved row, then the
  // row stride), or each its own (a cache of any page size: GatheredRows).
  constexpr bool kOneRun = Src::kRunRows >= Cfg::kBlockN;
  static_assert(kOneRun || Src::kRunRows == 1, "a stage's rows: one run, or one row a run");
  const int c = int(threadIdx.x) % Cfg::kChunks;
  const int r0 = int(threadIdx.x) / (Cfg::kChunks * Cfg::kHeads);
  const int rows_left = len - row0 < Cfg::kBlockN ? int(len - row0) : Cfg::kBlockN;
  const bool copy = ok && c * 8 < head_dim;
  const int64_t step = Cfg::kKeyStep * src.ld;
  const T* at = rows.row(src, 0, row0 + r0) + c * 8;
#pragma unroll
  for (int i = 0; i < Cfg::kCopiesPerThread; ++i) {
    const int r = r0 + i * Cfg::kKeyStep;
    if (!kOneRun && i > 0) at = rows.row(src, i, row0 + r) + c * 8;
    const bool valid = copy && r < rows_left;
    atom::sm80::cp_async_16(dst + common::swizzle<Cfg::kChunks>(r, c), valid ? at : src.base,
                            valid);
    if (kOneRun) at += step;
  }
}

/// The same row source `heads` kv heads further on (its base moved by heads * head_stride):
/// contiguous and paged sources alike address a head by that stride, whatever the layout.
template <class Src>
__device__ __forceinline__ Src other_head(Src src, int heads, int64_t head_stride) {
  src.base += heads * head_stride;
  return src;
}

template <class Traits, common::KvRows kKv>
__device__ __forceinline__ void fwd_heads_block(const FwdParams& p, int64_t tile) {
  using namespace atom::sm80;
  using Cfg = DecodeHeadsTile<Traits::kHeadDim>;
  using T = typename common::Element<Traits::kDType>::type;
  using Info = common::BlockInfo<Cfg::kBlockM, Cfg::kBlockN>;
  constexpr int kBN = Cfg::kBlockN, kStages = Cfg::kStages, kRowBytes = Cfg::kChunks * 16;
  constexpr DType kDT = Traits::kDType;
  static_assert(!Traits::kMasked, "a packed GQA decode has no window (the launcher refuses)");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sRing = reinterpret_cast<T*>(smem_raw);  // stage s: every head's K tile, then V tiles

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int g = lane / 4, t = lane % 4;
  // The tile: (split, head group, batch); p.heads_q is Hkv here (the packing).
  const int heads = int(p.heads_q);
  const int groups = (heads + Cfg::kHeads - 1) / Cfg::kHeads;
  const int split = int(tile % p.num_splits);
  const int64_t rest = tile / p.num_splits;
  const int group = int(rest % groups);
  const int64_t b = rest / groups;
  // This warp's head, and the head this thread copies. Heads past the call's (a last, partial
  // group) are clamped to a real one for the addresses: their copies zero-fill, their warps
  // compute on the zeros and store nothing (the selector gives the kernel calls with at least
  // one whole group).
  const int first = group * Cfg::kHeads;
  const int mine = first + warp, copied = first + (int(threadIdx.x) / Cfg::kChunks) % Cfg::kHeads;
  const bool mine_ok = mine < heads, copied_ok = copied < heads;
  const int mine_c = mine_ok ? mine : heads - 1, copied_c = copied_ok ? copied : heads - 1;
  const Info bi(p, (b * heads + mine_c) * p.num_splits + split, 1, false);

  const int hd = int(p.head_dim);
  const auto q_src = bi.template q_source<T>(p);
  const auto k_src = other_head(bi.template k_source_of<T, kKv>(p), copied_c - mine_c,
                                p.k_head_stride);
  const auto v_src = other_head(bi.template v_source_of<T, kKv>(p), copied_c - mine_c,
                                p.v_head_stride);
  const int slot = copied - first;  // the copied head's tile in a stage

  const int n_begin = bi.n_block_min, num_n = bi.n_block_max - bi.n_block_min;
  // Key block n_begin + i goes to stage i % kStages, one commit group per block (empty ones
  // included), as in the decode kernel; a paged cache's entries are read one block ahead.
  TileRows<HeadsCopyShape<Cfg>, kBN, std::remove_const_t<decltype(k_src)>> next_rows;
  auto load_kv = [&](int i) {
    if (i < num_n) {
      T* sK = sRing + (i % kStages) * Cfg::kSmemStage + slot * Cfg::kHeadTile;
      const int64_t row0 = int64_t(n_begin + i) * kBN;
      load_head_rows<Cfg>(sK, k_src, next_rows, row0, bi.len_k, hd, copied_ok);
      load_head_rows<Cfg>(sK + Cfg::kSmemKV, v_src, next_rows, row0, bi.len_k, hd, copied_ok);
      if (i + 1 < num_n) next_rows.fetch(k_src, row0 + kBN, bi.len_k);
    }
    cp_async_commit();
  };
  if (num_n > 0) next_rows.fetch(k_src, int64_t(n_begin) * kBN, bi.len_k);
  // Q: each warp its head's rows, into the last stage (joins group 0).
  T* sQ = sRing + (kStages - 1) * Cfg::kSmemStage + warp * Cfg::kBlockM * Cfg::kHeadDim;
#pragma unroll
  for (int k = lane; k < Cfg::kBlockM * Cfg::kChunks; k += 32) {
    const int r = k / Cfg::kChunks, c = k % Cfg::kChunks;
    const bool valid = mine_ok && r < bi.len_q && c * 8 < hd;
    cp_async_16(sQ + common::swizzle<Cfg::kChunks>(r, c), valid ? q_src.row(r) + c * 8 : q_src.base,
                valid);
  }
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) load_kv(i);

  uint32_t qf[Cfg::kDSteps][4];  // Q as the A operand, loaded once
  float O[2][2 * Cfg::kDTiles];
  zero_rows<Cfg::kDTiles>(O);
  common::RowSoftmax<2> softmax;
  const common::ScoreCap cap(p);  // the softcap, when the call has one
  const float scale_log2 = cap.scale_log2(p);
  const common::ScoreBias<true> bias{p, b, mine_c};  // ALiBi, when the call has it (a slope a row)

  // ldmatrix lane roles as in the decode kernel, within the warp's own head tile.
  const WarpQueryLanes<kRowBytes> q_lanes(smem_addr(sQ), lane);
  const WarpKeyLanes<kRowBytes> lanes(lane, 0);

  for (int i = 0; i < num_n; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // block i landed; every warp is done with block i - 1's stage
    if (i == 0) {
      q_lanes.load(qf);
      __syncthreads();  // every warp holds its Q: the last stage may be refilled
    }
    load_kv(i + kStages - 1);  // into the stage block i - 1 used (the last one, for i = 0)

    const uint32_t sK =
        smem_addr(sRing + (i % kStages) * Cfg::kSmemStage + warp * Cfg::kHeadTile);
    const int n = n_begin + i;
    warp_keys_step<Cfg, kDT>(qf, sK, sK + Cfg::kSmemKV * 2, lanes, O, softmax, scale_log2,
                             [&](float (&S)[2][4]) {
      cap.apply(S);
      bias.apply(S, [&](int r) { return g + 8 * r; }, bi.diag, int64_t(n) * kBN + 2 * t);
      if (!bi.needs_mask(p, n, false)) return;  // the sequence's last, partial key block
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (int64_t(n) * kBN + (c / 2) * 8 + 2 * t + c % 2 >= bi.len_k) S[r][c] = detail::kNegInf;
    });
  }
  softmax.finalize();
  cp_async_wait<0>();  // no copy outlives the block (the ring's last, empty groups)
  if (!mine_ok) return;

  // ---- Epilogue (common/epilogue.hpp): the warp's rows g and g + 8 (of its head's bi.len_q
  // packed query heads). Never varlen (a packed GQA decode call), so no padded LSE tail ----
  const common::FwdEpilogue<Traits, Info> ep(p, bi);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = g + 8 * r;
    if (row >= bi.len_q) continue;
    const auto out = ep.row(row, 2 * t);
    const float inv = softmax.inv_sum(r);
#pragma unroll
    for (int d = 0; d < Cfg::kDTiles; ++d)
      out.put(8 * d, {O[r][2 * d] * inv, O[r][2 * d + 1] * inv});
    if (t == 0) out.stat(softmax.state(r));
  }
}

#endif  // HIPFLASH_HAS_MMA_SYNC

/// The map from the launch grid to work tiles; the launcher sizes the grid with it too.
using HeadsScheduler = common::StaticScheduler;

/// The head-group decode kernel: one thread block per (split, head group, batch); kKv: K and
/// V rows at a stride or through a KV cache's block table. num_m_blocks is 1 (the launcher checks).
template <class Traits, common::KvRows kKv = common::KvRows::contiguous>
__global__ void __launch_bounds__(DecodeHeadsTile<Traits::kHeadDim>::kThreads,
                                  DecodeHeadsTile<Traits::kHeadDim>::kMinBlocks)
    fwd_decode_heads_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p, int /*num_m_blocks*/) {
#if defined(HIPFLASH_HAS_MMA_SYNC)
  if constexpr (Traits::kSplit) port::allow_dependent_launch();
  HeadsScheduler::run([&](int64_t tile) { fwd_heads_block<Traits, kKv>(p, tile); });
#else
  port::trap();  // mma.sync targets only; the selector knows
#endif  // HIPFLASH_HAS_MMA_SYNC
}

}  // namespace hipflash::decode
