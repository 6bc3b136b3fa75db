// hipflash — the launcher: validate -> select -> dispatch (SPEC §4, §5).
//
// Every check below runs before any output is touched or any kernel is launched.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "backend.hpp"
#include "hipflash/detail/selector.hpp"
#include "hipflash/forward.hpp"
#include "tensor_checks.hpp"

namespace hipflash {
namespace {

using detail::check_disjoint;
using detail::check_no_self_overlap;
using detail::shape_str;

/// What the last call on this thread ran; its name is built only when asked for (the string
/// work stays off the per-call path).
struct LastKernel {
  enum { none, cpu, gpu } where = none;
  KernelKind kind{};
  KernelKey key{};
  Arch arch{};
  bool long_rows = false;  ///< sm90_ws ran its long-row tile (gpu::Launched)
  bool widened_fp8 = false;  ///< fp8 inputs run on bf16 copies (Selection::widened_fp8)
};
thread_local LastKernel t_last_kernel;

std::string loc_str(Location l) {
  return l.kind == Location::cpu ? std::string("cpu") : "gpu:" + std::to_string(l.index);
}

/// Rank, sizes >= 0, and every element addressable in 64 bits (SPEC §2, §4): the first check
/// of every tensor, so that nothing after it can overflow computing sizes or offsets.
void check_rank(const TensorRef& t, const char* name, int rank, const char* layout) {
  HIPFLASH_CHECK(t.rank == rank, name, " must have rank ", rank, " (", layout, "), got shape ",
                 shape_str(t));
  for (int i = 0; i < rank; ++i)
    HIPFLASH_CHECK(t.sizes[i] >= 0, name, " has a negative size: ", shape_str(t));
  const char* why = "";
  HIPFLASH_CHECK(detail::indexable(t, &why), name, " with shape ", shape_str(t),
                 " cannot be indexed in 64 bits: ", why);
  detail::check_known_location(t, name);
}

/// a * b * ... in int64, or an invalid_argument naming `what`.
int64_t checked_product(std::initializer_list<int64_t> factors, const char* what) {
  int64_t r = 1;
  for (int64_t f : factors)
    HIPFLASH_CHECK(!__builtin_mul_overflow(r, f, &r), what, " overflows int64");
  return r;
}

void check_half_dtype(const TensorRef& t, const char* name, DType expected) {
  HIPFLASH_CHECK_AS(dtype_error, t.dtype == expected, name, " must have dtype ",
                    dtype_name(expected), " (the dtype of q), got ", dtype_name(t.dtype));
}

void check_last_dim(const TensorRef& t, const char* name) {
  HIPFLASH_CHECK(detail::last_dim_contiguous(t), name,
                 " must have a contiguous last dimension (stride 1), got stride ",
                 t.strides[t.rank - 1]);
}

void check_location(const TensorRef& t, const char* name, Location expected) {
  HIPFLASH_CHECK(t.loc == expected, name, " is on ", loc_str(t.loc), " but q is on ",
                 loc_str(expected), "; all tensors must be on the same device");
}

/// Shared by dense and varlen: the checks on q, k, v, out given their roles in the shape.
struct Dims { int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim; };

void check_options(const FwdOptions& opts);

/// The checks on q and k that every forward makes and resolve_num_splits too: their dtypes and
/// device, the head dim, and k/v heads that divide the query heads.
void check_qk(const TensorRef& q, const TensorRef& k, const Dims& d) {
  HIPFLASH_CHECK_AS(dtype_error,
                    q.dtype == DType::f16 || q.dtype == DType::bf16 || q.dtype == DType::e4m3,
                    "q must have dtype float16, bfloat16 or float8_e4m3fn, got ",
                    dtype_name(q.dtype));
  check_half_dtype(k, "k", q.dtype);
  check_location(k, "k", q.loc);
  HIPFLASH_CHECK(padded_head_dim(int(d.head_dim)) != 0 && d.head_dim == int(d.head_dim),
                 "head dim ", d.head_dim, " is not supported; supported head dims are ",
                 supported_head_dims());
  HIPFLASH_CHECK(d.heads_kv > 0 && d.heads_q % d.heads_kv == 0,
                 "the number of k/v heads (", d.heads_kv,
                 ") must divide the number of query heads (", d.heads_q, ")");
}

void check_common(const TensorRef& q, const TensorRef& k, const TensorRef& v,
                  const TensorRef& out, const FwdOptions& opts, const Dims& d) {
  check_qk(q, k, d);
  check_half_dtype(v, "v", q.dtype);
  if (q.dtype == DType::e4m3)
    HIPFLASH_CHECK_AS(dtype_error, out.dtype == DType::bf16,
                      "out must have dtype bfloat16 for float8_e4m3fn inputs, got ",
                      dtype_name(out.dtype));
  else
    check_half_dtype(out, "out", q.dtype);
  check_location(v, "v", q.loc);
  check_location(out, "out", q.loc);
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}}) {
    check_last_dim(*t, name);
    HIPFLASH_CHECK(t->data != nullptr || t->numel() == 0, name, " has no data pointer");
  }
  // Row-indexed buffers (LSE, split-K partials) hold B * Hq * Sq rows of up to D + 2 floats.
  checked_product({d.batch, d.heads_q, std::max<int64_t>(d.seqlen_q, 1), d.head_dim + 2,
                   int64_t(sizeof(float))},
                  "batch * heads_q * seqlen_q * (head_dim + 2) * 4 (the rows of the LSE and "
                  "split-K buffers)");
  check_no_self_overlap(out, "out");
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check_disjoint(out, "out", *t, name);
  check_options(opts);
}

