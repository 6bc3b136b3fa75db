// hipflash — the warp-specialised dk/dv pass of the backward on Hopper (sm_90a), for dense and
// varlen calls (strides no tensor map describes keep bwd_sm90_kernel.hpp): TMA loads into a
// two-stage ring, warpgroup MMAs, dQ staged in shared memory and added to the workspace by one
// bulk reduction per step. A varlen call's maps take its packed rows as one batch; the rows a
// box reads past its sequence (K, Q, dO) are zeroed in shared memory before use.
//
// A work tile is kBlockN = 128 keys of one (batch, kv head) and every query block that sees
// them, for each query head of the group (bwd::KeyBlock); a block (persistent, one per
// multiprocessor, for unmasked and deterministic calls) walks its tiles in three warpgroups:
//  * the producer warp: a tile's K and V (once the last tile's are released: the load overlaps
//    the consumers' dK / dV stores), then per step Q, dO (TMA, 128-byte swizzle) and the rows'
//    (lse_log2, delta) (1-d bulk copies) into the next free stage of the ring;
//  * the dQ writer warp (atomic path): per step, once the consumers have staged the step's dQ
//    tile, adds it to dq_accum with cp.reduce.async.bulk (dq_accum's rows are swizzled so that
//    the tile is one contiguous run: dq_accum_index) and hands the buffer back once read;
//  * two consumer warpgroups, 64 keys each, holding dK and dV in registers for a tile's walk.
//    Per step each computes
//      S^T = K_wg Q^T and dP^T = V_wg dO^T          (wgmma SS, two commit groups)
//      P^T = exp2(S^T scale log2e - lse_log2)        (while dP^T is still in flight)
//      dS^T = P^T (dP^T - delta)
//      dV += P^T dO,  dK += dS^T Q                   (wgmma RS: P and dS stay in registers)
//    and, on the atomic path, writes dS^T to shared memory; after both warpgroups have,
//    dQ = dS K (wgmma SS: a 64 x 64 piece each, as in bwd_sm90_kernel.hpp) goes into the
//    staged fp32 tile. Deterministic calls take the same path, the writer adding a row block's
//    terms in a fixed key-block order (a counter per row block in dq_semaphore): unmasked
//    calls walk rotated (bwd::RotatedWalk), masked and varlen ones take their tiles from a
//    counter (TileFeed; a rotated walk's paced by the dQ writer).
// The exponentials overlap the dP^T product, dV / dK the staging of dS^T; the two warpgroups'
// non-MMA phases interleave with each other's products, and no consumer issues a load or a
// global reduction. The score-modifier instantiation (kScoreMods: the softcap, ALiBi, as
// bwd::ScoreMods recomputes them) waits for both products, then per pair takes the modified
// score, P, and dS^T = P^T (dP^T - delta) (1 - tanh^2) (the cap's derivative).
#pragma once

#include <type_traits>

#include "atoms/sm80.hpp"
#include "atoms/sm90/tensor_map.hpp"
#include "atoms/sm90/tma.hpp"
#include "atoms/sm90/wgmma.hpp"
#include "bwd/bwd_block_info.hpp"
#include "bwd/bwd_score_mods.hpp"
#include "bwd/dkdv_sm90_parts.hpp"
#include "common/element.hpp"
#include "hipflash/detail/softmax_state.hpp"

namespace hipflash::bwd {

/// The tensor maps of q, k, v and dout: 4-d (head dim, row, head, batch), boxes of 64 columns
/// by the tile's rows (kBlockM for q and dout, kBlockN for k and v).
struct BwdTmaMaps {
  atom::sm90::TensorMap q, k, v, dout;
  /// dk and dv ([kBlockN rows x 64 columns] boxes, as k's; a varlen call's packed rows as one
  /// batch), where a map describes the gradients: the block then stores its dK / dV by bulk
  /// tensor stores (dkdv_store) — a varlen call's key blocks whole inside their sequence.
  atom::sm90::TensorMap dk, dv;
  /// How a block writes a tile's dK / dV.
  enum class DkdvStore : int {
    kThreads,   ///< 4-byte stores by the threads (no map; varlen tail blocks in any mode)
    kOverKV,    ///< one tile a block: staged over its K and V tiles, then bulk tensor stores
    kOwnStage,  ///< a persistent block: staged in a region of their own
                ///< (DkdvSm90WsTile::kOffStage), the next tile's K / V loading meanwhile
  };
  DkdvStore dkdv_store = DkdvStore::kThreads;
};

template <int kHeadDim_>
struct DkdvSm90WsTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = 128, kConsumers = 2;
  /// Query rows per step: 128 at head dim 64, 64 at head dim 128 (bwd_sm90_kernel.hpp's).
  static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64;
  static constexpr bool kDqByColumns = kHeadDim == 128;  ///< dQ pieces: column panels, else rows
  static constexpr int kConsumerThreads = 128 * kConsumers, kThreads = kConsumerThreads + 128;
  // The launch allocates 384 x 168 = 64,512 registers; setmaxnreg only moves them between the
  // warpgroups (asking for more than the block holds never returns): 128 x 24 + 256 x 240.
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kStages = 2, kPanels = kHeadDim / 64;
  static constexpr uint32_t kSmemKV = kBlockN * kHeadDim * 2, kSmemQ = kBlockM * kHeadDim * 2;
  static constexpr uint32_t kSmemDs = kBlockN * kBlockM * 2, kSmemDq = kBlockM * kHeadDim * 4;
  /// A persistent block's dK / dV staging region: both at head dim 64, one after the other at
  /// 128 (32 KiB: 64 more would pass the 227 KiB a block may have).
  static constexpr uint32_t kSmemStage = 32768;
  static constexpr int kStagePasses = int(2 * kSmemKV / kSmemStage);
  static constexpr uint32_t kStatBytes = kBlockM * 4;  ///< one stage's lse_log2 or delta
  /// Bytes a stage's full barrier counts: Q, dO, lse_log2 and delta.
  static constexpr uint32_t kStageBytes = 2 * kSmemQ + 2 * kStatBytes;
  // Shared-memory map from the 1024-byte-aligned base: K | V | Q[2] | dO[2] | dS^T | dQ (fp32)
  // | dK / dV staging | lse_log2[2] | delta[2] | barriers (Q full[2], Q empty[2], K/V full,
  // K/V empty, tile full[2], tile empty[2]) | tile numbers[2] (a counter's, TileFeed).
  static constexpr uint32_t kOffV = kSmemKV, kOffQ = 2 * kSmemKV;
  static constexpr uint32_t kOffDo = kOffQ + kStages * kSmemQ;
  static constexpr uint32_t kOffDs = kOffDo + kStages * kSmemQ;
  static constexpr uint32_t kOffDq = kOffDs + kSmemDs;
  static constexpr uint32_t kOffStage = kOffDq + kSmemDq;
  static constexpr uint32_t kOffLse = kOffStage + kSmemStage;
  static constexpr uint32_t kOffDelta = kOffLse + kStages * kStatBytes;
  static constexpr uint32_t kOffBars = kOffDelta + kStages * kStatBytes;
  static constexpr uint32_t kOffTiles = kOffBars + (6 + 2 * kStages) * 8;
  static constexpr int kSmemBytes = int(kOffTiles + 2 * 4 + 1024);
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128 (one or two panels)");
  static_assert(kSmemBytes <= 227 * 1024, "one block's shared memory on sm_90");
  static_assert(kSmemQ % 1024 == 0 && kSmemDs % 1024 == 0, "1024-byte aligned tiles");
  static_assert(kOffStage % 1024 == 0 && kSmemKV % 1024 == 0,
                "the staging region (and dV's half in it) 1024-byte aligned for SW128 stores");
};

