// hipflash — 64-bit indexability and element-exact overlap of strided views (see the header).
#include "tensor_checks.hpp"

#include "hipflash/errors.hpp"

#include <algorithm>
#include <array>
#include <cstdlib>

namespace hipflash::detail {
namespace {

bool mul_ok(int64_t a, int64_t b, int64_t* r) { return !__builtin_mul_overflow(a, b, r); }
bool add_ok(int64_t a, int64_t b, int64_t* r) { return !__builtin_add_overflow(a, b, r); }

/// One term of a sum  sum_k x_k * step_k  with x_k in [0, count_k - 1] and step_k > 0 (bytes).
struct Term {
  int64_t step, count;
};

/// The terms of one or two views (rank <= 4 each): a fixed array, no allocation per call.
struct Terms {
  std::array<Term, 8> t{};
  size_t n = 0;
  void push_back(Term x) { t[n++] = x; }
  size_t size() const { return n; }
  const Term& operator[](size_t k) const { return t[k]; }
  Term* begin() { return t.data(); }
  Term* end() { return t.data() + n; }
};

/// Depth-first search: is there an x with  lo <= sum_k x_k * step_k <= hi ? Terms sorted by
/// step, largest first; `rest[k]` is the largest sum terms k.. can reach. Every call costs one
/// unit of `budget`; at 0 the answer is "unknown".
struct Search {
  const Terms& terms;
  std::array<int64_t, 9> rest{};
  int64_t budget;

  explicit Search(const Terms& t, int64_t steps) : terms(t), budget(steps) {
    for (size_t k = t.size(); k-- > 0;) rest[k] = rest[k + 1] + (t[k].count - 1) * t[k].step;
  }

  static int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b != 0 && a < 0); }
  static int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

  Overlap run(size_t k, int64_t lo, int64_t hi) {
    if (hi < 0 || lo > rest[k]) return Overlap::none;
    if (k == terms.size()) return Overlap::some;  // lo <= 0 <= hi
    if (--budget < 0) return Overlap::unknown;
    const Term& t = terms[k];
    const int64_t x_lo = std::max<int64_t>(0, ceil_div(lo - rest[k + 1], t.step));
    const int64_t x_hi = std::min<int64_t>(t.count - 1, floor_div(hi, t.step));
    bool unknown = false;
    for (int64_t x = x_lo; x <= x_hi; ++x) {
      const Overlap o = run(k + 1, lo - x * t.step, hi - x * t.step);
      if (o == Overlap::some) return o;
      if (o == Overlap::unknown) unknown = true;
      if (budget < 0) return Overlap::unknown;
    }
    return unknown ? Overlap::unknown : Overlap::none;
  }
};

constexpr int64_t kSearchSteps = 1 << 16;

/// The terms of `t`'s addresses relative to its lowest address, and that lowest address.
/// Valid for an indexable, non-empty t.
void address_terms(const TensorRef& t, Terms& terms, int64_t& lowest) {
  const int64_t es = dtype_size(t.dtype);
  lowest = int64_t(reinterpret_cast<uintptr_t>(t.data));
  for (int d = 0; d < t.rank && d < 4; ++d) {  // (rank 0 to 4: indexable())
    if (t.sizes[d] <= 1 || t.strides[d] == 0) continue;  // stride 0 adds no address
    const int64_t step = t.strides[d] * es;
    if (step < 0) lowest += (t.sizes[d] - 1) * step;  // walk it backwards from its far end
    terms.push_back({std::abs(step), t.sizes[d]});
  }
}

}  // namespace

void check_known_location(const TensorRef& t, const char* name) {
  HIPFLASH_CHECK(t.loc.kind == Location::cpu || t.loc.kind == Location::gpu, name,
                 " has a Location of unknown kind ", int(t.loc.kind), " (cpu or gpu)");
}

std::string shape_str(const TensorRef& t) {
  if (t.rank < 0 || t.rank > 4) return "(rank " + std::to_string(t.rank) + ")";
  std::string s = "[";
  for (int i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.sizes[i]);
  return s + "]";
}

