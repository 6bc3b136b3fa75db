// hipflash — the one place that launches the warp-specialised sm90 forward kernel, with the
// tensor maps of q, k, v (and out) encoded per call (gpu/tma_host.hpp). Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include <cstdint>
#include <tuple>

#include "gpu/launch_fwd.hpp"
#include "gpu/tma_host.hpp"
#include "hipflash/detail/selector.hpp"  // tma_strides_ok
#include "sm90_ws/fwd_sm90_ws_kernel.hpp"

namespace hipflash::gpu {


/// The warp-specialised sm90 kernel's launch traits: a persistent grid, the tensor maps and
/// the divisors that decode its tile indices.
template <class Traits>
struct Sm90WsLaunch {
  using Tile = sm90_ws::TileOf<Traits>;
  using Scheduler = sm90_ws::Scheduler<Traits>;
  static constexpr auto kKernel = sm90_ws::fwd_sm90_ws_kernel<Traits>;
  static constexpr const char* kName = "sm90_ws";
  static std::tuple<sm90_ws::TmaMaps, common::TileDivisors> prepare(const FwdParams& p,
                                                                   int64_t num_m_blocks,
                                                                   int64_t tiles) {
    // Every tile index is decoded by the divisors, which are exact below 2^31.
    HIPFLASH_CHECK(tiles <= 0x7fffffff, "problem too large for the sm90_ws kernel: ", tiles,
                   " work tiles (batch * heads_q * query blocks * splits) exceed 2^31 - 1");
    sm90_ws::TmaMaps maps;
    // Boxes of [rows x one panel row] (128 bytes; 64 for fp8 at hd64). A varlen call's maps
    // take its packed rows as one batch (the kernel offsets the rows by cu_seqlens).
    constexpr int kCols = Tile::kPanelElems;
    const int64_t rows_q = p.map_rows_q(), rows_k = p.map_rows_k(), batch = p.map_batch();
    maps.q = tma_host::encode(p.q, p.dtype, p.head_dim, rows_q, p.heads_q, batch, p.q_row_stride,
                              p.q_head_stride, p.q_batch_stride, Tile::kBlockM, kCols);
    maps.k = tma_host::encode(p.k, p.dtype, p.head_dim, rows_k, p.heads_kv, batch, p.k_row_stride,
                              p.k_head_stride, p.k_batch_stride, Tile::kBlockN, kCols);
    maps.v = tma_host::encode(p.v, p.dtype, p.head_dim, rows_k, p.heads_kv, batch, p.v_row_stride,
                              p.v_head_stride, p.v_batch_stride, Tile::kBlockN, kCols);
    // hd64: out's map for the TMA store (a warpgroup's 64 rows a box), where one describes it;
    // else the consumers store the rows themselves (o_ok 0) — always for varlen, whose boxes
    // would write into the next sequence's rows.
    if (sm90_ws::kOutByTma<Traits::kHeadDim> && !p.is_varlen() &&
        reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
        tma_strides_ok(dtype_size(p.out_dtype), p.seqlen_q, p.o_row_stride, p.heads_q,
                       p.o_head_stride, p.batch, p.o_batch_stride)) {
      maps.o = tma_host::encode(p.out, p.out_dtype, p.head_dim, p.seqlen_q, p.heads_q, p.batch,
                                p.o_row_stride, p.o_head_stride, p.o_batch_stride, 64);
      maps.o_ok = 1;
    }
    return {maps, common::TileDivisors(p, num_m_blocks)};
  }
};

/// Calls with long rows run on the long-row tile (sm90_ws::long_row_tile: masked hd64, 16-bit
/// and fp8, on three consumers; unmasked 16-bit hd128 and hd96 from
/// sm90_ws::kHd128LongRowKeys keys on 176-key blocks); the launch says so
/// (note_long_row_tile) for the kernel's name.
template <class Traits>
void launch_sm90_ws_fwd(const FwdParams& p, port::stream_t stream) {
  HIPFLASH_CHECK_AS(runtime_error, !p.is_kvcache(),
                    "the sm90_ws kernel reads no KV cache (the selector's rule)");
  if constexpr (sm90_ws::kHasLongRowTile<Traits>) {
    int device = 0;
    port::check(port::get_device(&device), "querying the current device");
    if (sm90_ws::long_row_tile(Traits::kHeadDim, Traits::kMasked, Traits::kSplit, p.seqlen_q,
                              p.seqlen_k, p.window_left, p.window_right,
                              p.batch * p.heads_q, device_arch(device).num_sms)) {
      note_long_row_tile();
      return launch_fwd<Sm90WsLaunch<sm90_ws::LongRows<Traits>>>(p, stream);
    }
  }
  launch_fwd<Sm90WsLaunch<Traits>>(p, stream);
}

}  // namespace hipflash::gpu