#if defined(HIPFLASH_HAS_WGMMA)

namespace dkdv_ws {

using namespace ::hipflash::atom::sm90;

/// Named barriers (0 is __syncthreads): dS^T staged by both consumers; the dQ tile staged
/// (consumers arrive, the writer syncs) and read back (the writer arrives, consumers sync).
enum NamedBarrier : int { kDsReady = 1, kDqFull = 2, kDqEmpty = 3, kTailZeroed = 4, kDkdvStaged = 5 };
/// Consumers plus the writer warp.
inline constexpr int kDqBarThreads = 256 + 32;

template <class Cfg>
struct Smem {
  uint32_t base;  ///< 1024-byte aligned shared-window address
  __device__ __forceinline__ uint32_t k() const { return base; }
  __device__ __forceinline__ uint32_t v() const { return base + Cfg::kOffV; }
  __device__ __forceinline__ uint32_t q(int s) const { return base + Cfg::kOffQ + s * Cfg::kSmemQ; }
  __device__ __forceinline__ uint32_t dout(int s) const {
    return base + Cfg::kOffDo + s * Cfg::kSmemQ;
  }
  __device__ __forceinline__ uint32_t ds() const { return base + Cfg::kOffDs; }
  __device__ __forceinline__ uint32_t dq() const { return base + Cfg::kOffDq; }
  __device__ __forceinline__ uint32_t stage() const { return base + Cfg::kOffStage; }
  __device__ __forceinline__ uint32_t lse(int s) const {
    return base + Cfg::kOffLse + s * Cfg::kStatBytes;
  }
  __device__ __forceinline__ uint32_t delta(int s) const {
    return base + Cfg::kOffDelta + s * Cfg::kStatBytes;
  }
  __device__ __forceinline__ Mbarrier q_full(int s) const {
    return {base + Cfg::kOffBars + 8u * s};
  }
  __device__ __forceinline__ Mbarrier q_empty(int s) const {
    return {base + Cfg::kOffBars + 8u * (Cfg::kStages + s)};
  }
  __device__ __forceinline__ Mbarrier kv_full() const {
    return {base + Cfg::kOffBars + 8u * 2 * Cfg::kStages};
  }
  __device__ __forceinline__ Mbarrier kv_empty() const {
    return {base + Cfg::kOffBars + 8u * (2 * Cfg::kStages + 1)};
  }
  __device__ __forceinline__ Mbarrier tile_full(int s) const {
    return {base + Cfg::kOffBars + 8u * (2 * Cfg::kStages + 2 + s)};
  }
  __device__ __forceinline__ Mbarrier tile_empty(int s) const {
    return {base + Cfg::kOffBars + 8u * (2 * Cfg::kStages + 4 + s)};
  }
  __device__ __forceinline__ uint32_t tile_number(int s) const {
    return base + Cfg::kOffTiles + 4u * s;
  }
  /// One thread: full barriers take the producer's one arrival (plus bytes), empty ones one
  /// arrival per consumer warp (a tile number's also the writer warp's: a counted walk is
  /// deterministic, whose dq the writer adds, so the writer runs).
  __device__ __forceinline__ void init() const {
    constexpr uint32_t kConsumerWarps = Cfg::kConsumerThreads / 32;
    for (int s = 0; s < Cfg::kStages; ++s) {
      q_full(s).init(1);
      q_empty(s).init(kConsumerWarps);
    }
    kv_full().init(1);
    kv_empty().init(kConsumerWarps);
    for (int s = 0; s < 2; ++s) {
      tile_full(s).init(1);
      tile_empty(s).init(kConsumerWarps + 1);
    }
  }
};

/// Loads from and stores to a shared-window address (32-bit addressing: half the registers of
/// a pointer).
__device__ __forceinline__ uint32_t ld_shared(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void st_shared(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c),
               "f"(d)
               : "memory");
}

