// hipflash example: one causal forward with LSE on CPU buffers, through the installed package.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <hipflash/detail/host_numeric.hpp>
#include <hipflash/hipflash.hpp>

int main() {
  const int64_t B = 1, Sq = 4, Sk = 6, Hq = 2, Hkv = 1, D = 64;
  const auto bf16 = hipflash::DType::bf16;

  // Inputs in bf16 (stored as uint16_t), filled with a small deterministic pattern.
  std::vector<uint16_t> q(B * Sq * Hq * D), k(B * Sk * Hkv * D), v(B * Sk * Hkv * D);
  std::vector<uint16_t> out(q.size());
  std::vector<float> lse(B * Hq * Sq);
  auto fill = [](std::vector<uint16_t>& x, int seed) {
    for (size_t i = 0; i < x.size(); ++i)
      x[i] = hipflash::detail::float_to_bf16(std::sin(0.37f * float(i) + float(seed)));
  };
  fill(q, 1);
  fill(k, 2);
  fill(v, 3);

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
  for (uint16_t h : out)
    if (std::isnan(hipflash::detail::bf16_to_float(h))) return std::fprintf(stderr, "NaN in out\n"), 1;
  std::printf("hipflash %s, kernel %s: lse[0,0,0] = %.6f, out[0,0,0,0] = %.6f\n",
              hipflash::build_info().c_str(), hipflash::last_kernel_name().c_str(), lse[0],
              hipflash::detail::bf16_to_float(out[0]));
  return 0;
}
