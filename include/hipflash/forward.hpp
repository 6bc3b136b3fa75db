// hipflash — the public forward entry points (SPEC §1).
//
//   hipflash::forward(q, k, v, out, lse, opts, stream)
//   hipflash::varlen_forward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, opts, stream)
//
// Tensors live on the CPU (TensorRef::loc.kind == cpu: the CPU backend, `stream` ignored) or on
// one GPU (the device kernels, launched on `stream`). Every argument is validated first; a bad
// call throws hipflash::invalid_argument / dtype_error / not_implemented and writes nothing.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>

#include "hipflash/errors.hpp"
#include "hipflash/params.hpp"
#include "hipflash/types.hpp"

namespace hipflash {

struct FwdOptions {
  std::optional<float> softmax_scale;  ///< default 1/sqrt(D)
  bool causal = false;                 ///< bottom-right aligned; same as window (left, 0)
  int64_t window_left = -1;            ///< -1: unbounded
  int64_t window_right = -1;           ///< -1: unbounded
  int num_splits = 0;                  ///< 0: heuristic; 1: no split-K
  bool return_lse = false;             ///< write lse; requires an lse buffer
  /// > 0: logit soft-capping, cap * tanh(score / cap) before the softmax (FlashAttention 2's
  /// softcap, Gemma 2); 0: off. The CPU backend and the NVIDIA forward kernels; the GPU backward
  /// and AMD GPUs raise not_implemented.
  float softcap = 0.f;
  /// ALiBi (FlashAttention 2's alibi_slopes): fp32 [heads_q] or [batch, heads_q] on q's device;
  /// row i's score of key j gets -slope * |i + Sk - Sq - j| (after the softcap). nullptr: off.
  /// The CPU backend and the NVIDIA forward kernels; the GPU backward and AMD GPUs raise
  /// not_implemented.
  const TensorRef* alibi_slopes = nullptr;
  /// fp8 (FlashAttention 3's): with float8_e4m3fn q, k and v (and a bfloat16 out), fp32 descale
  /// factors, each [] / [1] (the tensor's) or [batch, heads_kv] (a query head takes its kv
  /// head's): the scores are (q.k) * q_descale * k_descale * softmax_scale — the LSE is theirs —
  /// and out = softmax . v * v_descale. nullptr: 1. Refused for other dtypes. Descales must be
  /// positive and finite (FlashAttention 3's; not checked on the GPU, where they are device
  /// values). The CPU backend dequantises (the reference); on GPUs the sm90_ws kernel (Hopper)
  /// or the generic kernel (AMD gfx94x / gfx950, compile-checked only) — SPEC §3.
  const TensorRef* q_descale = nullptr;
  const TensorRef* k_descale = nullptr;
  const TensorRef* v_descale = nullptr;
};

struct VarlenOptions : FwdOptions {
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
  LseLayout lse_layout = LseLayout::padded;
  /// FlashAttention 3's seqused_q / seqused_k: int32 [batch] on q's device, or nullptr. Sequence
  /// b uses only its first seqused_q[b] query rows and seqused_k[b] keys (each at most its
  /// cu_seqlens length; masks bottom-right aligned on the used lengths); its other rows get
  /// out = 0 and LSE -inf (and zero gradients). The CPU backend and the NVIDIA kernels, forward
  /// and backward (the values copied back for their checks, as cu_seqlens are); AMD GPUs raise
  /// not_implemented.
  const TensorRef* seqused_q = nullptr;
  const TensorRef* seqused_k = nullptr;
};

/// Split-K scratch, all optional. A call that splits uses `data` when `bytes` is enough
/// (>= splitk_workspace_bytes(...); an fp8 call that runs on bf16 copies, docs/spec.md §3,
/// needs room for the copies too, 2 bytes an element of q, k and v, and otherwise asks for
/// it); otherwise it asks `allocate` for the bytes it needs: device
/// memory on the tensors' GPU, usable by work enqueued on the call's stream, that the caller
/// keeps alive until the call returns (a framework's caching allocator: the PyTorch binding
/// passes at::empty). Without either the launcher allocates and frees its own, stream-ordered.
/// Either must be 16-byte aligned.
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
  std::function<void*(size_t bytes)> allocate;
};

/// Dense forward. q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], out like q,
/// lse fp32 [B, Hq, Sq] contiguous (only when opts.return_lse; pass nullptr otherwise).
void forward(const TensorRef& q, const TensorRef& k, const TensorRef& v, const TensorRef& out,
             const TensorRef* lse, const FwdOptions& opts = {}, Stream stream = nullptr,
             Workspace workspace = {});

/// Varlen forward. q [total_q, Hq, D], k/v [total_k, Hkv, D], cu_seqlens int32 [B + 1];
/// lse fp32 [B, Hq, max_seqlen_q] (padded) or [Hq, total_q] (packed).
void varlen_forward(const TensorRef& q, const TensorRef& k, const TensorRef& v,
                    const TensorRef& out, const TensorRef* lse, const TensorRef& cu_seqlens_q,
                    const TensorRef& cu_seqlens_k, const VarlenOptions& opts,
                    Stream stream = nullptr, Workspace workspace = {});

/// The split count num_splits = 0 resolves to for this problem (deterministic: passing the
/// returned count explicitly gives bitwise the same result).
int resolve_num_splits(const TensorRef& q, const TensorRef& k, const FwdOptions& opts);

/// Bytes of split-K workspace a call needs (0 when it does not split).
size_t splitk_workspace_bytes(const FwdParams& params);

/// The head dims the kernels support (SPEC §2) are the kernel registry's:
/// hipflash::padded_head_dim(d) != 0, listed by supported_head_dims()
/// (hipflash/detail/kernel_registry.hpp).

/// Human-readable name of what this build can run ("cpu", "cpu+cuda(sm_80,sm_90a)", ...).
std::string build_info();

/// Whether this build has GPU kernels and a GPU is visible.
bool gpu_available();

/// A function the CPU backend polls between tiles of a long call (on the calling thread, at
/// most every few milliseconds); when it returns true the call stops and throws
/// hipflash::interrupted. Process-wide; nullptr (the default) turns polling off. The PyTorch
/// binding installs one that runs Python's signal handlers, so Ctrl-C interrupts a CPU call.
using InterruptCheck = bool (*)();
void set_interrupt_check(InterruptCheck check);

/// Name of the kernel the last forward() on this thread ran, e.g.
/// "fwd_generic_bf16_hd128_causal_lse_sm90" or "cpu_reference" (for benchmarks and logs).
std::string last_kernel_name();

}  // namespace hipflash
