// hipflash — development probe (not a benchmark of record): the MUFU's ex2 throughput in f32
// and in packed f16x2 / bf16x2 form (elements per clock per SM, from one block's clock64 with
// four 512-thread blocks an SM, eight independent chains a thread), and with `cuobjdump -sass`
// the instructions each form becomes: whether a packed exponential could relieve the
// exp-bound fp8 forward (design-decisions.md#fp8-forward).
#include <cstdio>
#include <cuda_runtime.h>
template <int kMode>
__global__ void k(unsigned* out, int iters, long long* clk) {
  unsigned a[8];
  for (int i = 0; i < 8; ++i) a[i] = 0x3c003c00u ^ (threadIdx.x * 7 + i);
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (kMode == 0) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+r"(a[i]));
      if (kMode == 1) asm volatile("ex2.approx.f16x2 %0, %0;" : "+r"(a[i]));
      if (kMode == 2) asm volatile("ex2.approx.ftz.bf16x2 %0, %0;" : "+r"(a[i]));
    }
  }
  long long t1 = clock64();
  unsigned s = 0;
  for (int i = 0; i < 8; ++i) s ^= a[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0 && blockIdx.x == 0) *clk = t1 - t0;
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  unsigned* out; long long* clk; cudaMalloc(&out, 4 << 24); cudaMalloc(&clk, 8);
  const int blocks = sms * 4, threads = 512, iters = 4096;
  const char* names[] = {"ex2.f32", "ex2.f16x2", "ex2.bf16x2"};
  for (int mode = 0; mode < 3; ++mode) {
    for (int rep = 0; rep < 2; ++rep) {
      if (mode == 0) k<0><<<blocks, threads>>>(out, iters, clk);
      if (mode == 1) k<1><<<blocks, threads>>>(out, iters, clk);
      if (mode == 2) k<2><<<blocks, threads>>>(out, iters, clk);
      cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) { printf("error %s\n", cudaGetErrorString(e)); return 1; }
      long long c; cudaMemcpy(&c, clk, 8, cudaMemcpyDeviceToHost);
      // block 0's clocks; 4 blocks share an SM (2048 threads): instructions per SM = 4*512*iters*8
      double instr = 4.0 * threads * iters * 8, elems = instr * (mode == 0 ? 1 : 2);
      if (rep) printf("%-11s %.2f instr/clk/SM  %.2f elements/clk/SM\n", names[mode], instr / c, elems / c);
    }
  }
  return 0;
}
