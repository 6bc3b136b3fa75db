// hipflash — runtime value -> constexpr, in one place. Every switch ends in an error for a
// value it does not know (never a silent default).
#pragma once

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

/// Head dim -> the padded head dim of the instantiation that serves it (kernels are built for
/// 64, 128 and 256; 32 runs in the 64 kernel and 96 in the 128 kernel, zero-padded).
#define HIPFLASH_HEADDIM_SWITCH(d, NAME, ...)                                                 \
  [&] {                                                                                       \
    if ((d) == 32 || (d) == 64) {                                                             \
      constexpr int NAME = 64;                                                                \
      return __VA_ARGS__();                                                                   \
    } else if ((d) == 96 || (d) == 128) {                                                     \
      constexpr int NAME = 128;                                                               \
      return __VA_ARGS__();                                                                   \
    } else if ((d) == 256) {                                                                  \
      constexpr int NAME = 256;                                                               \
      return __VA_ARGS__();                                                                   \
    }                                                                                         \
    throw ::hipflash::invalid_argument(::hipflash::detail::concat(                            \
        "head dim ", (d), " is not supported; supported head dims are 32, 64, 96, 128, 256")); \
  }()

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
