// Hostile numeric inputs (SPEC §3), shared by the CPU and GPU suites: one NaN planted in q, k
// or v, and tied scores of huge magnitude. The expected result is always the fp64 reference's:
// NaN exactly where it has NaN, the usual tolerance elsewhere.
#pragma once

#include <vector>

#include "test_util.hpp"

namespace hipflash::test {

/// Which input gets the NaN: one query row (all of it), one key row, or one element of v.
enum class NanAt { q, k, v };

struct NanCase {
  Case c;
  NanAt at;

  std::string name() const {
    return c.name() + (at == NanAt::q ? "_nanq" : at == NanAt::k ? "_nank" : "_nanv");
  }
  friend std::ostream& operator<<(std::ostream& os, const NanCase& n) { return os << n.name(); }
};

/// The grid: every kernel family's shapes (prefill blocks, decode rows with GQA packing), masks
/// that hide the planted key from some rows, and split counts 1, 2, 3 and 0 (heuristic).
/// NaN in v is planted only without masks: on the GPU a masked key's v still enters the
/// tensor-core product as 0 * NaN (documented in docs/spec.md), so only unmasked v is exact.
inline std::vector<NanCase> nan_cases() {
  std::vector<NanCase> cases;
  const Case shapes[] = {
      {DType::bf16, 1, 97, 300, 2, 1, 64},    // prefill, GQA 2:1
      {DType::f16, 2, 70, 129, 2, 2, 128},    // prefill, keys ending inside a block
      {DType::bf16, 2, 1, 1000, 8, 2, 128},   // decode, GQA packed
      {DType::bf16, 1, 3, 700, 1, 1, 256},    // short rows, widest head
  };
  for (const Case& shape : shapes)
    for (bool causal : {false, true})
      for (int splits : {1, 2, 3, 0})
        for (NanAt at : {NanAt::q, NanAt::k, NanAt::v}) {
          if (at == NanAt::v && causal) continue;
          Case c = shape;
          c.causal = causal;
          c.splits = splits;
          cases.push_back({c, at});
        }
  return cases;
}

/// The dense problem of a NanCase: random inputs with one NaN planted in the middle.
inline Dense make_nan_problem(const NanCase& n, uint32_t seed = 3) {
  Dense t = make_dense(n.c, seed);
  const int64_t b = n.c.b - 1, D = n.c.d;
  auto plant = [&](HostTensor& x, int64_t row, int64_t head, int64_t d0, int64_t d1) {
    for (int64_t d = d0; d < d1; ++d)
      x.set_raw(x.base() + b * x.ref.strides[0] + row * x.ref.strides[1] +
                    head * x.ref.strides[2] + d,
                kNaN);
  };
  switch (n.at) {
    case NanAt::q: plant(t.q, n.c.sq / 2, n.c.hq - 1, 0, D); break;
    case NanAt::k: plant(t.k, n.c.sk / 2, n.c.hkv - 1, D / 3, D / 3 + 1); break;
    case NanAt::v: plant(t.v, n.c.sk / 2, n.c.hkv - 1, 5, 6); break;
  }
  return t;
}

/// Tied scores of huge magnitude: q = k = 1e4 (bf16 9984) everywhere, so every valid key has
/// the same score, ~6e7 * scale: out must be the plain mean of the valid keys' v, whatever the
/// split count (an fp32 LSE per split would weigh the splits equally instead).
inline Dense make_tied_problem(const Case& c) {
  Dense t = make_dense(c, 11);
  t.q.for_each_offset([&](int64_t off) { t.q.set_raw(off, 1e4f); });
  t.k.for_each_offset([&](int64_t off) { t.k.set_raw(off, 1e4f); });
  return t;
}

inline ref::CheckResult check_nan(const Dense& t) {
  ref::CheckOptions co;
  co.nan_inputs = true;
  return ref::check(t.problem(), t.out.ref, t.opts.return_lse ? &t.lse.ref : nullptr, co);
}

}  // namespace hipflash::test
