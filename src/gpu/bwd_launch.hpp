// hipflash — the one place that launches the backward kernels (SPEC §7). Included only by the
// generated instantiation TUs (bwd_<dtype>_hd<hd>.cu, see cmake/HipflashGpu.cmake).
//
// Order on the stream: preprocess (delta, lse_log2, dq_accum and its counters zeroed) -> dk/dv
// pass (on Hopper the warp-specialised kernel, adding dq in key-block order when deterministic;
// the cp.async one for strides no tensor map describes; elsewhere dq added atomically unless
// deterministic) -> dq pass (deterministic, not warp-specialised) or dq conversion -> dk/dv
// conversion (where the pass's GQA tiles took slices of a group: BwdParams::heads_per_tile) ->
// zero the rows outside every sequence's used rows (varlen; seqused). The warp-specialised dk/dv
// pass and the dq conversion go as programmatic dependents of the pass before them (where their
// code waits for it: sm_90+), so that their blocks are placed while it ends.
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "bwd/bwd_portable_kernel.hpp"
#include "bwd/bwd_preprocess_kernel.hpp"
#include "bwd/bwd_sm80_kernel.hpp"
#include "bwd/bwd_sm90_kernel.hpp"
#include "gpu/device_guard.hpp"  // dependent_launch
#include "gpu/launch_api.hpp"
#if defined(HIPFLASH_HAS_SM90_KERNELS)
#include "bwd/bwd_sm90_ws_kernel.hpp"
#include "gpu/tma_host.hpp"
#endif
#include "gpu/launch_fwd.hpp"  // set_smem_once_per_device
#include "hipflash/detail/selector.hpp"  // kBwdSm90MaxHeadDim

