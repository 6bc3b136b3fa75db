// hipflash — development probe (not a benchmark of record): the tensor pipe's rate for the
// forward's warpgroup MMA shapes, in cycles a wgmma, from one block per SM whose consumer
// warpgroups issue groups of four m64n128 wgmmas (k32 e4m3: one 128-byte head-dim row of Q K^T;
// k16 bf16: half of one) back to back, one group in flight behind the one issued:
//   fp8 SS (A and B from shared memory, Q K^T's form), fp8 RS (A from registers, P V's form),
//   bf16 SS; one or two issuing warpgroups; and fp8 SS under a third warpgroup that streams
//   ldmatrix.trans / stmatrix through shared memory the way fp8's V transposer does.
// On an H100 every case ran at 64.1 cycles a wgmma (65.1 beside the transposer's traffic): the
// pipe and its shared-memory operand supply keep the nominal rate
// (design-decisions.md#fp8-forward).
//
//   nvcc -std=c++17 -O2 -gencode arch=compute_90a,code=sm_90a -Iinclude -Ikernels \
//     bench/probes/wgmma_rate_probe.cu -o /tmp/wgmma_rate && /tmp/wgmma_rate
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "atoms/sm80.hpp"
#include "atoms/sm90/wgmma.hpp"
#include "atoms/sm90/wgmma_ops.hpp"
#include "probe_util.hpp"

namespace sm90 = hipflash::atom::sm90;
namespace wg = sm90::wgmma;
using hipflash::DType;

constexpr int kIters = 512, kSteps = 4;
constexpr uint32_t kTileA = 64 * 128, kTileB = 128 * 128, kScratch = 32 * 1024;
constexpr uint32_t kOffB = 2 * kTileA, kOffScratch = kOffB + kTileB;
constexpr uint32_t kOffFlag = kOffScratch + 2 * kScratch, kSmem = kOffFlag + 1024 + 1024;

template <DType kDT, bool kRs, bool kHammer>
__global__ void __launch_bounds__(384, 1) rate_kernel(int issuers, long long* cycles, float* sink) {
#if defined(HIPFLASH_HAS_WGMMA)
  using hipflash::atom::sm80::smem_addr;
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char* smem = raw + ((1024 - smem_addr(raw) % 1024) % 1024);
  const uint32_t base = smem_addr(smem);
  for (uint32_t i = threadIdx.x; i < kOffFlag / 4; i += blockDim.x) {
    uint32_t x = i * 2654435761u;
    x ^= x >> 15;
    // small finite values in either element type: e4m3 bytes / bf16 halves of magnitude < 2
    reinterpret_cast<uint32_t*>(smem)[i] =
        kDT == DType::e4m3 ? (x & 0x37373737u) : (x & 0x3f7f3f7fu);
  }
  volatile int* done = reinterpret_cast<volatile int*>(smem + kOffFlag);
  if (threadIdx.x == 0) *done = 0;
  __syncthreads();
  const int wg_id = threadIdx.x / 128;
  if (wg_id < issuers) {
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    uint32_t a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = (0x30303030u + threadIdx.x * 0x01010101u) & 0x37373737u;
    const uint32_t sA = base + wg_id * kTileA, sB = base + kOffB;
    __syncwarp();
    const long long t0 = clock64();
    for (int it = 0; it < kIters; ++it) {
      wg::fence();
#pragma unroll
      for (int ks = 0; ks < kSteps; ++ks) {
        const uint64_t db = wg::desc_k_major(sB + ks * 32);
        if constexpr (kRs)
          wg::Op<kDT, 128>::rs(d, a, db, 1);
        else
          wg::Op<kDT, 128>::ss(d, wg::desc_k_major(sA + ks * 32), db, 1);
      }
      wg::commit();
      wg::wait<1>();
    }
    wg::wait<0>();
    const long long t1 = clock64();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 64; ++i) s += d[i];
    sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + wg_id] = t1 - t0;
    if (threadIdx.x == 0) *done = 1;
  } else if (kHammer && wg_id == 2) {
    // The transposer's traffic: 16 x 32-byte steps a warp, ldmatrix.x4.trans then stmatrix.x4.
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const uint32_t src = base + kOffScratch + warp * 8192 + lane * 16;
    const uint32_t dst = src + kScratch;
    uint32_t acc = 0;
    while (*done == 0) {
#pragma unroll 4
      for (int i = 0; i < 16; ++i) {
        uint32_t v[4];
        hipflash::atom::sm80::ldmatrix_x4_trans(v, src + i * 512);
        const uint32_t w[4] = {__byte_perm(v[0], v[1], 0x6420), __byte_perm(v[0], v[1], 0x7531),
                               __byte_perm(v[2], v[3], 0x6420), __byte_perm(v[2], v[3], 0x7531)};
        sm90::stmatrix_x4(dst + i * 512, w);
        acc ^= w[0];
      }
    }
    sink[blockIdx.x * blockDim.x + threadIdx.x] = float(acc & 1);
  }