/// The options every forward checks (SPEC §4), resolve_num_splits too.
void check_options(const FwdOptions& opts) {
  HIPFLASH_CHECK(!opts.softmax_scale || (std::isfinite(*opts.softmax_scale) &&
                                         *opts.softmax_scale > 0.f &&
                                         *opts.softmax_scale <= kMaxSoftmaxScale),
                 "softmax_scale must be a number in (0, ", kMaxSoftmaxScale,
                 "] (larger scales overflow the fp32 scores), got ",
                 opts.softmax_scale.value_or(0.f));
  HIPFLASH_CHECK(std::isfinite(opts.softcap) && opts.softcap >= 0.f,
                 "softcap must be a finite number >= 0 (0: off), got ", opts.softcap);
  HIPFLASH_CHECK(opts.window_left >= -1 && opts.window_right >= -1,
                 "window_size must be (left, right) with -1 (unbounded) or values >= 0, got (",
                 opts.window_left, ", ", opts.window_right, ")");
  HIPFLASH_CHECK(opts.num_splits >= 0 && opts.num_splits <= kMaxSplits,
                 "num_splits must be in [0, ", kMaxSplits, "] (0 = heuristic), got ",
                 opts.num_splits);
}

void check_lse(const TensorRef* lse, const TensorRef& q, const TensorRef& out, const TensorRef& k,
               const TensorRef& v, std::initializer_list<int64_t> shape, const char* layout) {
  const TensorRef expected = make_tensor(nullptr, DType::f32, shape);
  HIPFLASH_CHECK(lse != nullptr,
                 "return_lse is set but no lse buffer was given; pass an fp32 tensor of shape ",
                 layout, " = ", shape_str(expected));
  HIPFLASH_CHECK(lse->data != nullptr || expected.numel() == 0,
                 "return_lse is set but the lse buffer has no data pointer");
  HIPFLASH_CHECK_AS(dtype_error, lse->dtype == DType::f32, "lse must have dtype float32, got ",
                    dtype_name(lse->dtype));
  check_location(*lse, "lse", q.loc);
  bool same_shape = lse->rank == expected.rank;
  for (int i = 0; same_shape && i < expected.rank; ++i)
    same_shape = lse->sizes[i] == expected.sizes[i];
  HIPFLASH_CHECK(same_shape, "lse buffer has shape ", shape_str(*lse), " but must be ", layout,
                 " = ", shape_str(expected));
  // An empty lse is trivially contiguous (its strides are free: torch gives [2, 0] strides
  // [1, 1], make_tensor [0, 1]).
  for (int d = 0; d < expected.rank && expected.numel() > 0; ++d)
    HIPFLASH_CHECK(lse->sizes[d] <= 1 || lse->strides[d] == expected.strides[d],
                   "lse must be contiguous (row-major ", layout, ")");
  const char* why = "";
  HIPFLASH_CHECK(detail::indexable(*lse, &why), "lse cannot be indexed in 64 bits: ", why);
  check_disjoint(*lse, "lse", out, "out");
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check_disjoint(*lse, "lse", *t, name);
}

/// FlashAttention 3's seqused_q / seqused_k (VarlenOptions): int32 [batch], contiguous, on q's
/// device, not overlapping out or lse; each value in [0, its sequence's cu_seqlens length]
/// (`cu_q` / `cu_k`: the host copies; a GPU tensor's values are copied back as cu_seqlens are,
/// and like them not checked while the stream captures a graph). CPU tensors and NVIDIA GPUs
/// (AMD: not_implemented, before any value is read).
void check_seqused(const VarlenOptions& opts, const TensorRef& q, const TensorRef& out,
                   const TensorRef* lse, int64_t batch, const std::vector<int32_t>& cu_q,
                   const std::vector<int32_t>& cu_k, Stream stream, bool capturing) {
  for (auto [t, name, cu] : {std::tuple{opts.seqused_q, "seqused_q", &cu_q},
                             std::tuple{opts.seqused_k, "seqused_k", &cu_k}}) {
    if (t == nullptr) continue;
    HIPFLASH_CHECK(t->dtype == DType::i32, name, " must have dtype int32, got ",
                   dtype_name(t->dtype));
    HIPFLASH_CHECK(t->rank == 1 && t->sizes[0] == batch, name, " must have shape [batch] = [",
                   batch, "], got ", shape_str(*t));
    HIPFLASH_CHECK(batch <= 1 || t->strides[0] == 1, name, " must be contiguous");
    HIPFLASH_CHECK(t->data != nullptr || batch == 0, name, " has no data pointer");
    check_location(*t, name, q.loc);
    check_disjoint(out, "out", *t, name);
    if (opts.return_lse) check_disjoint(*lse, "lse", *t, name);
    HIPFLASH_CHECK_AS(not_implemented,
                      q.loc.kind == Location::cpu || gpu::build_caps().gpu_vendor == Arch::nvidia,
                      name, " runs on the CPU backend and NVIDIA GPUs only: the AMD kernels do "
                      "not read it yet");
    if (capturing) continue;
    std::vector<int32_t> used(static_cast<size_t>(batch));
    if (batch > 0 && q.loc.kind == Location::cpu)
      std::memcpy(used.data(), t->data, size_t(batch) * sizeof(int32_t));
    else if (batch > 0)
      gpu::copy_to_host(used.data(), t->data, size_t(batch) * sizeof(int32_t), stream);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = int64_t((*cu)[b + 1]) - (*cu)[b];
      HIPFLASH_CHECK(used[b] >= 0 && used[b] <= len, name, "[", b, "] = ", used[b],
                     " must be in [0, ", len, "] (the sequence's cu_seqlens length)");
    }
  }
}

