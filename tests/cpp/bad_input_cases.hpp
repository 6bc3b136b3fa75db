// SPEC §4 as a table: every C++ entry point against bad input, on host or device memory.
//
// A Call holds a valid call of each entry point (forward, varlen_forward, kvcache_forward on a
// contiguous and a paged cache, varlen_paged_forward, merge_attn_states, backward,
// varlen_backward) in host storage, every buffer poisoned. A Case breaks one thing of one call
// (a size, a stride, a dtype, a location, an alias) and names the typed error and a piece of its
// message. run_bad_input_case places the buffers (host: as they are; device: copies, see
// tests/cpp/test_gpu_bad_inputs.cu), breaks the call, runs it, and checks the error and that
// every buffer — inputs, outputs, caches — is bit-for-bit what it was. The Python entry points
// walk the same rows in tests/python/test_bad_inputs.py; docs/spec.md §4 lists them.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "hipflash/hipflash.hpp"
#include "test_util.hpp"

namespace hipflash::test::bad_input {

enum class Err { invalid, dtype, not_impl };
enum class Entry { forward, varlen, kvcache, kvcache_paged, varlen_paged, merge, backward,
                   varlen_backward };

/// The buffers of one valid call per entry point (host storage) and the TensorRefs the call
/// passes, which a case edits. Dense: B = 2, Sq = 5, Sk = 7, Hq = 4, Hkv = 2, D = 64.
struct Call {
  HostTensor q{DType::bf16, {2, 5, 4, 64}}, k{DType::bf16, {2, 7, 2, 64}},
      v{DType::bf16, {2, 7, 2, 64}}, out{DType::bf16, {2, 5, 4, 64}}, lse{DType::f32, {2, 4, 5}};
  // Varlen: sequences of (3, 5) and (4, 2) rows.
  HostTensor vq{DType::bf16, {7, 4, 64}}, vk{DType::bf16, {7, 2, 64}}, vv{DType::bf16, {7, 2, 64}},
      vout{DType::bf16, {7, 4, 64}}, vlse{DType::f32, {2, 4, 4}}, cu_q = cu_seqlens({3, 4}),
      cu_k = cu_seqlens({5, 2});
  // KV cache: contiguous [2, 32, 2, 64], paged [5, 16, 2, 64] (two pages a sequence), one new
  // row per sequence; decode queries [2, 1, 4, 64].
  HostTensor kc{DType::bf16, {2, 32, 2, 64}}, vc{DType::bf16, {2, 32, 2, 64}},
      kp{DType::bf16, {5, 16, 2, 64}}, vp{DType::bf16, {5, 16, 2, 64}},
      knew{DType::bf16, {2, 1, 2, 64}}, vnew{DType::bf16, {2, 1, 2, 64}},
      seqlens{DType::i32, {2}}, table{DType::i32, {2, 2}}, dq_{DType::bf16, {2, 1, 4, 64}},
      dout_{DType::bf16, {2, 1, 4, 64}}, dlse{DType::f32, {2, 4, 1}};
  // Merge: two packed parts [2, 7, 4, 64] with LSEs [2, 4, 7].
  HostTensor outs{DType::bf16, {2, 7, 4, 64}}, lses{DType::f32, {2, 4, 7}},
      mout{DType::bf16, {7, 4, 64}}, mlse{DType::f32, {4, 7}};
  // Backward: the gradients' buffers (the forward's out / lse are `out` / `lse`, made valid).
  HostTensor gout{DType::bf16, {2, 5, 4, 64}}, dq{DType::bf16, {2, 5, 4, 64}},
      dk{DType::bf16, {2, 7, 2, 64}}, dv{DType::bf16, {2, 7, 2, 64}};
  HostTensor vdq{DType::bf16, {7, 4, 64}}, vdk{DType::bf16, {7, 2, 64}},
      vdv{DType::bf16, {7, 2, 64}};
  HostTensor slopes{DType::f32, {4}};  ///< ALiBi slopes [Hq] (a case passes them)
  HostTensor used{DType::i32, {2}};  ///< varlen seqused [B] (a case passes it): {2, 1}
  HostTensor scale{DType::f32, {1}};  ///< an fp8 descale factor (a case passes it): 1

