// hipflash — what the launcher proves about a TensorRef's memory before it writes anything
// (SPEC §2, §4): that every element can be indexed in 64 bits, and which views share bytes.
//
// Overlap is decided element-exactly, not by byte ranges: `out` in the even heads and q in the
// odd heads of one buffer are disjoint although their ranges interleave. The question "is there
// an index of a and one of b whose elements share a byte" is a bounded integer program; a
// depth-first search over the dimensions, largest stride first, settles it in a few steps for
// every real layout (nested strides leave one or two candidates per dimension). A search that
// would exceed its step budget answers `unknown`, which the launcher treats as an overlap.
#pragma once

#include <cstdint>
#include <string>

#include "hipflash/types.hpp"

namespace hipflash::detail {

/// "[2, 5, 7, 64]": a TensorRef's sizes, for error messages.
std::string shape_str(const TensorRef& t);

/// invalid_argument unless `t`'s location is a kind the launchers know (cpu or gpu): an
/// unknown kind is never run on either side.
void check_known_location(const TensorRef& t, const char* name);

/// Whether `t`'s elements can all be addressed: rank 0 to 4, sizes >= 0, and the element count
/// and the offset of every element, in bytes, fit in int64 (no wrap-around of the address
/// either).
/// On failure, `why` says what overflows.
bool indexable(const TensorRef& t, const char** why);

enum class Overlap { none, some, unknown };

/// Whether two views share a byte (empty views share nothing).
Overlap overlap(const TensorRef& a, const TensorRef& b);

/// Whether `t`'s last dimension is contiguous (stride 1), as every kernel's vector loads need;
/// a last dimension of one element, or an empty tensor (autograd's expanded zero-size
/// gradients have stride 0), has no stride to respect. The one spelling of SPEC §4's
/// "contiguous last dimension" rule.
inline bool last_dim_contiguous(const TensorRef& t) {
  return t.rank == 0 || t.strides[t.rank - 1] == 1 || t.sizes[t.rank - 1] <= 1 || t.numel() == 0;
}

/// Whether two different indices of `t` reach the same byte (a stride-0 dimension of size > 1,
/// or strides that fold onto each other). `unknown` where it could not be proved either way.
Overlap self_overlap(const TensorRef& t);

/// Throws invalid_argument unless the output `w` shares no element with `r` (element-exact:
/// interleaved disjoint views of one buffer are fine; a layout the search cannot settle is
/// refused, never guessed).
void check_disjoint(const TensorRef& w, const char* w_name, const TensorRef& r, const char* r_name);

/// Throws invalid_argument unless the output `t` writes no element twice (an expanded, stride-0
/// view, or strides that fold onto each other).
void check_no_self_overlap(const TensorRef& t, const char* name);

}  // namespace hipflash::detail