/// ALiBi's slopes (FwdOptions::alibi_slopes): fp32 [Hq] or [B, Hq] with a contiguous last
/// dimension, on q's device, not overlapping out or lse; into p (which has its batch and heads).
void fill_alibi(FwdParams& p, const FwdOptions& opts, const TensorRef& q, const TensorRef& out,
                const TensorRef* lse) {
  const TensorRef* a = opts.alibi_slopes;
  if (a == nullptr) return;
  HIPFLASH_CHECK_AS(dtype_error, a->dtype == DType::f32, "alibi_slopes must have dtype float32, got ",
                    dtype_name(a->dtype));
  const bool per_head = a->rank == 1 && a->sizes[0] == p.heads_q;
  const bool per_batch = a->rank == 2 && a->sizes[0] == p.batch && a->sizes[1] == p.heads_q;
  HIPFLASH_CHECK(per_head || per_batch, "alibi_slopes must have shape [heads_q] = [", p.heads_q,
                 "] or [batch, heads_q] = [", p.batch, ", ", p.heads_q, "], got ", shape_str(*a));
  const char* why = "";
  HIPFLASH_CHECK(detail::indexable(*a, &why), "alibi_slopes cannot be indexed in 64 bits: ", why);
  HIPFLASH_CHECK(p.heads_q <= 1 || a->strides[a->rank - 1] == 1,
                 "alibi_slopes must have a contiguous last dimension");
  HIPFLASH_CHECK(a->data != nullptr || p.heads_q == 0 || p.batch == 0,
                 "alibi_slopes has no data pointer");
  check_location(*a, "alibi_slopes", q.loc);
  check_disjoint(out, "out", *a, "alibi_slopes");
  if (opts.return_lse && lse) check_disjoint(*lse, "lse", *a, "alibi_slopes");
  p.alibi_slopes = static_cast<const float*>(a->data);
  p.alibi_batch_stride = per_batch ? a->strides[0] : 0;
}

/// An fp8 call's descale factors (FwdOptions::q_descale ...): fp32 [] / [1] or [batch,
/// heads_kv], on q's device, not overlapping out or lse; refused for other dtypes. Into p (which
/// has its batch, heads and dtype).
void fill_descales(FwdParams& p, const FwdOptions& opts, const TensorRef& q, const TensorRef& out,
                   const TensorRef* lse) {
  for (auto [t, dst, name] : {std::tuple{opts.q_descale, &p.q_descale, "q_descale"},
                              std::tuple{opts.k_descale, &p.k_descale, "k_descale"},
                              std::tuple{opts.v_descale, &p.v_descale, "v_descale"}}) {
    if (t == nullptr) continue;
    HIPFLASH_CHECK(p.dtype == DType::e4m3, name, " applies to float8_e4m3fn inputs only (q is ",
                   dtype_name(p.dtype), ")");
    HIPFLASH_CHECK_AS(dtype_error, t->dtype == DType::f32, name, " must have dtype float32, got ",
                      dtype_name(t->dtype));
    const bool whole = t->rank == 0 || (t->rank == 1 && t->sizes[0] == 1);
    const bool per_head = t->rank == 2 && t->sizes[0] == p.batch && t->sizes[1] == p.heads_kv;
    HIPFLASH_CHECK(whole || per_head, name, " must have shape [] or [1] (the tensor's) or ",
                   "[batch, heads_kv] = [", p.batch, ", ", p.heads_kv, "], got ", shape_str(*t));
    const char* why = "";
    HIPFLASH_CHECK(detail::indexable(*t, &why), name, " cannot be indexed in 64 bits: ", why);
    HIPFLASH_CHECK(t->data != nullptr || t->numel() == 0, name, " has no data pointer");
    check_location(*t, name, q.loc);
    check_disjoint(out, "out", *t, name);
    if (opts.return_lse && lse) check_disjoint(*lse, "lse", *t, name);
    *dst = {static_cast<const float*>(t->data), per_head ? t->strides[0] : 0,
            per_head ? t->strides[1] : 0};
  }
}

/// The window of SPEC §3, saturated: a bound that reaches every key of every row is the same
/// as -1, however large the integer, so the kernels' window arithmetic never overflows and such
/// a call runs unmasked. Bottom-right aligned, row i sees keys [i + d - left, i + d + right]
/// with d = Sk - Sq (per sequence for varlen and a KV cache, whose lengths are at most the max
/// lengths here): the last row's lower bound Sk - 1 - left is <= 0 for left >= Sk - 1, the
/// first row's upper bound Sk - Sq + right is >= Sk - 1 for right >= Sq - 1. So causal decode
/// (one query row: right 0) masks nothing and takes the packed GQA decode path. Needs
/// p.seqlen_q / seqlen_k.
void fill_window(FwdParams& p, const FwdOptions& opts) {
  const int64_t right = opts.causal ? 0 : opts.window_right;
  p.window_left = opts.window_left >= p.seqlen_k - 1 ? -1 : opts.window_left;
  p.window_right = right >= p.seqlen_q - 1 ? -1 : right;
}