namespace hipflash::gpu {
namespace bwd_detail {

/// The grid of a pass (a pass with no blocks is skipped by its caller: a zero grid is an error).
inline unsigned grid_of(int64_t blocks, const char* what) {
  HIPFLASH_CHECK(blocks <= 0x7fffffff, "problem too large for one launch: the backward's ", what,
                 " pass needs ", blocks, " thread blocks (more than 2^31 - 1)");
  return unsigned(blocks);
}

inline void check_launch(const char* what) {
  if (const port::error_t err = port::get_last_error(); err != port::kSuccess)
    port::check(err, (std::string("launching the backward's ") + what + " kernel").c_str());
}

template <DType kDType>
void zero_outside(void* base, int64_t row_stride, int64_t head_stride, int64_t total,
                  int64_t heads, int head_dim, const int32_t* cu, const int32_t* used,
                  int64_t batch, port::stream_t stream) {
  using W = typename common::Bits<kDType>::word;
  const int64_t threads = total * heads * (head_dim / 8);
  if (threads == 0) return;
  const int64_t blocks = (threads + bwd::kConvertThreads - 1) / bwd::kConvertThreads;
  bwd::bwd_zero_outside_kernel<kDType><<<grid_of(blocks, "varlen zero-fill"), bwd::kConvertThreads,
                                         0, stream>>>(static_cast<W*>(base), row_stride,
                                                      head_stride, total, heads, head_dim, cu,
                                                      used, batch);
  check_launch("varlen zero-fill");
}

#if defined(HIPFLASH_HAS_SM90_KERNELS)
/// The tensor maps of q and dout (boxes of block_m rows) and of k and v (block_n rows).
inline bwd::BwdTmaMaps tma_maps(const BwdParams& p, int block_m, int block_n) {
  const int64_t q = p.map_rows_q(), k = p.map_rows_k(), batch = p.map_batch();
  bwd::BwdTmaMaps maps;
  maps.q = tma_host::encode(p.q, p.dtype, p.head_dim, q, p.heads_q, batch, p.q_row_stride,
                            p.q_head_stride, p.q_batch_stride, block_m);
  maps.dout = tma_host::encode(p.dout, p.dtype, p.head_dim, q, p.heads_q, batch, p.do_row_stride,
                               p.do_head_stride, p.do_batch_stride, block_m);
  maps.k = tma_host::encode(p.k, p.dtype, p.head_dim, k, p.heads_kv, batch, p.k_row_stride,
                            p.k_head_stride, p.k_batch_stride, block_n);
  maps.v = tma_host::encode(p.v, p.dtype, p.head_dim, k, p.heads_kv, batch, p.v_row_stride,
                            p.v_head_stride, p.v_batch_stride, block_n);
  return maps;
}

/// The maps of dk and dv (boxes of block_n rows, as k's; varlen: the packed rows as one batch)
/// where the gradients have strides a map describes: the dk/dv pass then stores them by bulk
/// tensor stores, staged over K and V (one tile a block) or in a region of their own
/// (`persistent`: the next tile's K / V load overlaps the stores; BwdTmaMaps::dkdv_store); else
/// its threads store them.
inline void add_dkdv_maps(bwd::BwdTmaMaps& maps, const BwdParams& p, int block_n,
                          bool persistent) {
  const int64_t k = p.map_rows_k(), batch = p.map_batch();
  if (!bwd_map_ok(p, p.dk, k, p.heads_kv, p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride) ||
      !bwd_map_ok(p, p.dv, k, p.heads_kv, p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride))
    return;  // (varlen: packed rows as one batch; the kernel boxes whole key blocks only)
  maps.dk = tma_host::encode(p.dk, p.dtype, p.head_dim, k, p.heads_kv, batch, p.dk_row_stride,
                             p.dk_head_stride, p.dk_batch_stride, block_n);
  maps.dv = tma_host::encode(p.dv, p.dtype, p.head_dim, k, p.heads_kv, batch, p.dv_row_stride,
                             p.dv_head_stride, p.dv_batch_stride, block_n);
  maps.dkdv_store = persistent ? bwd::BwdTmaMaps::DkdvStore::kOwnStage
                               : bwd::BwdTmaMaps::DkdvStore::kOverKV;
}
#endif  // HIPFLASH_HAS_SM90_KERNELS

/// A kernel as a type (a generic lambda's argument that can name it as a template argument).
template <auto kKernel>
using KernelConstant = std::integral_constant<decltype(kKernel), kKernel>;

}  // namespace bwd_detail

template <class Traits>
void launch_bwd(const BwdParams& params, const BwdLaunch& how, port::stream_t stream) {
  using namespace bwd_detail;
  constexpr DType kDT = Traits::kDType;
  constexpr int kHD = Traits::kHeadDim;
  // The dk/dv pass decides where dq comes from: the warp-specialised one adds it to dq_accum,
  // in key-block order when deterministic (dq_semaphore); the others atomically, or leave it
  // to the dq pass when deterministic (dq_accum and the counters then unused: dropped here).
  bool ws = false;
#if defined(HIPFLASH_HAS_SM90_KERNELS)
  if constexpr (kHD <= kBwdSm90MaxHeadDim) ws = how.sm90 && sm90_ws_ok(params);
#endif
  // The score modifiers: the portable kernels, or the warp-specialised pass's instantiation
  // with them (run_backward's routing, bwd_score_mods_on_ws); no other pass applies them.
  const bool score_mods = params.has_score_mods();
  if (score_mods && !how.portable && !bwd_score_mods_on_ws(params, ws))
    throw std::logic_error("hipflash: the backward's score modifiers reached passes without them");
  BwdParams p = params;
  if (!ws || !p.deterministic) p.dq_semaphore = nullptr;
  if (p.dq_semaphore == nullptr || !(Traits::kMasked || p.is_varlen()) || score_mods)
    p.tile_counter = nullptr;  // the score modifiers' instantiation is not counted
  if (!ws && p.deterministic) p.dq_accum = nullptr;
  // The warp-specialised consumers read the statistics by 16-byte loads, permuted in 16-row
  // blocks (BwdParams::stats_permuted); every other pass reads them in row order. Both layouts and
  // dq_accum's 16-row pairs need 16-row workspace groups and 16-float rows.
  p.stats_permuted = ws;
  if (p.seqlen_rounded % 16 != 0 || p.padded_head_dim % 16 != 0)
    throw std::logic_error("hipflash: the backward's workspace rows are not in 16-row groups");
  if (!ws) {  // the other passes walk whole groups
    p.dkv_accum = nullptr;
    p.heads_per_tile = 0;
  }
  // Launches kernel<<<blocks (per (head, batch)) * heads * B, threads, smem>>>(p, blocks) with
  // `launch`'s attributes (the dq conversion: a programmatic dependent of the dk/dv pass).
  auto pass = [&](auto kernel, int64_t blocks, int64_t heads, int threads, int smem,
                  const char* what, port::LaunchOptions launch = {}) {
    const int64_t grid = blocks * heads * p.batch;
    if (grid == 0) return;  // nothing to do (and a zero grid is a launch error)
    const port::error_t err = port::launch_kernel(kernel, dim3(grid_of(grid, what)),
                                                  dim3(threads), smem, stream, launch, p,
                                                  int(blocks));
    port::check(err, (std::string("launching the backward's ") + what + " kernel").c_str());
  };
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };

  pass(bwd::bwd_preprocess_kernel<kDT>, p.seqlen_rounded / bwd::kPrepRows, p.heads_q,
       bwd::kPrepThreads, 0, "preprocess");

