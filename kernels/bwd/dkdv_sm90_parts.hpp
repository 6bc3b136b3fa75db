// hipflash — the pieces both Hopper dk/dv passes share (bwd_sm90_kernel.hpp, cp.async;
// bwd_sm90_ws_kernel.hpp, warp-specialised): the transposed score products, the gradient
// products with register A operands, the C-to-A fragment packing, the dQ piece and the dK / dV
// stores (or, over slices of a kv head's query heads, a slice's parts). Each product helper only
// issues wgmmas; the caller fences, commits and waits.
#pragma once

#include "atoms/sm80.hpp"  // pack2
#include "atoms/sm90/wgmma.hpp"
#include "atoms/sm90/wgmma_ops.hpp"
#include "bwd/bwd_block_info.hpp"
#include "common/element.hpp"

namespace hipflash::bwd::sm90_parts {

#if defined(HIPFLASH_HAS_WGMMA)

using namespace ::hipflash::atom::sm90;

/// acc = A B^T over the head dim, 64 keys x kBM queries (S^T = K Q^T or dP^T = V dO^T): A the
/// warpgroup's 64 rows of the kBN-row K or V tile at a_wg, B the kBM-row Q or dO tile at b
/// (both K-major SW128 panels), head-dim steps of 16 (panel ks / 4, 32 B a step).
template <DType kDT, int kBM, int kBN, int kHD>
__device__ __forceinline__ void issue_scores(float (&acc)[kBM / 2], uint32_t a_wg, uint32_t b) {
#pragma unroll
  for (int ks = 0; ks < kHD / 16; ++ks) {
    const uint32_t step = (ks % 4) * 32;
    wgmma::Op<kDT, kBM>::ss(acc, wgmma::desc_k_major(a_wg + (ks / 4) * kBN * 128 + step),
                            wgmma::desc_k_major(b + (ks / 4) * kBM * 128 + step), ks > 0);
  }
}

/// acc += F T over query steps of 16 (dV += P^T dO, dK += dS^T Q): F the register A fragments,
/// T the kBM-row dO or Q tile read MN-major (2048 bytes of rows a step).
template <DType kDT, int kBM, int kHD>
__device__ __forceinline__ void issue_grad(float (&acc)[kHD / 2],
                                           const uint32_t (&frag)[kBM / 16][4], uint32_t tile) {
#pragma unroll
  for (int kk = 0; kk < kBM / 16; ++kk)
    wgmma::Op<kDT, kHD>::rs(acc, frag[kk], wgmma::desc_mn_major(tile + kk * 16 * 128, kBM * 128),
                            1);
}

/// The C fragments of two 8-query tiles are the A fragment of one 16-query step.
template <DType kDT, int kBM>
__device__ __forceinline__ void pack_a(const float (&c)[kBM / 2], uint32_t (&frag)[kBM / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kBM / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      frag[kk][j] = ::hipflash::atom::sm80::pack2<kDT>(c[8 * kk + 2 * j], c[8 * kk + 2 * j + 1]);
}

/// A 64 x 64 piece of dQ = dS K over all kBN keys (wgmma SS, both operands MN-major): A dS^T's
/// panel of the piece's 64 queries at a0, B K's panel of its 64 columns at b0.
template <DType kDT, int kBN>
__device__ __forceinline__ void issue_dq(float (&dq)[32], uint32_t a0, uint32_t b0) {
#pragma unroll
  for (int ks = 0; ks < kBN / 16; ++ks)
    wgmma::Op<kDT, 64>::ss_tt(dq, wgmma::desc_mn_major(a0 + ks * 16 * 128, kBN * 128),
                              wgmma::desc_mn_major(b0 + ks * 16 * 128, kBN * 128), ks > 0);
}

/// dk = scale dS^T Q and dv = P^T dO for this thread's keys key0 and key0 + 8 of kv head hk
/// (accumulators in wgmma order: element 4i + 2h + e is key key0 + 8h, column 8i + 2t + e).
template <DType kDT, int kHD>
__device__ __forceinline__ void store_dkdv(const BwdParams& p, const SeqBounds& seq, int64_t b,
                                           int64_t hk, int64_t key0, int t,
                                           const float (&dK)[kHD / 2], const float (&dV)[kHD / 2]) {
  using T = common::element_t<kDT>;
  using ::hipflash::atom::sm80::pack2;
  T* dk = dk_rows<T>(p, b, seq.k_start, hk);
  T* dv = dv_rows<T>(p, b, seq.k_start, hk);
  const int hd = int(p.head_dim);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t j = key0 + 8 * hh;
    if (j >= seq.len_k) continue;
#pragma unroll
    for (int i = 0; i < kHD / 8; ++i) {
      const int col = 8 * i + 2 * t;
      if (col >= hd) continue;
      *reinterpret_cast<uint32_t*>(dk + j * p.dk_row_stride + col) =
          pack2<kDT>(dK[4 * i + 2 * hh] * p.softmax_scale,
                     dK[4 * i + 2 * hh + 1] * p.softmax_scale);
      *reinterpret_cast<uint32_t*>(dv + j * p.dv_row_stride + col) =
          pack2<kDT>(dV[4 * i + 2 * hh], dV[4 * i + 2 * hh + 1]);
    }
  }
}

/// Slice `slice`'s parts of dkv_accum = (scale dS^T Q, P^T dO) for this thread's keys key0 and
/// key0 + 8 of kv head hk (sequence-relative; rows up to seqlen_k_rounded exist, so none is
/// skipped): one 8-byte store per pair of columns.
template <int kHD>
__device__ __forceinline__ void store_dkdv_part(const BwdParams& p, int64_t slice, int64_t b,
                                                int64_t hk, int64_t key0, int t,
                                                const float (&dK)[kHD / 2],
                                                const float (&dV)[kHD / 2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float2* dk = reinterpret_cast<float2*>(p.dkv_row(0, slice, b, hk, key0 + 8 * hh) + 2 * t);
    float2* dv = reinterpret_cast<float2*>(p.dkv_row(1, slice, b, hk, key0 + 8 * hh) + 2 * t);
#pragma unroll
    for (int i = 0; i < kHD / 8; ++i) {
      dk[4 * i] = make_float2(dK[4 * i + 2 * hh] * p.softmax_scale,
                              dK[4 * i + 2 * hh + 1] * p.softmax_scale);
      dv[4 * i] = make_float2(dV[4 * i + 2 * hh], dV[4 * i + 2 * hh + 1]);
    }
  }
}

#endif  // HIPFLASH_HAS_WGMMA

}  // namespace hipflash::bwd::sm90_parts
