// hipflash — the mainloop pieces of the generic kernel on NVIDIA sm_80+: the two warp GEMMs,
// S = Q K^T and O += P V, on mma.sync (tile loads: atoms/sm80.hpp). Accumulators are [row][col] arrays: row 2*mt + h is fragment row g + 8h of MMA
// tile mt; column 2*nt + e is fragment column 2t + e of 8-column tile nt.
#pragma once

#include "atoms/sm80.hpp"
#include "common/swizzle.hpp"
#include "generic/tile_config.hpp"

namespace hipflash::generic::sm80 {

#if defined(HIPFLASH_HAS_MMA_SYNC)

using namespace ::hipflash::atom::sm80;  // the atom this body is written in
using namespace ::hipflash::common;      // the pieces every schedule shares

/// S[2*kMT][2*kNT] = Q_w K^T for this warp's rows (Q and K swizzled in shared memory).
template <class Tile, DType kDType>
__device__ __forceinline__ void gemm_qk(float (&S)[2 * Tile::kMTiles][2 * Tile::kNTiles],
                                        uint32_t sQ, uint32_t sK, int warp, int lane) {
  constexpr int kMT = Tile::kMTiles, kNT = Tile::kNTiles, kRowBytes = Tile::kChunks * 16;
  // ldmatrix lane roles: Q (A operand) rows lane%16, chunk +lane/16; K (B operand) rows
  // lane%8 + 8*(lane/16), chunk +(lane/8)%2. Both rows are == lane%8 (mod 8).
  const uint32_t q_row = sQ + (warp * Tile::kWarpRows + lane % 16) * kRowBytes;
  const uint32_t k_row = sK + (lane % 8 + (lane / 16) * 8) * kRowBytes;
  const uint32_t q_x = ((lane / 16) ^ (lane % 8)) * 16;
  const uint32_t k_x = (((lane / 8) % 2) ^ (lane % 8)) * 16;
#pragma unroll
  for (int r = 0; r < 2 * kMT; ++r)
#pragma unroll
    for (int c = 0; c < 2 * kNT; ++c) S[r][c] = 0.f;
#pragma unroll
  for (int ks = 0; ks < Tile::kHeadDim / 16; ++ks) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
      ldmatrix_x4(a[mt], q_row + mt * 16 * kRowBytes + ((ks * 32) ^ q_x));
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, k_row + np * 16 * kRowBytes + ((ks * 32) ^ k_x));
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma<kDType>(S[2 * mt][4 * np], S[2 * mt][4 * np + 1], S[2 * mt + 1][4 * np],
                    S[2 * mt + 1][4 * np + 1], a[mt], b[0], b[1]);
        mma<kDType>(S[2 * mt][4 * np + 2], S[2 * mt][4 * np + 3], S[2 * mt + 1][4 * np + 2],
                    S[2 * mt + 1][4 * np + 3], a[mt], b[2], b[3]);
      }
    }
  }
}

/// O[2*kMT][2*kDT] += P V, with P the probabilities in S (rounded to the input dtype).
template <class Tile, DType kDType>
__device__ __forceinline__ void gemm_pv(float (&O)[2 * Tile::kMTiles][2 * Tile::kDTiles],
                                        const float (&P)[2 * Tile::kMTiles][2 * Tile::kNTiles],
                                        uint32_t sV, int lane) {
  constexpr int kMT = Tile::kMTiles, kDT = Tile::kDTiles, kRowBytes = Tile::kChunks * 16;
  // ldmatrix.trans lane roles: V rows (keys) lane%16, chunk +lane/16.
  const uint32_t v_row = sV + (lane % 16) * kRowBytes;
  const uint32_t v_x = ((lane / 16) ^ (lane % 8)) * 16;
#pragma unroll
  for (int ks = 0; ks < Tile::kBlockN / 16; ++ks) {
    // The C fragment of two 8-key score tiles is the A fragment of one 16-key step.
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      a[mt][0] = pack2<kDType>(P[2 * mt][4 * ks], P[2 * mt][4 * ks + 1]);
      a[mt][1] = pack2<kDType>(P[2 * mt + 1][4 * ks], P[2 * mt + 1][4 * ks + 1]);
      a[mt][2] = pack2<kDType>(P[2 * mt][4 * ks + 2], P[2 * mt][4 * ks + 3]);
      a[mt][3] = pack2<kDType>(P[2 * mt + 1][4 * ks + 2], P[2 * mt + 1][4 * ks + 3]);
    }
#pragma unroll
    for (int dp = 0; dp < kDT / 2; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_row + ks * 16 * kRowBytes + ((dp * 32) ^ v_x));
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma<kDType>(O[2 * mt][4 * dp], O[2 * mt][4 * dp + 1], O[2 * mt + 1][4 * dp],
                    O[2 * mt + 1][4 * dp + 1], a[mt], b[0], b[1]);
        mma<kDType>(O[2 * mt][4 * dp + 2], O[2 * mt][4 * dp + 3], O[2 * mt + 1][4 * dp + 2],
                    O[2 * mt + 1][4 * dp + 3], a[mt], b[2], b[3]);
      }
    }
  }
}

#endif  // HIPFLASH_HAS_MMA_SYNC

}  // namespace hipflash::generic::sm80
