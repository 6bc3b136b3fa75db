// hipflash — the backward's warp GEMMs on the NVIDIA sm_80+ atom (mma.sync m16n8k16). A warp
// computes one 16-row tile; operands sit in shared memory in common::swizzle's layout (16-byte
// chunks XORed with row % 8) or, for the A operand of the "rs" form, in registers as the C
// fragment of an earlier GEMM. Accumulators are C[h][c]: fragment row g + 8h, column
// 8 * (c / 2) + 2t + (c % 2) (g = lane / 4, t = lane % 4), as in atoms/sm80.hpp.
//
// Three operand shapes cover the five GEMMs of the backward:
//   gemm_nt  C += A B^T, A [16][K] and B [N][K] both K-contiguous      (S^T = K Q^T, dP^T = V dO^T,
//                                                                       S = Q K^T, dP = dO V^T)
//   gemm_rs  C += A B,   A the fp32 C fragment of [16][K], B [K][N]     (dV += P^T dO, dK += dS^T Q,
//                                                                       dQ += dS K)
//   gemm_tn  C += A B,   A stored transposed [K][16], B [K][N]          (dQ += dS K, dS^T in smem)
// Lane terms: the address of the row a lane hands to ldmatrix and the XOR of its chunk; the
// per-step constant (chunk pair 2s, i.e. 32 s bytes) is XORed in, which equals adding it since
// the swizzle only touches a chunk index's low three bits.
#pragma once

#include <cstdint>

#include "atoms/sm80.hpp"

namespace hipflash::bwd::sm80 {

#if defined(HIPFLASH_HAS_MMA_SYNC)

using namespace ::hipflash::atom::sm80;

/// ldmatrix lane terms of a K-contiguous operand.
struct LaneRows {
  uint32_t addr;  ///< shared address of the row this lane supplies (row 0 of the tile + ...)
  uint32_t x;     ///< XOR term of its chunk, in bytes
};

/// A operand [16][K], non-transposed: rows lane % 16, chunk + lane / 16.
__device__ __forceinline__ LaneRows lanes_a(uint32_t tile, int row_bytes, int lane) {
  return {tile + uint32_t((lane % 16) * row_bytes), uint32_t(((lane / 16) ^ (lane % 8)) * 16)};
}
/// B operand [N][K], non-transposed (two 8-column tiles per ldmatrix.x4): rows
/// lane % 8 + 8 (lane / 16), chunk + (lane / 8) % 2. The same terms serve the transposed A
/// operand of gemm_tn (rows are K there, the chunk pair the two 8-row halves of the tile).
__device__ __forceinline__ LaneRows lanes_b(uint32_t tile, int row_bytes, int lane) {
  return {tile + uint32_t((lane % 8 + (lane / 16) * 8) * row_bytes),
          uint32_t((((lane / 8) % 2) ^ (lane % 8)) * 16)};
}
/// B operand [K][N] read transposed: rows (K) lane % 16, chunk + lane / 16.
__device__ __forceinline__ LaneRows lanes_bt(uint32_t tile, int row_bytes, int lane) {
  return lanes_a(tile, row_bytes, lane);
}

/// C[2][2 kN] (+)= A B^T over K = 16 kKSteps: A rows from `a` (lanes_a), B rows from `b`
/// (lanes_b, kN 8-row tiles, row_bytes apart per 16 rows).
template <DType kDType, int kN, int kKSteps>
__device__ __forceinline__ void gemm_nt(float (&C)[2][2 * kN], LaneRows a, LaneRows b,
                                        int b_row_bytes) {
  static_assert(kN % 2 == 0, "B tiles come in pairs (ldmatrix.x4)");
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t af[4];
    ldmatrix_x4(af, a.addr + ((ks * 32) ^ a.x));
#pragma unroll
    for (int np = 0; np < kN / 2; ++np) {
      uint32_t bf[4];
      ldmatrix_x4(bf, b.addr + np * 16 * b_row_bytes + ((ks * 32) ^ b.x));
      mma<kDType>(C[0][4 * np], C[0][4 * np + 1], C[1][4 * np], C[1][4 * np + 1], af, bf[0], bf[1]);
      mma<kDType>(C[0][4 * np + 2], C[0][4 * np + 3], C[1][4 * np + 2], C[1][4 * np + 3], af,
                  bf[2], bf[3]);
    }
  }
}

