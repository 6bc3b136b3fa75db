// hipflash — development probe (not a benchmark of record): LSE off/on of the sm90 FA kernels
// (hd64 S=512 and S=2048, hd128 S=512) with the output and LSE buffers reused or rotated over
// four, in both orders; `--ncu` runs each configuration without timing, for Nsight Compute.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "hipflash/hipflash.hpp"
using namespace hipflash;
#define CK(x)                                                     \
  do {                                                            \
    auto e = (x);                                                 \
    if (e != cudaSuccess) {                                       \
      printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); \
      exit(1);                                                    \
    }                                                             \
  } while (0)
__global__ void fill(uint16_t* p, size_t n, unsigned seed) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i < n) {
    unsigned x = (unsigned)i * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995;
    x ^= x >> 15;
    float f = (x & 0xffff) / 65536.f * 2.f - 1.f;
    unsigned u = __float_as_uint(f);
    p[i] = u >> 16;
  }
}
__global__ void spin(long long c) {
  long long t = clock64();
  while (clock64() - t < c) {
  }
}
int main(int argc, char** argv) {
  const bool ncu = argc > 1 && !strcmp(argv[1], "--ncu");
  struct C {
    int B, S, H, D;
    bool causal;
  } cells[] = {{32, 512, 32, 64, false}, {8, 2048, 32, 64, false}, {32, 512, 16, 128, false}};
  for (const C& c : cells) {
    const size_t n = size_t(c.B) * c.S * c.H * c.D, nl = size_t(c.B) * c.H * c.S;
    const int R = 4;  // rotation depth for out/lse
    uint16_t *q, *k, *v;
    std::vector<uint16_t*> o(R);
    std::vector<float*> l(R);
    CK(cudaMalloc(&q, n * 2));
    CK(cudaMalloc(&k, n * 2));
    CK(cudaMalloc(&v, n * 2));
    for (int i = 0; i < R; ++i) {
      CK(cudaMalloc(&o[i], n * 2));
      CK(cudaMalloc(&l[i], nl * 4));
    }
    fill<<<(n + 255) / 256, 256>>>(q, n, 1);
    fill<<<(n + 255) / 256, 256>>>(k, n, 2);
    fill<<<(n + 255) / 256, 256>>>(v, n, 3);
    Location g{Location::gpu, 0};
    auto tq = make_tensor(q, DType::bf16, {c.B, c.S, c.H, c.D}, g),
         tk = make_tensor(k, DType::bf16, {c.B, c.S, c.H, c.D}, g),
         tv = make_tensor(v, DType::bf16, {c.B, c.S, c.H, c.D}, g);
    std::vector<TensorRef> to, tl;
    for (int i = 0; i < R; ++i) {
      to.push_back(make_tensor(o[i], DType::bf16, {c.B, c.S, c.H, c.D}, g));
      tl.push_back(make_tensor(l[i], DType::f32, {c.B, c.H, c.S}, g));
    }
    auto run = [&](bool lse, int rot, int n_calls) {
      FwdOptions opt;
      opt.return_lse = lse;
      opt.causal = c.causal;
      opt.num_splits = 1;
      auto call = [&](int i) {
        forward(tq, tk, tv, to[i % rot], lse ? &tl[i % rot] : nullptr, opt);
      };
      for (int i = 0; i < 5; ++i) call(i);
      CK(cudaDeviceSynchronize());
      if (ncu) return 0.f;
      std::vector<cudaEvent_t> e0(n_calls), e1(n_calls);
      for (int i = 0; i < n_calls; ++i) {
        cudaEventCreate(&e0[i]);
        cudaEventCreate(&e1[i]);
      }
      spin<<<1, 1>>>(2000LL * 1000 * 30);
      for (int i = 0; i < n_calls; ++i) {
        cudaEventRecord(e0[i]);
        call(i);
        cudaEventRecord(e1[i]);
      }
      CK(cudaDeviceSynchronize());
      std::vector<float> ts;
      for (int i = 0; i < n_calls; ++i) {
        float ms;
        cudaEventElapsedTime(&ms, e0[i], e1[i]);
        ts.push_back(ms * 1e3f);
        cudaEventDestroy(e0[i]);
        cudaEventDestroy(e1[i]);
      }
      std::sort(ts.begin(), ts.end());
      return ts[n_calls / 2];
    };
    printf("B=%d S=%d H=%d D=%d:\n", c.B, c.S, c.H, c.D);
    for (int rot : {1, R}) {
      float a = run(false, rot, 40), b = run(true, rot, 40), b2 = run(true, rot, 40),
            a2 = run(false, rot, 40);
      if (!ncu)
        printf("  out/lse buffers %d: off %.1f  on %.1f  on %.1f  off %.1f us  (on/off %+.1f%%)\n",
               rot, a, b, b2, a2, 100.f * ((b + b2) / (a + a2) - 1));
    }
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    for (int i = 0; i < R; ++i) {
      cudaFree(o[i]);
      cudaFree(l[i]);
    }
  }
  CK(cudaGetLastError());
}
