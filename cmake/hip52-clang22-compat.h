// hipflash — what Debian's HIP 5.2 headers expect of the compiler and clang 22 no longer
// provides. Pre-included (-include) into every HIP translation unit by
// cmake/debian-clang22-hip.cmake, and by nothing else: it is a build shim, not project code.
// Clang's own __clang_hip_runtime_wrapper.h is included before it.
#pragma once

#if defined(__HIP__)

// HIP 5.2's amd_warp_functions.h defines warpSize as __AMDGCN_WAVEFRONT_SIZE, which clang 15
// predefined and clang 22 does not. Every arch this toolchain is used for (CDNA) is wave64.
#if !defined(__AMDGCN_WAVEFRONT_SIZE)
#define __AMDGCN_WAVEFRONT_SIZE 64
#endif  // !__AMDGCN_WAVEFRONT_SIZE

// HIP 5.2's amd_hip_fp16.h (hrcp, h2rcp) calls these two, which clang 15 declared in
// __clang_hip_libdevice_declares.h and clang 22 does not; __builtin_amdgcn_rcph is the same
// v_rcp_f16 instruction.
typedef _Float16 __hipflash_compat_2f16 __attribute__((ext_vector_type(2)));
extern "C" __attribute__((device, const)) inline _Float16 __llvm_amdgcn_rcp_f16(_Float16 x) {
  return static_cast<_Float16>(__builtin_amdgcn_rcph(x));
}
extern "C" __attribute__((device, const)) inline __hipflash_compat_2f16
__llvm_amdgcn_rcp_2f16(__hipflash_compat_2f16 x) {
  return __hipflash_compat_2f16{__llvm_amdgcn_rcp_f16(x.x), __llvm_amdgcn_rcp_f16(x.y)};
}

#endif  // __HIP__
