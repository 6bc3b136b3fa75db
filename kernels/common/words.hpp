// hipflash — shared by every schedule that moves elements as raw words: an element type's bits
// and their fp32 conversions (Bits), and 16-byte vector loads / stores of those words. The
// merge kernel and the backward's preprocess / dq conversion use them.
#pragma once

#include <cstdint>

#include "hipflash/port/port.hpp"
#include "hipflash/types.hpp"

namespace hipflash::common {

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

/// kVec elements of kDType as loaded, kept packed until each is converted: whole 16-byte
/// vectors (kVec * element size a multiple of 16: the launcher checked the alignment) stay four
/// registers each (eight bf16 / f16 unpacked would take eight), so a kernel that keeps several
/// in flight (the merge kernel) holds twice as many per register; otherwise one element per
/// register.
template <DType kDType, int kVec>
struct PackedVec {
  using W = typename Bits<kDType>::word;
  static constexpr bool kVector = (kVec * sizeof(W)) % 16 == 0;
  static constexpr int kRegs = kVector ? kVec * int(sizeof(W)) / 4 : kVec;
  uint32_t u[kRegs];

  __device__ __forceinline__ void load(const W* src) {
    if constexpr (kVector) {
#pragma unroll
      for (int q = 0; q < kRegs / 4; ++q) {
        const uint4 x = reinterpret_cast<const uint4*>(src)[q];
        u[4 * q] = x.x, u[4 * q + 1] = x.y, u[4 * q + 2] = x.z, u[4 * q + 3] = x.w;
      }
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        W w = src[e];
        uint32_t bits = 0;
        __builtin_memcpy(&bits, &w, sizeof(W));
        u[e] = bits;
      }
    }
  }
  /// Element e as fp32 (exact).
  __device__ __forceinline__ float get(int e) const {
    if constexpr (kVector && sizeof(W) == 2) {
      return Bits<kDType>::to_float(W(e % 2 ? u[e / 2] >> 16 : u[e / 2] & 0xffffu));
    } else if constexpr (sizeof(W) == 2) {
      return Bits<kDType>::to_float(W(u[e]));
    } else {
      return __uint_as_float(u[e]);
    }
  }
};

template <class W, int kVec>
__device__ __forceinline__ void store_words(W* dst, const W (&v)[kVec]) {
  constexpr int k16 = 16 / int(sizeof(W));  // words per 16-byte vector
  if constexpr (kVec > k16 && kVec % k16 == 0) {  // several 16-byte vectors
#pragma unroll
    for (int q = 0; q < kVec / k16; ++q) {
      W part[k16];
#pragma unroll
      for (int e = 0; e < k16; ++e) part[e] = v[q * k16 + e];
      store_words<W, k16>(dst + q * k16, part);
    }
  } else if constexpr (kVec * sizeof(W) == 16) {
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

}  // namespace hipflash::common