/// What every maker of FwdParams takes from the call's options alike (needs p's shape): the
/// dtypes, the scale, the softcap, ALiBi, the descales, the window and whether the LSE is asked.
void fill_options(FwdParams& p, const FwdOptions& opts, const TensorRef& q, const TensorRef& k,
                  const TensorRef& out, const TensorRef* lse) {
  p.dtype = q.dtype;
  p.out_dtype = out.dtype;
  p.kv_dtype = k.dtype;
  p.softmax_scale = opts.softmax_scale.value_or(1.f / std::sqrt(float(p.head_dim)));
  p.softcap = opts.softcap;
  fill_alibi(p, opts, q, out, lse);
  fill_descales(p, opts, q, out, lse);
  fill_window(p, opts);
  p.return_lse = opts.return_lse;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// Whether TMA tensor maps can describe q, k and v (Problem::tma_compatible): the 4-d map
/// (head dim, row, head, batch) — a varlen call's packed rows as one batch — has no empty
/// dimension (an empty key range, Sk = 0, takes a kernel that writes out = 0 and lse = -inf
/// without one; a call without query rows launches nothing and needs none), rows that a box's int32 coordinate reaches, 16-byte aligned bases, and every
/// stride of a dimension longer than one positive, a multiple of 16 bytes and below 2^40 bytes
/// (a size-1 dimension's is not used).
bool tma_describable(const FwdParams& p) {
  const int64_t rows_q = p.map_rows_q(), rows_k = p.map_rows_k(), batch = p.map_batch();
  if (p.batch == 0 || p.seqlen_q == 0) return true;  // nothing to launch: no map is made
  if (p.seqlen_k == 0 || rows_k == 0) return false;
  if (rows_q > INT32_MAX || rows_k > INT32_MAX) return false;  // the boxes' int32 coordinates
  const int64_t bytes = dtype_size(p.dtype);
  const auto aligned = [](const void* base) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0;
  };
  return aligned(p.q) && aligned(p.k) && aligned(p.v) &&
         tma_strides_ok(bytes, rows_q, p.q_row_stride, p.heads_q, p.q_head_stride, batch,
                        p.q_batch_stride) &&
         tma_strides_ok(bytes, rows_k, p.k_row_stride, p.heads_kv, p.k_head_stride, batch,
                        p.k_batch_stride) &&
         tma_strides_ok(bytes, rows_k, p.v_row_stride, p.heads_kv, p.v_head_stride, batch,
                        p.v_batch_stride);
}

/// What the selector needs to know about a (validated) call.
Problem make_problem(const FwdParams& p) {
  Problem prob;
  prob.dtype = p.dtype;
  prob.head_dim = int(p.head_dim);
  prob.return_lse = p.return_lse;
  prob.masked = p.has_window();
  prob.varlen = p.is_varlen();
  prob.num_splits = p.num_splits;
  prob.query_rows = p.gpu_query_rows();
  if (p.is_varlen()) prob.mean_query_rows = p.batch > 0 ? p.total_q / p.batch : 0;
  prob.tma_compatible = tma_describable(p);
  prob.kv_cache = p.is_kvcache();
  prob.kv_dtype = p.kv_dtype;
  prob.gqa_decode = p.packs_gqa_decode();
  prob.heads_kv = p.heads_kv;
  prob.batch = p.batch;
  prob.keys = p.seqlen_k;
  prob.kv_heads_in_rows = std::abs(p.k_head_stride) < std::abs(p.k_row_stride) &&
                          std::abs(p.v_head_stride) < std::abs(p.v_row_stride);
  prob.alibi = p.alibi_slopes != nullptr;
  if (p.dtype == DType::e4m3 && !p.is_kvcache())
    prob.widened = std::make_shared<const Problem>(make_problem(widened_fp8_params(p, nullptr)));
  return prob;
}

/// Resolves num_splits (0 -> heuristic) for the kernel that will run the call: the work items
/// are its (batch, head, query block)s — heads in groups of the tile's heads_per_block —, the
/// slots `processors` x its resident blocks on each.
/// `gpu` counts heads and rows the way the GPU kernels do (GQA decode packed).
int resolve_splits(const FwdParams& p, int requested, const gpu::TileShape& tile,
                   int64_t processors, bool gpu) {
  const int64_t sk = p.seqlen_k;
  if (requested == 1 || sk == 0) return 1;
  if (tile.block_n <= 0 || tile.block_m <= 0) return 1;
  const int64_t key_blocks = ceil_div(sk, tile.block_n);
  if (requested > 0) return int(std::min<int64_t>(requested, std::max<int64_t>(key_blocks, 1)));
  const int64_t split_blocks = ceil_div(sk, std::max(tile.block_n, tile.split_block_n));
  const int64_t heads =
      gpu ? ceil_div(p.gpu_heads(), std::max(tile.heads_per_block, 1)) : p.heads_q;
  const int64_t rows = gpu ? p.gpu_query_rows() : p.seqlen_q;
  const int64_t work = p.batch * heads * ceil_div(rows, tile.block_m);
  return num_splits_heuristic(work, processors, tile.blocks_per_sm, split_blocks);
}

/// The kernel a call runs on, on which device, and its resolved split count.
struct Plan {
  Selection sel;
  Arch arch;  ///< host for the CPU backend
  int num_splits = 1;
};

