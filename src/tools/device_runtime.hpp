// hipflash — the device runtime for the programs (hipflash-run, hipflash-bench). They are plain
// C++ and, built with a GPU backend (HIPFLASH_WITH_CUDA / HIPFLASH_WITH_HIP, set by
// hipflash_add_program), call the CUDA or HIP runtime directly: HF_RT(Malloc) is cudaMalloc or
// hipMalloc. Without one, HF_RT is undefined and the programs run the CPU backend only.
#pragma once

#include <cstdio>
#include <string>

#include "hipflash/errors.hpp"

#if defined(HIPFLASH_WITH_CUDA)
#include <cuda_runtime.h>
#define HF_RT(name) cuda##name
using DeviceProp = cudaDeviceProp;
#elif defined(HIPFLASH_WITH_HIP)
#include <hip/hip_runtime.h>
#define HF_RT(name) hip##name
using DeviceProp = hipDeviceProp_t;
#endif  // HIPFLASH_WITH_CUDA / HIPFLASH_WITH_HIP

#if defined(HF_RT)
/// Throws hipflash::runtime_error naming `what` when a runtime call failed.
inline void rt_check(HF_RT(Error_t) e, const char* what) {
  if (e != HF_RT(Success))
    throw hipflash::runtime_error(std::string(what) + ": " + HF_RT(GetErrorString)(e));
}
/// The same check where nothing may throw (destructors, cleanup): reported on stderr.
inline void rt_warn(HF_RT(Error_t) e, const char* what) noexcept {
  if (e != HF_RT(Success))
    std::fprintf(stderr, "hipflash: %s failed: %s\n", what, HF_RT(GetErrorString)(e));
}
#endif  // HF_RT