  if (how.portable) {  // always deterministic: a dq pass after the dk/dv pass
    using Tile = bwd::PortableTile<kHD>;
    pass(bwd::bwd_dkdv_portable_kernel<Traits>, ceil_div(p.seqlen_k, Tile::kBlockN), p.heads_kv,
         Tile::kThreads, 0, "portable dk/dv");
    pass(bwd::bwd_dq_portable_kernel<Traits>, ceil_div(p.seqlen_q, Tile::kBlockM), p.heads_q,
         Tile::kThreads, 0, "portable dq");
  } else {
#if defined(HIPFLASH_PLATFORM_NVIDIA)
    bool done = false;
#if defined(HIPFLASH_HAS_SM90_KERNELS)
    if constexpr (kHD <= kBwdSm90MaxHeadDim) {
      if (ws) {
        using Dkdv = bwd::DkdvSm90WsTile<kHD>;
        static_assert(Dkdv::kBlockN == kBwdSm90WsBlockN);
        const int64_t blocks = ceil_div(p.seqlen_k, Dkdv::kBlockN);
        if (const int64_t tiles = blocks * p.heads_kv * p.dkv_slices() * p.batch; tiles > 0) {
          bwd::BwdTmaMaps maps = tma_maps(p, Dkdv::kBlockM, Dkdv::kBlockN);
          int device = 0;
          port::check(port::get_device(&device), "querying the current device");
          // Unmasked dense tiles (all of a cost): persistent, one block per multiprocessor, in a
          // stride. Masked and varlen ones: a block per tile, handed out by the hardware as
          // multiprocessors free up, key block fastest, so that a head's key blocks run side by
          // side and share its Q, dO and dq_accum in L2 (+13-15% at causal S = 512-1k, hd128),
          // unless there are too few tiles to even out: heaviest first then (GQA 8 at S = 2k
          // with whole groups: 256 tiles, -15% key block fastest) — a GQA call first splits
          // its groups over more tiles (bwd_heads_per_tile; the workspace decided it).
          // Deterministic: persistent (a block waits on tiles its grid's resident blocks are
          // sure to reach), key block fastest; unmasked calls rotated (below); masked calls
          // each head's last key block first, adding dq in descending key-block order
          // (heaviest first cost masked calls 1.23-1.42x the default's time even with no wait
          // at all: the L2 sharing lost), their tiles taken from a counter as blocks free up
          // (bwd::TileFeed: a fixed walk started a head's key blocks at scattered times, and
          // each waited on the one started last); varlen ones too (a fixed stride's rounds fall
          // out of step over sequences of unequal lengths), a rotated walk's paced by its writer
          // (bwd::TileFeed: no block holds two tiles of a head).
          const int num_sms = device_arch(device).num_sms;
          const bool ordered = p.dq_semaphore != nullptr;
          // The counter ends at tiles + grid - 1 (each block's last take is past the end): 32-bit
          // numbers, else the snake.
          if (tiles > INT32_MAX - int64_t(num_sms)) p.tile_counter = nullptr;
          const bool counted = p.tile_counter != nullptr;
          const bool persistent = ordered || (!p.is_varlen() && !Traits::kMasked);
          const bwd::KeyOrder order =
              !Traits::kMasked                 ? bwd::KeyOrder::kFastest
              : ordered                        ? bwd::KeyOrder::kFastestLastFirst
              : tiles < kBwdMinTilesPerSm * num_sms ? bwd::KeyOrder::kSlowest
                                               : bwd::KeyOrder::kFastest;
          const int side_by_side = int(
              bwd_heads_side_by_side(p.tile_key_blocks(Dkdv::kBlockN), num_sms, Dkdv::kHeadDim,
                                     ordered, Traits::kMasked, p.tile_query_heads()));
          const bool snake = Traits::kMasked && persistent && !counted;
          const int64_t grid = persistent ? std::min<int64_t>(tiles, num_sms) : tiles;
          if (p.dkv_accum == nullptr) add_dkdv_maps(maps, p, Dkdv::kBlockN, persistent);
          // Deterministic unmasked calls walk rotated (bwd::RotatedWalk), a tile then waiting
          // on later key blocks of its head too: only where the stride puts a head's key
          // blocks on distinct blocks (blocks <= grid), each queued behind earlier heads' tiles
          // alone, so that every head completes in turn.
          const bool rotate = ordered && !Traits::kMasked && blocks <= grid;
          auto launch = [&](auto kernel) {  // a KernelConstant
            constexpr auto dkdv = decltype(kernel)::value;
            set_smem_once_per_device<dkdv>(Dkdv::kSmemBytes, "backward dk/dv (sm90_ws)");
            // A programmatic dependent of the preprocess (its blocks placed while that ends).
            port::check(port::launch_kernel(dkdv, dim3(grid_of(grid, "dk/dv (sm90_ws)")),
                                            dim3(Dkdv::kThreads), Dkdv::kSmemBytes, stream,
                                            dependent_launch<dkdv>(), p, int(blocks), maps,
                                            tiles, snake, order, side_by_side, rotate),
                        "launching the backward's dk/dv (sm90_ws) kernel");
          };
          if (score_mods) {
            launch(KernelConstant<bwd::bwd_dkdv_sm90_ws_kernel<Traits, false, true>>{});
          } else if (!counted) {
            launch(KernelConstant<bwd::bwd_dkdv_sm90_ws_kernel<Traits>>{});
          } else {  // deterministic masked or varlen calls
            launch(KernelConstant<bwd::bwd_dkdv_sm90_ws_kernel<Traits, true>>{});
          }
        }
        done = true;
      } else if (how.sm90) {
        using Dkdv = bwd::DkdvSm90Tile<kHD>;
        constexpr auto dkdv = bwd::bwd_dkdv_sm90_kernel<Traits>;
        set_smem_once_per_device<dkdv>(Dkdv::kSmemBytes, "backward dk/dv (sm90)");
        pass(dkdv, ceil_div(p.seqlen_k, Dkdv::kBlockN), p.heads_kv, Dkdv::kThreads,
             Dkdv::kSmemBytes, "dk/dv (sm90)");
        done = true;
      }
    }
#endif  // HIPFLASH_HAS_SM90_KERNELS
    if (!done) {
      using Dkdv = bwd::DkdvTile<kHD>;
      constexpr auto dkdv = bwd::bwd_dkdv_sm80_kernel<Traits>;
      set_smem_once_per_device<dkdv>(Dkdv::kSmemBytes, "backward dk/dv");
      pass(dkdv, ceil_div(p.seqlen_k, Dkdv::kBlockN), p.heads_kv, Dkdv::kThreads,
           Dkdv::kSmemBytes, "dk/dv");
    }
    if (p.deterministic && p.dq_semaphore == nullptr) {
      using Dq = bwd::DqTile<kHD>;
      constexpr auto dq = bwd::bwd_dq_sm80_kernel<Traits>;
      set_smem_once_per_device<dq>(Dq::kSmemBytes, "backward dq");
      pass(dq, ceil_div(p.seqlen_q, Dq::kBlockM), p.heads_q, Dq::kThreads, Dq::kSmemBytes, "dq");
    }
#endif  // HIPFLASH_PLATFORM_NVIDIA
  }