Plan plan_call(const FwdParams& p, int requested, Location loc) {
  Plan plan;
  // The split-K workspace: num_splits * B * Hq * Sq rows of (D + 2) floats.
  const auto check_workspace_size = [&](int splits) {
    checked_product({splits, p.batch, p.heads_q, p.seqlen_q, p.head_dim + 2, int64_t(sizeof(float))},
                    "the split-K workspace size (num_splits * batch * heads_q * seqlen_q * "
                    "(head_dim + 2) * 4)");
  };
  if (loc.kind == Location::cpu) {
    plan.sel.kind = KernelKind::cpu_reference;
    plan.num_splits =
        resolve_splits(p, requested, gpu::TileShape{64, 64, 1}, cpu::num_threads(), false);
    check_workspace_size(plan.num_splits);
    return plan;
  }
  HIPFLASH_CHECK_AS(not_implemented,
                    p.softcap == 0.f || gpu::build_caps().gpu_vendor == Arch::nvidia,
                    "softcap runs on the CPU backend and NVIDIA GPUs only: the AMD kernels do not "
                    "cap scores yet");
  HIPFLASH_CHECK_AS(not_implemented,
                    p.alibi_slopes == nullptr || gpu::build_caps().gpu_vendor == Arch::nvidia,
                    "alibi_slopes run on the CPU backend and NVIDIA GPUs only: the AMD kernels do "
                    "not add ALiBi biases yet");
  plan.arch = gpu::device_arch(loc.index);
  plan.sel = select_kernel(make_problem(p), plan.arch, gpu::build_caps());
  HIPFLASH_CHECK_AS(not_implemented, plan.sel.kind != KernelKind::unsupported, plan.sel.reason);
  const gpu::TileShape tile =
      gpu::tile_shape(plan.sel.kind, padded_head_dim(int(p.head_dim)), plan.sel.key.masked);
  // An fp8 call on widened copies splits as the bf16 call it becomes (GQA decode packed).
  plan.num_splits =
      resolve_splits(plan.sel.widened_fp8 ? widened_fp8_params(p, nullptr) : p, requested, tile,
                     plan.arch.num_sms, true);
  plan.sel.key.split = plan.num_splits > 1;
  check_workspace_size(plan.num_splits);
  return plan;
}

/// validate (done by the caller) -> select -> dispatch.
void dispatch(FwdParams& p, const FwdOptions& opts, Location loc, Stream stream, Workspace ws) {
  const Plan plan = plan_call(p, opts.num_splits, loc);
  p.num_splits = plan.num_splits;
  if (loc.kind == Location::cpu) {
    t_last_kernel.where = LastKernel::cpu;
    if (p.batch == 0 || p.seqlen_q == 0) return;
    cpu::run_forward(p);
    return;
  }
  t_last_kernel = {LastKernel::gpu, plan.sel.kind, plan.sel.key, plan.arch, false,
                   plan.sel.widened_fp8};
  if (p.batch == 0 || p.seqlen_q == 0) return;
  const gpu::Launched launched = gpu::run_forward(p, plan.sel, loc.index, stream, ws);
  t_last_kernel.long_rows = launched.long_rows;
}

Location resolve_location_of(Location loc) {
  if (loc.kind == Location::gpu) {
    HIPFLASH_CHECK_AS(not_implemented, gpu::build_caps().gpu,
                      "q is on a GPU but this hipflash was built without GPU kernels "
                      "(HIPFLASH_GPU=none); rebuild with HIPFLASH_GPU=cuda or hip, or pass CPU "
                      "tensors");
  }
  return loc;
}
Location resolve_location(const TensorRef& q) { return resolve_location_of(q.loc); }

}  // namespace

