// hipflash — the small vocabulary types of the public API.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "hipflash/errors.hpp"

namespace hipflash {

/// e4m3: OCP FP8 E4M3 (PyTorch's float8_e4m3fn), q, k and v of an fp8 forward with descale
/// factors (FwdOptions::q_descale ...).
enum class DType : int { f16 = 0, bf16 = 1, f32 = 2, i32 = 3, e4m3 = 4 };

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f32: return "float32";
    case DType::i32: return "int32";
    case DType::e4m3: return "float8_e4m3fn";
  }
  return "unknown";
}

/// For `static_assert(unsupported_dtype<kDType>, ...)` in the last branch of an `if constexpr`
/// chain over dtypes: every element type is spelled out, none is a silent default.
template <DType>
inline constexpr bool unsupported_dtype = false;

constexpr int dtype_size(DType t) {
  return t == DType::e4m3 ? 1 : t == DType::f16 || t == DType::bf16 ? 2 : 4;
}

/// Where a buffer lives. `index` is the device ordinal for gpu, ignored for cpu.
struct Location {
  enum Kind : int { cpu = 0, gpu = 1 } kind = cpu;
  int index = 0;
  friend constexpr bool operator==(Location a, Location b) {
    return a.kind == b.kind && (a.kind == cpu || a.index == b.index);
  }
  friend constexpr bool operator!=(Location a, Location b) { return !(a == b); }
};

/// Layout of a varlen LSE buffer (SPEC §2). Dense calls always use [B, Hq, Sq].
enum class LseLayout : int {
  padded = 0,  ///< [B, Hq, max_seqlen_q]; rows past a sequence's length are -inf
  packed = 1,  ///< [Hq, total_q] (FlashAttention-2/3, PyTorch)
};

/// A non-owning strided view of a buffer: the C++ API's "tensor". Sizes and strides are in
/// elements; rank 0 to 4 (the launchers refuse any other before reading a size).
struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::f16;
  int rank = 0;
  int64_t sizes[4] = {0, 0, 0, 0};
  int64_t strides[4] = {0, 0, 0, 0};
  Location loc{};

  /// The product of the sizes (of the first four, whatever `rank` claims: nothing past the
  /// arrays is read).
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank && i < 4; ++i) n *= sizes[i];
    return n;
  }
};

/// A contiguous (row-major) TensorRef over `data`; rank <= 4 (invalid_argument otherwise).
inline TensorRef make_tensor(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                             Location loc = {}) {
  HIPFLASH_CHECK(sizes.size() <= 4, "make_tensor: a TensorRef has rank <= 4, got ",
                 sizes.size(), " sizes");
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.loc = loc;
  t.rank = static_cast<int>(sizes.size());
  int i = 0;
  for (int64_t s : sizes) t.sizes[i++] = s;
  int64_t stride = 1;  // wraps only for sizes that validation refuses (64-bit check)
  for (int d = t.rank - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride = int64_t(uint64_t(stride) * uint64_t(t.sizes[d]));
  }
  return t;
}

/// Opaque stream handle (hipStream_t / cudaStream_t); nullptr is the default stream.
using Stream = void*;

}  // namespace hipflash
