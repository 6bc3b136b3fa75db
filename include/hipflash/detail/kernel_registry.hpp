// hipflash — the kernel registry (kernels.def) as C++: the kernel kinds, their names, which
// builds have them and the head dims they take, and the padded head dims. Everything that asks
// "which kernels exist, where, for which head dims" reads these, never a list of its own.
#pragma once

#include <cstddef>
#include <string>

namespace hipflash {

enum class KernelKind : int {
  cpu_reference,  ///< the CPU backend
#define HIPFLASH_HEAD_DIM(padded, also)
#define HIPFLASH_KERNEL(kind, launcher, build, max_head_dim, kv_cache, fp8_head_dim, summary) kind,
#include "hipflash/detail/kernels.def"
#undef HIPFLASH_KERNEL
#undef HIPFLASH_HEAD_DIM
  unsupported,
};

/// The builds a kernel kind exists in (kernels.def's `build` field).
enum class KernelBuild : int { gpu, cuda, cuda_sm90a, hip_gfx950 };

/// The KV caches a kernel kind's loaders read (kernels.def's `kv_cache` field): none; caches of
/// q's dtype; those and float8_e4m3fn caches (dequantised in registers).
enum class KvCacheReads : int { none, cache, cache_fp8 };

namespace registry {

struct Kernel {
  KernelKind kind;
  const char* name;
  KernelBuild build;
  int max_head_dim;  ///< the largest padded head dim it has a tile for
  KvCacheReads kv_cache;  ///< the KV caches its loaders read
  int fp8_head_dim;       ///< the largest padded head dim of its fp8 forward (0: none)
};
inline constexpr Kernel kKernels[] = {
#define HIPFLASH_HEAD_DIM(padded, also)
#define HIPFLASH_KERNEL(kind, launcher, build, max_head_dim, kv_cache, fp8_head_dim, summary) \
  {KernelKind::kind, #kind, KernelBuild::build, max_head_dim, KvCacheReads::kv_cache, fp8_head_dim},
#include "hipflash/detail/kernels.def"
#undef HIPFLASH_KERNEL
#undef HIPFLASH_HEAD_DIM
};

struct HeadDim {
  int padded;  ///< instantiated
  int also;    ///< a smaller head dim it serves, zero-padded (0: none)
};
inline constexpr HeadDim kHeadDims[] = {
#define HIPFLASH_HEAD_DIM(padded, also) {padded, also},
#define HIPFLASH_KERNEL(...)
#include "hipflash/detail/kernels.def"
#undef HIPFLASH_KERNEL
#undef HIPFLASH_HEAD_DIM
};
inline constexpr int kNumHeadDims = int(std::size(kHeadDims));

}  // namespace registry

constexpr const char* kernel_kind_name(KernelKind k) {
  if (k == KernelKind::cpu_reference) return "cpu";
  for (const auto& e : registry::kKernels)
    if (e.kind == k) return e.name;
  return "unsupported";
}

/// Padded head dim of the instantiations serving `head_dim`, or 0 if unsupported.
constexpr int padded_head_dim(int head_dim) {
  for (const auto& e : registry::kHeadDims)
    if (head_dim == e.padded || (e.also != 0 && head_dim == e.also)) return e.padded;
  return 0;
}

/// Bit of padded head dim `padded` in a head-dim mask (BuildCaps::head_dim_mask,
/// HIPFLASH_HEAD_DIM_MASK), or -1.
constexpr int head_dim_bit(int padded) {
  for (int i = 0; i < registry::kNumHeadDims; ++i)
    if (registry::kHeadDims[i].padded == padded) return i;
  return -1;
}
constexpr bool head_dim_in_mask(unsigned mask, int padded) {
  return head_dim_bit(padded) >= 0 && (mask >> head_dim_bit(padded) & 1u);
}

/// The largest padded head dim a kernel has a tile for (the selector, the dispatch and the
/// launchers read it); the CPU backend takes every head dim.
constexpr int max_head_dim(KernelKind k) {
  for (const auto& e : registry::kKernels)
    if (e.kind == k) return e.max_head_dim;
  return k == KernelKind::cpu_reference ? registry::kHeadDims[registry::kNumHeadDims - 1].padded
                                        : 0;
}

/// Whether a kernel's loaders read a KV cache (flash_attn_with_kvcache; contiguous or paged).
constexpr bool reads_kv_cache(KernelKind k) {
  for (const auto& e : registry::kKernels)
    if (e.kind == k) return e.kv_cache != KvCacheReads::none;
  return k == KernelKind::cpu_reference;
}

/// Whether a kernel's loaders read a float8_e4m3fn KV cache (it has those instantiations).
constexpr bool reads_fp8_kv_cache(KernelKind k) {
  for (const auto& e : registry::kKernels)
    if (e.kind == k) return e.kv_cache == KvCacheReads::cache_fp8;
  return k == KernelKind::cpu_reference;
}

/// The largest padded head dim a kernel runs the fp8 forward (float8_e4m3fn q, k, v) at; 0: none.
constexpr int fp8_max_head_dim(KernelKind k) {
  for (const auto& e : registry::kKernels)
    if (e.kind == k) return e.fp8_head_dim;
  return k == KernelKind::cpu_reference ? registry::kHeadDims[registry::kNumHeadDims - 1].padded
                                        : 0;
}

/// "32, 64, 96, 128, 256": the head dims a call may have, for error messages.
inline std::string supported_head_dims() {
  std::string s;
  for (const auto& e : registry::kHeadDims) {
    if (e.also != 0) s += std::to_string(e.also) + ", ";
    s += std::to_string(e.padded) + ", ";
  }
  return s.substr(0, s.size() - 2);
}

}  // namespace hipflash