std::string last_kernel_name() {
  const LastKernel& k = t_last_kernel;
  switch (k.where) {
    case LastKernel::none: return "none";
    case LastKernel::cpu: return "cpu_reference";
    case LastKernel::gpu: break;
  }
  return std::string("fwd_") + kernel_kind_name(k.kind) + "_" + k.key.name() +
         (k.long_rows ? "_longrows" : "") + (k.widened_fp8 ? "_from_fp8" : "") + "_" +
         k.arch.name();
}
std::string build_info() { return gpu::build_info(); }
bool gpu_available() {
  if (!gpu::build_caps().gpu) return false;
  try {
    gpu::device_arch(0);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

FwdParams make_dense_params(const TensorRef& q, const TensorRef& k, const TensorRef& v,
                            const TensorRef& out, const TensorRef* lse, const FwdOptions& opts) {
  check_rank(q, "q", 4, "[batch, seqlen_q, heads_q, head_dim]");
  check_rank(k, "k", 4, "[batch, seqlen_k, heads_kv, head_dim]");
  check_rank(v, "v", 4, "[batch, seqlen_k, heads_kv, head_dim]");
  check_rank(out, "out", 4, "[batch, seqlen_q, heads_q, head_dim]");
  Dims d{q.sizes[0], q.sizes[1], k.sizes[1], q.sizes[2], k.sizes[2], q.sizes[3]};
  HIPFLASH_CHECK(k.sizes[0] == d.batch && v.sizes[0] == d.batch, "batch size differs: q ",
                 shape_str(q), ", k ", shape_str(k), ", v ", shape_str(v));
  HIPFLASH_CHECK(k.sizes[3] == d.head_dim && v.sizes[3] == d.head_dim, "head dim differs: q ",
                 shape_str(q), ", k ", shape_str(k), ", v ", shape_str(v));
  HIPFLASH_CHECK(v.sizes[1] == d.seqlen_k, "k and v must have the same seqlen_k: k ",
                 shape_str(k), ", v ", shape_str(v));
  HIPFLASH_CHECK(v.sizes[2] == d.heads_kv, "k and v must have the same number of heads: k ",
                 shape_str(k), ", v ", shape_str(v));
  for (int i = 0; i < 4; ++i)
    HIPFLASH_CHECK(out.sizes[i] == q.sizes[i], "out must have the shape of q ", shape_str(q),
                   ", got ", shape_str(out));
  check_common(q, k, v, out, opts, d);
  if (opts.return_lse) {
    check_lse(lse, q, out, k, v, {d.batch, d.heads_q, d.seqlen_q}, "[batch, heads_q, seqlen_q]");
  }
  FwdParams p;
  p.q = q.data; p.k = k.data; p.v = v.data; p.out = out.data;
  p.q_batch_stride = q.strides[0]; p.q_row_stride = q.strides[1]; p.q_head_stride = q.strides[2];
  p.k_batch_stride = k.strides[0]; p.k_row_stride = k.strides[1]; p.k_head_stride = k.strides[2];
  p.v_batch_stride = v.strides[0]; p.v_row_stride = v.strides[1]; p.v_head_stride = v.strides[2];
  p.o_batch_stride = out.strides[0]; p.o_row_stride = out.strides[1];
  p.o_head_stride = out.strides[2];
  p.batch = d.batch; p.seqlen_q = d.seqlen_q; p.seqlen_k = d.seqlen_k;
  p.heads_q = d.heads_q; p.heads_kv = d.heads_kv; p.head_dim = d.head_dim;
  fill_options(p, opts, q, k, out, lse);
  if (opts.return_lse) {
    p.lse = static_cast<float*>(lse->data);
    p.lse_batch_stride = d.heads_q * d.seqlen_q;
    p.lse_head_stride = d.seqlen_q;
    p.lse_row_stride = 1;
  }
  return p;
}

void forward(const TensorRef& q, const TensorRef& k, const TensorRef& v, const TensorRef& out,
             const TensorRef* lse, const FwdOptions& opts, Stream stream, Workspace ws) {
  FwdParams p = make_dense_params(q, k, v, out, lse, opts);
  Location loc = resolve_location(q);
  dispatch(p, opts, loc, stream, ws);
}

int resolve_num_splits(const TensorRef& q, const TensorRef& k, const FwdOptions& opts) {
  // What the forward would refuse of these, refused here too (a split count for a call that
  // cannot run would mean nothing).
  check_rank(q, "q", 4, "[batch, seqlen_q, heads_q, head_dim]");
  check_rank(k, "k", 4, "[batch, seqlen_k, heads_kv, head_dim]");
  check_qk(q, k, {q.sizes[0], q.sizes[1], k.sizes[1], q.sizes[2], k.sizes[2], q.sizes[3]});
  HIPFLASH_CHECK(k.sizes[0] == q.sizes[0] && k.sizes[3] == q.sizes[3],
                 "k must have q's batch and head dim: q ", shape_str(q), ", k ", shape_str(k));
  check_options(opts);
  FwdParams p;
  p.batch = q.sizes[0]; p.seqlen_q = q.sizes[1]; p.heads_q = q.sizes[2]; p.head_dim = q.sizes[3];
  p.seqlen_k = k.sizes[1]; p.heads_kv = k.sizes[2]; p.dtype = q.dtype; p.kv_dtype = k.dtype;
  // The call's own pointers and strides (v taken as k's), so that the kernel the selector
  // judges them for (a TMA map's, fp8's or their bf16 copies') is the call's.
  p.q = q.data, p.k = p.v = k.data;
  p.q_batch_stride = q.strides[0], p.q_row_stride = q.strides[1], p.q_head_stride = q.strides[2];
  p.k_batch_stride = p.v_batch_stride = k.strides[0];
  p.k_row_stride = p.v_row_stride = k.strides[1];
  p.k_head_stride = p.v_head_stride = k.strides[2];
  fill_window(p, opts);
  return plan_call(p, opts.num_splits, resolve_location(q)).num_splits;
}

FwdParams make_varlen_params(const TensorRef& q, const TensorRef& k, const TensorRef& v,
                             const TensorRef& out, const TensorRef* lse, const TensorRef& cu_q,
                             const TensorRef& cu_k, const VarlenOptions& opts, Stream stream,
                             std::vector<int32_t>* host_cu_k, std::vector<int32_t>* host_cu_q) {
  check_rank(q, "q", 3, "[total_q, heads_q, head_dim]");
  check_rank(k, "k", 3, "[total_k, heads_kv, head_dim]");
  check_rank(v, "v", 3, "[total_k, heads_kv, head_dim]");
  check_rank(out, "out", 3, "[total_q, heads_q, head_dim]");
  HIPFLASH_CHECK(cu_q.dtype == DType::i32, "cu_seqlens_q must have dtype int32, got ",
                 dtype_name(cu_q.dtype));
  HIPFLASH_CHECK(cu_k.dtype == DType::i32, "cu_seqlens_k must have dtype int32, got ",
                 dtype_name(cu_k.dtype));
  HIPFLASH_CHECK(cu_q.rank == 1 && cu_q.sizes[0] >= 1,
                 "cu_seqlens_q must be a 1-D tensor of length batch + 1, got shape ",
                 shape_str(cu_q));
  HIPFLASH_CHECK(cu_k.rank == 1 && cu_k.sizes[0] == cu_q.sizes[0],
                 "cu_seqlens_k must have the length of cu_seqlens_q (", cu_q.sizes[0],
                 " = batch + 1), got shape ", shape_str(cu_k));
  HIPFLASH_CHECK(cu_q.sizes[0] <= 1 || (cu_q.strides[0] == 1 && cu_k.strides[0] == 1),
                 "cu_seqlens_q and cu_seqlens_k must be contiguous");
  HIPFLASH_CHECK(cu_q.data != nullptr && cu_k.data != nullptr,
                 "cu_seqlens_q and cu_seqlens_k must have data pointers");
  HIPFLASH_CHECK(detail::indexable(cu_q, nullptr) && detail::indexable(cu_k, nullptr),
                 "cu_seqlens_q and cu_seqlens_k cannot be indexed in 64 bits");
  check_location(cu_q, "cu_seqlens_q", q.loc);
  check_location(cu_k, "cu_seqlens_k", q.loc);
  const int64_t batch = cu_q.sizes[0] - 1;
  Dims d{batch, opts.max_seqlen_q, opts.max_seqlen_k, q.sizes[1], k.sizes[1], q.sizes[2]};
  const int64_t total_q = q.sizes[0], total_k = k.sizes[0];
  HIPFLASH_CHECK(k.sizes[2] == d.head_dim && v.sizes[2] == d.head_dim, "head dim differs: q ",
                 shape_str(q), ", k ", shape_str(k), ", v ", shape_str(v));
  HIPFLASH_CHECK(v.sizes[0] == total_k && v.sizes[1] == d.heads_kv,
                 "k and v must have the same shape: k ", shape_str(k), ", v ", shape_str(v));
  for (int i = 0; i < 3; ++i)
    HIPFLASH_CHECK(out.sizes[i] == q.sizes[i], "out must have the shape of q ", shape_str(q),
                   ", got ", shape_str(out));
  HIPFLASH_CHECK(opts.max_seqlen_q >= 0 && opts.max_seqlen_k >= 0,
                 "max_seqlen_q and max_seqlen_k must be >= 0");
  // No sequence is longer than its tensor: a larger maximum is a wrong argument (it would size
  // the padded LSE and the launch grid), refused before anything is allocated or launched.
  HIPFLASH_CHECK(opts.max_seqlen_q <= total_q, "max_seqlen_q = ", opts.max_seqlen_q,
                 " exceeds the rows of q (total_q = ", total_q, "): no sequence can be that long");
  HIPFLASH_CHECK(opts.max_seqlen_k <= total_k, "max_seqlen_k = ", opts.max_seqlen_k,
                 " exceeds the rows of k (total_k = ", total_k, "): no sequence can be that long");
  check_common(q, k, v, out, opts, d);
  check_disjoint(out, "out", cu_q, "cu_seqlens_q");
  check_disjoint(out, "out", cu_k, "cu_seqlens_k");
  HIPFLASH_CHECK(opts.lse_layout == LseLayout::padded || opts.lse_layout == LseLayout::packed,
                 "lse_layout must be LseLayout::padded or packed, got ", int(opts.lse_layout));
  if (opts.return_lse) {
    if (opts.lse_layout == LseLayout::padded)
      check_lse(lse, q, out, k, v, {batch, d.heads_q, d.seqlen_q},
                "[batch, heads_q, max_seqlen_q] (lse_layout='padded')");
    else
      check_lse(lse, q, out, k, v, {d.heads_q, total_q}, "[heads_q, total_q] (lse_layout='packed')");
    check_disjoint(*lse, "lse", cu_q, "cu_seqlens_q");
    check_disjoint(*lse, "lse", cu_k, "cu_seqlens_k");
  }
  // cu_seqlens: read them (a small synchronous copy for device tensors) and check them. While
  // the stream captures a graph no copy may run on it: the values are then the replay's, and
  // only the launch-time checks above apply (documented in docs/spec.md §4).
  const bool capturing = q.loc.kind == Location::gpu && gpu::stream_capturing(stream);
  std::vector<int32_t> hq(size_t(batch + 1)), hk(size_t(batch + 1));
  if (q.loc.kind == Location::cpu) {
    std::memcpy(hq.data(), cu_q.data, hq.size() * 4);
    std::memcpy(hk.data(), cu_k.data, hk.size() * 4);
  } else if (!capturing) {
    gpu::copy_to_host(hq.data(), cu_q.data, hq.size() * 4, stream);
    gpu::copy_to_host(hk.data(), cu_k.data, hk.size() * 4, stream);
  }
  struct CuCheck { const std::vector<int32_t>* cu; const char* name; int64_t total, max_len;
                   const char* max_name; };
  for (auto [cu, name, total, max_len, max_name] :
       {CuCheck{&hq, "cu_seqlens_q", total_q, opts.max_seqlen_q, "max_seqlen_q"},
        CuCheck{&hk, "cu_seqlens_k", total_k, opts.max_seqlen_k, "max_seqlen_k"}}) {
    if (capturing) break;
    HIPFLASH_CHECK((*cu)[0] >= 0, name, "[0] must be >= 0, got ", (*cu)[0]);
    for (int64_t b = 0; b < batch; ++b) {
      int64_t len = int64_t((*cu)[b + 1]) - (*cu)[b];
      HIPFLASH_CHECK(len >= 0, name, " must be non-decreasing, but ", name, "[", b + 1, "] = ",
                     (*cu)[b + 1], " < ", name, "[", b, "] = ", (*cu)[b]);
      HIPFLASH_CHECK(len <= max_len, max_name, " = ", max_len, " is too small: sequence ", b,
                     " has length ", len);
    }
    HIPFLASH_CHECK((*cu)[batch] <= total, name, "[-1] = ", (*cu)[batch],
                   " exceeds the number of rows of its tensor (", total, ")");
  }
  check_seqused(opts, q, out, lse, batch, hq, hk, stream, capturing);
  if (host_cu_k != nullptr) *host_cu_k = capturing ? std::vector<int32_t>{} : std::move(hk);
  if (host_cu_q != nullptr) *host_cu_q = capturing ? std::vector<int32_t>{} : std::move(hq);

  FwdParams p;
  p.q = q.data; p.k = k.data; p.v = v.data; p.out = out.data;
  p.q_row_stride = q.strides[0]; p.q_head_stride = q.strides[1];
  p.k_row_stride = k.strides[0]; p.k_head_stride = k.strides[1];
  p.v_row_stride = v.strides[0]; p.v_head_stride = v.strides[1];
  p.o_row_stride = out.strides[0]; p.o_head_stride = out.strides[1];
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.data);
  p.cu_seqlens_k = static_cast<const int32_t*>(cu_k.data);
  if (opts.seqused_q) p.seqused_q = static_cast<const int32_t*>(opts.seqused_q->data);
  if (opts.seqused_k) p.seqused_k = static_cast<const int32_t*>(opts.seqused_k->data);
  p.batch = batch; p.seqlen_q = d.seqlen_q; p.seqlen_k = d.seqlen_k;
  p.total_q = total_q; p.total_k = total_k;
  p.heads_q = d.heads_q; p.heads_kv = d.heads_kv; p.head_dim = d.head_dim;
  fill_options(p, opts, q, k, out, lse);
  p.lse_layout = opts.lse_layout;
  if (opts.return_lse) {
    p.lse = static_cast<float*>(lse->data);
    if (opts.lse_layout == LseLayout::padded) {
      p.lse_batch_stride = d.heads_q * d.seqlen_q;
      p.lse_head_stride = d.seqlen_q;
    } else {
      p.lse_batch_stride = 0;
      p.lse_head_stride = total_q;
    }
    p.lse_row_stride = 1;
  }
  return p;
}

void varlen_forward(const TensorRef& q, const TensorRef& k, const TensorRef& v,
                    const TensorRef& out, const TensorRef* lse, const TensorRef& cu_q,
                    const TensorRef& cu_k, const VarlenOptions& opts, Stream stream,
                    Workspace ws) {
  FwdParams p = make_varlen_params(q, k, v, out, lse, cu_q, cu_k, opts, stream);
  dispatch(p, opts, resolve_location(q), stream, ws);
}

void check_forward_plan(const FwdParams& p, const FwdOptions& opts, Location loc) {
  (void)plan_call(p, opts.num_splits, resolve_location_of(loc));
}

void dispatch_forward(FwdParams& p, const FwdOptions& opts, Location loc, Stream stream,
                      Workspace ws) {
  dispatch(p, opts, resolve_location_of(loc), stream, ws);
}

namespace {
/// The widened copies' extents: rows (a varlen call's packed rows, else batch x seqlen) x heads
/// x head_dim elements each, and each copy's bytes rounded up to 256.
struct WidenedSizes {
  int64_t q, kv;  ///< elements of q's copy, of k's (and v's)
  static size_t bytes(int64_t elems) { return (size_t(elems) * 2 + 255) / 256 * 256; }
};
WidenedSizes widened_sizes(const FwdParams& p) {
  const int64_t rows_q = p.is_varlen() ? p.total_q : p.batch * p.seqlen_q;
  const int64_t rows_k = p.is_varlen() ? p.total_k : p.batch * p.seqlen_k;
  return {rows_q * p.heads_q * p.head_dim, rows_k * p.heads_kv * p.head_dim};
}
}  // namespace

size_t widened_fp8_bytes(const FwdParams& p) {
  const WidenedSizes n = widened_sizes(p);
  return WidenedSizes::bytes(n.q) + 2 * WidenedSizes::bytes(n.kv);
}

FwdParams widened_fp8_params(const FwdParams& p, void* base) {
  FwdParams w = p;
  const WidenedSizes n = widened_sizes(p);
  char* at = static_cast<char*>(base);
  const auto next = [&](int64_t elems) {
    const void* here = at;
    if (at) at += WidenedSizes::bytes(elems);
    return here;
  };
  w.q = next(n.q);
  w.k = next(n.kv);
  w.v = next(n.kv);
  const int64_t d = p.head_dim;
  w.q_head_stride = d, w.q_row_stride = p.heads_q * d;
  w.k_head_stride = w.v_head_stride = d, w.k_row_stride = w.v_row_stride = p.heads_kv * d;
  w.q_batch_stride = p.is_varlen() ? 0 : p.seqlen_q * w.q_row_stride;
  w.k_batch_stride = w.v_batch_stride = p.is_varlen() ? 0 : p.seqlen_k * w.k_row_stride;
  w.dtype = w.kv_dtype = DType::bf16;
  w.q_descale = w.k_descale = w.v_descale = Descale{};
  return w;
}

size_t splitk_workspace_bytes(const FwdParams& p) {
  if (p.num_splits <= 1) return 0;
  // Bounded at validation: splits <= kMaxSplits and B * Hq * Sq * (D + 2) * 4 fits in int64.
  size_t rows = size_t(p.num_splits) * size_t(p.batch) * size_t(p.heads_q) * size_t(p.seqlen_q);
  size_t d = size_t(padded_head_dim(int(p.head_dim)));
  return rows * (d * sizeof(float) + sizeof(detail::SoftmaxState));
}

}  // namespace hipflash
