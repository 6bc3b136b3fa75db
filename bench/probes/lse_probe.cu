// hipflash — development probe (not a benchmark of record): LSE off/on x split-K workspace
// (launcher-allocated | given) for decode B=1 and the hd64 FA cells: per-call median (device
// events behind a spin kernel) and back-to-back time per call. `--ncu` runs each decode case a
// few times for Nsight Compute; `--hd64` runs only the hd64 cells.
#include <cstring>

#include "hipflash/hipflash.hpp"
#include "probe_util.hpp"

using namespace hipflash;

namespace {

struct Cell {
  const char* name;
  int B, Sq, Sk, Hq, Hkv, D;
  bool causal;
};

}  // namespace

int main(int argc, char** argv) {
  const bool ncu = argc > 1 && !std::strcmp(argv[1], "--ncu");
  const bool hd64_only = argc > 1 && !std::strcmp(argv[1], "--hd64");
  const Cell cells[] = {{"decode B=1 Sk=8k", 1, 1, 8192, 32, 8, 128, false},
                        {"decode B=1 Sk=16k", 1, 1, 16384, 32, 8, 128, false},
                        {"decode B=1 Sk=128k", 1, 1, 131072, 32, 8, 128, false},
                        {"fa hd64 S=512", 32, 512, 512, 32, 32, 64, false},
                        {"fa hd64 S=512 causal", 32, 512, 512, 32, 32, 64, true},
                        {"fa hd64 S=2048", 8, 2048, 2048, 32, 32, 64, false},
                        {"fa hd64 S=2048 causal", 8, 2048, 2048, 32, 32, 64, true}};
  void* ws_buf = nullptr;
  const size_t ws_bytes = size_t(256) << 20;
  probe::check(cudaMalloc(&ws_buf, ws_bytes), "cudaMalloc");
  for (const Cell& c : cells) {
    if (ncu && (c.Sk == 131072 || c.D == 64)) continue;
    if (hd64_only && c.D != 64) continue;
    const size_t nq = size_t(c.B) * c.Sq * c.Hq * c.D, nk = size_t(c.B) * c.Sk * c.Hkv * c.D;
    uint16_t *q = probe::random_bf16(nq, 1), *k = probe::random_bf16(nk, 2),
             *v = probe::random_bf16(nk, 3), *o = nullptr;
    float* l = nullptr;
    probe::check(cudaMalloc(&o, nq * 2), "cudaMalloc");
    probe::check(cudaMalloc(&l, size_t(c.B) * c.Hq * c.Sq * 4), "cudaMalloc");
    const Location g{Location::gpu, 0};
    const TensorRef tq = make_tensor(q, DType::bf16, {c.B, c.Sq, c.Hq, c.D}, g),
                    tk = make_tensor(k, DType::bf16, {c.B, c.Sk, c.Hkv, c.D}, g),
                    tv = make_tensor(v, DType::bf16, {c.B, c.Sk, c.Hkv, c.D}, g),
                    to = make_tensor(o, DType::bf16, {c.B, c.Sq, c.Hq, c.D}, g),
                    tl = make_tensor(l, DType::f32, {c.B, c.Hq, c.Sq}, g);
    for (int lse = 0; lse < 2; ++lse)
      for (int given = (c.D == 64); given < 2; ++given) {  // FA cells do not split
        FwdOptions opt;
        opt.return_lse = lse;
        opt.causal = c.causal;
        Workspace ws;
        if (given) ws.data = ws_buf, ws.bytes = ws_bytes;
        auto call = [&](int) { forward(tq, tk, tv, to, lse ? &tl : nullptr, opt, nullptr, ws); };
        for (int i = 0; i < (ncu ? 3 : 5); ++i) call(i);
        probe::check(cudaDeviceSynchronize(), "warm-up");
        if (ncu) continue;
        const probe::PerCall t = probe::time_per_call(call, 50);
        const float b2b = probe::time_back_to_back(call, 50);
        std::printf("%-20s lse=%d ws=%s  per-call median %8.2f us (min %8.2f)  back-to-back "
                    "%8.2f us/call  %s\n",
                    c.name, lse, given ? "given" : "alloc", t.median_us, t.min_us, b2b,
                    last_kernel_name().c_str());
      }
    for (void* p : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)l}) cudaFree(p);
  }
  probe::check(cudaGetLastError(), "the probe");
}