  /// Every buffer, for placing and for the written-nothing check.
  std::vector<HostTensor*> all() {
    return {&q, &k, &v, &out, &lse, &vq, &vk, &vv, &vout, &vlse, &cu_q, &cu_k, &kc, &vc, &kp,
            &vp, &knew, &vnew, &seqlens, &table, &dq_, &dout_, &dlse, &outs, &lses, &mout,
            &mlse, &gout, &dq, &dk, &dv, &vdq, &vdk, &vdv, &slopes, &used, &scale};
  }

  // The refs the call passes (placed copies of the buffers' refs; a case edits these).
  TensorRef Q, K, V, Out, Lse, VQ, VK, VV, VOut, VLse, CuQ, CuK, KC, VC, KP, VP, KNew, VNew,
      Seqlens, Table, DQ_, DOut_, DLse, Outs, Lses, MOut, MLse, GOut, DQ, DK, DV, VDQ, VDK, VDV,
      Slopes, Used, Scale;
  FwdOptions opts;
  VarlenOptions vopts;
  KvCacheOptions kopts;
  BwdOptions bopts;
  VarlenBwdOptions vbopts;
  Location other;        ///< a location that is not the call's (cross-device cases)
  bool pass_lse = true;  ///< forward: pass the lse buffer

  Call() {
    std::mt19937 rng(3);
    for (HostTensor* t : {&q, &k, &v, &vq, &vk, &vv, &kc, &vc, &kp, &vp, &knew, &vnew, &outs,
                          &gout, &dq_})
      t->randomize(rng);
    for (HostTensor* t : {&out, &vout, &mout, &dq, &dk, &dv, &vdq, &vdk, &vdv, &dout_}) t->fill(kNaN);
    for (HostTensor* t : {&lse, &vlse, &mlse, &dlse}) t->fill(kNaN);
    // The backward's out / lse: any finite values will do (nothing runs).
    lses.randomize(rng);
    lse.randomize(rng);
    vlse.randomize(rng);
    seqlens.i32()[0] = 3, seqlens.i32()[1] = 20;
    used.i32()[0] = 2, used.i32()[1] = 1;
    scale.f32()[0] = 1.f;
    const int32_t pages[4] = {4, 0, 2, 3};
    for (int i = 0; i < 4; ++i) table.i32()[i] = pages[i];
    opts.return_lse = vopts.return_lse = kopts.return_lse = true;
    vopts.max_seqlen_q = 4, vopts.max_seqlen_k = 5;
    vbopts.max_seqlen_q = 4, vbopts.max_seqlen_k = 5;
  }

  /// Places every ref with `place` (HostTensor -> TensorRef on the run's memory).
  template <class Place>
  void place_all(Place& place) {
    TensorRef* refs[] = {&Q, &K, &V, &Out, &Lse, &VQ, &VK, &VV, &VOut, &VLse, &CuQ, &CuK, &KC,
                         &VC, &KP, &VP, &KNew, &VNew, &Seqlens, &Table, &DQ_, &DOut_, &DLse,
                         &Outs, &Lses, &MOut, &MLse, &GOut, &DQ, &DK, &DV, &VDQ, &VDK, &VDV,
                         &Slopes, &Used, &Scale};
    const std::vector<HostTensor*> bufs = all();
    for (size_t i = 0; i < bufs.size(); ++i) *refs[i] = place(*bufs[i]);
  }

