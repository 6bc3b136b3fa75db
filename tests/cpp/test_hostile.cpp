// Hostile inputs on the CPU backend and in the launcher's checks (SPEC §3, §4): NaN through
// every split count, tied huge scores, saturating windows, sizes that overflow 64 bits,
// element-exact aliasing, the C++ helpers' rank checks, and interrupting a long call.
#include <atomic>
#include <functional>

#include "../../src/tensor_checks.hpp"
#include "hostile_cases.hpp"

namespace hipflash::test {
namespace {

// ---- NaN propagation and tied scores -----------------------------------------------------------

class CpuNan : public ::testing::TestWithParam<NanCase> {};

TEST_P(CpuNan, ReachesExactlyWhatTheReferenceReaches) {
  Dense t = make_nan_problem(GetParam());
  t.run();
  EXPECT_REF_OK(check_nan(t));
}

INSTANTIATE_TEST_SUITE_P(Grid, CpuNan, ::testing::ValuesIn(nan_cases()),
                         [](const auto& info) { return info.param.name(); });

TEST(CpuTiedScores, SplitsAreWeightedByTheirKeyCounts) {
  for (int splits : {1, 2, 3, 5}) {
    Dense t = make_tied_problem({DType::bf16, 1, 4, 300, 2, 1, 64, false, -1, -1, splits});
    t.run();
    EXPECT_REF_OK(t.check()) << "splits " << splits;
  }
}

// ---- Options that overflow or saturate ---------------------------------------------------------

Dense small(int splits = 1) { return make_dense({DType::bf16, 1, 37, 150, 2, 1, 64, false, -1, -1, splits}, 4); }

TEST(CpuWindow, BoundsBeyondTheSequenceSaturate) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  Dense plain = small();
  plain.run();
  for (auto [left, right] : {std::pair{int64_t(-1), kMax}, {kMax, int64_t(-1)}, {kMax, kMax},
                             {int64_t(150), int64_t(37)}}) {
    Dense t = small();
    t.opts.window_left = left;
    t.opts.window_right = right;
    t.run();
    EXPECT_TRUE(t.out.bitwise_equal(plain.out)) << left << ", " << right;
    EXPECT_TRUE(t.lse.bitwise_equal(plain.lse)) << left << ", " << right;
  }
  // The exact bounds: left Sk - 1 and right Sq - 1 reach every key of every row (bottom-right
  // aligned); one less masks a key of the last (first) row.
  {
    Dense t = small();
    t.opts.window_left = 149;
    t.opts.window_right = 36;
    t.run();
    EXPECT_TRUE(t.out.bitwise_equal(plain.out));
    EXPECT_TRUE(t.lse.bitwise_equal(plain.lse));
  }
  for (auto [left, right] : {std::pair{int64_t(148), int64_t(-1)}, {int64_t(-1), int64_t(35)}}) {
    Dense t = small();
    t.opts.window_left = left;
    t.opts.window_right = right;
    t.run();
    EXPECT_FALSE(t.lse.bitwise_equal(plain.lse)) << left << ", " << right << " masks a key";
    EXPECT_REF_OK(t.check());
  }
  // Causal with an unbounded-in-effect left bound is plain causal.
  Dense causal = small();
  causal.opts.causal = true;
  causal.run();
  Dense t = small();
  t.opts.causal = true;
  t.opts.window_left = kMax;
  t.run();
  EXPECT_TRUE(t.out.bitwise_equal(causal.out));
  EXPECT_REF_OK(t.check());
}

TEST(CpuWindow, CausalDecodeIsUnmasked) {
  // One query row, bottom-right aligned: causal sees every key (and the GPU launcher packs
  // the call's GQA heads as for a non-causal one).
  auto decode = [](bool causal) {
    Dense t = make_dense({DType::bf16, 2, 1, 300, 8, 2, 128, causal, -1, -1, 1}, 5);
    t.run();
    return t;
  };
  const Dense plain = decode(false), causal = decode(true);
  EXPECT_TRUE(causal.out.bitwise_equal(plain.out));
  EXPECT_TRUE(causal.lse.bitwise_equal(plain.lse));
}

void expect_invalid(const std::string& substr, const std::function<void()>& call) {
  try {
    call();
    ADD_FAILURE() << "no exception; expected one mentioning '" << substr << "'";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(substr), std::string::npos) << e.what();
    EXPECT_LT(std::string(e.what()).size(), 400u) << "messages stay short";
  }
}

TEST(CpuOptions, HugeSoftmaxScaleIsRefused) {
  for (float scale : {1e37f, 65537.f}) {
    Dense t = small();
    t.opts.softmax_scale = scale;
    expect_invalid("softmax_scale must be a number in (0, 65536]", [&] { t.run(); });
    EXPECT_TRUE(t.out.all_nan());
  }
  Dense t = small();
  t.opts.softmax_scale = 65536.f;  // the largest allowed: finite, exact
  t.run();
  EXPECT_REF_OK(t.check());
}

