// hipflash GPU tests (CUDA builds) — device copies of host tensors, synchronisation and the
// fixture that skips, with the reason, when no GPU is usable. Shared by the GPU suites.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "test_util.hpp"

namespace hipflash::test {

inline void cuda_check(cudaError_t e, const char* expr, const char* file, int line) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + expr +
                             " failed: " + cudaGetErrorString(e));
}
#define CUDA_CHECK(expr) cuda_check((expr), #expr, __FILE__, __LINE__)

/// A device copy of a HostTensor's whole storage; `ref` is the same view, on the GPU.
struct DeviceTensor {
  void* ptr = nullptr;
  size_t bytes = 0;
  TensorRef ref;

  explicit DeviceTensor(const HostTensor& h) : bytes(h.words.size() * 4), ref(h.ref) {
    CUDA_CHECK(cudaMalloc(&ptr, bytes));
    CUDA_CHECK(cudaMemcpy(ptr, h.words.data(), bytes, cudaMemcpyHostToDevice));
    const ptrdiff_t offset = static_cast<const char*>(h.ref.data) -
                             reinterpret_cast<const char*>(h.words.data());
    ref.data = static_cast<char*>(ptr) + offset;
    ref.loc = {Location::gpu, 0};
  }
  void download(HostTensor& h) const {
    CUDA_CHECK(cudaMemcpy(h.words.data(), ptr, bytes, cudaMemcpyDeviceToHost));
  }
  ~DeviceTensor() {
    const cudaError_t e = cudaFree(ptr);
    if (e != cudaSuccess) ADD_FAILURE() << "cudaFree: " << cudaGetErrorString(e);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
};

inline void sync(cudaStream_t stream = nullptr) {
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaGetLastError());
}

/// A GPU suite's fixture: skipped, saying why, where no GPU is usable. Gpu for plain tests,
/// GpuParam<Case> for a parametrised suite (class GpuForward : public GpuParam<Case> {}).
template <class Base>
class SkipsWithoutGpu : public Base {
 protected:
  void SetUp() override {
    if (!gpu_available())
      GTEST_SKIP() << "no usable GPU (" << build_info() << "): the GPU suite needs a CUDA device";
  }
};
class Gpu : public SkipsWithoutGpu<::testing::Test> {};
template <class Case>
class GpuParam : public SkipsWithoutGpu<::testing::TestWithParam<Case>> {};

}  // namespace hipflash::test
