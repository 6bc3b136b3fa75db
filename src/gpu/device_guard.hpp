// hipflash — restores the calling thread's current device on scope exit (internal, GPU TUs).
#pragma once

#include <atomic>
#include <cstdint>

#include "hipflash/port/port.hpp"

namespace hipflash::gpu {

/// Makes `device` current for the scope; the previous device comes back on exit.
struct ScopedDevice {
  int prev = -1;
  explicit ScopedDevice(int device) {
    port::check(port::get_device(&prev), "querying the current device");
    if (prev != device) port::check(port::set_device(device), "selecting the device");
  }
  ~ScopedDevice() {
    int cur = -1;
    port::check_nothrow(port::get_device(&cur), "querying the current device");
    if (cur != prev) port::check_nothrow(port::set_device(prev), "restoring the previous device");
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
};

/// A property of (something, device) worked out once per device: get(device, compute) calls
/// compute() the first time for `device` and returns what it said from then on (devices >= 64
/// are not cached: compute() each time). A function attribute is per device, not per process.
class PerDeviceBit {
 public:
  template <class Compute>
  bool get(int device, Compute&& compute) {
    const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
    if (bit != 0 && (known_.load(std::memory_order_acquire) & bit) != 0)
      return (value_.load(std::memory_order_acquire) & bit) != 0;
    const bool v = compute();
    if (bit != 0) {
      if (v) value_.fetch_or(bit, std::memory_order_acq_rel);
      known_.fetch_or(bit, std::memory_order_acq_rel);
    }
    return v;
  }

 private:
  std::atomic<uint64_t> known_{0}, value_{0};
};

}  // namespace hipflash::gpu