  void run(Entry e) {
    switch (e) {
      case Entry::forward: forward(Q, K, V, Out, pass_lse ? &Lse : nullptr, opts); return;
      case Entry::varlen: varlen_forward(VQ, VK, VV, VOut, &VLse, CuQ, CuK, vopts); return;
      case Entry::kvcache:
        kvcache_forward(DQ_, KC, VC, &KNew, &VNew, &Seqlens, nullptr, DOut_, &DLse, kopts);
        return;
      case Entry::kvcache_paged:
        kvcache_forward(DQ_, KP, VP, &KNew, &VNew, &Seqlens, &Table, DOut_, &DLse, kopts);
        return;
      case Entry::varlen_paged:
        varlen_paged_forward(VQ, KP, VP, VOut, &VLse, CuQ, CuK, Table, vopts);
        return;
      case Entry::merge: merge_attn_states(Outs, Lses, MOut, &MLse); return;
      case Entry::backward: backward(GOut, Q, K, V, Out, Lse, DQ, DK, DV, bopts); return;
      case Entry::varlen_backward:
        varlen_backward(VOut, VQ, VK, VV, VOut, VLse, CuQ, CuK, VDQ, VDK, VDV, vbopts);
        return;
    }
  }
};

/// A view of t's first row with t's shape: every dimension but the last of stride 0 (an
/// expanded tensor).
inline TensorRef expanded(TensorRef t) {
  for (int d = 0; d + 1 < t.rank; ++d) t.strides[d] = 0;
  return t;
}
/// t with a last-dimension stride of 2 (not contiguous; nothing is read, so it may run past
/// the storage).
inline TensorRef strided_last(TensorRef t) {
  t.strides[t.rank - 1] = 2;
  return t;
}

/// A contiguous padded LSE [B, H, rows] over t's storage (for a smaller max_seqlen_q).
inline TensorRef shorter_rows(const TensorRef& t, int64_t rows) {
  return make_tensor(t.data, t.dtype, {t.sizes[0], t.sizes[1], rows}, t.loc);
}

struct Case {
  const char* id;
  Entry entry;
  std::function<void(Call&)> breaks;
  Err want;
  const char* message;
};

/// The dense call's q, k and v as float8_e4m3fn views of their storage (out stays bfloat16:
/// a valid fp8 call until a case breaks it).
inline void make_fp8(Call& c) { c.Q.dtype = c.K.dtype = c.V.dtype = DType::e4m3; }

inline std::vector<Case> cases() {
  using E = Entry;
  const Err inv = Err::invalid, dt = Err::dtype;
  return {
      // forward (SPEC §4)
      {"forward-rank", E::forward, [](Call& c) { c.Q.rank = 3; }, inv, "q must have rank 4"},
      {"forward-negative-size", E::forward, [](Call& c) { c.K.sizes[1] = -1; }, inv,
       "negative size"},
      {"forward-batch-differs", E::forward, [](Call& c) { c.K.sizes[0] = 1; }, inv,
       "batch size differs"},
      {"forward-heads-divide", E::forward, [](Call& c) { c.Q.sizes[2] = c.Out.sizes[2] = 3; },
       inv, "must divide"},
      {"forward-dtype", E::forward, [](Call& c) { c.K.dtype = DType::f16; }, dt,
       "k must have dtype"},
      {"forward-lse-dtype", E::forward, [](Call& c) { c.Lse.dtype = DType::bf16; }, dt,
       "lse must have dtype float32"},
      {"forward-other-device", E::forward, [](Call& c) { c.V.loc = c.other; }, inv,
       "same device"},
      {"forward-last-dim", E::forward, [](Call& c) { c.Q = strided_last(c.Q); }, inv,
       "contiguous last dimension"},
      {"forward-head-dim", E::forward,
       [](Call& c) { c.Q.sizes[3] = c.K.sizes[3] = c.V.sizes[3] = c.Out.sizes[3] = 48; }, inv,
       "supported head dims"},
      {"forward-no-lse", E::forward, [](Call& c) { c.pass_lse = false; }, inv, "no lse buffer"},
      {"forward-lse-small", E::forward, [](Call& c) { c.Lse.sizes[2] = 4; }, inv, "lse buffer"},
      {"forward-lse-aliases-out", E::forward,
       [](Call& c) { c.Lse.data = c.Out.data; }, inv, "lse must not alias out"},
      {"forward-out-aliases-q", E::forward, [](Call& c) { c.Out = c.Q; }, inv,
       "out must not alias q"},
      {"forward-out-overlaps-itself", E::forward, [](Call& c) { c.Out = expanded(c.Out); }, inv,
       "out must not overlap itself"},
      {"forward-size-overflows", E::forward,
       [](Call& c) {
         for (TensorRef* t : {&c.Q, &c.K, &c.V, &c.Out}) *t = expanded(*t);
         c.Q.sizes[0] = c.K.sizes[0] = c.V.sizes[0] = c.Out.sizes[0] = int64_t(1) << 53;
         c.Q.sizes[1] = c.K.sizes[1] = c.V.sizes[1] = c.Out.sizes[1] = 1;
         c.opts.return_lse = false;
       },
       inv, "overflows int64"},
      {"forward-window", E::forward, [](Call& c) { c.opts.window_left = -2; }, inv,
       "window_size"},
      {"forward-scale", E::forward, [](Call& c) { c.opts.softmax_scale = -1.f; }, inv,
       "softmax_scale"},
      {"forward-softcap", E::forward, [](Call& c) { c.opts.softcap = -1.f; }, inv, "softcap"},
      {"forward-softcap-nan", E::forward, [](Call& c) { c.opts.softcap = kNaN; }, inv,
       "softcap"},
      {"forward-fp8-out-dtype", E::forward,
       [](Call& c) { make_fp8(c), c.Out.dtype = DType::f16; }, dt,
       "out must have dtype bfloat16 for float8_e4m3fn inputs"},
      {"forward-fp8-mixed", E::forward, [](Call& c) { make_fp8(c), c.V.dtype = DType::bf16; },
       dt, "v must have dtype float8_e4m3fn"},
      {"forward-descale-not-fp8", E::forward, [](Call& c) { c.opts.q_descale = &c.Scale; }, inv,
       "q_descale applies to float8_e4m3fn inputs only"},
      {"forward-descale-dtype", E::forward,
       [](Call& c) { make_fp8(c), c.Scale.dtype = DType::bf16, c.opts.k_descale = &c.Scale; },
       dt, "k_descale must have dtype float32"},
      {"forward-descale-shape", E::forward,
       [](Call& c) { make_fp8(c), c.Scale.sizes[0] = 3, c.opts.v_descale = &c.Scale; }, inv,
       "v_descale must have shape"},
      {"forward-descale-aliases-out", E::forward,
       [](Call& c) { make_fp8(c), c.Scale.data = c.Out.data, c.opts.q_descale = &c.Scale; },
       inv, "out must not"},
      {"backward-fp8", E::backward, [](Call& c) { make_fp8(c); }, dt,
       "the backward takes float16 or bfloat16 inputs"},
      {"varlen-fp8-out-dtype", E::varlen,
       [](Call& c) { c.VQ.dtype = c.VK.dtype = c.VV.dtype = DType::e4m3, c.VOut.dtype = DType::f16; },
       dt, "out must have dtype bfloat16 for float8_e4m3fn inputs"},
      {"varlen-paged-fp8", E::varlen_paged, [](Call& c) { c.VQ.dtype = DType::e4m3; },
       Err::not_impl, "float8_e4m3fn queries against a paged KV cache"},
      {"forward-descale-aliases-lse", E::forward,
       [](Call& c) { make_fp8(c), c.Scale.data = c.Lse.data, c.opts.q_descale = &c.Scale; },
       inv, "lse must not"},
      {"forward-alibi-dtype", E::forward,
       [](Call& c) { c.Slopes.dtype = DType::bf16, c.opts.alibi_slopes = &c.Slopes; }, dt,
       "alibi_slopes must have dtype float32"},
      {"forward-alibi-shape", E::forward,
       [](Call& c) { c.Slopes.sizes[0] = 3, c.opts.alibi_slopes = &c.Slopes; }, inv,
       "alibi_slopes must have shape"},
      {"forward-alibi-other-device", E::forward,
       [](Call& c) { c.Slopes.loc = c.other, c.opts.alibi_slopes = &c.Slopes; }, inv,
       "same device"},
      {"forward-splits", E::forward, [](Call& c) { c.opts.num_splits = 100000; }, inv,
       "num_splits"},
      // varlen_forward
      {"varlen-cu-dtype", E::varlen, [](Call& c) { c.CuQ.dtype = DType::f32; }, inv, "int32"},
      {"varlen-cu-length", E::varlen, [](Call& c) { c.CuK.sizes[0] = 2; }, inv,
       "length of cu_seqlens_q"},
      {"varlen-max-seqlen-small", E::varlen, [](Call& c) { c.vopts.max_seqlen_q = 3, c.VLse = shorter_rows(c.VLse, 3); }, inv,
       "too small"},
      {"varlen-seqused-dtype", E::varlen,
       [](Call& c) { c.Used.dtype = DType::f32, c.vopts.seqused_q = &c.Used; }, inv,
       "seqused_q must have dtype int32"},
      {"varlen-seqused-shape", E::varlen,
       [](Call& c) { c.Used.sizes[0] = 3, c.vopts.seqused_k = &c.Used; }, inv,
       "seqused_k must have shape [batch]"},
      {"varlen-max-seqlen-q-huge", E::varlen,
       [](Call& c) { c.vopts.max_seqlen_q = int64_t(1) << 40; }, inv, "max_seqlen_q"},
      {"varlen-max-seqlen-k-huge", E::varlen,
       [](Call& c) { c.vopts.max_seqlen_k = int64_t(1) << 40; }, inv, "max_seqlen_k"},
      {"varlen-cu-other-device", E::varlen, [](Call& c) { c.CuK.loc = c.other; }, inv,
       "cu_seqlens_k is on"},
      {"varlen-out-aliases-cu", E::varlen, [](Call& c) { c.VOut.data = c.CuQ.data; }, inv,
       "must not alias"},
      // kvcache_forward: the append writes the caches in place
      {"kvcache-expanded-cache", E::kvcache,
       [](Call& c) { c.KC = expanded(c.KC), c.VC = expanded(c.VC); }, inv,
       "k_cache must not overlap itself"},
      {"kvcache-expanded-pages", E::kvcache_paged,
       [](Call& c) { c.KP.strides[0] = 0, c.VP.strides[0] = 0; }, inv,
       "k_cache must not overlap itself"},
      {"kvcache-softcap", E::kvcache, [](Call& c) { c.kopts.softcap = kInf; }, inv, "softcap"},
      {"kvcache-caches-alias", E::kvcache, [](Call& c) { c.VC = c.KC; }, inv, "must not alias"},
      {"kvcache-cache-aliases-new", E::kvcache, [](Call& c) { c.KNew.data = c.KC.data; }, inv,
       "must not alias k"},
      {"kvcache-seqlens-dtype", E::kvcache, [](Call& c) { c.Seqlens.dtype = DType::f32; }, inv,
       "int32"},
      {"kvcache-seqlens-shape", E::kvcache, [](Call& c) { c.Seqlens.sizes[0] = 1; }, inv,
       "one entry per sequence"},
      {"kvcache-seqlens-other-device", E::kvcache, [](Call& c) { c.Seqlens.loc = c.other; },
       inv, "device of q"},
      {"kvcache-page-size", E::kvcache_paged,
       [](Call& c) { c.KP.sizes[1] = c.VP.sizes[1] = 0; }, inv, "page size"},
      {"kvcache-table-rows", E::kvcache_paged, [](Call& c) { c.Table.sizes[0] = 1; }, inv,
       "one row per sequence"},
      {"kvcache-new-shape", E::kvcache, [](Call& c) { c.KNew.sizes[2] = c.VNew.sizes[2] = 1; },
       inv, "k must have shape"},
      // varlen_paged_forward (chunked prefill)
      {"varlen-paged-max-seqlen-k", E::varlen_paged,
       [](Call& c) { c.vopts.max_seqlen_k = 33; }, inv, "cache holds"},
      {"varlen-paged-table-dtype", E::varlen_paged, [](Call& c) { c.Table.dtype = DType::f32; },
       inv, "int32"},
      // merge_attn_states
      {"merge-parts", E::merge, [](Call& c) { c.Outs.sizes[0] = 0; }, inv, "parts"},
      {"merge-out-dtype", E::merge, [](Call& c) { c.MOut.dtype = DType::f16; }, dt,
       "out must have the dtype of outs"},
      {"merge-lses-dtype", E::merge, [](Call& c) { c.Lses.dtype = DType::bf16; }, dt,
       "lses must have dtype float32"},
      {"merge-lses-shape", E::merge, [](Call& c) { c.Lses.sizes[2] = 6; }, inv,
       "does not match outs"},
      {"merge-other-device", E::merge, [](Call& c) { c.Lses.loc = c.other; }, inv,
       "same device"},
      {"merge-out-aliases-outs", E::merge, [](Call& c) { c.MOut.data = c.Outs.data; }, inv,
       "out must not alias outs"},
      {"merge-lse-overlaps-itself", E::merge, [](Call& c) { c.MLse = expanded(c.MLse); }, inv,
       "lse must not overlap itself"},
      // backward / varlen_backward
      {"backward-dout-shape", E::backward, [](Call& c) { c.GOut.sizes[1] = 4; }, inv,
       "dout must have the shape"},
      {"backward-dq-aliases-q", E::backward, [](Call& c) { c.DQ = c.Q; }, inv,
       "dq must not alias q"},
      {"backward-dk-overlaps-itself", E::backward, [](Call& c) { c.DK = expanded(c.DK); }, inv,
       "dk must not overlap itself"},
      {"backward-lse-dtype", E::backward, [](Call& c) { c.Lse.dtype = DType::bf16; }, dt,
       "float32"},
      {"varlen-backward-max-seqlen", E::varlen_backward,
       [](Call& c) { c.vbopts.max_seqlen_q = 3, c.VLse = shorter_rows(c.VLse, 3); }, inv,
       "too small"},
      {"varlen-backward-dv-aliases-dk", E::varlen_backward, [](Call& c) { c.VDV = c.VDK; }, inv,
       "must not alias"},
      {"varlen-backward-softcap", E::varlen_backward, [](Call& c) { c.vbopts.softcap = -2.f; },
       inv, "softcap"},
      {"backward-dk-aliases-alibi", E::backward,
       [](Call& c) { c.Slopes.data = c.DK.data, c.bopts.alibi_slopes = &c.Slopes; }, inv,
       "dk must not alias alibi_slopes"},
  };
}

/// A case's id as a GoogleTest parameter name ("forward-rank" -> "forward_rank").
struct CaseName {
  template <class Info>
  std::string operator()(const Info& info) const {
    std::string id = info.param.id;
    for (char& ch : id)
      if (ch == '-') ch = '_';
    return id;
  }
};

/// Runs one case with buffers placed by `place` (a callable HostTensor -> TensorRef) at
/// location `here`; `read_back(host)` returns what a buffer holds after the call. Expects the
/// typed error with `message` in it and every buffer bit-for-bit unchanged.
template <class Place, class ReadBack>
void run_bad_input_case(const Case& c, Place&& place, ReadBack&& read_back, Location here,
                        Location other) {
  Call call;
  std::vector<HostTensor> before;
  for (HostTensor* t : call.all()) before.push_back(*t);
  call.place_all(place);
  call.other = other;
  c.breaks(call);
  std::string what = "no error";
  Err got = Err::not_impl;
  bool threw = false;
  try {
    call.run(c.entry);
  } catch (const dtype_error& e) {
    threw = true, got = Err::dtype, what = e.what();
  } catch (const invalid_argument& e) {
    threw = true, got = Err::invalid, what = e.what();
  } catch (const not_implemented& e) {
    threw = true, got = Err::not_impl, what = e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << c.id << ": unexpected exception type: " << e.what();
    return;
  }
  EXPECT_TRUE(threw) << c.id << ": no error";
  EXPECT_EQ(int(got), int(c.want)) << c.id << ": " << what;
  EXPECT_NE(what.find(c.message), std::string::npos) << c.id << ": " << what;
  EXPECT_LT(what.size(), 300u) << c.id << ": " << what;
  const std::vector<HostTensor*> bufs = call.all();
  for (size_t i = 0; i < bufs.size(); ++i)
    EXPECT_TRUE(read_back(*bufs[i]).bitwise_equal(before[i]))
        << c.id << ": buffer " << i << " was written by a refused call (" << here.kind << ")";
}

}  // namespace hipflash::test::bad_input
