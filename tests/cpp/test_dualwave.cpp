// The gfx950 dualwave schedule, executed on the CPU: its portable half (kernels/gfx950/
// dualwave_schedule.hpp — the 256-row blocks, the key blocks each 32-row wave visits, the
// masks, the lazy rescale, the split partials and the LSE writer through FwdParams' indices) run
// with scalar arithmetic where the kernel has MFMAs, against the fp64 reference of SPEC §3.
// There is no AMD GPU: this is what executes the schedule's logic; the gfx950 instruction paths
// are compile-checked (scripts/compile-check amd-clang22).
#include <cmath>

#include "backend.hpp"
#include "gfx950/dualwave_schedule.hpp"
#include "hostile_cases.hpp"

namespace hipflash::test {
namespace {

using gfx950::DualwaveTile;
using gfx950::Info;
using gfx950::WaveWalk;
using detail::SoftmaxState;

/// What the emulation saw, for the tests that check the schedule's shortcuts.
struct Stats {
  int64_t wave_blocks = 0;     ///< (wave, key block) pairs computed
  int64_t wave_skipped = 0;    ///< pairs of a block's range that a wave skipped
  int64_t rescales = 0;        ///< (wave, key block) pairs that rescaled the accumulator
};

/// One thread block of the dualwave kernel (linear index `linear`), as the kernel computes it.
template <int kHD>
void run_block(const FwdParams& p, int64_t linear, int num_m_blocks, bool masked, Stats& st) {
  using Cfg = DualwaveTile<kHD>;
  const Info bi(p, linear, num_m_blocks, masked);
  const int64_t m0 = int64_t(bi.m_block) * Cfg::kBlockM;
  const bool split = p.num_splits > 1;
  // common::write_padded_lse_tail: the padded varlen LSE rows of this block are -inf.
  auto padded_lse_tail = [&] {
    if (p.return_lse && !split && p.cu_seqlens_q && p.lse_layout == LseLayout::padded)
      for (int64_t row = m0; row < m0 + Cfg::kBlockM && row < p.seqlen_q; ++row)
        if (row >= bi.len_q) p.lse[p.lse_offset(bi.b, bi.h, 0, row)] = detail::kNegInf;
  };
  if (m0 >= bi.len_q) return padded_lse_tail();
  const int D = int(p.head_dim);
  auto elem = [&](const void* base, int64_t off) { return detail::load_as_float(base, off, p.dtype); };
  const int64_t q0 = bi.b * p.q_batch_stride + bi.q_start * p.q_row_stride + bi.h * p.q_head_stride;
  const int64_t k0 = bi.b * p.k_batch_stride + bi.k_start * p.k_row_stride + bi.h_kv * p.k_head_stride;
  const int64_t v0 = bi.b * p.v_batch_stride + bi.k_start * p.v_row_stride + bi.h_kv * p.v_head_stride;
  const float scale_log2 = p.softmax_scale * detail::kLog2e;

  for (int wave = 0; wave < Cfg::kWaves; ++wave) {
    const WaveWalk walk = WaveWalk::of(p, bi, m0, wave, masked);
    const int rows = int(walk.r1 - walk.r0);
    if (rows <= 0) continue;
    std::vector<float> m(size_t(rows), detail::kNegInf), l(size_t(rows), 0.f);
    std::vector<float> acc(size_t(rows) * D, 0.f);
    // The block walks its key blocks last to first; the wave computes the ones it visits.
    for (int n = bi.n_block_max - 1; n >= bi.n_block_min; --n) {
      if (!walk.visits(n)) {
        ++st.wave_skipped;
        continue;
      }
      ++st.wave_blocks;
      const bool mask = walk.needs_mask(p, bi, n, masked);
      const int64_t n0 = int64_t(n) * Cfg::kBlockN;
      std::vector<float> s(size_t(rows) * Cfg::kBlockN);
      std::vector<gfx950::LazyMax> lazy(static_cast<size_t>(rows));
      bool any_grew = false;
      for (int r = 0; r < rows; ++r) {
        const int64_t i = walk.r0 + r;
        float mx = detail::kNegInf;
        for (int c = 0; c < Cfg::kBlockN; ++c) {
          const int64_t j = n0 + c;
          float dot = 0.f;  // keys past len_k are zero rows in LDS, and masked below
          if (j < bi.len_k)
            for (int d = 0; d < D; ++d)
              dot += elem(p.q, q0 + i * p.q_row_stride + d) * elem(p.k, k0 + j * p.k_row_stride + d);
          if (mask && !Info::key_valid(p, i, j, bi.len_k, bi.diag, masked)) dot = detail::kNegInf;
          s[size_t(r) * Cfg::kBlockN + c] = dot;
          mx = std::fmax(mx, dot);
        }
        lazy[size_t(r)] = gfx950::lazy_max(m[size_t(r)], mx * scale_log2);
        any_grew |= lazy[size_t(r)].grew;
      }
      if (any_grew) {  // the wave-uniform rescale of the accumulator
        ++st.rescales;
        for (int r = 0; r < rows; ++r) {
          l[size_t(r)] *= lazy[size_t(r)].scale;
          for (int d = 0; d < D; ++d) acc[size_t(r) * D + d] *= lazy[size_t(r)].scale;
        }
      }
      for (int r = 0; r < rows; ++r) {
        m[size_t(r)] = lazy[size_t(r)].m;
        const float m_use = SoftmaxState::safe_max(m[size_t(r)]);
        for (int c = 0; c < Cfg::kBlockN; ++c) {
          const int64_t j = n0 + c;
          const float pj = std::exp2(std::fma(s[size_t(r) * Cfg::kBlockN + c], scale_log2, -m_use));
          l[size_t(r)] += pj;
          if (j >= bi.len_k) continue;  // the zero rows of the LDS tile add nothing
          const float pr = float(ref::round_to(pj, p.dtype));  // P enters the MFMA in the input dtype
          for (int d = 0; d < D; ++d) acc[size_t(r) * D + d] += pr * elem(p.v, v0 + j * p.v_row_stride + d);
        }
      }
    }
    // Epilogue: the split's partial (out / l, state) or the rounded output and the LSE.
    for (int r = 0; r < rows; ++r) {
      const int64_t i = walk.r0 + r;
      const float inv = SoftmaxState::inv_sum(l[size_t(r)]);
      if (split) {
        const int64_t prow = p.partial_row(bi.split, bi.b, bi.h, i);
        for (int d = 0; d < kHD; ++d)
          p.out_partial[prow * kHD + d] = d < D ? acc[size_t(r) * D + d] * inv : 0.f;
        p.state_partial[prow] = SoftmaxState{m[size_t(r)], l[size_t(r)]};
      } else {
        const int64_t o0 = bi.b * p.o_batch_stride + bi.q_start * p.o_row_stride + bi.h * p.o_head_stride;
        for (int d = 0; d < D; ++d)
          detail::store_from_float(p.out, o0 + i * p.o_row_stride + d, acc[size_t(r) * D + d] * inv, p.dtype);
        if (p.return_lse) p.lse[p.lse_offset(bi.b, bi.h, bi.q_start, i)] = SoftmaxState::lse_of(m[size_t(r)], l[size_t(r)]);
      }
    }
  }
  padded_lse_tail();
}

/// The combine kernel's math over the emulated partials (kernels/combine/combine_kernel.hpp).
template <int kHD>
void combine(const FwdParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    int64_t q_start = 0, len_q = p.seqlen_q;
    if (p.cu_seqlens_q) q_start = p.cu_seqlens_q[b], len_q = p.cu_seqlens_q[b + 1] - q_start;
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (int64_t row = 0; row < p.seqlen_q; ++row) {
        if (row >= len_q) {
          if (p.return_lse && p.lse_layout == LseLayout::padded) p.lse[p.lse_offset(b, h, 0, row)] = detail::kNegInf;
          continue;
        }
        SoftmaxState total;
        for (int s = 0; s < p.num_splits; ++s) total.merge(p.state_partial[p.partial_row(s, b, h, row)]);
        std::vector<float> out(kHD, 0.f);
        for (int s = 0; s < p.num_splits; ++s) {
          const int64_t prow = p.partial_row(s, b, h, row);
          if (!p.state_partial[prow].live()) continue;
          const float w = detail::combine_weight(p.state_partial[prow], total);
          for (int d = 0; d < kHD; ++d) out[size_t(d)] += w * p.out_partial[prow * kHD + d];
        }
        const int64_t o0 = b * p.o_batch_stride + (q_start + row) * p.o_row_stride + h * p.o_head_stride;
        for (int d = 0; d < p.head_dim; ++d) detail::store_from_float(p.out, o0 + d, out[size_t(d)], p.dtype);
        if (p.return_lse) p.lse[p.lse_offset(b, h, q_start, row)] = total.lse();
      }
  }
}

/// The whole dualwave launch on the CPU: every block, then the combine when split.
Stats emulate(FwdParams p, int splits) {
  Stats st;
  const int hd = padded_head_dim(int(p.head_dim));
  if (p.batch == 0 || p.seqlen_q == 0) return st;
  const int key_blocks = int((p.seqlen_k + 63) / 64);
  p.num_splits = std::max(1, std::min(splits, std::max(key_blocks, 1)));
  std::vector<float> out_partial, state_words;
  if (p.num_splits > 1) {
    const size_t rows = size_t(p.num_splits) * size_t(p.batch * p.heads_q * p.seqlen_q);
    out_partial.assign(rows * size_t(hd), std::nanf(""));  // poisoned: every read row is written
    state_words.assign(rows * 2, std::nanf(""));
    p.out_partial = out_partial.data();
    p.state_partial = reinterpret_cast<SoftmaxState*>(state_words.data());
  }
  const int num_m_blocks = int((p.seqlen_q + 255) / 256);
  const int64_t blocks = int64_t(num_m_blocks) * p.num_splits * p.heads_q * p.batch;
  for (int64_t linear = 0; linear < blocks; ++linear) {
    if (hd == 64) run_block<64>(p, linear, num_m_blocks, p.has_window(), st);
    else run_block<128>(p, linear, num_m_blocks, p.has_window(), st);
  }
  if (p.num_splits > 1) {
    if (hd == 64) combine<64>(p);
    else combine<128>(p);
  }
  return st;
}

Stats emulate(Dense& t, int splits) {
  return emulate(make_dense_params(t.q.ref, t.k.ref, t.v.ref, t.out.ref,
                                   t.opts.return_lse ? &t.lse.ref : nullptr, t.opts),
                 splits);
}

Stats emulate(Varlen& t, int splits) {
  return emulate(make_varlen_params(t.q.ref, t.k.ref, t.v.ref, t.out.ref,
                                    t.opts.return_lse ? &t.lse.ref : nullptr, t.cu_q.ref,
                                    t.cu_k.ref, t.opts, nullptr),
                 splits);
}

// ---- The grid ----------------------------------------------------------------------------------

class Dualwave : public ::testing::TestWithParam<Case> {};

TEST_P(Dualwave, MatchesReference) {
  const Case& c = GetParam();
  Dense t = make_dense(c, 21);
  emulate(t, c.splits);
  ref::CheckOptions co;
  co.max_rows = 600;
  EXPECT_REF_OK(ref::check(t.problem(), t.out.ref, &t.lse.ref, co));
}

std::vector<Case> grid() {
  std::vector<Case> v;
  // Rows that end inside a wave and inside a 256-row block, keys inside a 64-key block;
  // cross-attention both ways; GQA; head dims 32/64 (tile 64) and 96/128 (tile 128).
  for (DType dt : {DType::bf16, DType::f16})
    for (int64_t d : {64, 128}) {
      v.push_back({dt, 1, 300, 300, 2, 1, d, false, -1, -1, 1});
      v.push_back({dt, 1, 300, 300, 2, 1, d, true, -1, -1, 1});
    }
  v.push_back({DType::bf16, 2, 513, 130, 4, 2, 96, true, -1, -1, 1});    // Sq > Sk: empty rows
  v.push_back({DType::bf16, 1, 77, 700, 2, 2, 32, true, -1, -1, 1});     // Sq < Sk
  v.push_back({DType::f16, 1, 600, 600, 1, 1, 64, false, 100, 20, 1});   // sliding window
  v.push_back({DType::bf16, 1, 600, 600, 1, 1, 128, true, 64, -1, 1});   // causal + left window
  v.push_back({DType::bf16, 1, 260, 900, 2, 1, 128, false, -1, -1, 3});  // split-K
  v.push_back({DType::bf16, 1, 260, 900, 2, 1, 64, true, -1, -1, 2});    // split-K, causal
  v.push_back({DType::f16, 1, 5, 2000, 8, 2, 128, false, -1, -1, 7});    // decode-like, split
  v.push_back({DType::bf16, 1, 1, 1, 1, 1, 64, false, -1, -1, 1});       // one row, one key
  return v;
}

INSTANTIATE_TEST_SUITE_P(Grid, Dualwave, ::testing::ValuesIn(grid()),
                         [](const auto& info) { return info.param.name(); });

TEST(DualwaveVarlen, BothLseLayoutsAndEmptySequences) {
  for (LseLayout layout : {LseLayout::padded, LseLayout::packed})
    for (bool causal : {false, true})
      for (int splits : {1, 3}) {
        Varlen t(DType::bf16, {3, 0, 290, 40}, {5, 7, 290, 0}, 4, 2, 64, layout, 8);
        t.opts.causal = causal;
        emulate(t, splits);
        EXPECT_REF_OK(t.check()) << "layout " << int(layout) << " causal " << causal << " splits " << splits;
      }
}

TEST(DualwaveNan, ReachesExactlyWhatTheReferenceReaches) {
  for (const NanCase& n : nan_cases()) {
    if (n.c.d == 256) continue;  // not a dualwave head dim
    Dense t = make_nan_problem(n);
    emulate(t, n.c.splits == 0 ? 2 : n.c.splits);
    EXPECT_REF_OK(check_nan(t)) << n;
  }
}

TEST(DualwaveTiedScores, SplitsAreWeightedByTheirKeyCounts) {
  for (int splits : {1, 2, 3}) {
    Dense t = make_tied_problem({DType::bf16, 1, 4, 300, 2, 1, 64, false, -1, -1, splits});
    emulate(t, splits);
    EXPECT_REF_OK(t.check()) << "splits " << splits;
  }
}

TEST(DualwaveSchedule, WavesSkipWhatTheirRowsCannotSee) {
  // Causal 1024 x 1024: in each 256-row block the first waves see fewer key blocks than the
  // last (waves 0-1 skip three of the block's key blocks, 2-3 two, 4-5 one).
  Dense t = make_dense({DType::bf16, 1, 1024, 1024, 1, 1, 64, true, -1, -1, 1}, 2);
  const Stats st = emulate(t, 1);
  EXPECT_EQ(st.wave_skipped, 4 * (2 * 3 + 2 * 2 + 2 * 1));
  EXPECT_EQ(st.wave_blocks + st.wave_skipped, int64_t(4 + 8 + 12 + 16) * 8);  // blocks 0..3: 1..4 x 4 key blocks, x 8 waves
  ref::CheckOptions co;
  co.max_rows = 400;
  EXPECT_REF_OK(ref::check(t.problem(), t.out.ref, &t.lse.ref, co));
}

TEST(DualwaveSchedule, LazyRescaleSkipsMostAccumulatorRescales) {
  // Random inputs: after a wave's first key blocks its row maxima rarely grow by 2^8 more, so
  // most key blocks leave the accumulator alone.
  Dense t = make_dense({DType::bf16, 1, 256, 4096, 1, 1, 128, false, -1, -1, 1}, 3);
  const Stats st = emulate(t, 1);
  EXPECT_EQ(st.wave_blocks, 8 * 64);
  EXPECT_LE(st.rescales, st.wave_blocks / 8) << "rescales " << st.rescales;
  ref::CheckOptions co;
  co.max_rows = 64;
  EXPECT_REF_OK(ref::check(t.problem(), t.out.ref, &t.lse.ref, co));
}

TEST(DualwaveSchedule, LazyMaxRule) {
  using gfx950::lazy_max;
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(lazy_max(-inf, 3.f).grew);        // the first valid key
  EXPECT_EQ(lazy_max(-inf, 3.f).scale, 0.f);    // nothing to keep
  EXPECT_FALSE(lazy_max(-inf, -inf).grew);      // still no valid key
  EXPECT_FALSE(lazy_max(10.f, 18.f).grew);      // within the threshold: m stays
  EXPECT_EQ(lazy_max(10.f, 18.f).m, 10.f);
  EXPECT_TRUE(lazy_max(10.f, 18.5f).grew);      // past it
  EXPECT_FLOAT_EQ(lazy_max(10.f, 18.5f).scale, std::exp2(-8.5f));
  EXPECT_FALSE(lazy_max(10.f, 2.f).grew);       // a smaller max never moves m
}

}  // namespace
}  // namespace hipflash::test
