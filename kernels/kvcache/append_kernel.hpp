// hipflash — the KV-cache append kernel (SPEC §7): writes the new keys and values k_new / v_new
// [B, S_new, Hkv, D] into rows cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 of each
// sequence's cache, contiguous or paged (common::PagedRows), before the forward reads them on the
// same stream. One thread per element (2-byte words; S_new is small in decode and chunked
// prefill, so the copy is a few microseconds), grid-stride loop, 64-bit indices.
#pragma once

#include <cstdint>

#include "common/kv_source.hpp"
#include "hipflash/params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::kvcache {

inline constexpr int kThreads = 256;
inline constexpr int64_t kMaxBlocks = 65536;

/// The cache (FwdParams: k, v, their strides, block table, seqlens_k) and the rows to append.
struct AppendParams {
  FwdParams cache;
  const void* __restrict__ k_new = nullptr;
  const void* __restrict__ v_new = nullptr;
  int64_t new_batch_stride[2] = {0, 0}, new_row_stride[2] = {0, 0}, new_head_stride[2] = {0, 0};
  int64_t s_new = 0;
};

/// x / scale as an e4m3 byte, as the CPU backend quantises (src/kvcache.cpp, append_on_cpu):
/// an IEEE division, round to nearest even, saturated to +-448, NaN as S.1111.111 with the
/// sign of the NaN operand (the host's division passes it on; the GPU's gives its own NaN),
/// the subnormal range (below 2^-6) in units of 2^-9 by an integer rounding, as the CPU does
/// (the hardware conversion is left the normal range).
__device__ __forceinline__ uint8_t quantise_e4m3(float x, float scale) {
  const float y = __fdiv_rn(x, scale);
  const float signed_as = isnan(x) ? x : isnan(scale) ? scale : y;
  const uint8_t sign = uint8_t(__float_as_uint(signed_as) >> 24 & 0x80u);
  if (isnan(y)) return uint8_t(sign | 0x7fu);
  const float a = fabsf(y);
  if (a < 0.015625f) return uint8_t(sign | __float2int_rn(a * 512.f));  // 8: 2^-6, still right
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(y));
  return uint8_t(pair & 0xffu);
#else
  port::trap();  // an fp8 cache needs sm_89 (the selector refuses it before the append)
  return 0;
#endif
}

/// A 16-bit element of k_new / v_new (kDType, bf16 or f16) as a float.
__device__ __forceinline__ float element_to_float(uint16_t bits, DType dtype) {
  if (dtype == DType::bf16) return __uint_as_float(uint32_t(bits) << 16);
  return __half2float(__ushort_as_half(bits));
}

/// Copies every element of k_new and v_new to its cache row (validated: the rows fit the
/// capacity and, for a paged cache, the block-table entries are the caller's); an fp8 cache
/// (p.kv_dtype e4m3) takes it divided by its scale (k_descale / v_descale), quantised.
__global__ void __launch_bounds__(kThreads) append_kernel(const HIPFLASH_GRID_CONSTANT AppendParams a) {
  const FwdParams& p = a.cache;
  const int64_t D = p.head_dim, row_elems = p.heads_kv * D, per_seq = a.s_new * row_elems;
  const int64_t per_tensor = p.batch * per_seq, items = 2 * per_tensor;
  const int64_t step = int64_t(gridDim.x) * kThreads;
  for (int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x; item < items; item += step) {
    const int which = item >= per_tensor ? 1 : 0;  // 0: k, 1: v
    int64_t rest = item - which * per_tensor;
    const int64_t b = rest / per_seq;
    rest -= b * per_seq;
    const int64_t j = rest / row_elems;
    rest -= j * row_elems;
    const int64_t hk = rest / D, d = rest - hk * D;
    const auto* src = static_cast<const uint16_t*>(which ? a.v_new : a.k_new) +
                      b * a.new_batch_stride[which] + j * a.new_row_stride[which] +
                      hk * a.new_head_stride[which] + d;
    const int64_t batch_stride = which ? p.v_batch_stride : p.k_batch_stride;
    const int64_t row_stride = which ? p.v_row_stride : p.k_row_stride;
    const int64_t head_stride = which ? p.v_head_stride : p.k_head_stride;
    const int64_t row = p.seqlens_k[b] + j;
    // The element's offset in the cache: through the block table (common::GatheredRows' rule,
    // any page size), or at the sequence's entry (FlashAttention's cache_batch_idx) of a
    // contiguous cache.
    int64_t at;
    if (p.block_table != nullptr) {
      const common::GatheredRows<const char> pages{nullptr, p.block_table_row(b), batch_stride,
                                                   row_stride, p.page_div};
      at = pages.offset(row);
    } else {
      const int64_t entry = p.cache_batch_idx ? p.cache_batch_idx[b] : b;
      at = entry * batch_stride + row * row_stride;
    }
    at += hk * head_stride + d;
    void* cache = const_cast<void*>(which ? p.v : p.k);
    if (p.kv_dtype == DType::e4m3) {
      const float* scale_at = which ? p.v_descale.ptr : p.k_descale.ptr;  // [] / [1]: one value
      const float scale = scale_at ? *scale_at : 1.f;
      static_cast<uint8_t*>(cache)[at] = quantise_e4m3(element_to_float(*src, p.dtype), scale);
    } else {
      static_cast<uint16_t*>(cache)[at] = *src;
    }
  }
}

}  // namespace hipflash::kvcache
