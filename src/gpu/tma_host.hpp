// hipflash — the host half of TMA: a 4-d tensor map (head dim, row, head, batch) of one
// operand, encoded per call through the driver entry point that the CUDA runtime exposes (no
// link against libcuda). Used by the warp-specialised forward and backward launchers.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only)

#include <cstdint>
#include <cstring>

#include "atoms/sm90/tensor_map.hpp"
#include "hipflash/errors.hpp"
#include "hipflash/port/port.hpp"
#include "hipflash/types.hpp"

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

/// The 4-d map (head dim, row, head, batch) of one operand, boxes of [box_rows x box_cols]
/// elements (a 128-byte row by default: 64 of 16 bits) with the swizzle of that row's width
/// (128 or 64 bytes); out-of-range rows and head-dim columns read as zero.
inline atom::sm90::TensorMap encode(const void* base, DType dtype, int64_t head_dim, int64_t rows,
                                int64_t heads, int64_t batch, int64_t row_stride,
                                int64_t head_stride, int64_t batch_stride, int box_rows,
                                int box_cols = 0) {
  const int64_t kBytes = dtype_size(dtype);
  if (box_cols == 0) box_cols = int(128 / kBytes);
  const int64_t box_bytes = box_cols * kBytes;
  HIPFLASH_CHECK_AS(runtime_error, box_bytes == 64 || box_bytes == 128,
                    "a TMA box row of ", box_bytes, " bytes: the kernels swizzle 64 or 128");
  // A stride of a size-1 dimension is never used; TMA still wants a multiple of 16 bytes.
  auto stride = [&](int64_t s, int64_t extent) { return extent == 1 ? 16 : uint64_t(s * kBytes); };
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(rows), cuuint64_t(heads),
                              cuuint64_t(batch)};
  const cuuint64_t strides[3] = {stride(row_stride, rows), stride(head_stride, heads),
                                 stride(batch_stride, batch)};
  const cuuint32_t box[4] = {cuuint32_t(box_cols), cuuint32_t(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = encode_tiled()(
      &map,
      dtype == DType::bf16   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
      : dtype == DType::e4m3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8  // fp8 bytes, moved as they are
                             : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      4, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      box_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  HIPFLASH_CHECK_AS(runtime_error, r == CUDA_SUCCESS, "encoding a TMA tensor map failed (CUresult ",
                    int(r), "); the selector's sm90_tma_compatible() should have refused this call");
  atom::sm90::TensorMap out;
  static_assert(sizeof(out) == sizeof(map), "a CUtensorMap is 128 bytes");
  std::memcpy(&out, &map, sizeof(map));
  return out;
}

}  // namespace tma_host

}  // namespace hipflash::gpu
