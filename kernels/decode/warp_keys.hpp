// hipflash — the decode kernels' key step (NVIDIA mma.sync): one warp, 16 keys of a stage, its
// 16 query rows. The decode kernel's warps each take 16 keys of a 64-key block of one head;
// the head-group kernel's warps each take a 16-key stage of their own head.
#pragma once

#include "atoms/sm80.hpp"
#include "common/softmax.hpp"
#include "common/swizzle.hpp"
#include "hipflash/types.hpp"

namespace hipflash::decode {

#if defined(HIPFLASH_HAS_MMA_SYNC)

/// A warp's O accumulator (its lane's part of 16 rows x kHeadDim), zeroed.
template <int kDTiles>
__device__ __forceinline__ void zero_rows(float (&O)[2][2 * kDTiles]) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int c = 0; c < 2 * kDTiles; ++c) O[r][c] = 0.f;
}

/// A lane's ldmatrix roles for a warp's 16-row Q tile at shared address q_tile (swizzled
/// [16][kChunks * 8]), whose A fragments `load` reads once.
template <int kRowBytes>
struct WarpQueryLanes {
  uint32_t q_row, q_x;
  __device__ __forceinline__ WarpQueryLanes(uint32_t q_tile, int lane)
      : q_row(q_tile + (lane % 16) * kRowBytes), q_x(((lane / 16) ^ (lane % 8)) * 16) {}
  template <int kDSteps>
  __device__ __forceinline__ void load(uint32_t (&qf)[kDSteps][4]) const {
#pragma unroll
    for (int ks = 0; ks < kDSteps; ++ks) atom::sm80::ldmatrix_x4(qf[ks], q_row + ((ks * 32) ^ q_x));
  }
};

/// A lane's ldmatrix roles for a warp's 16 K / V rows from `first_row` of a swizzled
/// [rows][kChunks * 8] tile (rows == lane % 8 (mod 8) throughout, as the swizzle wants):
/// byte offsets of its row and the XOR of its 16-byte column.
template <int kRowBytes>
struct WarpKeyLanes {
  uint32_t k_off, k_x, v_off, v_x;
  __device__ __forceinline__ WarpKeyLanes(int lane, int first_row)
      : k_off((first_row + lane % 8 + (lane / 16) * 8) * kRowBytes),
        k_x((((lane / 8) % 2) ^ (lane % 8)) * 16),
        v_off((first_row + lane % 16) * kRowBytes),
        v_x(((lane / 16) ^ (lane % 8)) * 16) {}
};

/// The online-softmax update of a warp's scores S, and O rescaled by it. Once the running
/// maxima settle (a few blocks into a long key range) every rescale factor is exactly 1: the
/// warp skips its 4 * kDTiles multiplies — the loop is issue-bound — with the same O (NaN and 0
/// factors still multiply; under fast math a multiply by 1 would flush a subnormal accumulator
/// to 0, which the skip keeps: both are within rounding).
template <int kDTiles>
__device__ __forceinline__ void update_rows(float (&S)[2][4], float (&O)[2][2 * kDTiles],
                                            common::RowSoftmax<2>& softmax, float scale_log2) {
  float rescale[2];
  softmax.update(S, scale_log2, rescale);
  if (!port::all_lanes(rescale[0] == 1.f && rescale[1] == 1.f)) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < 2 * kDTiles; ++c) O[r][c] *= rescale[r];
  }
}

/// One warp's 16 keys: S = Q K^T (qf: Q as the A operand; the K tile at shared address sK),
/// mask(S) (the caller's: -inf where a key is not visible), the online-softmax update
/// (update_rows), then O += P V (the V tile at sV).
template <class Cfg, DType kDT, int kRowBytes, class Mask>
__device__ __forceinline__ void warp_keys_step(const uint32_t (&qf)[Cfg::kDSteps][4], uint32_t sK,
                                               uint32_t sV, const WarpKeyLanes<kRowBytes>& lanes,
                                               float (&O)[2][2 * Cfg::kDTiles],
                                               common::RowSoftmax<2>& softmax, float scale_log2,
                                               const Mask& mask) {
  using namespace atom::sm80;
  float S[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int ks = 0; ks < Cfg::kDSteps; ++ks) {
    uint32_t b[4];
    ldmatrix_x4(b, sK + lanes.k_off + ((ks * 32) ^ lanes.k_x));
    mma<kDT>(S[0][0], S[0][1], S[1][0], S[1][1], qf[ks], b[0], b[1]);
    mma<kDT>(S[0][2], S[0][3], S[1][2], S[1][3], qf[ks], b[2], b[3]);
  }
  mask(S);
  update_rows<Cfg::kDTiles>(S, O, softmax, scale_log2);
  // The C fragment of the two 8-key score tiles is the A fragment of one 16-key step.
  const uint32_t a[4] = {pack2<kDT>(S[0][0], S[0][1]), pack2<kDT>(S[1][0], S[1][1]),
                         pack2<kDT>(S[0][2], S[0][3]), pack2<kDT>(S[1][2], S[1][3])};
#pragma unroll
  for (int dp = 0; dp < Cfg::kDTiles / 2; ++dp) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, sV + lanes.v_off + ((dp * 32) ^ lanes.v_x));
    mma<kDT>(O[0][4 * dp], O[0][4 * dp + 1], O[1][4 * dp], O[1][4 * dp + 1], a, b[0], b[1]);
    mma<kDT>(O[0][4 * dp + 2], O[0][4 * dp + 3], O[1][4 * dp + 2], O[1][4 * dp + 3], a, b[2],
             b[3]);
  }
}

