// hipflash — the one place that launches the warp-specialised sm90 forward kernel, and the
// host half of its TMA: the tensor maps of q, k and v, encoded per call through the driver
// entry point that the CUDA runtime exposes (no link against libcuda). Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only)

#include <cstdint>
#include <cstring>
#include <mutex>
#include <tuple>

#include "gpu/launch_fwd.hpp"
#include "hipflash/detail/selector.hpp"  // tma_strides_ok
#include "sm90_ws/fwd_sm90_ws_kernel.hpp"

namespace hipflash::gpu {

namespace tma_host {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/// cuTensorMapEncodeTiled from the driver, looked up once (ABI of CUDA 12.0).
inline EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
    port::check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                 cudaEnableDefault, &found),
                "looking up cuTensorMapEncodeTiled");
    HIPFLASH_CHECK_AS(runtime_error, found == cudaDriverEntryPointSuccess && ptr != nullptr,
                      "the CUDA driver has no cuTensorMapEncodeTiled (TMA needs a 12.0+ driver)");
    return reinterpret_cast<EncodeTiled>(ptr);
  }();
  return fn;
}

/// The 4-d map (head dim, row, head, batch) of one operand, boxes of [box_rows x 64] elements
/// with the 128-byte swizzle; out-of-range rows and head-dim columns read as zero.
inline sm90_ws::TensorMap encode(const void* base, DType dtype, int64_t head_dim, int64_t rows,
                                int64_t heads, int64_t batch, int64_t row_stride,
                                int64_t head_stride, int64_t batch_stride, int box_rows) {
  constexpr int64_t kBytes = 2;
  // A stride of a size-1 dimension is never used; TMA still wants a multiple of 16 bytes.
  auto stride = [&](int64_t s, int64_t extent) { return extent == 1 ? 16 : uint64_t(s * kBytes); };
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(rows), cuuint64_t(heads),
                              cuuint64_t(batch)};
  const cuuint64_t strides[3] = {stride(row_stride, rows), stride(head_stride, heads),
                                 stride(batch_stride, batch)};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = encode_tiled()(
      &map, dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      4, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  HIPFLASH_CHECK_AS(runtime_error, r == CUDA_SUCCESS, "encoding a TMA tensor map failed (CUresult ",
                    int(r), "); the selector's sm90_tma_compatible() should have refused this call");
  sm90_ws::TensorMap out;
  static_assert(sizeof(out) == sizeof(map), "a CUtensorMap is 128 bytes");
  std::memcpy(&out, &map, sizeof(map));
  return out;
}

}  // namespace tma_host

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
    maps.q = tma_host::encode(p.q, p.dtype, p.head_dim, p.seqlen_q, p.heads_q, p.batch,
                              p.q_row_stride, p.q_head_stride, p.q_batch_stride, Tile::kBlockM);
    maps.k = tma_host::encode(p.k, p.dtype, p.head_dim, p.seqlen_k, p.heads_kv, p.batch,
                              p.k_row_stride, p.k_head_stride, p.k_batch_stride, Tile::kBlockN);
    maps.v = tma_host::encode(p.v, p.dtype, p.head_dim, p.seqlen_k, p.heads_kv, p.batch,
                              p.v_row_stride, p.v_head_stride, p.v_batch_stride, Tile::kBlockN);
    // hd64 (hd128 with its hook): out's map for the TMA store (a warpgroup's 64 rows a box),
    // where one describes it; else the consumers store the rows themselves (o_ok 0).
    if (sm90_ws::kOutByTma<Traits::kHeadDim> && reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
        tma_strides_ok(dtype_size(p.dtype), p.seqlen_q, p.o_row_stride, p.heads_q,
                       p.o_head_stride, p.batch, p.o_batch_stride)) {
      maps.o = tma_host::encode(p.out, p.dtype, p.head_dim, p.seqlen_q, p.heads_q, p.batch,
                                p.o_row_stride, p.o_head_stride, p.o_batch_stride, 64);
      maps.o_ok = 1;
    }
    return {maps, common::TileDivisors(p, num_m_blocks)};
  }
};

/// Calls with long rows run on the long-row tile (sm90_ws::long_row_tile: masked hd64 on three
/// consumers, unmasked hd128 and hd96 from sm90_ws::kHd128LongRowKeys keys on 176-key
/// blocks); the launch says so (note_long_row_tile) for the kernel's name.
template <class Traits>
void launch_sm90_ws_fwd(const FwdParams& p, port::stream_t stream) {
  HIPFLASH_CHECK_AS(runtime_error, !p.is_varlen() && !p.is_kvcache(),
                    "the sm90_ws kernel takes dense calls only (the selector's rule)");
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