/// dk = scale dS^T Q or dv = P^T dO of this thread's tile rows `row` and row + 8 (accumulators
/// in wgmma order: element 4i + 2h + e is row row + 8h, column 8i + 2t + e) in the layout the
/// K / V maps load: SW128 panels of [kBN rows x 64 columns] at `tile`, what one bulk tensor
/// store a panel writes out. A warp's stores fill 32 banks (row phases g).
template <DType kDT, int kHD, int kBN>
__device__ __forceinline__ void stage_grad(uint32_t tile, float scale, int row, int t,
                                           const float (&acc)[kHD / 2]) {
  using ::hipflash::atom::sm80::pack2;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = row + 8 * hh;
#pragma unroll
    for (int i = 0; i < kHD / 8; ++i) {
      const uint32_t off = sw128_offset<kBN>(r, i) + 4 * t;
      st_shared(tile + off, pack2<kDT>(acc[4 * i + 2 * hh] * scale, acc[4 * i + 2 * hh + 1] * scale));
    }
  }
}

/// Zeroes rows [first, kRows) of a tile (atom::sm90::zero_rows) by the consumer threads;
/// `sync` 1: they then fence and meet (else the caller does).
template <class Cfg, int kRows>
__device__ __forceinline__ void zero_tail_rows(uint32_t tile, int first, int sync) {
  zero_rows<kRows, Cfg::kPanels, Cfg::kConsumerThreads>(tile, first, int(threadIdx.x));
  if (sync) {
    fence_proxy_async();
    named_sync<Cfg::kConsumerThreads>(kTailZeroed);
  }
}

