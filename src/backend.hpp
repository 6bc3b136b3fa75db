// hipflash — what the launcher needs from each backend (internal).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "hipflash/bwd_params.hpp"
#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/detail/selector.hpp"
#include "hipflash/forward.hpp"
#include "hipflash/merge_params.hpp"
#include "hipflash/params.hpp"

namespace hipflash {

/// The launcher's validation (SPEC §4) and FwdParams of a dense / varlen call, before the
/// kernel is selected and num_splits resolved (p.num_splits is 1). Internal: the host tests of
/// the kernel schedules build their parameters with them. make_varlen_params reads cu_seqlens
/// to the host to check them (unless the stream captures a graph); `host_cu_k` / `host_cu_q`,
/// when given, receive those copies (empty while capturing).
FwdParams make_dense_params(const TensorRef& q, const TensorRef& k, const TensorRef& v,
                            const TensorRef& out, const TensorRef* lse, const FwdOptions& opts);
FwdParams make_varlen_params(const TensorRef& q, const TensorRef& k, const TensorRef& v,
                             const TensorRef& out, const TensorRef* lse, const TensorRef& cu_q,
                             const TensorRef& cu_k, const VarlenOptions& opts, Stream stream,
                             std::vector<int32_t>* host_cu_k = nullptr,
                             std::vector<int32_t>* host_cu_q = nullptr);

/// The select and split steps of dispatch_forward alone: throws what dispatch_forward would
/// throw before launching (a kernel or head dim this build lacks, a workspace too large).
void check_forward_plan(const FwdParams& p, const FwdOptions& opts, Location loc);

/// fp8 q, k and v that no fp8 kernel takes (Selection::widened_fp8: head dim 256, strides a TMA
/// map cannot describe, ALiBi, GPUs without fp8 tensor cores) run on the bf16 kernels over
/// widened copies (kernels/fp8/widen_kernel.hpp): q * q_descale * k_descale, k, and
/// v * v_descale in bf16, each contiguous ([B, S, H, D], or [total, H, D] for varlen) and
/// 256-byte aligned, q then k then v. Their bytes:
size_t widened_fp8_bytes(const FwdParams& p);
/// `p` reading those copies at `base` (nullptr: their layout alone, which the selector judges):
/// dtype bf16, contiguous strides, no descales.
FwdParams widened_fp8_params(const FwdParams& p, void* base);

/// select -> resolve num_splits -> run, for FwdParams the caller validated (make_*_params and
/// its own checks): the launcher's dispatch, shared with kvcache_forward.
void dispatch_forward(FwdParams& p, const FwdOptions& opts, Location loc, Stream stream,
                      Workspace ws);

}  // namespace hipflash

namespace hipflash::cpu {

/// The CPU backend: SPEC §3 on host memory, multi-threaded, tiled with the online softmax.
void run_forward(const FwdParams& params);

/// Runs fn(0 .. items - 1) on the CPU backend's threads (the caller's among them), items taken
/// in order from a shared counter; the calling thread polls the interrupt check between its
/// items (hipflash::interrupted). The first exception of any item is rethrown here.
void parallel_for(int64_t items, const std::function<void(int64_t)>& fn);

/// The function set by hipflash::set_interrupt_check (nullptr: none).
InterruptCheck interrupt_check();

/// Threads the CPU backend uses (its "multiprocessor count" for the split heuristic).
int num_threads();

}  // namespace hipflash::cpu

namespace hipflash::gpu {

/// What the GPU part of this build contains (HIPFLASH_GPU=none: gpu == false).
BuildCaps build_caps();
std::string build_info();

/// Arch of device `device`; throws runtime_error if there is none.
Arch device_arch(int device);

/// Device ordinal owning `ptr`, or -1 when it is host memory (or no GPU runtime is built).
int pointer_device(const void* ptr);

/// Synchronous copy of `bytes` from device memory on `stream` to the host.
void copy_to_host(void* dst, const void* src, size_t bytes, Stream stream);

/// Whether `stream` is capturing a CUDA/HIP graph (no synchronous copy may run on it then).
bool stream_capturing(Stream stream);

/// What a forward launch chose beyond the selection, for last_kernel_name(): whether the
/// sm90_ws kernel ran its long-row tile (sm90_ws::long_row_tile, decided at launch).
struct Launched {
  bool long_rows = false;
};

/// Launches the selected forward (and, for num_splits > 1, the combine) on `stream`.
/// `params` are validated; the split workspace is allocated here when `ws` is too small.
Launched run_forward(const FwdParams& params, const Selection& sel, int device, Stream stream,
                     Workspace ws);

/// Launches the backward passes for `params` (validated; the grads' checks done) on `stream`:
/// alignment checked first, the fp32 workspace taken from `ws` or allocated on the stream.
/// total_q / total_k: rows of the varlen tensors (0 for dense calls); zero_q / zero_k: whether
/// some row of dq / of dk and dv lies outside every sequence's used rows (the zero-fill pass).
void run_backward(const BwdParams& params, int device, Stream stream, Workspace ws,
                  int64_t total_q, int64_t total_k, bool zero_q = true, bool zero_k = true);

/// Launches the merge_attn_states kernel for `p` (validated, on GPU `device`) on `stream`.
void run_merge(const MergeParams& p, int device, Stream stream);

/// The sm version of the code the KV-cache append kernel runs on the current device (port::
/// code_version; every GPU TU is built for one arch list): device_arch's Arch::fp8_cvt.
int kvcache_append_code_version();

/// Appends k_new / v_new ([B, S_new, Hkv, D], validated) to the cache `p` describes (k, v,
/// strides, seqlens_k on the device, block table) on `stream`, before the forward.
void run_kvcache_append(const FwdParams& p, const TensorRef& k_new, const TensorRef& v_new,
                        int device, Stream stream);

/// seqused_q (`p` validated, varlen, on GPU `device`): out 0 and packed LSE -inf on each
/// sequence's rows past seqused_q[b], which the forward kernels do not write; on `stream`.
void run_seqused_rows(const FwdParams& p, int device, Stream stream);

/// The tile of a GPU kernel: query rows and keys per block, resident blocks per multiprocessor
/// (what the split heuristic fills), heads per block (the head-group decode kernel: every kv
/// head of a batch), for a masked (causal / window) call or not. All zero (heads one) when this
/// build has no such kernel.
struct TileShape {
  int block_m = 0, block_n = 0, blocks_per_sm = 0, heads_per_block = 1;
  /// Keys the split heuristic counts as one block (its floor: four a split), if more than
  /// block_n: the head-group decode kernel's 16-key stages would allow splits of 64 keys,
  /// mostly its ring's fill.
  int split_block_n = 0;
};
TileShape tile_shape(KernelKind kind, int padded_head_dim, bool masked);

}  // namespace hipflash::gpu