bool indexable(const TensorRef& t, const char** why) {
  const char* unused;
  if (why == nullptr) why = &unused;
  if (t.rank < 0 || t.rank > 4) return *why = "its rank is not 0 to 4", false;
  int64_t numel = 1, lo = 0, hi = 0;
  for (int d = 0; d < t.rank; ++d) {
    if (t.sizes[d] < 0) return *why = "a size is negative", false;
    if (!mul_ok(numel, t.sizes[d], &numel)) return *why = "the element count overflows int64", false;
  }
  if (numel == 0) return true;  // nothing is ever addressed
  for (int d = 0; d < t.rank; ++d) {
    int64_t ext;
    if (!mul_ok(t.sizes[d] - 1, t.strides[d], &ext) || !add_ok(ext < 0 ? lo : hi, ext, ext < 0 ? &lo : &hi))
      return *why = "the offset of its last element overflows int64", false;
  }
  const int64_t es = dtype_size(t.dtype);
  int64_t lo_b, hi_b;
  if (!mul_ok(lo, es, &lo_b) || !mul_ok(hi + 1, es, &hi_b))
    return *why = "its extent in bytes overflows int64", false;
  // (No data: nothing to wrap; the launchers then report the missing pointer.)
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  if (t.data != nullptr && (base + uintptr_t(lo_b) > base || base + uintptr_t(hi_b) < base))
    return *why = "its elements wrap around the address space", false;
  return true;
}

Overlap overlap(const TensorRef& a, const TensorRef& b) {
  // The callers check indexability first; a view that is not indexable proves nothing.
  if (!indexable(a, nullptr) || !indexable(b, nullptr)) return Overlap::unknown;
  if (a.numel() == 0 || b.numel() == 0 || a.data == nullptr || b.data == nullptr)
    return Overlap::none;
  // addr_a(x) - addr_b(y) in (-es_a, es_b)  <=>  the elements share a byte. With
  // y' = count - 1 - y the b terms enter positively:  sum x*step_a + sum y'*step_b  must lie in
  // [lo_b - lo_a + rest_b - es_a + 1, lo_b - lo_a + rest_b + es_b - 1].
  Terms terms;
  int64_t lowest_a, lowest_b;
  address_terms(a, terms, lowest_a);
  const size_t na = terms.size();
  address_terms(b, terms, lowest_b);
  int64_t rest_b = 0;
  for (size_t k = na; k < terms.size(); ++k) rest_b += (terms[k].count - 1) * terms[k].step;
  const int64_t center = lowest_b - lowest_a + rest_b;
  const int64_t lo = center - dtype_size(a.dtype) + 1, hi = center + dtype_size(b.dtype) - 1;
  std::sort(terms.begin(), terms.end(), [](const Term& x, const Term& y) { return x.step > y.step; });
  return Search(terms, kSearchSteps).run(0, lo, hi);
}

Overlap self_overlap(const TensorRef& t) {
  if (!indexable(t, nullptr)) return Overlap::unknown;  // (the callers check it first)
  if (t.numel() <= 1) return Overlap::none;
  for (int d = 0; d < t.rank; ++d)
    if (t.sizes[d] > 1 && t.strides[d] == 0) return Overlap::some;
  // Sorted by |stride|, each dimension stepping past everything the smaller ones reach proves
  // the map one-to-one; the layouts that fail that test are refused as "unknown".
  Terms terms;
  int64_t lowest;
  address_terms(t, terms, lowest);
  std::sort(terms.begin(), terms.end(), [](const Term& x, const Term& y) { return x.step < y.step; });
  int64_t reach = dtype_size(t.dtype);  // bytes covered by the smaller dimensions
  for (const Term& term : terms) {
    if (term.step < reach) return Overlap::unknown;
    reach += (term.count - 1) * term.step;
  }
  return Overlap::none;
}

void check_disjoint(const TensorRef& w, const char* w_name, const TensorRef& r, const char* r_name) {
  const Overlap o = overlap(w, r);
  HIPFLASH_CHECK(o == Overlap::none, w_name, " must not alias ", r_name,
                 o == Overlap::some ? " (they share elements)"
                                    : " (their strides interleave in a way hipflash cannot prove "
                                      "disjoint; pass separate buffers)");
}

void check_no_self_overlap(const TensorRef& t, const char* name) {
  const Overlap o = self_overlap(t);
  if (o == Overlap::none) return;
  std::string strides = "[";
  for (int i = 0; i < t.rank && i < 4; ++i)
    strides += (i ? ", " : "") + std::to_string(t.strides[i]);
  HIPFLASH_CHECK(false, name, " must not overlap itself (", shape_str(t), " with strides ",
                 strides, "]", o == Overlap::some ? " maps two indices to one element)"
                                                  : " may map two indices to one element)");
}

}  // namespace hipflash::detail