/// The ordered dq's counter (dq_semaphore): an acquiring load and a releasing add at GPU scope,
/// and the fence that orders the bulk reductions (async proxy) with them.
__device__ __forceinline__ int load_acquire(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release(int32_t* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

/// A shared-window address as a generic pointer into this block's shared memory.
__device__ __forceinline__ float* smem_floats(unsigned char* raw, uint32_t addr) {
  return reinterpret_cast<float*>(raw + (addr - ::hipflash::atom::sm80::smem_addr(raw)));
}

}  // namespace dkdv_ws

#endif  // HIPFLASH_HAS_WGMMA

/// A step's (query head, first row), advanced one step at a time (no 64-bit division); after
/// the group's last head the walk wraps to its first (a rotated walk, DkdvWork).
template <int kBM>
struct StepPos {
  int h, m0, row_lo, row_end, h_lo, h_end;  // rows and heads fit 31 bits
  __device__ __forceinline__ void next() {
    m0 += kBM;
    if (m0 >= row_end) {
      m0 = row_lo;
      if (++h == h_end) h = h_lo;
    }
  }
};

/// One work tile of the persistent grid: key block `tile` of the dk/dv pass (bwd::KeyBlock's
/// order), its query steps and where they start. Every role of a block decodes the same tiles.
/// `rotate` (deterministic unmasked calls, where a sequence's key blocks all walk the same
/// steps): the walk starts where bwd::RotatedWalk puts it, wrapping over the group's heads, if
/// the sequence's walk applies (else it starts at step 0 and the dq ranks ascend).
template <int kBM, int kBN>
struct DkdvWork {
  KeyBlock kb;
  int64_t m_steps;        ///< query blocks of one head's walk
  int64_t steps;          ///< query blocks x query heads of the group; 0: no row sees the keys
  int64_t row_end;        ///< the end of one head's walk (row_lo + m_steps x kBM)
  int64_t first = 0;      ///< the step the walk starts at
  int64_t key_blocks = 0; ///< the sequence's key blocks when the walk is rotated, else 0

  __device__ __forceinline__ DkdvWork(const BwdParams& p, int64_t tile, int num_n_blocks,
                                      KeyOrder order, int side_by_side, bool rotate)
      : kb(p, tile, num_n_blocks, order, kBN, kBM, true, p.heads_per_tile, side_by_side) {
    m_steps = kb.past_keys() ? 0 : (kb.row_hi - kb.row_lo + kBM - 1) / kBM;
    steps = m_steps * kb.groups;
    row_end = kb.row_lo + m_steps * kBM;
    const int64_t n = (kb.seq.len_k + kBN - 1) / kBN;  // <= num_n_blocks (bwd::SeqBounds)
    if (rotate && RotatedWalk::applies(n, steps)) {
      key_blocks = n;
      first = walk().first(uint32_t(kb.n_block));
    }
  }

  __device__ __forceinline__ RotatedWalk walk() const {
    return {uint32_t(key_blocks), uint32_t(steps)};
  }

  __device__ __forceinline__ StepPos<kBM> first_step() const {
    const int h_lo = int(kb.h0);
    const int head = first > 0 ? int(uint32_t(first) / uint32_t(m_steps)) : 0;
    return StepPos<kBM>{h_lo + head, int(kb.row_lo + (first - head * m_steps) * kBM),
                        int(kb.row_lo), int(row_end), h_lo, h_lo + int(kb.groups)};
  }

  /// The rank of this tile's dq addition at `pos` in a rotated walk.
  __device__ __forceinline__ int rotated_rank(const StepPos<kBM>& pos) const {
    const uint32_t x = uint32_t(pos.h - pos.h_lo) * uint32_t(m_steps) +
                       uint32_t(pos.m0 - pos.row_lo) / kBM;
    return int(walk().rank(x, uint32_t(kb.n_block)));
  }
};

/// The tiles this block walks, in increasing order: a stride of gridDim.x, or (`snake`)
/// common::SnakeScheduler's walk — round r takes tile r G + block, or r G + G - 1 - block when
/// r is odd, pairing a heavy causal tile (they come first) with a light one.
struct TileWalk {
  int64_t tile;
  bool odd = false;
  __device__ __forceinline__ void next(bool snake) {
    const int64_t block = blockIdx.x, blocks = gridDim.x;
    tile += !snake ? blocks : odd ? 2 * block + 1 : 2 * (blocks - block) - 1;
    odd = !odd;
  }
};

#if defined(HIPFLASH_HAS_WGMMA)
/// A block's tiles in increasing order, the same for each of its roles: a fixed walk (TileWalk),
/// or (kCounted: deterministic masked or varlen calls) taken from a counter as blocks free up,
/// so that the tiles a tile waits on (numbered lower) were taken, by running blocks, before it:
/// no deadlock however many of the grid's blocks are resident. The producer takes each (every
/// one from the counter) and posts it to the other roles through a ring of two numbers in
/// shared memory; a number past the last tile ends every role's walk. A rotated walk's tile
/// waits on later tiles of its head too (`rotate`): there the producer takes a tile only once
/// the dQ writer has finished the last one (`writer_paced`), so that no block holds two tiles
/// of a head, the first waiting on the second — a head's n <= grid tiles then sit on n blocks,
/// and every head taken whole completes.
template <class Cfg, bool kCounted>
struct TileFeed {
  dkdv_ws::Smem<Cfg> sm;
  int32_t* counter;  ///< kCounted: the next tile's number
  bool snake;
  bool writer_paced = false;  ///< kCounted, rotated: the writer frees its slot at its tile end
  TileWalk walk{blockIdx.x};
  uint32_t taken = 0;

  /// The producer's next tile.
  __device__ __forceinline__ int64_t produce() {
    if constexpr (!kCounted) {
      return fixed();
    } else {
      const int slot = int(taken & 1u);
      sm.tile_empty(slot).wait(((taken >> 1) & 1u) ^ 1u);
      if (writer_paced && taken > 0)  // the last tile's additions all made
        sm.tile_empty(slot ^ 1).wait(((taken - 1) >> 1) & 1u);
      const int64_t tile = atomicAdd(counter, 1);  // taken once the ring has room for it
      dkdv_ws::st_shared(sm.tile_number(slot), uint32_t(tile));
      sm.tile_full(slot).arrive();
      ++taken;
      return tile;
    }
  }
  /// The next tile of a consumer or the writer (every lane of the warp). `release` false (the
  /// writer, writer_paced): its slot is freed by release_last() instead.
  __device__ __forceinline__ int64_t consume(bool release = true) {
    if constexpr (!kCounted) {
      return fixed();
    } else {
      const int slot = int(taken & 1u);
      sm.tile_full(slot).wait((taken >> 1) & 1u);
      const int64_t tile = dkdv_ws::ld_shared(sm.tile_number(slot));
      __syncwarp();
      if (release && threadIdx.x % 32 == 0) sm.tile_empty(slot).arrive();
      ++taken;
      return tile;
    }
  }
  /// The writer (writer_paced, lane 0): done with the tile it consumed last.
  __device__ __forceinline__ void release_last() {
    if constexpr (kCounted) sm.tile_empty(int((taken - 1) & 1u)).arrive();
  }

 private:
  __device__ __forceinline__ int64_t fixed() {
    const int64_t tile = walk.tile;
    walk.next(snake);
    return tile;
  }
};
#endif  // HIPFLASH_HAS_WGMMA

/// Block i takes tiles i, i + gridDim.x, ... of `tiles` (or the snake's, or kCounted a
/// counter's, TileFeed): persistent (one block per multiprocessor) or one tile per block (the
/// launcher's choice), tiles numbered in bwd::KeyBlock's `order` (deterministic dq: the order
/// of its additions, below). The
/// producer loads a tile's K / V as soon as the consumers have released the last tile's, so
/// that load overlaps their dK / dV stores.
template <class Traits, bool kCounted = false, bool kScoreMods = false>
__global__ void __launch_bounds__(DkdvSm90WsTile<Traits::kHeadDim>::kThreads, 1)
    bwd_dkdv_sm90_ws_kernel(const HIPFLASH_GRID_CONSTANT BwdParams p, int num_n_blocks,
                            const HIPFLASH_GRID_CONSTANT BwdTmaMaps maps, int64_t tiles,
                            bool snake, KeyOrder order, int side_by_side, bool rotate) {
#if defined(HIPFLASH_HAS_WGMMA)
  using namespace ::hipflash::atom::sm90;
  using namespace dkdv_ws;
  using ::hipflash::atom::sm80::smem_addr;
  using Cfg = DkdvSm90WsTile<Traits::kHeadDim>;
  constexpr DType kDT = Traits::kDType;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kHD = Cfg::kHeadDim;
  using Work = DkdvWork<kBM, kBN>;
  using Feed = TileFeed<Cfg, kCounted>;
  // Heads side by side: deterministic masked calls at head dim 64 (bwd_heads_side_by_side);
  // every other instantiation walks one head at a time, its code unchanged.
  constexpr bool kSideBySide = kCounted && Traits::kMasked && kHD <= 64;
  const int heads_side_by_side = kSideBySide ? side_by_side : 1;

  const bool varlen = p.is_varlen();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Smem<Cfg> sm{(smem_addr(smem_raw) + 1023u) & ~1023u};
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  constexpr int kProducerWarp = Cfg::kConsumerThreads / 32, kWriterWarp = kProducerWarp + 1;
  if (threadIdx.x == 0) {
    sm.init();
    Mbarrier::fence_init();
  }
  __syncthreads();
  // A programmatic dependent of the preprocess pass (bwd_preprocess_kernel.hpp): placed while it
  // finishes, reading nothing it writes (lse_log2, delta, dq_accum, the counters) before this.
  port::wait_prerequisite_grids();
  port::allow_dependent_launch();  // the dq conversion's blocks wait for ours to finish

  if (warp >= kProducerWarp) {  // the producer warpgroup: loads and dQ reductions
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp == kProducerWarp && lane == 0) {
      tma::prefetch_map(&maps.q);
      tma::prefetch_map(&maps.dout);
      uint32_t it = 0, kv_it = 0;  // stages and K / V tiles loaded so far
      Feed feed{sm, p.tile_counter, snake, kCounted && rotate};
      for (int64_t tile; (tile = feed.produce()) < tiles;) {
        const Work w(p, tile, num_n_blocks, order, heads_side_by_side, rotate);
        if (w.steps == 0) continue;  // the consumers only store zeros
        // Map coordinates: a varlen call's maps are its packed rows as one batch.
        const int hk = int(w.kb.hk), b = int(w.kb.b), mb = varlen ? 0 : b;
        const int n0 = int(w.kb.seq.k_start + w.kb.n0), q0 = int(w.kb.seq.q_start);
        sm.kv_empty().wait((kv_it++ & 1u) ^ 1u);
        sm.kv_full().arrive_expect_tx(2 * Cfg::kSmemKV);
#pragma unroll
        for (int c = 0; c < Cfg::kPanels; ++c) {
          tma::load_4d(sm.k() + c * kBN * 128, &maps.k, sm.kv_full(), 64 * c, n0, hk, mb);
          tma::load_4d(sm.v() + c * kBN * 128, &maps.v, sm.kv_full(), 64 * c, n0, hk, mb);
        }
        StepPos<kBM> pos = w.first_step();
        for (int64_t s = 0; s < w.steps; ++s, pos.next(), ++it) {
          const int st = int(it % Cfg::kStages);
          sm.q_empty(st).wait(((it / Cfg::kStages) & 1u) ^ 1u);
          const Mbarrier full = sm.q_full(st);
          full.arrive_expect_tx(Cfg::kStageBytes);
          const int h = int(pos.h), m0 = int(pos.m0);
#pragma unroll
          for (int c = 0; c < Cfg::kPanels; ++c) {
            tma::load_4d(sm.q(st) + c * kBM * 128, &maps.q, full, 64 * c, q0 + m0, h, mb);
            tma::load_4d(sm.dout(st) + c * kBM * 128, &maps.dout, full, 64 * c, q0 + m0, h, mb);
          }
          const int64_t ws = p.ws_row(b, h, m0);
          tma::load_1d(sm.lse(st), p.lse_log2 + ws, Cfg::kStatBytes, full);
          tma::load_1d(sm.delta(st), p.delta + ws, Cfg::kStatBytes, full);
        }
      }
    } else if (warp == kWriterWarp && p.dq_accum != nullptr) {
      // The dQ writer, per step: the buffer free (the last reduction has read it), then the
      // consumers' staged tile added to dq_accum — one bar.arrive per consumer kDqEmpty sync.
      // Deterministic: a row block's key blocks add in a fixed key-block order, each once the
      // block's counter equals its rank. Its own addition counts on once performed, which the
      // writer waits for after handing the buffer back (the consumers' next step overlaps the
      // wait) and before any wait on a counter. The order is ascending, or descending under
      // KeyOrder::kFastestLastFirst (masked calls: a head's key blocks run side by side, and a
      // later one reaches each row block earlier in its walk, so none waits while they keep
      // pace; at hd64 several heads' key blocks interleave, ranks still per head). Either way
      // a tile waits only on tiles numbered before it, which a persistent grid's blocks reach
      // (each walks its tiles in increasing order). A rotated walk (DkdvWork; unmasked calls)
      // ranks in the order the walks reach a step and waits on a head's later key blocks too:
      // the launcher rotates only where a head's key blocks fall on distinct blocks of the
      // stride (n <= grid), each behind tiles of earlier heads only.
      const bool ordered = p.dq_semaphore != nullptr;
      int32_t* pending = nullptr;  // the counter of the last addition, not yet counted on
      auto count_on = [&pending] {
        if (pending == nullptr) return;
        tma::wait_group<0>();  // performed, not just read
        fence_proxy_async_global();
        add_release(pending, 1);
        pending = nullptr;
      };
      Feed feed{sm, p.tile_counter, snake, kCounted && rotate};
      for (int64_t tile; (tile = feed.consume(!feed.writer_paced)) < tiles;) {
        const Work w(p, tile, num_n_blocks, order, heads_side_by_side, rotate);
        StepPos<kBM> pos = w.first_step();
        for (int64_t s = 0; s < w.steps; ++s, pos.next()) {
          if (lane == 0) tma::wait_group_read<0>();
          __syncwarp();
          named_arrive<kDqBarThreads>(kDqEmpty);
          if (lane == 0) count_on();
          named_sync<kDqBarThreads>(kDqFull);
          if (lane == 0) {
            const int64_t ws = p.ws_row(w.kb.b, pos.h, pos.m0);
            if (ordered) {
              const SeqBounds& seq = w.kb.seq;
              const int rank =
                  w.key_blocks > 0 ? w.rotated_rank(pos)
                  : order == KeyOrder::kFastestLastFirst
                      ? int(seq.last_key_block_seeing(p, pos.m0, kBM, kBN) - w.kb.n_block)
                      : int(w.kb.n_block - seq.first_key_block_seeing(p, pos.m0, kBN));
              int32_t* const counter = p.dq_semaphore + ws / 64;
              while (load_acquire(counter) != rank) __nanosleep(32);
              fence_proxy_async_global();
              pending = counter;
            }
            tma::reduce_add_1d(p.dq_accum + ws * kHD, sm.dq(), Cfg::kSmemDq);
            tma::commit_group();
          }
        }
        if (feed.writer_paced && lane == 0) {  // additions counted on, the slot freed
          count_on();
          feed.release_last();
        }
      }
      if (lane == 0) {
        count_on();
        tma::wait_group<0>();
      }
    }
    return;
  }

  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int wg = warp / 4, wi = warp % 4, g = lane / 4, t = lane % 4;
  const float scale_log2 = p.softmax_scale * detail::kLog2e;
  uint32_t it = 0, kv_it = 0;  // stages and K / V tiles consumed so far
  Feed feed{sm, p.tile_counter, snake};
  for (int64_t tile; (tile = feed.consume()) < tiles;) {
    const Work w(p, tile, num_n_blocks, order, heads_side_by_side, rotate);
    if (w.kb.past_keys()) continue;  // past this varlen sequence's keys
    const int64_t hk = w.kb.hk, b = w.kb.b, n0 = w.kb.n0;
    const SeqBounds& seq = w.kb.seq;
    // Accumulators in wgmma order: element 4i + 2h + e is row g + 8h of this warp's 16 (keys
    // here, queries for dQ), column 8i + 2t + e.
    float dK[kHD / 2], dV[kHD / 2];
#pragma unroll
    for (int i = 0; i < kHD / 2; ++i) dK[i] = dV[i] = 0.f;
    const uint32_t sK_wg = sm.k() + wg * 64 * 128, sV_wg = sm.v() + wg * 64 * 128;
    const int64_t key0 = n0 + wg * 64 + wi * 16 + g;  // this thread's keys: key0, key0 + 8
    if (w.steps > 0) {
      sm.kv_full().wait(kv_it & 1u);
      if (varlen && n0 + kBN > seq.len_k)  // the next sequence's keys: K zeroed
        zero_tail_rows<Cfg, kBN>(sm.k(), int(seq.len_k - n0), 1);
    }

    StepPos<kBM> pos = w.first_step();
    for (int64_t s = 0; s < w.steps; ++s, pos.next(), ++it) {
      const int st = int(it % Cfg::kStages);
      const int64_t m0 = pos.m0;
      sm.q_full(st).wait((it / Cfg::kStages) & 1u);
      if (varlen && m0 + kBM > seq.len_q) {  // the next sequence's rows: Q, dO zeroed
        zero_tail_rows<Cfg, kBM>(sm.q(st), int(seq.len_q - m0), 0);
        zero_tail_rows<Cfg, kBM>(sm.dout(st), int(seq.len_q - m0), 0);
        fence_proxy_async();
        named_sync<Cfg::kConsumerThreads>(kTailZeroed);
      }

      // S^T = K Q^T, then dP^T = V dO^T, over head-dim steps of 16 (panel ks / 4, 32 B a step).
      float S[kBM / 2], dP[kBM / 2];
      wgmma::fence();
      sm90_parts::issue_scores<kDT, kBM, kBN, kHD>(S, sK_wg, sm.q(st));
      wgmma::commit();
      sm90_parts::issue_scores<kDT, kBM, kBN, kHD>(dP, sV_wg, sm.dout(st));
      wgmma::commit();

      // P^T from the saved LSE while dP^T runs, then dS^T = P^T (dP^T - delta); where the step
      // needs a mask (KeyPairRows::needed, uniform over the block), a select for masked pairs
      // (a masked NaN leaks nothing), the other steps without one: the rows seeing this
      // thread's keys key0 and key0 + 8.
      // The statistics, permuted by the preprocess in 16-row blocks (BwdParams::stats_index):
      // this thread's columns 8i + 2t + e at 4-float group 4 (i / 2) + t, element 2 (i % 2) + e
      // (a warp's four groups of a block: 64 contiguous bytes, no bank conflict).
      const float4* lse4 = reinterpret_cast<const float4*>(smem_floats(smem_raw, sm.lse(st))) + t;
      const float4* delta4 =
          reinterpret_cast<const float4*>(smem_floats(smem_raw, sm.delta(st))) + t;
      auto pair = [](const float4* at, int i) {
        const float4 v = at[4 * (i / 2)];
        return i % 2 == 0 ? make_float2(v.x, v.y) : make_float2(v.z, v.w);
      };
      const KeyPairRows<kBM, Traits::kMasked> key_rows(seq, p, m0, n0, kBN, key0);
      auto probabilities_and_grads = [&](auto select) {
        constexpr bool kSelect = decltype(select)::value;
        wgmma::wait<1>();
        wgmma::fence_operands(S);
#pragma unroll
        for (int i = 0; i < kBM / 8; ++i) {
          const float2 l2s = pair(lse4, i);  // columns 8i + 2t and 8i + 2t + 1
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = 8 * i + 2 * t + e;
            const float l2 = e == 0 ? l2s.x : l2s.y;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int r = 4 * i + 2 * hh + e;
              const float pr = exp2f(S[r] * scale_log2 - l2);
              S[r] = !kSelect || key_rows.sees(col, hh) ? pr : 0.f;
            }
          }
        }
        wgmma::wait<0>();  // dP^T done
        wgmma::fence_operands(dP);
#pragma unroll
        for (int i = 0; i < kBM / 8; ++i) {
          const float2 dls = pair(delta4, i);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = 8 * i + 2 * t + e;
            const float dl = e == 0 ? dls.x : dls.y;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int r = 4 * i + 2 * hh + e;
              // P^T is 0 where masked, but dP^T - delta may be NaN there: select, don't multiply.
              dP[r] = !kSelect || key_rows.sees(col, hh) ? S[r] * (dP[r] - dl) : 0.f;
            }
          }
        }
      };
      // kScoreMods (the softcap, ALiBi: ScoreMods, as the forward applies them): both products
      // first, then per pair the modified score, P, and dS with the cap's derivative.
      auto modified_probabilities_and_grads = [&](auto select) {
        constexpr bool kSelect = decltype(select)::value;
        const ScoreMods mods = ScoreMods::of(p, b, pos.h);
        wgmma::wait<0>();
        wgmma::fence_operands(S);
        wgmma::fence_operands(dP);
        // Column 2t's distance from key key0 (row m0 + 2t's from the diagonal), converted once:
        // each pair's is a constant away (exact below 2^24).
        const float dist0 = float(m0 + seq.diag - key0 + 2 * t);
#pragma unroll
        for (int i = 0; i < kBM / 8; ++i) {
          const float2 l2s = pair(lse4, i), dls = pair(delta4, i);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = 8 * i + 2 * t + e;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int r = 4 * i + 2 * hh + e;
              float slope = 1.f;  // d(the score the softmax saw) / d(s): the cap's 1 - tanh^2
              const float x = mods.apply(S[r], dist0 + float(8 * i + e - 8 * hh), slope);
              const float pr = exp2f(x * mods.scale_log2 - (e == 0 ? l2s.x : l2s.y));
              const bool sees = !kSelect || key_rows.sees(col, hh);
              S[r] = sees ? pr : 0.f;
              dP[r] = sees ? pr * (dP[r] - (e == 0 ? dls.x : dls.y)) * slope : 0.f;
            }
          }
        }
      };
      if constexpr (kScoreMods) {
        if (key_rows.needed)
          modified_probabilities_and_grads(std::true_type{});
        else
          modified_probabilities_and_grads(std::false_type{});
      } else if (key_rows.needed) {
        probabilities_and_grads(std::true_type{});
      } else {
        probabilities_and_grads(std::false_type{});
      }
      uint32_t Pf[kBM / 16][4], dSf[kBM / 16][4];
      sm90_parts::pack_a<kDT, kBM>(S, Pf);
      sm90_parts::pack_a<kDT, kBM>(dP, dSf);
      if (p.dq_accum != nullptr) {
        // dV += P^T dO first; while it runs, dS^T (rounded, as the A operand of dQ) into its
        // SW128 tile. Free: both warpgroups passed the last step's kDqEmpty sync after their dQ
        // products were done. Then dQ's product, and dK += dS^T Q behind it: the dQ piece is
        // staged for the writer while dK's product runs.
        wgmma::fence();
        sm90_parts::issue_grad<kDT, kBM, kHD>(dV, Pf, sm.dout(st));
        wgmma::commit();
        // dS^T into its tile, swizzled by the row phase; the phases (the dS^T rows' here, pair
        // g's for the dQ piece below) kept opaque, so that each address is a base and a
        // constant. hd128: by stmatrix — dSf[k] is the four 8 x 8 matrices of query columns
        // 16k .. 16k + 15 (chunks 2k and 2k + 1, k % 4 of panel k / 4) for this warp's keys g
        // and g + 8, this lane addressing row r = lane % 8 of matrix m = lane / 8: key
        // r + 8 (m % 2), chunk 2k + m / 2 (phase r). Other head dims: 32-bit stores (phase
        // g); stmatrix measured slower at hd64 (docs/design-decisions.md, the consumers'
        // shared-memory traffic).
        int ds_phase = kHD == 128 ? lane % 8 : g, phase = dq_pair_swizzle(g);
        asm volatile("" : "+r"(ds_phase), "+r"(phase));
        if constexpr (kHD == 128) {
          const int m = lane / 8;
          const uint32_t ds_row =
              sm.ds() + uint32_t(wg * 64 + wi * 16 + 8 * (m % 2) + ds_phase) * 128;
#pragma unroll
          for (int k = 0; k < kBM / 16; ++k)
            stmatrix_x4(ds_row + (k / 4) * kBN * 128 + (((2 * (k % 4) + m / 2) ^ ds_phase) << 4),
                        dSf[k]);
        } else {
          const uint32_t ds_row = sm.ds() + uint32_t(wg * 64 + wi * 16 + g) * 128 + 4 * t;
#pragma unroll
          for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)  // dS^T[4i + 2hh ..]: dSf[i / 2][2 (i % 2) + hh]
              st_shared(ds_row + (i / 8) * kBN * 128 + hh * 8 * 128 + (((i % 8) ^ ds_phase) << 4),
                        dSf[i / 2][2 * (i % 2) + hh]);
        }
        fence_proxy_async();
        named_sync<Cfg::kConsumerThreads>(kDsReady);
        // A: dS^T's panel of this piece's 64 queries; B: K's panel of its 64 columns.
        const uint32_t a0 = sm.ds() + (Cfg::kDqByColumns ? 0 : wg * kBN * 128);
        const uint32_t b0 = sm.k() + (Cfg::kDqByColumns ? wg * kBN * 128 : 0);
        float dQ[32];
        wgmma::fence();
        sm90_parts::issue_dq<kDT, kBN>(dQ, a0, b0);
        wgmma::commit();
        sm90_parts::issue_grad<kDT, kBM, kHD>(dK, dSf, sm.q(st));
        wgmma::commit();
        wgmma::wait<1>();  // dV and dQ done, dK's product in flight
        wgmma::fence_operands(dV);
        wgmma::fence_operands(dQ);

        // The piece into the staged tile in dq_accum's layout (dq_accum_index): this thread's
        // rows g and g + 8 of its warp's 16 are pair g of the group, columns col0 + 8i + 2t and
        // + 1 of both one 16-byte chunk, col0 / 2 + 4i + t, swizzled by dq_pair_swizzle(g) (each
        // quarter warp's 8 stores fill all 32 banks: four wavefronts, the fewest for 512 bytes).
        named_sync<kDqBarThreads>(kDqEmpty);
        const int col0 = Cfg::kDqByColumns ? wg * 64 : 0;
        const int group0 = (Cfg::kDqByColumns ? 0 : wg * 64) + wi * 16;  // the group's first row
        const uint32_t dq_pair = sm.dq() + uint32_t(group0 + 2 * g) * (kHD * 4);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          st_shared(dq_pair + (((col0 / 2 + 4 * i + t) ^ phase) << 4), dQ[4 * i], dQ[4 * i + 1],
                    dQ[4 * i + 2], dQ[4 * i + 3]);
        fence_proxy_async();
        named_arrive<kDqBarThreads>(kDqFull);
        wgmma::wait<0>();  // dK done: Q, dO and the statistics read
        wgmma::fence_operands(dK);
        __syncwarp();  // every lane's reads before its lane 0's release
        if (lane == 0) sm.q_empty(st).arrive();
      } else {
        // dV += P^T dO, dK += dS^T Q.
        wgmma::fence();
        sm90_parts::issue_grad<kDT, kBM, kHD>(dV, Pf, sm.dout(st));
        sm90_parts::issue_grad<kDT, kBM, kHD>(dK, dSf, sm.q(st));
        wgmma::commit();
        wgmma::wait<0>();
        wgmma::fence_operands(dV);
        wgmma::fence_operands(dK);
        __syncwarp();
        if (lane == 0) sm.q_empty(st).arrive();
      }
    }
    if (w.steps > 0) {  // K and V read (every warp's products waited for): the next tile's load
      __syncwarp();
      if (lane == 0) sm.kv_empty().arrive();
      ++kv_it;
    }

    // dk = scale dS^T Q, dv = P^T dO, rows of this thread's keys: with maps, staged in shared
    // memory and written by one bulk tensor store a panel (whole 128-byte rows; the map clips
    // rows past the keys; a varlen call's map is its packed rows, so only key blocks whole
    // inside their sequence) — one tile a block over K and V, which every warp of both
    // warpgroups is done reading (each waited for its products), a persistent block in a region
    // of its own while its next tile's K and V load; the exit waits only for the stores to have
    // read shared memory. Else by the threads, 4 bytes a store (a persistent block's stores
    // measured 12% slower at B 32 S 512 hd128 fwd+bwd, H100; varlen deterministic causal hd64
    // 34% slower than by boxes: docs/design-decisions.md).
    const int row = wg * 64 + wi * 16 + g;
    const bool boxed = !varlen || n0 + kBN <= seq.len_k;
    auto store = [&](const TensorMap* map, uint32_t tile) {  // thread 0: the staged panels
#pragma unroll
      for (int c = 0; c < Cfg::kPanels; ++c)
        tma::store_4d(map, tile + c * kBN * 128, 64 * c, int(seq.k_start + n0), int(hk),
                      varlen ? 0 : int(b));
    };
    if (p.dkv_accum != nullptr) {  // one slice of the kv head's query heads: its parts
      const int64_t slice = w.kb.h0 % (p.heads_q / p.heads_kv) / w.kb.groups;
      sm90_parts::store_dkdv_part<kHD>(p, slice, b, hk, key0, t, dK, dV);
    } else if (!boxed) {
      sm90_parts::store_dkdv<kDT, kHD>(p, seq, b, hk, key0, t, dK, dV);
    } else if (maps.dkdv_store == BwdTmaMaps::DkdvStore::kOverKV) {
      named_sync<Cfg::kConsumerThreads>(kDkdvStaged);
      stage_grad<kDT, kHD, kBN>(sm.k(), p.softmax_scale, row, t, dK);
      stage_grad<kDT, kHD, kBN>(sm.v(), 1.f, row, t, dV);
      fence_proxy_async();
      named_sync<Cfg::kConsumerThreads>(kDkdvStaged);
      if (threadIdx.x == 0) {
        store(&maps.dk, sm.k());
        store(&maps.dv, sm.v());
        tma::commit_group();
        tma::wait_group_read<0>();
      }
    } else if (maps.dkdv_store == BwdTmaMaps::DkdvStore::kOwnStage) {
      // The staging region: the last tile's stores must have read it (thread 0 waits, then
      // the consumers meet), then dK (and dV beside it at head dim 64, after it at 128).
      // Stores still reading at the block's exit are waited for after the walk.
      const uint32_t dk_at = sm.stage();
      const uint32_t dv_at = dk_at + (Cfg::kStagePasses == 1 ? Cfg::kSmemKV : 0);
#pragma unroll
      for (int pass = 0; pass < Cfg::kStagePasses; ++pass) {
        const bool dk_pass = pass == 0, dv_pass = pass == Cfg::kStagePasses - 1;
        if (threadIdx.x == 0) tma::wait_group_read<0>();
        named_sync<Cfg::kConsumerThreads>(kDkdvStaged);
        if (dk_pass) stage_grad<kDT, kHD, kBN>(dk_at, p.softmax_scale, row, t, dK);
        if (dv_pass) stage_grad<kDT, kHD, kBN>(dv_at, 1.f, row, t, dV);
        fence_proxy_async();
        named_sync<Cfg::kConsumerThreads>(kDkdvStaged);
        if (threadIdx.x == 0) {
          if (dk_pass) store(&maps.dk, dk_at);
          if (dv_pass) store(&maps.dv, dv_at);
          tma::commit_group();
        }
      }
    } else {
      sm90_parts::store_dkdv<kDT, kHD>(p, seq, b, hk, key0, t, dK, dV);
    }
  }
  if (maps.dkdv_store == BwdTmaMaps::DkdvStore::kOwnStage && threadIdx.x == 0)
    tma::wait_group_read<0>();  // the last tile's stores have read the staging region
#else
  port::trap();  // TMA and wgmma need sm_90a; the launcher picks this kernel only where built
#endif  // HIPFLASH_HAS_WGMMA
}

}  // namespace hipflash::bwd