/// The A fragment of k-step ks from the fp32 C fragment of a [16][K] product (rounded).
template <DType kDType, int kCols>
__device__ __forceinline__ void a_from_c(uint32_t (&af)[4], const float (&P)[2][kCols], int ks) {
  af[0] = pack2<kDType>(P[0][4 * ks], P[0][4 * ks + 1]);
  af[1] = pack2<kDType>(P[1][4 * ks], P[1][4 * ks + 1]);
  af[2] = pack2<kDType>(P[0][4 * ks + 2], P[0][4 * ks + 3]);
  af[3] = pack2<kDType>(P[1][4 * ks + 2], P[1][4 * ks + 3]);
}

/// C[2][2 kN] += A B over K = 16 kKSteps, A the C fragment P[2][2 K / 8] (rounded to the
/// dtype), B [K][N] rows from `b` (lanes_bt) starting at chunk `chunk0` (even) of each row.
template <DType kDType, int kN, int kKSteps, int kPCols>
__device__ __forceinline__ void gemm_rs(float (&C)[2][2 * kN], const float (&P)[2][kPCols],
                                        LaneRows b, int b_row_bytes, int chunk0) {
  static_assert(kPCols == 4 * kKSteps, "P covers K");
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t af[4];
    a_from_c<kDType>(af, P, ks);
#pragma unroll
    for (int dp = 0; dp < kN / 2; ++dp) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, b.addr + ks * 16 * b_row_bytes + (((chunk0 + 2 * dp) * 16) ^ b.x));
      mma<kDType>(C[0][4 * dp], C[0][4 * dp + 1], C[1][4 * dp], C[1][4 * dp + 1], af, bf[0], bf[1]);
      mma<kDType>(C[0][4 * dp + 2], C[0][4 * dp + 3], C[1][4 * dp + 2], C[1][4 * dp + 3], af,
                  bf[2], bf[3]);
    }
  }
}

/// C[2][2 kN] += A B over K = 16 kKSteps, A stored transposed ([K][M] rows from `a`, lanes_b,
/// this tile's 16 columns from chunk `a_chunk0`), B [K][N] rows from `b` (lanes_bt) from chunk
/// `b_chunk0`.
template <DType kDType, int kN, int kKSteps>
__device__ __forceinline__ void gemm_tn(float (&C)[2][2 * kN], LaneRows a, int a_row_bytes,
                                        int a_chunk0, LaneRows b, int b_row_bytes, int b_chunk0) {
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t af[4];
    ldmatrix_x4_trans(af, a.addr + ks * 16 * a_row_bytes + ((a_chunk0 * 16) ^ a.x));
#pragma unroll
    for (int dp = 0; dp < kN / 2; ++dp) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, b.addr + ks * 16 * b_row_bytes + (((b_chunk0 + 2 * dp) * 16) ^ b.x));
      mma<kDType>(C[0][4 * dp], C[0][4 * dp + 1], C[1][4 * dp], C[1][4 * dp + 1], af, bf[0], bf[1]);
      mma<kDType>(C[0][4 * dp + 2], C[0][4 * dp + 3], C[1][4 * dp + 2], C[1][4 * dp + 3], af,
                  bf[2], bf[3]);
    }
  }
}

template <int kRows, int kCols>
__device__ __forceinline__ void zero(float (&C)[kRows][kCols]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) C[r][c] = 0.f;
}

#endif  // HIPFLASH_HAS_MMA_SYNC

}  // namespace hipflash::bwd::sm80
