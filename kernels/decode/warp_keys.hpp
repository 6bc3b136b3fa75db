// hipflash — the decode kernels' key step (NVIDIA mma.sync): one warp, 16 keys of a stage, its
// 16 query rows. The decode kernel's warps each take 16 keys of a 64-key block of one head;
// the head-group kernel's warps each take a 16-key stage of their own head.
#pragma once

#include "atoms/sm80.hpp"
#include "common/softmax.hpp"
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

/// One warp's 16 keys: S = Q K^T (qf: Q as the A operand; the K tile at shared address sK),
/// mask(S) (the caller's: -inf where a key is not visible), the online-softmax update, then
/// O += P V (the V tile at sV). Once the running maxima settle (a few blocks into a long key
/// range) every rescale factor is exactly 1: the warp skips its 4 * kDTiles multiplies — the
/// loop is issue-bound — with the same O (NaN and 0 factors still multiply; under fast math a
/// multiply by 1 would flush a subnormal accumulator to 0, which the skip keeps: both are
/// within rounding).
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
  float rescale[2];
  softmax.update(S, scale_log2, rescale);
  if (!port::all_lanes(rescale[0] == 1.f && rescale[1] == 1.f)) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < 2 * Cfg::kDTiles; ++c) O[r][c] *= rescale[r];
  }
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

#endif  // HIPFLASH_HAS_MMA_SYNC

}  // namespace hipflash::decode
