// hipflash — fp8 q, k and v widened to bfloat16 for the bf16 kernels: the path of an fp8 call
// that no fp8 kernel takes (head dim 256, strides a TMA map cannot describe, ALiBi, GPUs
// without fp8 tensor cores; the selector's widened_fp8).
//
// One operand a launch. Each element becomes x * scale(sequence, kv head) rounded to bf16:
// q takes q_descale * k_descale (the scores' factor, so that the kernel's scores and LSE are the
// descaled ones), k is widened exactly (every e4m3 value is a bf16 value), v takes v_descale.
// Where the factors are powers of two (or 1) the bf16 call computes on exactly the descaled
// values; otherwise the fp32 product (q_descale * k_descale first, then the element) is rounded
// to bf16 (relative 2^-9), below the fp8 inputs' own 2^-4. NaN bytes stay NaN. Memory-bound: a block walks whole rows (grid-stride), each thread
// widens kVec bytes into one 16-byte store.
#pragma once

#include <cstdint>

#include "common/words.hpp"
#include "hipflash/params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::fp8 {

inline constexpr int kThreads = 256;
inline constexpr int kVec = 8;  ///< e4m3 bytes a thread widens at once: 8 in, 16 out
/// The grid-stride loop's block cap (rows beyond it are walked again by the same blocks).
inline constexpr int64_t kMaxBlocks = 65536;

/// One operand: e4m3 `src` (strides in elements; varlen: batch 1, rows the packed rows) into
/// contiguous bf16 `dst` [batch * rows, heads, head_dim].
struct WidenParams {
  const uint8_t* __restrict__ src = nullptr;
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
  uint16_t* __restrict__ dst = nullptr;
  int64_t batch = 0, rows = 0, heads = 0, head_dim = 0;
  int64_t group = 1;  ///< heads per kv head: kv head of head h is h / group
  /// The factors, at (sequence, kv head) (nullptr pointer: 1).
  Descale scale, scale2;
  /// Varlen with a per-sequence factor: sequence s holds rows [cu_seqlens[s], cu_seqlens[s + 1])
  /// (num_seqs of them); nullptr otherwise (the sequence is the batch index).
  const int32_t* __restrict__ cu_seqlens = nullptr;
  int64_t num_seqs = 0;
};

/// An e4m3 byte (PyTorch's float8_e4m3fn: bias 7, no infinities, S.1111.111 NaN) as fp32,
/// exactly: normal numbers by moving the exponent and mantissa bits, subnormals as man * 2^-9.
__device__ __forceinline__ float e4m3_to_float(uint32_t byte) {
  const uint32_t sign = (byte & 0x80u) << 24, em = byte & 0x7fu;
  if (em == 0x7fu) return __uint_as_float(sign | 0x7fc00000u);
  if (em < 8u) return __uint_as_float(sign | __float_as_uint(float(em) * 0x1p-9f));
  return __uint_as_float(sign | ((em + (120u << 3)) << 20));  // exponent bias 7 -> 127
}

/// The sequence row `r` (a packed row) belongs to: the last s with cu_seqlens[s] <= r (rows past
/// every sequence, which no kernel reads, count as the last one's).
__device__ __forceinline__ int64_t sequence_of(const WidenParams& p, int64_t r) {
  int64_t lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (p.cu_seqlens[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

template <bool kVector>
__global__ void __launch_bounds__(kThreads) widen_kernel(const HIPFLASH_GRID_CONSTANT WidenParams p) {
  using B = common::Bits<DType::bf16>;
  const int pieces = int((p.head_dim + kVec - 1) / kVec);
  const int per_row = int(p.heads) * pieces;  // the launcher checked that it fits
  const int64_t total = p.batch * p.rows;
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    const int64_t b = row / p.rows, r = row - b * p.rows;
    const int64_t seq = p.cu_seqlens ? sequence_of(p, r) : b;
    const uint8_t* src_row = p.src + b * p.batch_stride + r * p.row_stride;
    uint16_t* dst_row = p.dst + row * p.heads * p.head_dim;
    for (int i = threadIdx.x; i < per_row; i += kThreads) {
      const int h = i / pieces, c = (i - h * pieces) * kVec;
      const int64_t kv_head = h / p.group;
      const float s = p.scale.at(seq, kv_head) * p.scale2.at(seq, kv_head);
      const uint8_t* src = src_row + h * p.head_stride + c;
      uint16_t* dst = dst_row + int64_t(h) * p.head_dim + c;
      if constexpr (kVector) {  // 8-byte aligned source, 16-byte aligned destination
        const uint2 raw = *reinterpret_cast<const uint2*>(src);
        uint16_t w[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          w[e] = B::from_float(e4m3_to_float(((e < 4 ? raw.x : raw.y) >> (8 * (e % 4))) & 0xffu) * s);
        common::store_words<uint16_t, kVec>(dst, w);
      } else {
        for (int e = 0; e < kVec && c + e < p.head_dim; ++e)
          dst[e] = B::from_float(e4m3_to_float(src[e]) * s);
      }
    }
  }
}

}  // namespace hipflash::fp8