  if (p.dq_accum != nullptr && !how.portable) {
    constexpr auto convert = bwd::bwd_dq_convert_kernel<kDT>;
    pass(convert, ceil_div(p.seqlen_rounded / 2 * (p.padded_head_dim / 8), bwd::kConvertThreads),
         p.heads_q, bwd::kConvertThreads, 0, "dq conversion", dependent_launch<convert>());
  }
  if (p.dkv_accum != nullptr)
    pass(bwd::bwd_dkv_convert_kernel<kDT>,
         ceil_div(p.seqlen_k_rounded * (p.padded_head_dim / 8), bwd::kConvertThreads), p.heads_kv,
         bwd::kConvertThreads, 0, "dk/dv conversion");

  if (p.is_varlen() && how.zero_q)
    zero_outside<kDT>(p.dq, p.dq_row_stride, p.dq_head_stride, p.total_q, p.heads_q,
                      int(p.head_dim), p.cu_seqlens_q, p.seqused_q, p.batch, stream);
  if (p.is_varlen() && how.zero_k) {
    zero_outside<kDT>(p.dk, p.dk_row_stride, p.dk_head_stride, p.total_k, p.heads_kv,
                      int(p.head_dim), p.cu_seqlens_k, p.seqused_k, p.batch, stream);
    zero_outside<kDT>(p.dv, p.dv_row_stride, p.dv_head_stride, p.total_k, p.heads_kv,
                      int(p.head_dim), p.cu_seqlens_k, p.seqused_k, p.batch, stream);
  }
}

}  // namespace hipflash::gpu

/// Explicit instantiations of the backward for one (dtype, padded head dim): unmasked and masked.
#define HIPFLASH_INSTANTIATE_BWD(DT, HD)                                                        \
  namespace hipflash::gpu {                                                                    \
  template void launch_bwd<BwdTraits<DT, HD, false>>(const BwdParams&, const BwdLaunch&,       \
                                                     port::stream_t);                          \
  template void launch_bwd<BwdTraits<DT, HD, true>>(const BwdParams&, const BwdLaunch&,        \
                                                    port::stream_t);                           \
  }