// ---- An fp8 (e4m3) KV cache: the K / V tiles stay e4m3 in shared memory, and each lane turns
// the bytes ldmatrix gives it into f16 MMA operands with one cvt per pair (sm_89 and newer).
// ldmatrix treats a 16-byte chunk of e4m3 as eight 16-bit elements, so a lane receives four
// consecutive bytes of one row (x4) or two bytes of each of two rows (x4.trans); rather than
// move bytes between lanes, both products take their operands in the order that arrives:
//  * Q K^T sums over the head dim in any order: in chunk c (d = 16c .. 16c + 15) the MMA's k
//    positions {2t, 2t + 1, 2t + 8, 2t + 9} are d = 16c + 4t + {0, 1, 2, 3}; Q's A fragments
//    are built in that order (load_q_f16).
//  * P V's n columns are any d order the epilogue undoes: chunk c's bytes 2g and 2g + 1 of two
//    key rows become column g of two n-tiles, the even and the odd d; a lane's C fragment then
//    holds d = 16c + 4t + {0, 1, 2, 3} (fp8_o_columns).
// Q is f16 (the MMA's other operand), each row scaled by a power of two that puts its largest
// |q| in [2^14, 2^15), undone with the K scale on the fp32 scores; P is f16 scaled by 2^15
// (kFp8PScale), undone with the V scale on O: neither rounds more than bf16 operands would.

// e4m3 pairs to f16 (sm_89's cvt): atom::sm80.
using ::hipflash::atom::sm80::e4m3x4_to_f16;
using ::hipflash::atom::sm80::kHasE4m3Cvt;

/// P's scale in the fp8 step's f16 P operand: P in [0, 1] times 2^15 keeps 2^-39 and up.
inline constexpr float kFp8PScale = 32768.f;

/// Two 16-bit values of one register as floats (low half first).
template <DType kDT>
__device__ __forceinline__ float2 unpack2(uint32_t w) {
  if constexpr (kDT == DType::bf16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    __half2 h;
    *reinterpret_cast<uint32_t*>(&h) = w;
    return __half22float2(h);
  }
}

/// Q (a swizzled [16][kDSteps * 16] tile of kDT at sQ) as the fp8 step's f16 A fragments, d in
/// the order of the e4m3 K fragments, each row scaled by 2^-e; row_pow2[r] = 2^e for rows g and
/// g + 8. e puts the row's largest finite |q| in [2^14, 2^15) (clamped to [-100, 113]: a row of
/// values below 2^-86 keeps what f16 holds of it); e = 0 for a zero row or one with inf.
template <int kDSteps, DType kDT, class T>
__device__ __forceinline__ void load_q_f16(uint32_t (&qf)[kDSteps][4], float (&row_pow2)[2],
                                           const T* sQ, int lane) {
  constexpr int kChunks = kDSteps * 2;
  const int g = lane / 4, t = lane % 4;
  const auto words = [&](int r, int ks) {  // d = 16 ks + 4t .. + 3 of row g + 8r
    return *reinterpret_cast<const uint2*>(sQ + common::swizzle<kChunks>(g + 8 * r, 2 * ks + t / 2) +
                                           (t % 2) * 4);
  };
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = 0.f;
#pragma unroll
    for (int ks = 0; ks < kDSteps; ++ks) {
      const uint2 w = words(r, ks);
      const float2 a = unpack2<kDT>(w.x), b = unpack2<kDT>(w.y);
      mx = fmaxf(mx, fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y))));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    int e = 0;
    if (mx > 0.f && mx <= 3.402823466e38f) e = min(max(ilogbf(mx) - 14, -100), 113);
    row_pow2[r] = __int_as_float((127 + e) << 23);
    inv[r] = __int_as_float((127 - e) << 23);
  }
#pragma unroll
  for (int ks = 0; ks < kDSteps; ++ks)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint2 w = words(r, ks);
      const float2 a = unpack2<kDT>(w.x), b = unpack2<kDT>(w.y);
      qf[ks][r] = common::pack2<DType::f16>(a.x * inv[r], a.y * inv[r]);      // k 2t, 2t + 1
      qf[ks][2 + r] = common::pack2<DType::f16>(b.x * inv[r], b.y * inv[r]);  // k 2t + 8, + 9
    }
}

