// hipflash — runtime value -> constexpr, in one place. Every switch ends in an error for a
// value it does not know (never a silent default).
#pragma once

#include <type_traits>
#include <utility>

#include "hipflash/detail/kernel_registry.hpp"
#include "hipflash/errors.hpp"
#include "hipflash/types.hpp"

/// BOOL_SWITCH(flag, kFlag, [&] { run<kFlag>(); });
#define HIPFLASH_BOOL_SWITCH(cond, NAME, ...) \
  [&] {                                       \
    if (cond) {                               \
      constexpr bool NAME = true;             \
      return __VA_ARGS__();                   \
    } else {                                  \
      constexpr bool NAME = false;            \
      return __VA_ARGS__();                   \
    }                                         \
  }()

namespace hipflash::detail {

/// Calls f(std::integral_constant<int, padded>) for the padded head dim serving `head_dim`
/// (kernels.def's list); an unsupported head dim throws invalid_argument.
template <int I = 0, class F>
auto head_dim_switch(int head_dim, F&& f)
    -> decltype(f(std::integral_constant<int, registry::kHeadDims[0].padded>{})) {
  if constexpr (I == registry::kNumHeadDims) {
    throw invalid_argument(concat("head dim ", head_dim, " is not supported; supported head dims are ",
                                  supported_head_dims()));
  } else {
    constexpr registry::HeadDim e = registry::kHeadDims[I];
    if (head_dim == e.padded || (e.also != 0 && head_dim == e.also))
      return f(std::integral_constant<int, e.padded>{});
    return head_dim_switch<I + 1>(head_dim, std::forward<F>(f));
  }
}

}  // namespace hipflash::detail

/// Head dim -> the padded head dim of the instantiations that serve it (kernels.def: 32 runs in
/// the 64 kernels and 96 in the 128 ones, zero-padded).
#define HIPFLASH_HEADDIM_SWITCH(d, NAME, ...)                      \
  ::hipflash::detail::head_dim_switch((d), [&](auto head_dim_c_) { \
    constexpr int NAME = decltype(head_dim_c_)::value;             \
    return __VA_ARGS__();                                          \
  })

/// DType -> the element type. `ELEM` names a type alias inside the lambda.
#define HIPFLASH_DTYPE_SWITCH(dt, DT, ...)                                                    \
  [&] {                                                                                       \
    if ((dt) == ::hipflash::DType::f16) {                                                     \
      constexpr ::hipflash::DType DT = ::hipflash::DType::f16;                                \
      return __VA_ARGS__();                                                                   \
    } else if ((dt) == ::hipflash::DType::bf16) {                                             \
      constexpr ::hipflash::DType DT = ::hipflash::DType::bf16;                               \
      return __VA_ARGS__();                                                                   \
    }                                                                                         \
    throw ::hipflash::dtype_error(::hipflash::detail::concat(                                 \
        "dtype ", ::hipflash::dtype_name(dt), " is not supported; expected float16 or bfloat16")); \
  }()

/// The same with float8_e4m3fn (the forward's input dtypes: fp8 q, k and v).
#define HIPFLASH_INPUT_DTYPE_SWITCH(dt, DT, ...)                                               \
  [&] {                                                                                       \
    if ((dt) == ::hipflash::DType::e4m3) {                                                    \
      constexpr ::hipflash::DType DT = ::hipflash::DType::e4m3;                               \
      return __VA_ARGS__();                                                                   \
    }                                                                                         \
    return HIPFLASH_DTYPE_SWITCH(dt, DT, __VA_ARGS__);                                        \
  }()
