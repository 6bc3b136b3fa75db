# hipflash — toolchain file for CMake's HIP language with Debian's ROCm packages (bookworm:
# hipcc 5.2, clang 15, libamdhip64-dev, rocm-device-libs).
#
#   cmake -B build-hip -DHIPFLASH_GPU=hip -DCMAKE_TOOLCHAIN_FILE=cmake/debian-hip.cmake
#
# Why it is needed: CMake (3.25) accepts only clang as the HIP compiler, not the hipcc wrapper,
# and expects the HIP runtime package at <rocm root>/lib/cmake/hip-lang, while Debian installs
# it under the multiarch directory /usr/lib/<triplet>/cmake/hip-lang. This file points CMake at
# a small ROCm-root shim (one symlink, in the build tree) and passes clang the flags hipcc
# would (--rocm-path, --hip-version, the device-library path). CMake reads this file again
# for every try_compile.

# The multiarch directory that holds hip-lang (x86_64-linux-gnu on amd64).
file(GLOB _hf_hip_lang_cfg "/usr/lib/*/cmake/hip-lang/hip-lang-config.cmake")
if(NOT _hf_hip_lang_cfg)
  message(FATAL_ERROR "debian-hip.cmake: no /usr/lib/<triplet>/cmake/hip-lang; "
                      "install libamdhip64-dev (apt-get install hipcc libamdhip64-dev)")
endif()
list(GET _hf_hip_lang_cfg 0 _hf_hip_lang_cfg)
get_filename_component(_hf_hip_lang_dir "${_hf_hip_lang_cfg}" DIRECTORY)
get_filename_component(_hf_multiarch_cmake "${_hf_hip_lang_dir}" DIRECTORY)
get_filename_component(_hf_multiarch_lib "${_hf_multiarch_cmake}" DIRECTORY)

# The clang that Debian's hipcc drives (hipcc.pl names it, e.g. clang++-15; clang++-14 may also
# be installed but cannot target gfx940). `hipcc --version` is no help: it wants a GPU.
if(NOT CMAKE_HIP_COMPILER)
  find_program(_hf_hipcc_pl hipcc.pl)
  set(_hf_clang "")
  if(_hf_hipcc_pl)
    file(STRINGS "${_hf_hipcc_pl}" _hf_line REGEX "clang\\+\\+-[0-9]+" LIMIT_COUNT 1)
    if(_hf_line MATCHES "(clang\\+\\+-[0-9]+)")
      find_program(_hf_clang_found ${CMAKE_MATCH_1})
      set(_hf_clang "${_hf_clang_found}")
    endif()
  endif()
  if(NOT _hf_clang)
    message(FATAL_ERROR "debian-hip.cmake: cannot tell which clang++-<N> hipcc uses; "
                        "pass -DCMAKE_HIP_COMPILER=/usr/bin/clang++-<N>")
  endif()
  set(CMAKE_HIP_COMPILER "${_hf_clang}" CACHE FILEPATH "HIP compiler (the clang hipcc uses)")
endif()

# The ROCm-root shim: <shim>/lib/cmake/hip-lang -> the multiarch hip-lang directory.
if(NOT CMAKE_HIP_COMPILER_ROCM_ROOT)
  set(_hf_shim "${CMAKE_BINARY_DIR}/debian-rocm-root")
  file(MAKE_DIRECTORY "${_hf_shim}/lib/cmake")
  file(CREATE_LINK "${_hf_hip_lang_dir}" "${_hf_shim}/lib/cmake/hip-lang" SYMBOLIC)
  set(CMAKE_HIP_COMPILER_ROCM_ROOT "${_hf_shim}")
endif()

# hip-lang's own dependencies (amd_comgr) live in the multiarch directory too.
list(APPEND CMAKE_PREFIX_PATH "${_hf_multiarch_cmake}")

# What hipcc adds on Debian: the HIP install, its version (without it clang assumes 3.5 and
# does not pre-include __clang_hip_runtime_wrapper.h, so __device__ & co. are unknown) and
# the device bitcode libraries.
execute_process(COMMAND hipconfig --version OUTPUT_VARIABLE _hf_hip_version
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT _hf_hip_version MATCHES "^([0-9]+\\.[0-9]+\\.[0-9]+)")  # "5.2.21153-0"
  message(FATAL_ERROR "debian-hip.cmake: `hipconfig --version` gave '${_hf_hip_version}'")
endif()
set(_hf_hip_version "${CMAKE_MATCH_1}")
set(_hf_bitcode "${_hf_multiarch_lib}/amdgcn/bitcode")
set(CMAKE_HIP_FLAGS_INIT
    "--rocm-path=/usr --hip-version=${_hf_hip_version} --hip-device-lib-path=${_hf_bitcode}")

# hip-lang puts /usr/include on the include path; ahead of libstdc++'s headers it breaks their
# #include_next <math.h>. Marking it implicit makes CMake drop it (as it does for CXX).
list(APPEND CMAKE_HIP_IMPLICIT_INCLUDE_DIRECTORIES /usr/include)
