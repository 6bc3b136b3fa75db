// hipflash — the one portability layer. The rest of the code speaks the project's own names
// (hipflash::port::*, HIPFLASH_* macros); this header maps them to HIP on AMD
// (<hip/hip_runtime.h>, compiled by hipcc) or to the CUDA runtime on NVIDIA (nvcc).
// No vendor symbol is redefined.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include "hipflash/errors.hpp"

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#if __has_include(<hip/hip_bf16.h>)
#include <hip/hip_bf16.h>  // ROCm >= 5.7: __hip_bfloat16
#define HIPFLASH_HIP_BF16_NEW 1
#else
#include <hip/hip_bfloat16.h>  // older ROCm (Debian's HIP 5.2): hip_bfloat16
#endif
#define HIPFLASH_PLATFORM_AMD 1
#elif defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define HIPFLASH_PLATFORM_NVIDIA 1
#else
#error "hipflash/port/port.hpp is for device translation units (hipcc or nvcc)"
#endif  // platform

// ---- Device-arch feature macros (meaningful inside device code) -----------------------------
#if defined(HIPFLASH_PLATFORM_NVIDIA) && defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
#define HIPFLASH_HAS_MMA_SYNC 1  // mma.sync m16n8k16 bf16/f16, ldmatrix, cp.async
#endif
#if __CUDA_ARCH__ >= 900
#define HIPFLASH_HAS_SM90_CONTROL 1  // griddepcontrol
#endif
#if __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HIPFLASH_HAS_WGMMA 1  // sm_90a: wgmma, setmaxnreg
#endif
#endif  // NVIDIA device

#if defined(HIPFLASH_PLATFORM_AMD) && defined(__HIP_DEVICE_COMPILE__)
#if defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || \
    defined(__gfx950__)
#define HIPFLASH_HAS_MFMA 1  // v_mfma_f32_16x16x16{bf16_1k,f16}
#endif
#if defined(__gfx950__)
#define HIPFLASH_IS_GFX950 1
#endif
#endif  // AMD device

/// Kernel parameters passed by value and never written: __grid_constant__ where it exists.
#if defined(HIPFLASH_PLATFORM_NVIDIA)
#define HIPFLASH_GRID_CONSTANT __grid_constant__
#else
#define HIPFLASH_GRID_CONSTANT
#endif

