// hipflash — development probe (not a benchmark of record): LSE off/on x split-K workspace
// (launcher-allocated | given) for decode B=1 and the hd64 FA cells; per-call events behind a
// spin kernel (launch cost hidden); `--ncu` runs each config 3 times for the profiler.
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
struct Cell {
  const char* name;
  int B, Sq, Sk, Hq, Hkv, D;
};
int main(int argc, char** argv) {
  const bool ncu = argc > 1 && !strcmp(argv[1], "--ncu");
  const bool hd64_only = argc > 1 && !strcmp(argv[1], "--hd64");
  Cell cells[] = {{"decode B=1 Sk=8k", 1, 1, 8192, 32, 8, 128},
                  {"decode B=1 Sk=16k", 1, 1, 16384, 32, 8, 128},
                  {"decode B=1 Sk=128k", 1, 1, 131072, 32, 8, 128},
                  {"fa hd64 S=512", 32, 512, 512, 32, 32, 64},
                  {"fa hd64 S=512 causal", -32, 512, 512, 32, 32, 64},
                  {"fa hd64 S=2048", 8, 2048, 2048, 32, 32, 64},
                  {"fa hd64 S=2048 causal", -8, 2048, 2048, 32, 32, 64}};
  void* ws_buf;
  const size_t ws_bytes = size_t(256) << 20;
  CK(cudaMalloc(&ws_buf, ws_bytes));
  for (Cell c : cells) {
    const bool causal = c.B < 0;
    c.B = causal ? -c.B : c.B;
    if (ncu && (c.Sk == 131072 || c.D == 64)) continue;
    if (hd64_only && c.D != 64) continue;
    size_t nq = size_t(c.B) * c.Sq * c.Hq * c.D, nk = size_t(c.B) * c.Sk * c.Hkv * c.D;
    uint16_t *q, *k, *v, *o;
    float* l;
    CK(cudaMalloc(&q, nq * 2));
    CK(cudaMalloc(&k, nk * 2));
    CK(cudaMalloc(&v, nk * 2));
    CK(cudaMalloc(&o, nq * 2));
    CK(cudaMalloc(&l, size_t(c.B) * c.Hq * c.Sq * 4));
    fill<<<(nq + 255) / 256, 256>>>(q, nq, 1);
    fill<<<(nk + 255) / 256, 256>>>(k, nk, 2);
    fill<<<(nk + 255) / 256, 256>>>(v, nk, 3);
    Location g{Location::gpu, 0};
    auto tq = make_tensor(q, DType::bf16, {c.B, c.Sq, c.Hq, c.D}, g),
         tk = make_tensor(k, DType::bf16, {c.B, c.Sk, c.Hkv, c.D}, g),
         tv = make_tensor(v, DType::bf16, {c.B, c.Sk, c.Hkv, c.D}, g),
         to = make_tensor(o, DType::bf16, {c.B, c.Sq, c.Hq, c.D}, g),
         tl = make_tensor(l, DType::f32, {c.B, c.Hq, c.Sq}, g);
    for (int lse = 0; lse < 2; ++lse)
      for (int ws = (c.D == 64); ws < 2; ++ws) {
        FwdOptions opt;
        opt.return_lse = lse;
        opt.causal = causal;
        Workspace w;
        if (ws) {
          w.data = ws_buf;
          w.bytes = ws_bytes;
        }
        auto call = [&] { forward(tq, tk, tv, to, lse ? &tl : nullptr, opt, nullptr, w); };
        for (int i = 0; i < (ncu ? 1 : 5); ++i) call();
        CK(cudaDeviceSynchronize());
        if (ncu) {
          for (int i = 0; i < 2; ++i) call();
          CK(cudaDeviceSynchronize());
          continue;
        }
        const int n = 50;
        std::vector<cudaEvent_t> e0(n), e1(n);
        for (int i = 0; i < n; ++i) {
          cudaEventCreate(&e0[i]);
          cudaEventCreate(&e1[i]);
        }
        spin<<<1, 1>>>(2000LL * 1000 *
                       20);  // ~20 ms at ~2 GHz: the host queues every call behind it
        for (int i = 0; i < n; ++i) {
          cudaEventRecord(e0[i]);
          call();
          cudaEventRecord(e1[i]);
        }
        CK(cudaDeviceSynchronize());
        std::vector<float> ts;
        for (int i = 0; i < n; ++i) {
          float ms;
          cudaEventElapsedTime(&ms, e0[i], e1[i]);
          ts.push_back(ms * 1e3f);
          cudaEventDestroy(e0[i]);
          cudaEventDestroy(e1[i]);
        }
        std::sort(ts.begin(), ts.end());
        // back-to-back: one event pair around n calls
        cudaEvent_t a, b;
        cudaEventCreate(&a);
        cudaEventCreate(&b);
        spin<<<1, 1>>>(2000LL * 1000 * 20);
        cudaEventRecord(a);
        for (int i = 0; i < n; ++i) call();
        cudaEventRecord(b);
        CK(cudaEventSynchronize(b));
        float tot;
        cudaEventElapsedTime(&tot, a, b);
        printf(
            "%-20s lse=%d ws=%s  per-call median %8.2f us (min %8.2f)  back-to-back %8.2f us/call  "
            "%s\n",
            c.name, lse, ws ? "given" : "alloc", ts[n / 2], ts[0], tot * 1e3f / n,
            last_kernel_name().c_str());
      }
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(o);
    cudaFree(l);
  }
  CK(cudaGetLastError());
}