TEST(CpuSizes, ProductsThatOverflowInt64AreRefused) {
  Dense t = small();
  TensorRef q = t.q.ref, out = t.out.ref, k = t.k.ref;
  q.sizes[1] = out.sizes[1] = int64_t(1) << 40;  // offsets (2^40 - 1) * 2^40 overflow
  q.strides[1] = out.strides[1] = int64_t(1) << 40;
  expect_invalid("cannot be indexed in 64 bits", [&] { forward(q, t.k.ref, t.v.ref, out, &t.lse.ref, t.opts); });
  k.sizes[1] = int64_t(1) << 62;
  k.sizes[2] = 4;  // element count 2^64
  expect_invalid("k with shape", [&] { forward(t.q.ref, k, t.v.ref, t.out.ref, &t.lse.ref, t.opts); });
  EXPECT_TRUE(t.out.all_nan());
}

TEST(CpuVarlen, MaxSeqlenBeyondTheTensorIsRefused) {
  // No sequence is longer than its tensor's rows: a larger maximum would size the padded LSE
  // and the launch, so it is refused before anything is allocated or written.
  for (int64_t max_q : {int64_t(9), int64_t(1) << 40, int64_t(1) << 62}) {
    Varlen t(DType::bf16, {3, 5}, {4, 6}, 2, 1, 64, LseLayout::packed);
    t.opts.max_seqlen_q = max_q;
    expect_invalid("max_seqlen_q", [&] { t.run(); });
    EXPECT_TRUE(t.out.all_nan());
    EXPECT_TRUE(t.lse.all_nan());
  }
  Varlen t(DType::bf16, {3, 5}, {4, 6}, 2, 1, 64, LseLayout::packed);
  t.opts.max_seqlen_k = int64_t(1) << 40;
  expect_invalid("max_seqlen_k", [&] { t.run(); });
  EXPECT_TRUE(t.out.all_nan());
}

// ---- Aliasing ------------------------------------------------------------------------------------

TEST(CpuAliasing, OutOverlappingItselfIsRefused) {
  Dense t = small();
  TensorRef out = t.out.ref;
  out.strides[1] = 0;  // an expanded view: every query row is the same memory
  expect_invalid("out must not overlap itself", [&] { forward(t.q.ref, t.k.ref, t.v.ref, out, &t.lse.ref, t.opts); });
  out = t.out.ref;
  out.strides[2] = 32;  // heads half a row apart: they share 32 elements
  expect_invalid("out must not overlap itself", [&] { forward(t.q.ref, t.k.ref, t.v.ref, out, &t.lse.ref, t.opts); });
}

TEST(CpuAliasing, InterleavedDisjointViewsAreAccepted) {
  // One buffer [B, S, 2 * H, D]: q in the odd heads, out in the even heads. Their byte ranges
  // interleave but no element is shared.
  const int64_t B = 1, S = 37, H = 2, D = 64;
  HostTensor buf = HostTensor::strided(DType::bf16, {B, S, 2 * H, D}, {S * 2 * H * D, 2 * H * D, D, 1},
                                       B * S * 2 * H * D);
  std::mt19937 rng(2);
  buf.randomize(rng);
  HostTensor q = buf, out = buf;  // copies of the storage; re-pointed below at the same buffer
  TensorRef qv = buf.ref, ov = buf.ref;
  qv.sizes[2] = ov.sizes[2] = H;
  qv.strides[2] = ov.strides[2] = 2 * D;
  qv.data = static_cast<uint16_t*>(buf.ref.data) + D;  // odd heads
  Dense t = small();
  HostTensor lse(DType::f32, {B, H, S});
  FwdOptions opts;
  opts.return_lse = true;
  forward(qv, t.k.ref, t.v.ref, ov, &lse.ref, opts);
  EXPECT_REF_OK(ref::check(ref::Problem::dense(qv, t.k.ref, t.v.ref, opts), ov, &lse.ref));
  // Shift out by one element: now it overlaps q.
  ov.data = static_cast<uint16_t*>(buf.ref.data) + D + 1;
  ov.sizes[3] = qv.sizes[3] = D;
  expect_invalid("out must not alias q", [&] { forward(qv, t.k.ref, t.v.ref, ov, &lse.ref, opts); });
}