namespace hipflash::port {

#if defined(HIPFLASH_PLATFORM_AMD)
using stream_t = hipStream_t;
using error_t = hipError_t;
inline constexpr error_t kSuccess = hipSuccess;
inline const char* error_string(error_t e) { return hipGetErrorString(e); }
inline error_t get_last_error() { return hipGetLastError(); }
inline error_t get_device(int* d) { return hipGetDevice(d); }
inline error_t set_device(int d) { return hipSetDevice(d); }
inline error_t device_count(int* n) { return hipGetDeviceCount(n); }
inline error_t malloc_async(void** p, size_t n, stream_t s) { return hipMallocAsync(p, n, s); }
inline error_t free_async(void* p, stream_t s) { return hipFreeAsync(p, s); }
inline error_t memcpy_d2h(void* dst, const void* src, size_t n, stream_t s) {
  error_t e = hipMemcpyAsync(dst, src, n, hipMemcpyDeviceToHost, s);
  return e == hipSuccess ? hipStreamSynchronize(s) : e;
}
inline error_t stream_synchronize(stream_t s) { return hipStreamSynchronize(s); }
inline bool stream_capturing(stream_t s) {
  hipStreamCaptureStatus st = hipStreamCaptureStatusNone;
  return hipStreamIsCapturing(s, &st) == hipSuccess && st != hipStreamCaptureStatusNone;
}
/// Device pointer -> device ordinal; -1 for host memory.
inline int pointer_device(const void* p) {
  hipPointerAttribute_t a{};
  if (hipPointerGetAttributes(&a, p) != hipSuccess) {
    (void)hipGetLastError();
    return -1;
  }
  return a.memoryType == hipMemoryTypeDevice ? a.device : -1;
}
template <class Kernel>
inline error_t set_max_dynamic_smem(Kernel k, int bytes) {
  return hipFuncSetAttribute(reinterpret_cast<const void*>(k),
                             hipFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
#else
using stream_t = cudaStream_t;
using error_t = cudaError_t;
inline constexpr error_t kSuccess = cudaSuccess;
inline const char* error_string(error_t e) { return cudaGetErrorString(e); }
inline error_t get_last_error() { return cudaGetLastError(); }
inline error_t get_device(int* d) { return cudaGetDevice(d); }
inline error_t set_device(int d) { return cudaSetDevice(d); }
inline error_t device_count(int* n) { return cudaGetDeviceCount(n); }
inline error_t malloc_async(void** p, size_t n, stream_t s) { return cudaMallocAsync(p, n, s); }
inline error_t free_async(void* p, stream_t s) { return cudaFreeAsync(p, s); }
inline error_t memcpy_d2h(void* dst, const void* src, size_t n, stream_t s) {
  error_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s);
  return e == cudaSuccess ? cudaStreamSynchronize(s) : e;
}
inline error_t stream_synchronize(stream_t s) { return cudaStreamSynchronize(s); }
inline bool stream_capturing(stream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
}
inline int pointer_device(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}
template <class Kernel>
inline error_t set_max_dynamic_smem(Kernel k, int bytes) {
  return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
#endif  // HIPFLASH_PLATFORM_AMD

// ---- 16-bit element types ---------------------------------------------------------------------
#if defined(HIPFLASH_PLATFORM_AMD) && defined(HIPFLASH_HIP_BF16_NEW)
using bf16_t = __hip_bfloat16;
#elif defined(HIPFLASH_PLATFORM_AMD)
using bf16_t = hip_bfloat16;
#else
using bf16_t = __nv_bfloat16;
#endif  // bf16_t
using f16_t = __half;

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
#if defined(HIPFLASH_PLATFORM_AMD) && defined(HIPFLASH_HIP_BF16_NEW)
  return __float2bfloat16(x);
#elif defined(HIPFLASH_PLATFORM_AMD)
  return hip_bfloat16(x);  // round to nearest even
#else
  return __float2bfloat16_rn(x);
#endif
}
template <>
__device__ __forceinline__ f16_t from_float<f16_t>(float x) { return __float2half_rn(x); }

/// Throws hipflash::runtime_error carrying the device runtime's message.
inline void check(error_t e, const char* what) {
  if (e != kSuccess) {
    throw ::hipflash::runtime_error(std::string(what) + ": " + error_string(e));
  }
}
/// The same where nothing may throw (destructors: a scratch buffer's free, the previous
/// device restored): the failure is reported on stderr, never dropped.
inline void check_nothrow(error_t e, const char* what) noexcept {
  if (e != kSuccess) std::fprintf(stderr, "hipflash: %s failed: %s\n", what, error_string(e));
}

/// Wave/warp size of the compilation target, as a constexpr. Host code on AMD gets 64 (every
/// CDNA target hipflash builds for, gfx90a/gfx94x/gfx950, runs wave64).
#if defined(HIPFLASH_PLATFORM_AMD)
#if defined(__AMDGCN_WAVEFRONT_SIZE)
inline constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
#else
inline constexpr int kWarpSize = 64;
#endif
#else
inline constexpr int kWarpSize = 32;
#endif  // warp size
__host__ __device__ constexpr int warp_size() { return kWarpSize; }

// ---- Warp-level primitives ------------------------------------------------------------------
#if defined(HIPFLASH_PLATFORM_AMD)
/// Butterfly exchange within the wave. HIP has no lane-mask form: all lanes take part.
template <class T>
__device__ __forceinline__ T shfl_xor(T v, int lane_mask) { return __shfl_xor(v, lane_mask); }
template <class T>
__device__ __forceinline__ T shfl(T v, int src_lane) { return __shfl(v, src_lane); }
/// True on every lane when `pred` holds on every lane of the wave (a warp-uniform branch).
__device__ __forceinline__ bool all_lanes(bool pred) { return __all(pred); }
#else
template <class T>
__device__ __forceinline__ T shfl_xor(T v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
template <class T>
__device__ __forceinline__ T shfl(T v, int src_lane) {
  return __shfl_sync(0xffffffffu, v, src_lane);
}
/// True on every lane when `pred` holds on every lane of the warp (a warp-uniform branch).
__device__ __forceinline__ bool all_lanes(bool pred) { return __all_sync(0xffffffffu, pred); }
#endif  // shuffles

// ---- Programmatic dependent launch (NVIDIA sm_90+) ------------------------------------------
// A kernel launched with launch_kernel and LaunchOptions::programmatic may start while the work
// before it in the stream is still running: it must call wait_prerequisite_grids() before it
// reads or writes memory that work touches. A kernel in front of it may call
// allow_dependent_launch() so that the dependent's blocks are placed as soon as all of its own
// blocks have started (without it, when they have all exited). Both are no-ops on other
// targets, where the launch is plain.

/// Waits until the grids this one depends on have completed and their writes are visible.
__device__ __forceinline__ void wait_prerequisite_grids() {
#if defined(HIPFLASH_HAS_SM90_CONTROL)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Lets the grid launched programmatically after this one start (its blocks then wait).
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(HIPFLASH_HAS_SM90_CONTROL)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// The sm version of the code `kernel` runs on the current device: min(PTX, machine code), so
/// that PTX JIT-compiled for a newer GPU counts as the PTX's arch; 0 where unknown (AMD).
template <class... Params>
inline int code_version(void (*kernel)(Params...)) {
#if defined(HIPFLASH_PLATFORM_NVIDIA)
  cudaFuncAttributes a{};
  if (cudaFuncGetAttributes(&a, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return a.ptxVersion < a.binaryVersion ? a.ptxVersion : a.binaryVersion;
#else
  (void)kernel;
  return 0;
#endif
}

/// Whether `kernel`'s code on the current device calls griddepcontrol.wait where
/// wait_prerequisite_grids() is written: built from sm_90+ code (an sm_80 build JIT-compiled
/// for a newer GPU is not). Only then may it be launched programmatically.
template <class... Params>
inline bool waits_for_prerequisite_grids(void (*kernel)(Params...)) {
  return code_version(kernel) >= 90;
}

/// How launch_kernel launches beyond the grid (NVIDIA sm_90+ devices; the caller knows the
/// device): as a programmatic dependent of the work before it in the stream.
struct LaunchOptions {
  bool programmatic = false;
};

/// kernel<<<grid, block, smem, s>>>(args...) with `how`'s attributes (a plain launch on AMD).
template <class... Params, class... Args>
inline error_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             stream_t s, LaunchOptions how, Args&&... args) {
#if defined(HIPFLASH_PLATFORM_NVIDIA)
#if CUDART_VERSION < 12030
  // Capturing a programmatic launch into a graph needs CUDA 12.3+: launch plainly there.
  if (how.programmatic && stream_capturing(s)) how.programmatic = false;
#endif
  cudaLaunchAttribute attr[1];
  unsigned n = 0;
  if (how.programmatic) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) (void)cudaGetLastError();  // returned here: not the next launch's
  return err;
#else
  (void)how;
  kernel<<<grid, block, smem, s>>>(std::forward<Args>(args)...);
  return hipGetLastError();
#endif
}

/// Stops the kernel loudly: the body an unsupported target compiles to.
__device__ __forceinline__ void trap() {
#if defined(HIPFLASH_PLATFORM_AMD)
  __builtin_trap();
#else
  __trap();
#endif
}

}  // namespace hipflash::port
