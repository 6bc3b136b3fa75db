// hipflash — the merge_attn_states kernel (SPEC §7): N partial attention results merged by
// their LSEs with the split-K combine's math (detail::SoftmaxState, detail::combine_weight).
//
// Memory-bound: every part's row is read once, the merged row written once. A thread owns one
// kVec-element piece of one (row, head): 16 bytes (8 bf16/f16 or 4 f32) on the vector path, one
// element on the scalar path the launcher takes for rows that are not 16-byte aligned. It
// merges the parts' LSEs into the row's total state (the same sequence of operations as the CPU
// merge, MergeParams::total_state), then reads the live parts' pieces kBatch at a time, all
// loads in flight before the first multiply-add, and accumulates w_i * out_i in fp32 in part
// order. A part with LSE -inf is never read (its out may hold anything); a NaN LSE makes every
// weight NaN; every part empty gives out 0 and LSE -inf. The piece-0 thread of a row writes
// the merged LSE. Grid-stride loop over the pieces, 64-bit offsets (32-bit index arithmetic
// where the indices fit).
#pragma once

#include <cstdint>

#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/merge_params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::merge {

inline constexpr int kThreads = 256;
/// Parts whose loads a thread keeps in flight at once.
inline constexpr int kBatch = 4;
/// The grid-stride loop's block count cap (enough to fill any GPU several times over).
inline constexpr int64_t kMaxBlocks = 65536;

/// An element type as raw bits (what a 16-byte vector holds) and its fp32 conversions, spelled
/// out per dtype (no default).
template <DType kDType>
struct Bits;
template <>
struct Bits<DType::bf16> {
  using word = uint16_t;
  __device__ __forceinline__ static float to_float(word w) {
    return __uint_as_float(uint32_t(w) << 16);  // exact
  }
  __device__ __forceinline__ static word from_float(float x) {
    const port::bf16_t h = port::from_float<port::bf16_t>(x);  // round to nearest even
    word w;
    __builtin_memcpy(&w, &h, sizeof(w));
    return w;
  }
};
template <>
struct Bits<DType::f16> {
  using word = uint16_t;
  __device__ __forceinline__ static float to_float(word w) {
    __half_raw r;
    r.x = w;
    return __half2float(__half(r));
  }
  __device__ __forceinline__ static word from_float(float x) {
    const port::f16_t h = port::from_float<port::f16_t>(x);
    word w;
    __builtin_memcpy(&w, &h, sizeof(w));
    return w;
  }
};
template <>
struct Bits<DType::f32> {
  using word = float;
  __device__ __forceinline__ static float to_float(word w) { return w; }
  __device__ __forceinline__ static word from_float(float x) { return x; }
};

/// kVec words at `src` (one 16-byte load when kVec words make 16 bytes; the launcher checked
/// the alignment).
template <class W, int kVec>
__device__ __forceinline__ void load_words(const W* src, W (&v)[kVec]) {
  if constexpr (kVec * sizeof(W) == 16) {
    // Unpacked by value (no memcpy into the array: clang 15 then keeps it in scratch / LDS).
    const uint4 x = *reinterpret_cast<const uint4*>(src);
    const uint32_t u[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (sizeof(W) == 2) {
        v[2 * e] = W(u[e] & 0xffffu);
        v[2 * e + 1] = W(u[e] >> 16);
      } else {
        v[e] = __uint_as_float(u[e]);
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = src[e];
  }
}

template <class W, int kVec>
__device__ __forceinline__ void store_words(W* dst, const W (&v)[kVec]) {
  if constexpr (kVec * sizeof(W) == 16) {
    // Packed into four 32-bit words by value, so that the store stays one 16-byte vector.
    uint32_t u[4];
    if constexpr (sizeof(W) == 2) {
#pragma unroll
      for (int e = 0; e < 4; ++e) u[e] = uint32_t(v[2 * e]) | (uint32_t(v[2 * e + 1]) << 16);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) u[e] = __float_as_uint(v[e]);
    }
#if defined(HIPFLASH_PLATFORM_NVIDIA)
    // Spelled out: inside the kernel's loop nvcc (13.0) splits a plain uint4 store into four
    // 32-bit stores (checked in the PTX); the 16-byte store is the point of the vector path.
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(u[0]), "r"(u[1]),
                 "r"(u[2]), "r"(u[3])
                 : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = make_uint4(u[0], u[1], u[2], u[3]);
#endif  // HIPFLASH_PLATFORM_NVIDIA
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) dst[e] = v[e];
  }
}

/// Merges p.parts partial results (validated; head_dim a multiple of kVec, and for 16-byte
/// vectors aligned pointers and strides — the launcher's choice).
template <DType kDType, int kVec>
__global__ void __launch_bounds__(kThreads) merge_kernel(const HIPFLASH_GRID_CONSTANT MergeParams p) {
  using detail::SoftmaxState;
  using B = Bits<kDType>;
  using W = typename B::word;
  const W* outs = static_cast<const W*>(p.outs);
  W* out = static_cast<W*>(p.out);
  // Pieces per (row, head); at least one, so that a row of head_dim 0 still gets its LSE.
  const int64_t pieces = p.head_dim >= kVec ? p.head_dim / kVec : 1;
  const int64_t items = p.rows * p.heads * pieces;
  const int64_t step = int64_t(gridDim.x) * kThreads;
  // 32-bit divisions where every index fits (the common case): a 64-bit one costs as much as
  // the thread's share of the memory traffic.
  const bool narrow = items <= int64_t(UINT32_MAX) && p.lse_seqlen <= int64_t(UINT32_MAX);
  for (int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x; item < items; item += step) {
    int64_t c, h, t, row;
    if (narrow) {
      const uint32_t it = uint32_t(item), np = uint32_t(pieces), nh = uint32_t(p.heads),
                     ns = uint32_t(p.lse_seqlen);
      const uint32_t rh = it / np, t32 = rh / nh;
      c = int64_t(it - rh * np) * kVec;
      h = int64_t(rh - t32 * nh);
      t = t32;
      const uint32_t tb = t32 / ns;
      row = int64_t(tb) * p.lses_batch_stride + h * p.lses_head_stride +
            int64_t(t32 - tb * ns) * p.lses_row_stride;
    } else {
      c = (item % pieces) * kVec;
      const int64_t rh = item / pieces;
      h = rh % p.heads, t = rh / p.heads;
      row = p.lses_offset(t, h);
    }

    const SoftmaxState total = p.total_state(row);
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    for (int64_t i0 = 0; i0 < p.parts; i0 += kBatch) {
      W v[kBatch][kVec];
      float w[kBatch];
      bool live[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int64_t i = i0 + j;
        live[j] = false;
        w[j] = 0.f;
        if (i < p.parts) {
          const SoftmaxState s = p.part_state(i, row);
          live[j] = s.live();
          w[j] = detail::combine_weight(s, total);
          if (live[j] && c < p.head_dim) load_words<W, kVec>(outs + p.outs_offset(i, t, h) + c, v[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (!live[j]) continue;  // an empty part's row is never read
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += w[j] * B::to_float(v[j][e]);  // 0 * NaN stays NaN
      }
    }
    if (c < p.head_dim) {
      W r[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) r[e] = B::from_float(acc[e]);
      store_words<W, kVec>(out + p.out_offset(t, h) + c, r);
    }
    if (p.lse != nullptr && c == 0) p.lse[p.lse_offset(t, h)] = total.lse();
  }
}

}  // namespace hipflash::merge