TEST(CpuAliasing, OutOrLseOverlappingCuSeqlensIsRefused) {
  Varlen t(DType::bf16, {3, 5}, {4, 6}, 2, 1, 64, LseLayout::packed);
  // cu_seqlens_q placed inside out's storage.
  TensorRef cu = t.cu_q.ref;
  cu.data = t.out.ref.data;
  std::copy_n(t.cu_q.i32(), 3, static_cast<int32_t*>(cu.data));
  expect_invalid("out must not alias cu_seqlens_q", [&] {
    varlen_forward(t.q.ref, t.k.ref, t.v.ref, t.out.ref, &t.lse.ref, cu, t.cu_k.ref, t.opts);
  });
  // cu_seqlens_k inside the packed LSE.
  TensorRef ck = t.cu_k.ref;
  ck.data = static_cast<float*>(t.lse.ref.data) + 4;
  std::copy_n(t.cu_k.i32(), 3, static_cast<int32_t*>(ck.data));
  expect_invalid("lse must not alias cu_seqlens_k", [&] {
    varlen_forward(t.q.ref, t.k.ref, t.v.ref, t.out.ref, &t.lse.ref, t.cu_q.ref, ck, t.opts);
  });
}

TEST(OverlapSearch, ExactOnInterleavedReversedAndMixedViews) {
  using detail::Overlap;
  alignas(16) static uint16_t buf[4096];
  auto view = [](int64_t offset, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                 DType dt = DType::bf16) {
    TensorRef t;
    t.data = buf + offset;
    t.dtype = dt;
    t.rank = int(sizes.size());
    for (int i = 0; i < t.rank; ++i) t.sizes[i] = sizes[i], t.strides[i] = strides[i];
    return t;
  };
  // Even and odd columns of a [32, 64] matrix: disjoint; shifted by a row: still disjoint.
  EXPECT_EQ(detail::overlap(view(0, {32, 32}, {64, 2}), view(1, {32, 32}, {64, 2})), Overlap::none);
  EXPECT_EQ(detail::overlap(view(0, {32, 32}, {64, 2}), view(65, {31, 32}, {64, 2})), Overlap::none);
  EXPECT_EQ(detail::overlap(view(0, {32, 32}, {64, 2}), view(2, {32, 32}, {64, 2})), Overlap::some);
  // A reversed view (negative stride) over the same elements.
  EXPECT_EQ(detail::overlap(view(0, {8, 8}, {8, 1}), view(63, {8, 8}, {-8, -1})), Overlap::some);
  EXPECT_EQ(detail::overlap(view(0, {8, 4}, {8, 1}), view(63, {8, 4}, {-8, -1})), Overlap::none);
  // Mixed element sizes: an fp32 element covers two bf16 slots.
  TensorRef f = view(2, {1}, {1}, DType::f32);  // bytes 4..7 of buf: bf16 slots 2 and 3
  EXPECT_EQ(detail::overlap(f, view(3, {1}, {1})), Overlap::some);
  EXPECT_EQ(detail::overlap(view(3, {1}, {1}), f), Overlap::some);
  EXPECT_EQ(detail::overlap(f, view(4, {1}, {1})), Overlap::none);
  EXPECT_EQ(detail::overlap(f, view(1, {1}, {1})), Overlap::none);
  // Self-overlap: stride 0, folded strides, and a proper layout.
  EXPECT_EQ(detail::self_overlap(view(0, {4, 8}, {0, 1})), Overlap::some);
  EXPECT_EQ(detail::self_overlap(view(0, {4, 8}, {4, 1})), Overlap::unknown);
  EXPECT_EQ(detail::self_overlap(view(0, {4, 8}, {-8, 1})), Overlap::none);
  EXPECT_EQ(detail::self_overlap(view(0, {4, 1, 8}, {8, 0, 1})), Overlap::none);
}

// ---- Raw TensorRef fields the C++ API takes as given ---------------------------------------------

TEST(CppFields, RanksOutsideZeroToFourAreRefusedBeforeASizeIsRead) {
  // The sizes and strides arrays hold four: a rank above reads (and a message printed) past them.
  for (int rank : {5, 12, 100000, std::numeric_limits<int>::max(), -3}) {
    Dense t = small();
    TensorRef q = t.q.ref, lse = t.lse.ref, dq = t.q.ref;
    q.rank = rank;
    expect_invalid("q must have rank 4", [&] { forward(q, t.k.ref, t.v.ref, t.out.ref, &t.lse.ref, t.opts); });
    lse.rank = rank;
    expect_invalid("lse", [&] { forward(t.q.ref, t.k.ref, t.v.ref, t.out.ref, &lse, t.opts); });
    EXPECT_TRUE(t.out.all_nan());
    t.run();
    BwdOptions b;
    dq.rank = rank;
    HostTensor dout = t.out, dk = t.k, dv = t.v;
    expect_invalid("dq", [&] {
      backward(dout.ref, t.q.ref, t.k.ref, t.v.ref, t.out.ref, t.lse.ref, dq, dk.ref, dv.ref, b);
    });
    expect_invalid("k_cache", [&] { check_written_buffers({{&q, "k_cache"}}, {}); });
    expect_invalid("cache_seqlens", [&] {
      check_written_buffers({{&t.k.ref, "k_cache"}}, {{&lse, "cache_seqlens"}});
    });
    EXPECT_EQ(detail::shape_str(q), "(rank " + std::to_string(rank) + ")");
  }
}

