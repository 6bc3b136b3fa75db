# hipflash — toolchain file for CMake's HIP language with clang 22 (Debian 12's bookworm-security
# LLVM 22: clang-22 lld-22 clang-tools-22 llvm-22, installed by scripts/setup) over Debian's ROCm
# 5.2 runtime headers and device libraries (libamdhip64-dev, rocm-device-libs), for the archs
# clang 15 does not know: gfx942 and gfx950 (MI300X/MI325X, MI350).
#
#   cmake -B build-hip22 -DHIPFLASH_GPU=hip -DCMAKE_TOOLCHAIN_FILE=cmake/debian-clang22-hip.cmake
#         [-DHIPFLASH_HIP_ARCHS="gfx942;gfx950"]      (the default with this file)
#
# It is cmake/debian-hip.cmake (the ROCm-root shim, --rocm-path, --hip-version, the bitcode
# folder) with clang++-22 as the compiler, plus what clang 22 needs to use ROCm 5.2's pieces:
#   - the device libraries by name: clang 22 no longer links hip.bc by itself (__syncthreads
#     then fails to link), so the whole list is given, and with it the per-arch ISA library.
#     ROCm 5.2 has no oclc_isa_version_942/950.bc; its math library only compares the value
#     against older ISAs, so gfx942 and gfx950 link the gfx940 one;
#   - code object v5: clang 22 defaults to v6, which needs ROCm >= 6.3 device libraries;
#   - cmake/hip52-clang22-compat.h, pre-included: a warpSize macro and two f16 rcp functions
#     that HIP 5.2's headers expect from the compiler.
# clang 22 refuses gfx940/gfx941 (folded into gfx942): those stay with debian-hip.cmake (clang 15).
# CMake reads this file again for every try_compile.

set(_hf_clang22_isa_gfx90a 90a)
set(_hf_clang22_isa_gfx942 940)
set(_hf_clang22_isa_gfx950 940)

if(NOT CMAKE_HIP_COMPILER)
  find_program(_hf_clang22 clang++-22)
  if(NOT _hf_clang22)
    message(FATAL_ERROR "debian-clang22-hip.cmake: no clang++-22; run scripts/setup "
                        "(apt-get install clang-22 lld-22 clang-tools-22 llvm-22)")
  endif()
  set(CMAKE_HIP_COMPILER "${_hf_clang22}" CACHE FILEPATH "HIP compiler (clang 22)")
endif()

# The archs to build: the per-arch ISA library has to be named for exactly these (an -Xarch_
# flag for an arch that is not built is an unused-argument warning), so choose them when the
# build folder is configured for the first time. Without a choice on the command line this file
# makes gfx942;gfx950 the project's default instead of gfx90a;gfx940.
if(DEFINED CMAKE_HIP_ARCHITECTURES)
  set(_hf_archs "${CMAKE_HIP_ARCHITECTURES}")
elseif(DEFINED HIPFLASH_HIP_ARCHS)
  set(_hf_archs "${HIPFLASH_HIP_ARCHS}")
else()
  set(_hf_archs gfx942 gfx950)
  set(HIPFLASH_HIP_ARCHS "gfx942;gfx950" CACHE STRING "AMD offload architectures")
endif()

include("${CMAKE_CURRENT_LIST_DIR}/debian-hip.cmake")  # sets CMAKE_HIP_FLAGS_INIT

set(_hf_libs hip ocml ockl oclc_daz_opt_off oclc_unsafe_math_off oclc_finite_only_off
    oclc_correctly_rounded_sqrt_on oclc_wavefrontsize64_on oclc_abi_version_500)
foreach(_hf_lib IN LISTS _hf_libs)
  string(APPEND CMAKE_HIP_FLAGS_INIT " --hip-device-lib=${_hf_lib}.bc")
endforeach()
# The per-arch ISA library goes into the compile rule, not CMAKE_HIP_FLAGS: CMake passes those
# to the link too, where clang warns that every -Xarch_<gpu> argument is unused. The rule is
# CMake's own (CMakeHIPInformation.cmake) with the flags added after <FLAGS>.
set(_hf_xarch "")
foreach(_hf_arch IN LISTS _hf_archs)
  string(REGEX REPLACE ":.*" "" _hf_arch "${_hf_arch}")  # gfx942:xnack- -> gfx942
  if(NOT DEFINED _hf_clang22_isa_${_hf_arch})
    message(FATAL_ERROR "debian-clang22-hip.cmake: no ROCm 5.2 ISA library chosen for "
                        "'${_hf_arch}' (known: gfx90a gfx942 gfx950; gfx940 needs "
                        "cmake/debian-hip.cmake)")
  endif()
  string(APPEND _hf_xarch
         " -Xarch_${_hf_arch} --hip-device-lib=oclc_isa_version_${_hf_clang22_isa_${_hf_arch}}.bc")
endforeach()
set(CMAKE_HIP_COMPILE_OBJECT
    "<CMAKE_HIP_COMPILER> <DEFINES> <INCLUDES> <FLAGS>${_hf_xarch} -o <OBJECT> -x hip -c <SOURCE>")
string(APPEND CMAKE_HIP_FLAGS_INIT
       " -mcode-object-version=5 -include ${CMAKE_CURRENT_LIST_DIR}/hip52-clang22-compat.h")
