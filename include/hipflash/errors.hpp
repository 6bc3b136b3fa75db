// hipflash — typed errors (SPEC §4).
//
// Every check of the public API throws one of these before anything is launched or written.
// The Python binding maps them: invalid_argument -> ValueError, dtype_error -> TypeError,
// not_implemented -> NotImplementedError, runtime_error -> RuntimeError,
// interrupted -> KeyboardInterrupt.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace hipflash {

/// A bad argument: wrong rank, shapes that disagree, a buffer too small, a bad cu_seqlens...
struct invalid_argument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// A bad dtype (not bf16/f16, q/k/v differing, lse not fp32). An invalid_argument in C++,
/// a TypeError in Python.
struct dtype_error : invalid_argument {
  using invalid_argument::invalid_argument;
};

/// A valid request that this build or backend does not implement.
struct not_implemented : std::logic_error {
  using std::logic_error::logic_error;
};

/// A device fault or launch error, carrying the device runtime's message.
struct runtime_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A long call stopped because the interrupt check (set_interrupt_check) asked it to; its
/// outputs are partly written.
struct interrupted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

}  // namespace hipflash

/// Throws `Error` with the streamed message when `cond` is false:
///   HIPFLASH_CHECK_AS(invalid_argument, hq % hkv == 0, "k heads (", hkv, ") must divide ...");
#define HIPFLASH_CHECK_AS(Error, cond, ...)                                  \
  do {                                                                       \
    if (!(cond)) throw ::hipflash::Error(::hipflash::detail::concat(__VA_ARGS__)); \
  } while (0)

/// The common case: an invalid_argument.
#define HIPFLASH_CHECK(cond, ...) HIPFLASH_CHECK_AS(invalid_argument, cond, __VA_ARGS__)
