// hipflash — restores the calling thread's current device on scope exit (internal, GPU TUs).
#pragma once

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
    if (port::get_device(&cur) == port::kSuccess && cur != prev) (void)port::set_device(prev);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
};

}  // namespace hipflash::gpu