/// A lane's ldmatrix address in a warp's 16 e4m3 K / V rows from `first_row` (a multiple of
/// 16) of a swizzled [rows][kRowBytes] tile: matrices (rows 0-7, chunk 2s), (rows 8-15, 2s),
/// (rows 0-7, 2s + 1), (rows 8-15, 2s + 1) at step s; the same address serves K (x4) and V
/// (x4.trans).
template <int kRowBytes>
struct Fp8KeyLanes {
  uint32_t off, x;
  __device__ __forceinline__ Fp8KeyLanes(int lane, int first_row) {
    const int row = first_row + ((lane / 8) % 2) * 8 + lane % 8;
    off = row * kRowBytes;
    x = ((lane / 16) ^ common::swizzle_xor<kRowBytes / 16>(row)) * 16;
  }
};

/// Where a lane's C-fragment values of the fp8 step's O lie: n-tile 2c + e column n holds
/// d = 16c + 2n + e, so O[r][4c .. 4c + 3] are d = 16c + 4t + {0, 2, 1, 3}. Returns them in d
/// order.
template <int kDTiles>
__device__ __forceinline__ float4 fp8_o_columns(const float (&O)[2][2 * kDTiles], int r, int c) {
  return make_float4(O[r][4 * c], O[r][4 * c + 2], O[r][4 * c + 1], O[r][4 * c + 3]);
}

/// warp_keys_step for an e4m3 K / V tile (sK, sV: shared addresses): Q K^T on f16 MMAs (qf from
/// load_q_f16), the scores times row_scale (2^e of the row's Q times the K scale) before
/// mask(S), the update, and O += (2^15 P) V on f16 MMAs, O's columns as fp8_o_columns says.
template <class Cfg, int kRowBytes, class Mask>
__device__ __forceinline__ void warp_keys_step_fp8(const uint32_t (&qf)[Cfg::kDSteps][4],
                                                   uint32_t sK, uint32_t sV,
                                                   const Fp8KeyLanes<kRowBytes>& lanes,
                                                   const float (&row_scale)[2],
                                                   float (&O)[2][2 * Cfg::kDTiles],
                                                   common::RowSoftmax<2>& softmax,
                                                   float scale_log2, const Mask& mask) {
  using namespace atom::sm80;
  constexpr DType kF16 = DType::f16;
  float S[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int s = 0; s < Cfg::kDSteps / 2; ++s) {
    uint32_t r[4], b[4][2];
    ldmatrix_x4(r, sK + lanes.off + ((s * 32) ^ lanes.x));
#pragma unroll
    for (int m = 0; m < 4; ++m) e4m3x4_to_f16(r[m], b[m][0], b[m][1]);
    mma<kF16>(S[0][0], S[0][1], S[1][0], S[1][1], qf[2 * s], b[0][0], b[0][1]);
    mma<kF16>(S[0][2], S[0][3], S[1][2], S[1][3], qf[2 * s], b[1][0], b[1][1]);
    mma<kF16>(S[0][0], S[0][1], S[1][0], S[1][1], qf[2 * s + 1], b[2][0], b[2][1]);
    mma<kF16>(S[0][2], S[0][3], S[1][2], S[1][3], qf[2 * s + 1], b[3][0], b[3][1]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) S[r][c] *= row_scale[r];
  mask(S);
  update_rows<Cfg::kDTiles>(S, O, softmax, scale_log2);
  const uint32_t a[4] = {
      common::pack2<kF16>(S[0][0] * kFp8PScale, S[0][1] * kFp8PScale),
      common::pack2<kF16>(S[1][0] * kFp8PScale, S[1][1] * kFp8PScale),
      common::pack2<kF16>(S[0][2] * kFp8PScale, S[0][3] * kFp8PScale),
      common::pack2<kF16>(S[1][2] * kFp8PScale, S[1][3] * kFp8PScale)};
#pragma unroll
  for (int s = 0; s < Cfg::kDSteps / 2; ++s) {
    uint32_t r[4];
    ldmatrix_x4_trans(r, sV + lanes.off + ((s * 32) ^ lanes.x));
    // r[m]: bytes (key 2t, d 2g), (2t, 2g + 1), (2t + 1, 2g), (2t + 1, 2g + 1) of matrix m;
    // regrouped into (2t, 2t + 1) pairs at d 2g (low half) and d 2g + 1 (high half).
    uint32_t even[4], odd[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) e4m3x4_to_f16(__byte_perm(r[m], 0, 0x3120), even[m], odd[m]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // chunk 2s + h: n-tiles 2 (2s + h) (even d), + 1 (odd d)
      const int j = 2 * (2 * s + h);
      mma<kF16>(O[0][2 * j], O[0][2 * j + 1], O[1][2 * j], O[1][2 * j + 1], a, even[2 * h],
                even[2 * h + 1]);
      mma<kF16>(O[0][2 * j + 2], O[0][2 * j + 3], O[1][2 * j + 2], O[1][2 * j + 3], a, odd[2 * h],
                odd[2 * h + 1]);
    }
  }
}

#endif  // HIPFLASH_HAS_MMA_SYNC

}  // namespace hipflash::decode
