// hipflash — the CPU backward (SPEC §7): validation, then the gradients from the forward's LSE.
#include "hipflash/backward.hpp"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "common/block_info.hpp"
#include "hipflash/detail/host_numeric.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "tensor_checks.hpp"

namespace hipflash {
namespace {

using detail::shape_str;

void check_like(const TensorRef& t, const char* name, const TensorRef& like, const char* like_name) {
  const char* why = "";
  for (auto [r, r_name] : {std::pair{&like, like_name}, {&t, name}})  // ranks first: sizes read
    HIPFLASH_CHECK(detail::indexable(*r, &why), r_name, " with shape ", shape_str(*r),
                   " cannot be indexed in 64 bits: ", why);
  HIPFLASH_CHECK(t.rank == like.rank, name, " must have the shape of ", like_name, " ",
                 shape_str(like), ", got ", shape_str(t));
  for (int i = 0; i < t.rank; ++i)
    HIPFLASH_CHECK(t.sizes[i] == like.sizes[i], name, " must have the shape of ", like_name, " ",
                   shape_str(like), ", got ", shape_str(t));
  HIPFLASH_CHECK_AS(dtype_error, t.dtype == like.dtype, name, " must have dtype ",
                    dtype_name(like.dtype), ", got ", dtype_name(t.dtype));
  HIPFLASH_CHECK(t.loc == like.loc, name, " must be on the device of ", like_name);
  HIPFLASH_CHECK(detail::last_dim_contiguous(t), name,
                 " must have a contiguous last dimension (stride 1)");
  HIPFLASH_CHECK(t.data != nullptr || t.numel() == 0, name, " has no data pointer");
}

}  // namespace

namespace {

/// The gradients of a validated call (dense or varlen: p's cu_seqlens) on the CPU.
void run_backward(const FwdParams& p, const TensorRef& dout, const TensorRef& q,
                  const TensorRef& k, const TensorRef& v, const TensorRef& out,
                  const TensorRef& dq, const TensorRef& dk, const TensorRef& dv) {
  const int64_t B = p.batch, Hq = p.heads_q, Hkv = p.heads_kv, D = p.head_dim, G = Hq / Hkv;
  const float scale = p.softmax_scale;
  const detail::Softcap softcap{p.softcap};
  const DType dt = p.dtype;
  // Element (batch b, row `row` of the sequence starting at `start`, head h) of a dense
  // [B, S, H, D] or varlen [total, H, D] tensor.
  auto off = [](const TensorRef& t, int64_t b, int64_t start, int64_t row, int64_t h) {
    return t.rank == 4 ? b * t.strides[0] + row * t.strides[1] + h * t.strides[2]
                       : (start + row) * t.strides[0] + h * t.strides[1];
  };
  auto at = [&](const TensorRef& t, int64_t o, int64_t d) { return detail::load_as_float(t.data, o + d, dt); };
  auto put = [&](const TensorRef& t, int64_t o, int64_t d, float x) { detail::store_from_float(t.data, o + d, x, dt); };

  // One task per (batch, kv head): it owns that head's dk / dv and its query heads' dq, so no
  // two threads write one element and the order of every sum is fixed (deterministic).
  auto task = [&](int64_t b, int64_t hk) {
    int64_t q0 = 0, k0 = 0, Sq = p.seqlen_q, Sk = p.seqlen_k;
    if (p.is_varlen()) {
      q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
      Sq = p.seqused_q ? p.seqused_q[b] : p.cu_seqlens_q[b + 1] - q0;  // seqused: validated
      Sk = p.seqused_k ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - k0;  // <= the cu lengths
    }
    std::vector<float> dk_acc(static_cast<size_t>(Sk * D), 0.f), dv_acc(static_cast<size_t>(Sk * D), 0.f);
    std::vector<float> kf(static_cast<size_t>(Sk * D)), vf(static_cast<size_t>(Sk * D));
    std::vector<float> qi(static_cast<size_t>(D)), doi(static_cast<size_t>(D)),
        dqi(static_cast<size_t>(D));
    for (int64_t j = 0; j < Sk; ++j)
      for (int64_t d = 0; d < D; ++d) {
        kf[size_t(j * D + d)] = at(k, off(k, b, k0, j, hk), d);
        vf[size_t(j * D + d)] = at(v, off(v, b, k0, j, hk), d);
      }
    const int64_t diag = Sk - Sq;
    const auto* lse_data = p.lse;
    for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
      for (int64_t i = 0; i < Sq; ++i) {
        std::fill(dqi.begin(), dqi.end(), 0.f);
        const float lse_i = lse_data[p.lse_offset(b, h, q0, i)];
        const float slope = p.alibi_slope(b, h);
        if (lse_i != detail::kNegInf) {  // a row with no valid key has no gradient
          float Di = 0.f;  // rowsum(dO * O), from the saved (rounded) output, as the GPU will
          const int64_t oq = off(q, b, q0, i, h), oo = off(out, b, q0, i, h), od = off(dout, b, q0, i, h);
          for (int64_t d = 0; d < D; ++d) {
            qi[size_t(d)] = at(q, oq, d);
            doi[size_t(d)] = at(dout, od, d);
            Di += doi[size_t(d)] * at(out, oo, d);
          }
          for (int64_t j = 0; j < Sk; ++j) {
            if (!common::BlockInfo<64, 64>::key_valid(p, i, j, Sk, diag, p.has_window())) continue;
            const float* kj = &kf[size_t(j * D)];
            const float* vj = &vf[size_t(j * D)];
            float sc = 0.f, dp = 0.f;
            for (int64_t d = 0; d < D; ++d) {
              sc += qi[size_t(d)] * kj[d];
              dp += doi[size_t(d)] * vj[d];
            }
            // P from the forward's LSE; with a softcap, of the capped score, and dS carries
            // the cap's slope 1 - tanh^2 back to the scaled score.
            float score = sc * scale, cap_slope = 1.f;
            if (softcap.on()) {
              const float t = softcap.tanh_of(score);
              score = softcap.cap * t;
              cap_slope = 1.f - t * t;
            }
            if (p.alibi_slopes) score += detail::alibi_bias(slope, i + diag, j);  // no gradient
            const float pij = std::exp(score - lse_i);
            const float ds = pij * (dp - Di) * cap_slope;
            float* dkj = &dk_acc[size_t(j * D)];
            float* dvj = &dv_acc[size_t(j * D)];
            for (int64_t d = 0; d < D; ++d) {
              dqi[size_t(d)] += scale * ds * kj[d];
              dkj[d] += scale * ds * qi[size_t(d)];
              dvj[d] += pij * doi[size_t(d)];
            }
          }
        }
        const int64_t oq = off(dq, b, q0, i, h);
        for (int64_t d = 0; d < D; ++d) put(dq, oq, d, dqi[size_t(d)]);
      }
    for (int64_t j = 0; j < Sk; ++j) {
      const int64_t ok = off(dk, b, k0, j, hk), ov = off(dv, b, k0, j, hk);
      for (int64_t d = 0; d < D; ++d) {
        put(dk, ok, d, dk_acc[size_t(j * D + d)]);
        put(dv, ov, d, dv_acc[size_t(j * D + d)]);
      }
    }
  };

  cpu::parallel_for(B * Hkv, [&](int64_t t) { task(t / Hkv, t % Hkv); });
}

/// The gradients' checks (after the forward's own checks of q, k, v, out and lse).
void check_grads(const TensorRef& dout, const TensorRef& q, const TensorRef& k, const TensorRef& v,
                 const TensorRef& out, const TensorRef& lse, const TensorRef& dq,
                 const TensorRef& dk, const TensorRef& dv,
                 std::initializer_list<std::pair<const TensorRef*, const char*>> extra) {
  HIPFLASH_CHECK_AS(dtype_error, q.dtype != DType::e4m3,
                    "the backward takes float16 or bfloat16 inputs, got float8_e4m3fn (fp8 "
                    "attention is forward only, as in FlashAttention 3)");
  check_like(dout, "dout", out, "out");
  check_like(dq, "dq", q, "q");
  check_like(dk, "dk", k, "k");
  check_like(dv, "dv", v, "v");
  const std::pair<const TensorRef*, const char*> grads[] = {{&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}};
  const std::pair<const TensorRef*, const char*> inputs[] = {
      {&dout, "dout"}, {&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&lse, "lse"}};
  for (auto [g, gname] : grads) {
    detail::check_no_self_overlap(*g, gname);
    for (auto [t, tname] : inputs) detail::check_disjoint(*g, gname, *t, tname);
    for (auto [t, tname] : extra)  // cu_seqlens, alibi_slopes (null: not passed)
      if (t != nullptr) detail::check_disjoint(*g, gname, *t, tname);
    for (auto [h, hname] : grads)
      if (g != h) detail::check_disjoint(*g, gname, *h, hname);
  }
  HIPFLASH_CHECK_AS(not_implemented, q.loc.kind == Location::cpu || gpu::build_caps().gpu,
                    "q is on a GPU but this hipflash was built without GPU kernels "
                    "(HIPFLASH_GPU=none); rebuild with HIPFLASH_GPU=cuda or hip, or pass CPU "
                    "tensors");
}

/// The GPU kernels' params: the forward's, the gradients' pointers and strides (dense
/// [B, S, H, D] or varlen [total, H, D]: batch stride 0).
BwdParams gpu_params(const FwdParams& fp, const TensorRef& dout, const TensorRef& dq,
                     const TensorRef& dk, const TensorRef& dv, bool deterministic) {
  BwdParams p;
  static_cast<FwdParams&>(p) = fp;
  auto strides = [](const TensorRef& t, int64_t& batch, int64_t& row, int64_t& head) {
    const bool dense = t.rank == 4;
    batch = dense ? t.strides[0] : 0;
    row = t.strides[dense ? 1 : 0];
    head = t.strides[dense ? 2 : 1];
  };
  p.dout = dout.data;
  p.dq = dq.data;
  p.dk = dk.data;
  p.dv = dv.data;
  strides(dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  strides(dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  strides(dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  strides(dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  p.deterministic = deterministic;
  p.num_splits = 1;
  return p;
}

FwdOptions forward_options(const BwdOptions& opts) {
  FwdOptions fo;
  fo.softmax_scale = opts.softmax_scale;
  fo.causal = opts.causal;
  fo.window_left = opts.window_left;
  fo.window_right = opts.window_right;
  fo.softcap = opts.softcap;
  fo.alibi_slopes = opts.alibi_slopes;
  fo.num_splits = 1;
  fo.return_lse = true;
  return fo;
}

}  // namespace

void backward(const TensorRef& dout, const TensorRef& q, const TensorRef& k, const TensorRef& v,
              const TensorRef& out, const TensorRef& lse, const TensorRef& dq,
              const TensorRef& dk, const TensorRef& dv, const BwdOptions& opts, Stream stream,
              Workspace workspace) {
  // The forward's own checks of q, k, v, out and lse (shapes, dtypes, devices, aliasing).
  const FwdParams p = make_dense_params(q, k, v, out, &lse, forward_options(opts));
  check_grads(dout, q, k, v, out, lse, dq, dk, dv, {{opts.alibi_slopes, "alibi_slopes"}});
  if (q.loc.kind == Location::gpu) {
    gpu::run_backward(gpu_params(p, dout, dq, dk, dv, opts.deterministic), q.loc.index, stream,
                      workspace, 0, 0);
    return;
  }
  run_backward(p, dout, q, k, v, out, dq, dk, dv);
}

void varlen_backward(const TensorRef& dout, const TensorRef& q, const TensorRef& k,
                     const TensorRef& v, const TensorRef& out, const TensorRef& lse,
                     const TensorRef& cu_seqlens_q, const TensorRef& cu_seqlens_k,
                     const TensorRef& dq, const TensorRef& dk, const TensorRef& dv,
                     const VarlenBwdOptions& opts, Stream stream, Workspace workspace) {
  VarlenOptions vo;
  static_cast<FwdOptions&>(vo) = forward_options(opts);
  vo.max_seqlen_q = opts.max_seqlen_q;
  vo.max_seqlen_k = opts.max_seqlen_k;
  vo.lse_layout = opts.lse_layout;
  vo.seqused_q = opts.seqused_q;
  vo.seqused_k = opts.seqused_k;
  std::vector<int32_t> host_cu_k, host_cu_q;
  const FwdParams p = make_varlen_params(q, k, v, out, &lse, cu_seqlens_q, cu_seqlens_k, vo,
                                         stream, &host_cu_k, &host_cu_q);
  check_grads(dout, q, k, v, out, lse, dq, dk, dv,
              {{&cu_seqlens_q, "cu_seqlens_q"}, {&cu_seqlens_k, "cu_seqlens_k"},
               {opts.alibi_slopes, "alibi_slopes"}, {opts.seqused_q, "seqused_q"},
               {opts.seqused_k, "seqused_k"}});
  if (q.loc.kind == Location::gpu) {
    // The launcher zeroes the rows outside every sequence's used rows: none where the sequences
    // cover the tensor's rows and use them all (cu_seqlens as read for the checks; while a
    // graph is captured they are unknown: always).
    const auto rows_outside = [](const std::vector<int32_t>& cu, const TensorRef* used,
                                 int64_t total) {
      return used != nullptr || cu.empty() || cu.front() > 0 || cu.back() < total;
    };
    gpu::run_backward(gpu_params(p, dout, dq, dk, dv, opts.deterministic), q.loc.index, stream,
                      workspace, q.sizes[0], k.sizes[0],
                      rows_outside(host_cu_q, opts.seqused_q, q.sizes[0]),
                      rows_outside(host_cu_k, opts.seqused_k, k.sizes[0]));
    return;
  }
  // Rows outside every sequence (before cu_seqlens[0], from cu_seqlens[B] on) and a
  // sequence's rows past its seqused take part in nothing: their gradients are 0, written here
  // (the used rows are the tasks').
  auto zero_unused = [&](const TensorRef& g, const int32_t* cu, const int32_t* used) {
    const int64_t total = g.sizes[0];
    std::vector<char> in_use(size_t(total), 0);
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t r = cu[b]; r < cu[b] + (used ? used[b] : cu[b + 1] - cu[b]); ++r)
        in_use[size_t(r)] = 1;
    for (int64_t r = 0; r < total; ++r) {
      if (in_use[size_t(r)]) continue;
      for (int64_t h = 0; h < g.sizes[1]; ++h)
        for (int64_t d = 0; d < g.sizes[2]; ++d)
          detail::store_from_float(g.data, r * g.strides[0] + h * g.strides[1] + d, 0.f, g.dtype);
    }
  };
  zero_unused(dq, p.cu_seqlens_q, p.seqused_q);
  zero_unused(dk, p.cu_seqlens_k, p.seqused_k);
  zero_unused(dv, p.cu_seqlens_k, p.seqused_k);
  run_backward(p, dout, q, k, v, out, dq, dk, dv);
}

}  // namespace hipflash