TEST(CppFields, NoDataPointerIsSaidSo) {
  // Not "wraps around the address space": a null pointer with a backward stride has no data.
  Dense t = small();
  TensorRef q = t.q.ref;
  q.data = nullptr;
  q.strides[1] = -q.strides[1];
  expect_invalid("q has no data pointer", [&] { forward(q, t.k.ref, t.v.ref, t.out.ref, &t.lse.ref, t.opts); });
}

TEST(CppFields, SlopesAndDescalesBeyond64BitsAreRefused) {
  // Their strides reach addresses 64 bits cannot hold (the offset wraps): refused as q would be.
  Dense t = make_dense({DType::bf16, 2, 8, 8, 2, 1, 64}, 1);
  HostTensor slopes(DType::f32, {2, 2});
  slopes.fill(0.5f);
  TensorRef a = slopes.ref;
  a.strides[0] = (int64_t(1) << 62) + (int64_t(1) << 40);
  t.opts.alibi_slopes = &a;
  expect_invalid("alibi_slopes cannot be indexed in 64 bits", [&] { t.run(); });
  EXPECT_TRUE(t.out.all_nan());
}

TEST(CppFields, UnknownEnumValuesAreRefused) {
  // A location kind or an LSE layout outside its enum: refused, never run as one of them.
  Dense t = small();
  TensorRef q = t.q.ref;
  q.loc.kind = static_cast<Location::Kind>(7);
  expect_invalid("unknown kind", [&] { forward(q, t.k.ref, t.v.ref, t.out.ref, &t.lse.ref, t.opts); });
  HostTensor outs(DType::f32, {2, 3, 2, 8}), lses(DType::f32, {2, 2, 3}), out(DType::f32, {3, 2, 8});
  outs.fill(1.f);
  lses.fill(0.f);
  out.fill(kNaN);
  TensorRef bad = out.ref;
  bad.loc.kind = static_cast<Location::Kind>(7);
  expect_invalid("unknown kind", [&] { merge_attn_states(outs.ref, lses.ref, bad, nullptr); });
  EXPECT_TRUE(out.all_nan());
  Varlen v(DType::bf16, {3, 5}, {4, 6}, 2, 1, 64, LseLayout::packed);
  v.opts.lse_layout = static_cast<LseLayout>(5);
  expect_invalid("lse_layout", [&] { v.run(); });
  EXPECT_TRUE(v.out.all_nan());
  EXPECT_TRUE(v.lse.all_nan());
}

TEST(CppFields, AMergeWithoutHeadsReturnsAtOnce) {
  // Empty (no heads): nothing to merge, whatever the row count (it used to walk 2^60 rows).
  HostTensor outs(DType::f32, {1, 1, 1, 8}), lses(DType::f32, {1, 1, 1}), out(DType::f32, {1, 1, 8});
  TensorRef o = outs.ref, l = lses.ref, r = out.ref;
  o.sizes[1] = r.sizes[0] = l.sizes[2] = int64_t(1) << 60;
  o.sizes[2] = r.sizes[1] = l.sizes[1] = 0;
  merge_attn_states(o, l, r, nullptr);
}

TEST(CppHelpers, MakeTensorRefusesRankAboveFour) {
  expect_invalid("rank <= 4", [] { (void)make_tensor(nullptr, DType::f16, {1, 2, 3, 4, 5}); });
  EXPECT_EQ(make_tensor(nullptr, DType::f16, {1, 2, 3, 4}).rank, 4);
}

// ---- Interrupting a long call --------------------------------------------------------------------

std::atomic<int> g_polls{0};

TEST(CpuInterrupt, ACheckThatFiresStopsTheCall) {
  // The calling thread polls after its first block: a check that fires then stops the call.
  Dense t = make_dense({DType::bf16, 1, 1024, 1024, 8, 8, 64}, 1);
  g_polls = 0;
  set_interrupt_check([] { return ++g_polls >= 1; });
  try {
    t.run();
    ADD_FAILURE() << "the call was not interrupted (polled " << g_polls << " times)";
  } catch (const interrupted& e) {
    EXPECT_NE(std::string(e.what()).find("interrupted"), std::string::npos);
  }
  set_interrupt_check(nullptr);
  EXPECT_EQ(g_polls.load(), 1);
  // Without a check the same call runs to the end.
  t.poison();
  t.run();
  ref::CheckOptions co;
  co.max_rows = 64;
  EXPECT_REF_OK(ref::check(t.problem(), t.out.ref, &t.lse.ref, co));
}

}  // namespace
}  // namespace hipflash::test