#endif
}

template <DType kDT, bool kRs, bool kHammer>
void run(const char* name, int issuers, int sms, long long* d_cycles, float* sink) {
  auto kern = rate_kernel<kDT, kRs, kHammer>;
  probe::check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSmem) + 1024),
               "cudaFuncSetAttribute");
  std::vector<long long> c(sms * 2);
  for (int rep = 0; rep < 3; ++rep) {
    probe::check(cudaMemset(d_cycles, 0, sizeof(long long) * sms * 2), "cudaMemset");
    kern<<<sms, 384, kSmem + 1024>>>(issuers, d_cycles, sink);
    probe::check(cudaGetLastError(), name);
    probe::check(cudaDeviceSynchronize(), name);
  }
  probe::check(cudaMemcpy(c.data(), d_cycles, sizeof(long long) * sms * 2,
                          cudaMemcpyDeviceToHost),
               "cudaMemcpy");
  std::vector<double> per;  // cycles a wgmma of the pipe (the issuers share it)
  for (int b = 0; b < sms; ++b) {
    long long t = 0;
    for (int w = 0; w < issuers; ++w) t = std::max(t, c[b * 2 + w]);
    per.push_back(double(t) / (double(kIters) * kSteps * issuers));
  }
  std::sort(per.begin(), per.end());
  std::printf("%-34s issuers %d: %6.1f cycles a wgmma (median of %d SMs; min %.1f, max %.1f)\n",
              name, issuers, per[per.size() / 2], sms, per.front(), per.back());
}

int main() {
  int sms = 0;
  probe::check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "SM count");
  long long* d_cycles = nullptr;
  float* sink = nullptr;
  probe::check(cudaMalloc(&d_cycles, sizeof(long long) * sms * 2), "cudaMalloc");
  probe::check(cudaMalloc(&sink, sizeof(float) * sms * 384), "cudaMalloc");
  std::printf("m64n128 wgmmas, groups of %d, %d groups an issuer, one group in flight; nominal: "
              "64 cycles (4096 bf16 / 8192 fp8 flop a cycle an SM)\n", kSteps, kIters);
  for (int issuers = 1; issuers <= 2; ++issuers) {
    run<DType::e4m3, false, false>("fp8 k32 SS", issuers, sms, d_cycles, sink);
    run<DType::e4m3, true, false>("fp8 k32 RS", issuers, sms, d_cycles, sink);
    run<DType::bf16, false, false>("bf16 k16 SS", issuers, sms, d_cycles, sink);
    run<DType::e4m3, false, true>("fp8 k32 SS + transposer traffic", issuers, sms, d_cycles, sink);
    run<DType::e4m3, true, true>("fp8 k32 RS + transposer traffic", issuers, sms, d_cycles, sink);
  }
  return 0;
}
