// hipflash — development probe (not a benchmark of record): LSE off/on of the sm90 FA kernels
// (hd64 S=512 and S=2048, hd128 S=512) with the output and LSE buffers reused or rotated over
// four, in both orders; `--ncu` runs each configuration without timing, for Nsight Compute.
#include <cstring>
#include <vector>

#include "hipflash/hipflash.hpp"
#include "probe_util.hpp"

using namespace hipflash;

int main(int argc, char** argv) {
  const bool ncu = argc > 1 && !std::strcmp(argv[1], "--ncu");
  struct Cell {
    int B, S, H, D;
  } cells[] = {{32, 512, 32, 64}, {8, 2048, 32, 64}, {32, 512, 16, 128}};
  constexpr int kRotation = 4;  // output/LSE buffer sets
  for (const Cell& c : cells) {
    const size_t n = size_t(c.B) * c.S * c.H * c.D, nl = size_t(c.B) * c.H * c.S;
    uint16_t *q = probe::random_bf16(n, 1), *k = probe::random_bf16(n, 2),
             *v = probe::random_bf16(n, 3);
    const Location g{Location::gpu, 0};
    const TensorRef tq = make_tensor(q, DType::bf16, {c.B, c.S, c.H, c.D}, g),
                    tk = make_tensor(k, DType::bf16, {c.B, c.S, c.H, c.D}, g),
                    tv = make_tensor(v, DType::bf16, {c.B, c.S, c.H, c.D}, g);
    std::vector<void*> buffers;
    std::vector<TensorRef> to, tl;
    for (int i = 0; i < kRotation; ++i) {
      void *o = nullptr, *l = nullptr;
      probe::check(cudaMalloc(&o, n * 2), "cudaMalloc");
      probe::check(cudaMalloc(&l, nl * 4), "cudaMalloc");
      buffers.insert(buffers.end(), {o, l});
      to.push_back(make_tensor(o, DType::bf16, {c.B, c.S, c.H, c.D}, g));
      tl.push_back(make_tensor(l, DType::f32, {c.B, c.H, c.S}, g));
    }
    // Median per-call time with LSE on or off, out/lse rotating over `rot` buffer sets.
    auto run = [&](bool lse, int rot) {
      FwdOptions opt;
      opt.return_lse = lse;
      opt.num_splits = 1;
      auto call = [&](int i) {
        forward(tq, tk, tv, to[i % rot], lse ? &tl[i % rot] : nullptr, opt);
      };
      for (int i = 0; i < 5; ++i) call(i);
      probe::check(cudaDeviceSynchronize(), "warm-up");
      return ncu ? 0.f : probe::time_per_call(call, 40, 30).median_us;
    };
    std::printf("B=%d S=%d H=%d D=%d:\n", c.B, c.S, c.H, c.D);
    for (int rot : {1, kRotation}) {
      const float a = run(false, rot), b = run(true, rot), b2 = run(true, rot),
                  a2 = run(false, rot);
      if (!ncu)
        std::printf("  out/lse buffers %d: off %.1f  on %.1f  on %.1f  off %.1f us  (on/off "
                    "%+.1f%%)\n",
                    rot, a, b, b2, a2, 100.f * ((b + b2) / (a + a2) - 1));
    }
    for (void* p : buffers) cudaFree(p);
    for (void* p : {(void*)q, (void*)k, (void*)v}) cudaFree(p);
  }
  probe::check(cudaGetLastError(), "the probe");
}
