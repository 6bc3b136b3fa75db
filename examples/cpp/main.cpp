// hipflash example: one causal forward with LSE on CPU buffers, through the installed package.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <hipflash/hipflash.hpp>

int main() {
  const int64_t B = 1, Sq = 4, Sk = 6, Hq = 2, Hkv = 1, D = 64;
  const auto bf16 = hipflash::DType::bf16;

  // Inputs in bf16 (16-bit words, hipflash/numeric.hpp), from a small deterministic pattern.
  auto pattern = [](int64_t n, int seed) {
    std::vector<float> x(static_cast<size_t>(n));
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * float(i) + float(seed));
    return x;
  };
  std::vector<uint16_t> q = hipflash::float_to_bf16(pattern(B * Sq * Hq * D, 1));
  std::vector<uint16_t> k = hipflash::float_to_bf16(pattern(B * Sk * Hkv * D, 2));
  std::vector<uint16_t> v = hipflash::float_to_bf16(pattern(B * Sk * Hkv * D, 3));
  std::vector<uint16_t> out(q.size());
  std::vector<float> lse(size_t(B * Hq * Sq));

  // Host buffers: the CPU backend runs them (a GPU build runs device pointers on the GPU).
  auto tq = hipflash::make_tensor(q.data(), bf16, {B, Sq, Hq, D});
  auto tk = hipflash::make_tensor(k.data(), bf16, {B, Sk, Hkv, D});
  auto tv = hipflash::make_tensor(v.data(), bf16, {B, Sk, Hkv, D});
  auto tout = hipflash::make_tensor(out.data(), bf16, {B, Sq, Hq, D});
  auto tlse = hipflash::make_tensor(lse.data(), hipflash::DType::f32, {B, Hq, Sq});

  hipflash::FwdOptions opts;
  opts.causal = true;  // bottom-right aligned: row 0 sees keys 0..2
  opts.return_lse = true;
  try {
    hipflash::forward(tq, tk, tv, tout, &tlse, opts);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hipflash::forward failed: %s\n", e.what());
    return 1;
  }

  for (float x : lse)
    if (!std::isfinite(x)) return std::fprintf(stderr, "non-finite lse %f\n", x), 1;
  const std::vector<float> outf = hipflash::bf16_to_float(out);
  for (float x : outf)
    if (std::isnan(x)) return std::fprintf(stderr, "NaN in out\n"), 1;
  std::printf("hipflash %s, kernel %s: lse[0,0,0] = %.6f, out[0,0,0,0] = %.6f\n",
              hipflash::build_info().c_str(), hipflash::last_kernel_name().c_str(), lse[0],
              outf[0]);
  return 0;
}
