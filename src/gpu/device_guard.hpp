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

/// How to launch `kKernel` after the work before it in the stream: as a programmatic dependent
/// where its code on the current device waits for that work (built from sm_90+ code: it calls
/// griddepcontrol.wait where port::wait_prerequisite_grids() is written), so that its blocks are
/// placed while that work finishes; plainly elsewhere (an sm_80 build JIT-compiled for a newer
/// GPU has no wait). Cached per device and kernel.
template <auto kKernel>
port::LaunchOptions dependent_launch() {
  static PerDeviceBit waits;
  int device = 0;
  port::check(port::get_device(&device), "querying the current device");
  port::LaunchOptions how;
  how.programmatic = waits.get(device, [] { return port::waits_for_prerequisite_grids(kKernel); });
  return how;
}

}  // namespace hipflash::gpu
