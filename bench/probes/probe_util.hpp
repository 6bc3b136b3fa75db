// hipflash — what the development probes share: error checks, random bf16 device buffers, and
// the per-call device time of a call queued behind a spin kernel (so the host's launch cost is
// not in it). Not a benchmark of record: bench/attn_bench.py and bench/bench_cpp.cpp are.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace probe {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("CUDA error in %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

__global__ void fill_kernel(uint16_t* p, size_t n, unsigned seed) {
  const size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  unsigned x = unsigned(i) * 2654435761u ^ seed;  // a hash of (i, seed): uniform in [-1, 1)
  x ^= x >> 13;
  x *= 0x5bd1e995;
  x ^= x >> 15;
  p[i] = uint16_t(__float_as_uint((x & 0xffff) / 65536.f * 2.f - 1.f) >> 16);  // bf16
}

/// n random bf16 values in fresh device memory.
inline uint16_t* random_bf16(size_t n, unsigned seed) {
  uint16_t* p = nullptr;
  check(cudaMalloc(&p, n * 2), "cudaMalloc");
  fill_kernel<<<unsigned((n + 255) / 256), 256>>>(p, n, seed);
  check(cudaGetLastError(), "fill");
  return p;
}

__global__ void spin_kernel(long long cycles) {
  const long long t = clock64();
  while (clock64() - t < cycles) {
  }
}

/// Occupies the GPU for about `ms` (at ~2 GHz) so the host can queue everything behind it.
inline void spin(double ms) { spin_kernel<<<1, 1>>>((long long)(ms * 2e6)); }

struct PerCall {
  float median_us, min_us;
};

/// Device time of call(i), i < n, each between its own pair of events, all queued behind a spin.
template <class Call>
PerCall time_per_call(Call call, int n, double spin_ms = 20) {
  std::vector<cudaEvent_t> e0(n), e1(n);
  for (int i = 0; i < n; ++i) {
    check(cudaEventCreate(&e0[i]), "cudaEventCreate");
    check(cudaEventCreate(&e1[i]), "cudaEventCreate");
  }
  spin(spin_ms);
  for (int i = 0; i < n; ++i) {
    cudaEventRecord(e0[i]);
    call(i);
    cudaEventRecord(e1[i]);
  }
  check(cudaDeviceSynchronize(), "timed calls");
  std::vector<float> ts;
  for (int i = 0; i < n; ++i) {
    float ms = 0;
    cudaEventElapsedTime(&ms, e0[i], e1[i]);
    ts.push_back(ms * 1e3f);
    cudaEventDestroy(e0[i]);
    cudaEventDestroy(e1[i]);
  }
  std::sort(ts.begin(), ts.end());
  return {ts[n / 2], ts[0]};
}

/// Device time per call of n calls back to back, queued behind a spin.
template <class Call>
float time_back_to_back(Call call, int n, double spin_ms = 20) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  spin(spin_ms);
  cudaEventRecord(a);
  for (int i = 0; i < n; ++i) call(i);
  cudaEventRecord(b);
  check(cudaEventSynchronize(b), "timed calls");
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms * 1e3f / n;
}

}  // namespace probe
