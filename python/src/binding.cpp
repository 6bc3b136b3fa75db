// hipflash._C — the PyTorch operators (SPEC §1): at::Tensor -> hipflash::TensorRef, nothing else.
//
//   hipflash::fwd             (q, k, v, ...)                -> (out, lse)   allocates out and lse
//   hipflash::fwd_out         (q, k, v, out!, lse!?, ...)   -> ()           writes the caller's
//   hipflash::varlen_fwd      (q, k, v, cu_q, cu_k, ...)    -> (out, lse)
//   hipflash::varlen_fwd_out  (q, k, v, out!, lse!?, ...)   -> ()
//   hipflash::varlen_fwd_paged (q, k_cache, v_cache, cu_q, cu_k, block_table, ...) -> (out, lse)
//                                                            chunked prefill against a paged cache
//   hipflash::merge_attn_states (outs, lses)                -> (out, lse)   stacked parts
//   hipflash::fwd_kvcache     (q, k_cache!, v_cache!, k?, v?, cache_seqlens?, block_table?, ...)
//                                                            -> (out, lse)   appends k/v in place
//   hipflash::bwd             (dout, q, k, v, out, lse, ...) -> (dq, dk, dv) the backward
//   hipflash::varlen_bwd      (dout, q, k, v, out, lse, cu_q, cu_k, ...) -> (dq, dk, dv)
//
// Registered with TORCH_LIBRARY, so torch.compile, torch.jit.trace, CUDA graphs and
// torch.library.opcheck see real operators. One kernel serves the CPU and CUDA dispatch keys
// (the C++ launcher picks the backend from the tensors' location); the Autograd key gets the
// autograd boundary (the forward ops carry no autograd history of their own — hipflash's
// autograd.Function wraps fwd / varlen_fwd with bwd / varlen_bwd; a direct call whose inputs
// require grad under grad mode is an error, never a silently detached result) and bumps the version counter of what *_out writes, as any
// in-place op does. The fake (meta) kernels for torch.compile are in python/hipflash/_ops.py.
//
// Every check of SPEC §4 lives in the C++ launcher; its typed errors become c10 errors of the
// matching Python type here (ValueError, TypeError, NotImplementedError, RuntimeError), with the
// launcher's short message. A CPU call polls Python's signal handlers between tiles, so Ctrl-C
// interrupts it (hipflash::interrupted; the Python wrapper raises KeyboardInterrupt).
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <torch/version.h>

#if defined(HIPFLASH_TORCH_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif  // HIPFLASH_TORCH_CUDA

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "hipflash/hipflash.hpp"

// float8_e4m3fn (fp8 inputs) exists from PyTorch 2.1.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define HIPFLASH_TORCH_HAS_FP8 1
#else
#define HIPFLASH_TORCH_HAS_FP8 0
#endif

namespace py = pybind11;

namespace {

/// What a tensor is for: it decides the error type of a dtype that hipflash has no name for.
enum class Role { operand, lse, index };

std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

/// torch's name of a dtype ("float64", as in torch.float64) for error messages.
std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: return c10::toString(t);
  }
}

/// Where a tensor lives, as hipflash names it; other devices are refused.
hipflash::Location location_of(const at::Tensor& t, const char* name) {
  switch (t.device().type()) {
    case at::kCPU: return {hipflash::Location::cpu, 0};
    case at::kCUDA:  // also ROCm torch's HIP devices
      return {hipflash::Location::gpu, t.device().has_index() ? t.device().index() : 0};
    default:
      HIPFLASH_CHECK_AS(not_implemented, false, name, " is on device '", t.device(),
                        "'; hipflash runs on cpu and cuda/hip tensors");
  }
  return {};
}

/// The TensorRef of a strided CPU or CUDA/HIP tensor. Dtypes hipflash cannot name (float64,
/// int64, ...) are rejected here with the error type the launcher would use for that role.
hipflash::TensorRef to_ref(const at::Tensor& t, const char* name, Role role) {
  using hipflash::DType;
  HIPFLASH_CHECK(t.defined(), name, " is an undefined tensor");
  HIPFLASH_CHECK(t.layout() == at::kStrided, name, " must be a strided (dense) tensor, got layout ",
                 t.layout());
  HIPFLASH_CHECK(t.dim() <= 4, name, " has rank ", t.dim(), " (shape ", shape_of(t),
                 "); hipflash tensors have rank 3 (varlen) or 4 (dense)");
  hipflash::TensorRef r;
  switch (t.scalar_type()) {
    case at::kHalf: r.dtype = DType::f16; break;
    case at::kBFloat16: r.dtype = DType::bf16; break;
    case at::kFloat: r.dtype = DType::f32; break;
    case at::kInt: r.dtype = DType::i32; break;
#if HIPFLASH_TORCH_HAS_FP8
    case at::kFloat8_e4m3fn: r.dtype = DType::e4m3; break;
#endif
    default:
      if (role == Role::index)  // cu_seqlens: a ValueError, as for any non-int32 dtype (SPEC §4)
        HIPFLASH_CHECK(false, name, " must have dtype int32, got ", dtype_str(t.scalar_type()));
      HIPFLASH_CHECK_AS(dtype_error, false, name, " must have dtype ",
                        role == Role::lse ? "float32" : "float16, bfloat16 or float8_e4m3fn",
                        ", got ",
                        dtype_str(t.scalar_type()));
  }
  r.loc = location_of(t, name);
  r.rank = int(t.dim());
  for (int i = 0; i < r.rank; ++i) {
    r.sizes[i] = t.size(i);
    r.strides[i] = t.stride(i);
  }
  r.data = t.numel() == 0 ? nullptr : t.data_ptr();
  return r;
}

/// The memory a strided tensor of any dtype covers, as a TensorRef for the aliasing checks (its
/// elements as hipflash dtypes of their size; an 8-byte one as two float32 in a last
/// dimension of its own).
hipflash::TensorRef memory_ref(const at::Tensor& t, const char* name) {
  using hipflash::DType;
  const int64_t size = t.element_size();
  HIPFLASH_CHECK(t.layout() == at::kStrided && t.dim() + (size == 8) <= 4 &&
                     (size == 1 || size == 2 || size == 4 || size == 8),
                 name, " (", dtype_str(t.scalar_type()), ", shape ", shape_of(t),
                 ") is not a tensor hipflash can check for aliasing");
  hipflash::TensorRef r;
  r.loc = location_of(t, name);
  r.dtype = size == 1 ? DType::e4m3 : size == 2 ? DType::f16 : DType::f32;
  r.rank = int(t.dim());
  for (int i = 0; i < r.rank; ++i) {
    r.sizes[i] = t.size(i);
    r.strides[i] = t.stride(i) * (size == 8 ? 2 : 1);
  }
  if (size == 8) {
    r.sizes[r.rank] = 2;
    r.strides[r.rank] = 1;
    ++r.rank;
  }
  r.data = t.numel() == 0 ? nullptr : t.data_ptr();
  return r;
}

/// The schema's int64 options, range-checked before they narrow.
hipflash::FwdOptions fwd_options(c10::optional<double> softmax_scale, bool causal,
                                 int64_t window_left, int64_t window_right, int64_t num_splits,
                                 bool return_lse, double softcap) {
  HIPFLASH_CHECK(num_splits >= 0 && num_splits <= hipflash::kMaxSplits, "num_splits must be in [0, ",
                 hipflash::kMaxSplits, "] (0 = heuristic), got ", num_splits);
  // Narrowed to float: beyond its range inf (refused by the launcher), below its smallest
  // positive value 0 — for the softcap "off", so refused here with the value given.
  for (auto [value, name] : {std::pair{softmax_scale.value_or(0.0), "softmax_scale"},
                             {softcap, "softcap"}})
    HIPFLASH_CHECK(!(value > 0.0) || float(value) > 0.f, name, " = ", value,
                   " is below float32's smallest positive value");
  hipflash::FwdOptions o;
  if (softmax_scale) o.softmax_scale = float(*softmax_scale);  // beyond float: inf, refused
  o.causal = causal;
  o.window_left = window_left;
  o.window_right = window_right;
  o.num_splits = int(num_splits);
  o.return_lse = return_lse;
  o.softcap = float(softcap);  // beyond float: inf, refused
  return o;
}

using OptionalTensor = c10::optional<at::Tensor>;

/// An optional tensor argument as the launcher takes it: a TensorRef that lives as long as this
/// (build it inside run_launcher: to_ref reports a bad tensor).
struct OptionalRef {
  std::optional<hipflash::TensorRef> ref;
  OptionalRef(const c10::optional<at::Tensor>& t, const char* name, Role role) {
    if (t) ref = to_ref(*t, name, role);
  }
  const hipflash::TensorRef* get() const { return ref ? &*ref : nullptr; }
};

/// The options bwd and varlen_bwd share (`alibi`: the slopes' ref, which outlives the call).
hipflash::BwdOptions bwd_options(c10::optional<double> softmax_scale, bool causal,
                                 int64_t window_left, int64_t window_right, bool deterministic,
                                 double softcap, const OptionalRef& alibi) {
  const hipflash::FwdOptions f =
      fwd_options(softmax_scale, causal, window_left, window_right, 1, true, softcap);
  hipflash::BwdOptions o;
  o.softmax_scale = f.softmax_scale;
  o.softcap = f.softcap;
  o.alibi_slopes = alibi.get();
  o.causal = causal;
  o.window_left = window_left;
  o.window_right = window_right;
  o.deterministic = deterministic;
  return o;
}

hipflash::LseLayout lse_layout_of(const std::string& s) {
  HIPFLASH_CHECK(s == "padded" || s == "packed", "lse_layout must be 'padded' or 'packed', got '",
                 s, "'");
  return s == "packed" ? hipflash::LseLayout::packed : hipflash::LseLayout::padded;
}

/// The stream a call on q's device runs on: the current CUDA stream of that device.
hipflash::Stream stream_of(const at::Tensor& q) {
#if defined(HIPFLASH_TORCH_CUDA)
  if (q.is_cuda()) return c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
#endif  // HIPFLASH_TORCH_CUDA
  (void)q;
  return nullptr;
}

/// Split-K workspace from PyTorch's caching allocator (on q's device, current stream), held in
/// `keep` until the call returns: no cudaMallocAsync/free per call.
hipflash::Workspace torch_workspace(const at::Tensor& q, std::vector<at::Tensor>& keep) {
  hipflash::Workspace ws;
  ws.allocate = [&q, &keep](size_t bytes) {
    keep.push_back(at::empty({int64_t(bytes)}, q.options().dtype(at::kByte)));
    return keep.back().data_ptr();
  };
  return ws;
}

/// Runs `call` without the GIL (when this thread holds it) and turns hipflash's typed errors
/// into c10 errors of the Python type SPEC §4 names.
template <class F>
void run_launcher(F&& call) {
  try {
    std::optional<py::gil_scoped_release> no_gil;
    if (Py_IsInitialized() && PyGILState_Check()) no_gil.emplace();
    call();
  } catch (const hipflash::dtype_error& e) {
    TORCH_CHECK_TYPE(false, e.what());
  } catch (const hipflash::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const hipflash::not_implemented& e) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
  } catch (const hipflash::interrupted& e) {
    TORCH_CHECK(false, e.what());  // "hipflash: the call was interrupted ..."
  } catch (const hipflash::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// ---- The backend kernels (CPU and CUDA dispatch keys) ----------------------------------------

void fwd_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
             const c10::optional<at::Tensor>& lse, c10::optional<double> softmax_scale,
             bool causal, int64_t window_left, int64_t window_right, int64_t num_splits,
             bool return_lse, double softcap, const c10::optional<at::Tensor>& alibi_slopes,
             const OptionalTensor& q_descale, const OptionalTensor& k_descale,
             const OptionalTensor& v_descale) {
  std::vector<at::Tensor> keep;
  run_launcher([&] {
    const auto qr = to_ref(q, "q", Role::operand), kr = to_ref(k, "k", Role::operand),
               vr = to_ref(v, "v", Role::operand), outr = to_ref(out, "out", Role::operand);
    std::optional<hipflash::TensorRef> lser;
    if (lse) lser = to_ref(*lse, "lse", Role::lse);
    const OptionalRef alibi(alibi_slopes, "alibi_slopes", Role::lse),
        qd(q_descale, "q_descale", Role::lse), kd(k_descale, "k_descale", Role::lse),
        vd(v_descale, "v_descale", Role::lse);
    hipflash::FwdOptions o = fwd_options(softmax_scale, causal, window_left, window_right,
                                         num_splits, return_lse, softcap);
    o.alibi_slopes = alibi.get();
    o.q_descale = qd.get();
    o.k_descale = kd.get();
    o.v_descale = vd.get();
    hipflash::forward(qr, kr, vr, outr, lser ? &*lser : nullptr, o, stream_of(q),
                      torch_workspace(q, keep));
  });
}

/// The dtype of the out a call allocates: q's, bfloat16 for fp8 inputs (FlashAttention 3's).
at::ScalarType out_dtype(const at::Tensor& q) {
#if HIPFLASH_TORCH_HAS_FP8
  if (q.scalar_type() == at::kFloat8_e4m3fn) return at::kBFloat16;
#endif
  return q.scalar_type();
}

/// The LSE buffer of a call: [B, Hq, Sq] (dense, padded varlen) or [Hq, total_q] (packed), or
/// an empty tensor when not asked for, or when the shapes are too wrong to size it (the
/// launcher then reports them).
at::Tensor alloc_lse(const at::Tensor& q, bool return_lse, std::vector<int64_t> shape) {
  if (!return_lse) return at::empty({0}, q.options().dtype(at::kFloat));
  int64_t bytes = 4;
  for (int64_t s : shape)  // a shape the launcher will refuse gets no buffer (it reports it)
    if (s < 0 || __builtin_mul_overflow(bytes, s, &bytes) || bytes > (int64_t(1) << 48))
      return at::empty({0}, q.options().dtype(at::kFloat));
  return at::empty(shape, q.options().dtype(at::kFloat));
}

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, c10::optional<double> softmax_scale,
                                       bool causal, int64_t window_left, int64_t window_right,
                                       int64_t num_splits, bool return_lse, double softcap,
                                       const c10::optional<at::Tensor>& alibi_slopes,
                                       const OptionalTensor& q_descale,
                                       const OptionalTensor& k_descale,
                                       const OptionalTensor& v_descale) {
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(out_dtype(q)));
  at::Tensor lse = q.dim() == 4 ? alloc_lse(q, return_lse, {q.size(0), q.size(2), q.size(1)})
                                : alloc_lse(q, return_lse, {-1});
  fwd_out(q, k, v, out, return_lse ? c10::optional<at::Tensor>(lse) : c10::nullopt,
          softmax_scale, causal, window_left, window_right, num_splits, return_lse, softcap,
          alibi_slopes, q_descale, k_descale, v_descale);
  return {out, lse};
}

/// The options of a varlen forward call (varlen_fwd_out, varlen_fwd_paged).
hipflash::VarlenOptions varlen_options(int64_t max_seqlen_q, int64_t max_seqlen_k,
                                       c10::optional<double> softmax_scale, bool causal,
                                       int64_t window_left, int64_t window_right,
                                       int64_t num_splits, bool return_lse,
                                       const std::string& lse_layout, double softcap) {
  hipflash::VarlenOptions opts;
  opts.lse_layout = lse_layout_of(lse_layout);
  static_cast<hipflash::FwdOptions&>(opts) = fwd_options(
      softmax_scale, causal, window_left, window_right, num_splits, return_lse, softcap);
  opts.max_seqlen_q = max_seqlen_q;
  opts.max_seqlen_k = max_seqlen_k;
  return opts;
}

void varlen_fwd_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                    int64_t max_seqlen_q, int64_t max_seqlen_k, const at::Tensor& out,
                    const c10::optional<at::Tensor>& lse, c10::optional<double> softmax_scale,
                    bool causal, int64_t window_left, int64_t window_right, int64_t num_splits,
                    bool return_lse, const std::string& lse_layout, double softcap,
                    const c10::optional<at::Tensor>& alibi_slopes, const OptionalTensor& seqused_q,
                    const OptionalTensor& seqused_k, const OptionalTensor& q_descale,
                    const OptionalTensor& k_descale, const OptionalTensor& v_descale) {
  std::vector<at::Tensor> keep;
  run_launcher([&] {
    const OptionalRef alibi(alibi_slopes, "alibi_slopes", Role::lse),
        used_q(seqused_q, "seqused_q", Role::index), used_k(seqused_k, "seqused_k", Role::index),
        qd(q_descale, "q_descale", Role::lse), kd(k_descale, "k_descale", Role::lse),
        vd(v_descale, "v_descale", Role::lse);
    hipflash::VarlenOptions opts =
        varlen_options(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                       window_right, num_splits, return_lse, lse_layout, softcap);
    opts.alibi_slopes = alibi.get();
    opts.seqused_q = used_q.get();
    opts.seqused_k = used_k.get();
    opts.q_descale = qd.get();
    opts.k_descale = kd.get();
    opts.v_descale = vd.get();
    const auto qr = to_ref(q, "q", Role::operand), kr = to_ref(k, "k", Role::operand),
               vr = to_ref(v, "v", Role::operand), outr = to_ref(out, "out", Role::operand);
    const auto cuq = to_ref(cu_seqlens_q, "cu_seqlens_q", Role::index);
    const auto cuk = to_ref(cu_seqlens_k, "cu_seqlens_k", Role::index);
    std::optional<hipflash::TensorRef> lser;
    if (lse) lser = to_ref(*lse, "lse", Role::lse);
    hipflash::varlen_forward(qr, kr, vr, outr, lser ? &*lser : nullptr, cuq, cuk, opts,
                             stream_of(q), torch_workspace(q, keep));
  });
}

/// The LSE varlen_fwd allocates for this call (an empty one when none is asked for, or when the
/// arguments are too wrong to size it: the launcher's checks report them).
at::Tensor varlen_lse(const at::Tensor& q, const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q,
                      bool return_lse, const std::string& lse_layout) {
  if (return_lse && q.dim() == 3) {
    if (lse_layout == "packed") return alloc_lse(q, true, {q.size(1), q.size(0)});
    if (lse_layout == "padded" && cu_seqlens_q.dim() == 1 && cu_seqlens_q.numel() >= 1 &&
        max_seqlen_q <= q.size(0))  // a longer maximum is refused by the launcher
      return alloc_lse(q, true, {cu_seqlens_q.numel() - 1, q.size(1), max_seqlen_q});
  }
  return alloc_lse(q, false, {});
}

/// Chunked prefill: varlen queries against a paged KV cache (an fp8 one with its scales).
std::tuple<at::Tensor, at::Tensor> varlen_fwd_paged(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const at::Tensor& block_table,
    int64_t max_seqlen_q, int64_t max_seqlen_k, c10::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, int64_t num_splits, bool return_lse,
    const std::string& lse_layout, double softcap, const c10::optional<at::Tensor>& alibi_slopes,
    const OptionalTensor& k_scale, const OptionalTensor& v_scale) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = varlen_lse(q, cu_seqlens_q, max_seqlen_q, return_lse, lse_layout);
  std::vector<at::Tensor> keep;
  run_launcher([&] {
    const OptionalRef alibi(alibi_slopes, "alibi_slopes", Role::lse),
        ks(k_scale, "k_scale", Role::lse), vs(v_scale, "v_scale", Role::lse);
    hipflash::PagedVarlenOptions opts =
        varlen_options(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                       window_right, num_splits, return_lse, lse_layout, softcap);
    opts.alibi_slopes = alibi.get();
    opts.k_scale = ks.get();
    opts.v_scale = vs.get();
    std::optional<hipflash::TensorRef> lser;
    if (return_lse) lser = to_ref(lse, "lse", Role::lse);
    hipflash::varlen_paged_forward(
        to_ref(q, "q", Role::operand), to_ref(k_cache, "k_cache", Role::operand),
        to_ref(v_cache, "v_cache", Role::operand), to_ref(out, "out", Role::operand),
        lser ? &*lser : nullptr, to_ref(cu_seqlens_q, "cu_seqlens_q", Role::index),
        to_ref(cu_seqlens_k, "cu_seqlens_k", Role::index),
        to_ref(block_table, "block_table", Role::index), opts, stream_of(q),
        torch_workspace(q, keep));
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    c10::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    int64_t num_splits, bool return_lse, const std::string& lse_layout, double softcap,
    const c10::optional<at::Tensor>& alibi_slopes, const OptionalTensor& seqused_q,
    const OptionalTensor& seqused_k, const OptionalTensor& q_descale,
    const OptionalTensor& k_descale, const OptionalTensor& v_descale) {
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(out_dtype(q)));
  at::Tensor lse = varlen_lse(q, cu_seqlens_q, max_seqlen_q, return_lse, lse_layout);
  varlen_fwd_out(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
                 return_lse ? c10::optional<at::Tensor>(lse) : c10::nullopt, softmax_scale,
                 causal, window_left, window_right, num_splits, return_lse, lse_layout, softcap,
                 alibi_slopes, seqused_q, seqused_k, q_descale, k_descale, v_descale);
  return {out, lse};
}

/// merge_attn_states over stacked parts: outs [N, T, H, D], lses [N, H, T] (packed) or
/// [N, B, H, S] (dense, T = B * S) -> out [T, H, D], lse lses.shape[1:].
std::tuple<at::Tensor, at::Tensor> merge_attn_states(const at::Tensor& outs, const at::Tensor& lses) {
  at::Tensor out = outs.dim() == 4 ? at::empty({outs.size(1), outs.size(2), outs.size(3)}, outs.options())
                                   : at::empty({0}, outs.options());
  at::Tensor lse = lses.dim() >= 2 ? at::empty(lses.sizes().slice(1), lses.options().dtype(at::kFloat))
                                   : at::empty({0}, lses.options().dtype(at::kFloat));
  run_launcher([&] {
    const auto o = to_ref(outs, "outs", Role::operand), l = to_ref(lses, "lses", Role::lse),
               r = to_ref(out, "out", Role::operand), rl = to_ref(lse, "lse", Role::lse);
    hipflash::merge_attn_states(o, l, r, &rl, stream_of(outs));
  });
  return {out, lse};
}

/// A KV-cache index tensor's values as the caller holds them on the host (KvCacheOptions::
/// cache_seqlens_host): one int32 per entry of the tensor, which must be given.
std::vector<int32_t> host_values(at::OptionalIntArrayRef held, const OptionalTensor& t,
                                 const char* name) {
  if (!held) return {};
  HIPFLASH_CHECK(t.has_value(), name, "_host was given without ", name);
  HIPFLASH_CHECK(t->dim() == 1 && t->size(0) == int64_t(held->size()), name, "_host has ",
                 held->size(), " values but ", name, " has shape ", shape_of(*t));
  std::vector<int32_t> values;
  values.reserve(held->size());
  for (const int64_t v : *held) {
    HIPFLASH_CHECK(v >= std::numeric_limits<int32_t>::min() &&
                   v <= std::numeric_limits<int32_t>::max(), name, "_host value ", v,
                   " is not an int32");
    values.push_back(int32_t(v));
  }
  return values;
}

/// Attention against a KV cache (contiguous, or paged with a block table), after appending the
/// optional k / v in place at cache_seqlens.
std::tuple<at::Tensor, at::Tensor> fwd_kvcache(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const c10::optional<at::Tensor>& k, const c10::optional<at::Tensor>& v,
    const c10::optional<at::Tensor>& cache_seqlens, const c10::optional<at::Tensor>& block_table,
    c10::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    int64_t num_splits, bool return_lse, double softcap, const c10::optional<at::Tensor>& alibi_slopes,
    const OptionalTensor& k_scale, const OptionalTensor& v_scale,
    const OptionalTensor& cache_batch_idx, const OptionalTensor& cache_leftpad,
    at::OptionalIntArrayRef cache_seqlens_host, at::OptionalIntArrayRef cache_leftpad_host) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = q.dim() == 4 ? alloc_lse(q, return_lse, {q.size(0), q.size(2), q.size(1)})
                                : alloc_lse(q, return_lse, {-1});
  std::vector<at::Tensor> keep;
  run_launcher([&] {
    const OptionalRef alibi(alibi_slopes, "alibi_slopes", Role::lse),
        ks(k_scale, "k_scale", Role::lse), vs(v_scale, "v_scale", Role::lse),
        bidx(cache_batch_idx, "cache_batch_idx", Role::index),
        lpad(cache_leftpad, "cache_leftpad", Role::index);
    hipflash::KvCacheOptions o;
    static_cast<hipflash::FwdOptions&>(o) =
        fwd_options(softmax_scale, causal, window_left, window_right, num_splits, return_lse,
                    softcap);
    o.alibi_slopes = alibi.get();
    o.k_scale = ks.get();
    o.v_scale = vs.get();
    o.cache_batch_idx = bidx.get();
    o.cache_leftpad = lpad.get();
    const std::vector<int32_t> held_lens = host_values(cache_seqlens_host, cache_seqlens,
                                                       "cache_seqlens"),
                               held_pads = host_values(cache_leftpad_host, cache_leftpad,
                                                       "cache_leftpad");
    if (cache_seqlens_host) o.cache_seqlens_host = held_lens.data();
    if (cache_leftpad_host) o.cache_leftpad_host = held_pads.data();
    const auto qr = to_ref(q, "q", Role::operand), kc = to_ref(k_cache, "k_cache", Role::operand),
               vc = to_ref(v_cache, "v_cache", Role::operand), outr = to_ref(out, "out", Role::operand);
    std::optional<hipflash::TensorRef> kr, vr, sr, br, lr;
    if (k) kr = to_ref(*k, "k", Role::operand);
    if (v) vr = to_ref(*v, "v", Role::operand);
    if (cache_seqlens) sr = to_ref(*cache_seqlens, "cache_seqlens", Role::index);
    if (block_table) br = to_ref(*block_table, "block_table", Role::index);
    if (return_lse) lr = to_ref(lse, "lse", Role::lse);
    hipflash::kvcache_forward(qr, kc, vc, kr ? &*kr : nullptr, vr ? &*vr : nullptr,
                              sr ? &*sr : nullptr, br ? &*br : nullptr, outr, lr ? &*lr : nullptr,
                              o, stream_of(q), torch_workspace(q, keep));
  });
  return {out, lse};
}

/// The backward (CPU or GPU, by the tensors' device): gradients of fwd from its saved
/// (q, k, v, out, lse); the GPU workspace comes from PyTorch's caching allocator.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::optional<double> softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, bool deterministic, double softcap,
    const c10::optional<at::Tensor>& alibi_slopes) {
  at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
             dv = at::empty(v.sizes(), v.options());
  std::vector<at::Tensor> keep;  // the workspace, held until the kernels are enqueued
  run_launcher([&] {
    const OptionalRef alibi(alibi_slopes, "alibi_slopes", Role::lse);
    const hipflash::BwdOptions o = bwd_options(softmax_scale, causal, window_left, window_right,
                                               deterministic, softcap, alibi);
    hipflash::backward(to_ref(dout, "dout", Role::operand), to_ref(q, "q", Role::operand),
                       to_ref(k, "k", Role::operand), to_ref(v, "v", Role::operand),
                       to_ref(out, "out", Role::operand), to_ref(lse, "lse", Role::lse),
                       to_ref(dq, "dq", Role::operand), to_ref(dk, "dk", Role::operand),
                       to_ref(dv, "dv", Role::operand), o, stream_of(q),
                       torch_workspace(q, keep));
  });
  return {dq, dk, dv};
}

/// The varlen backward (CPU or GPU).
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    c10::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    bool deterministic, const std::string& lse_layout, double softcap,
    const c10::optional<at::Tensor>& alibi_slopes, const OptionalTensor& seqused_q,
    const OptionalTensor& seqused_k) {
  at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
             dv = at::empty(v.sizes(), v.options());
  std::vector<at::Tensor> keep;  // the workspace, held until the kernels are enqueued
  run_launcher([&] {
    const OptionalRef alibi(alibi_slopes, "alibi_slopes", Role::lse),
        used_q(seqused_q, "seqused_q", Role::index), used_k(seqused_k, "seqused_k", Role::index);
    hipflash::VarlenBwdOptions o;
    static_cast<hipflash::BwdOptions&>(o) = bwd_options(softmax_scale, causal, window_left,
                                                        window_right, deterministic, softcap, alibi);
    o.seqused_q = used_q.get();
    o.seqused_k = used_k.get();
    o.max_seqlen_q = max_seqlen_q;
    o.max_seqlen_k = max_seqlen_k;
    o.lse_layout = lse_layout_of(lse_layout);
    hipflash::varlen_backward(
        to_ref(dout, "dout", Role::operand), to_ref(q, "q", Role::operand),
        to_ref(k, "k", Role::operand), to_ref(v, "v", Role::operand),
        to_ref(out, "out", Role::operand), to_ref(lse, "lse", Role::lse),
        to_ref(cu_seqlens_q, "cu_seqlens_q", Role::index),
        to_ref(cu_seqlens_k, "cu_seqlens_k", Role::index), to_ref(dq, "dq", Role::operand),
        to_ref(dk, "dk", Role::operand), to_ref(dv, "dv", Role::operand), o, stream_of(q),
        torch_workspace(q, keep));
  });
  return {dq, dk, dv};
}

// ---- The Autograd key: the boundary of the operators that carry no autograd history ---------

/// Refuses, under grad mode, any tensor argument of `op` that requires grad: these operators
/// carry no autograd history (hipflash's autograd.Functions wrap fwd / varlen_fwd with bwd /
/// varlen_bwd), so a result must never be silently detached.
void refuse_grad(const at::Tensor& t, const char* op) {
  TORCH_CHECK(!(t.defined() && t.requires_grad()), "hipflash.", op,
              ": an input requires grad, but hipflash has no backward yet for this call "
              "(flash_attn_func / flash_attn_varlen_func without out= are differentiable); "
              "call it under torch.no_grad() or pass detached tensors");
}
void refuse_grad(const c10::optional<at::Tensor>& t, const char* op) {
  if (t) refuse_grad(*t, op);
}
template <class T>
void refuse_grad(const T&, const char*) {}  // not a tensor

void bump(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }
void bump(const c10::optional<at::Tensor>& t) {
  if (t) bump(*t);
}
template <class T>
void bump(const T&) {}

/// The Autograd kernel of operator hipflash::`kOp` (backend kernel signature R(A...)), shown to
/// users as `kUser`: refuses inputs that require grad under grad mode, runs the operator below
/// autograd, and bumps the version counter of every argument its schema marks as written
/// (Tensor(a!): out= buffers, the KV caches), as any in-place op does — also when the call
/// stops early (an interrupted call has written part of them).
template <const char* kOp, const char* kUser, class Sig>
struct Autograd;
template <const char* kOp, const char* kUser, class R, class... A>
struct Autograd<kOp, kUser, R(A...)> {
  static R call(A... args) {
    if (at::GradMode::is_enabled()) (refuse_grad(args, kUser), ...);
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(kOp, "");
    static const std::vector<bool> written = [] {
      std::vector<bool> w;
      for (const auto& arg : op.schema().arguments())
        w.push_back(arg.alias_info() != nullptr && arg.alias_info()->isWrite());
      return w;
    }();
    struct BumpOnExit {
      std::tuple<const A&...> args;
      ~BumpOnExit() {
        size_t i = 0;
        std::apply([&](const auto&... a) { ((written[i++] ? bump(a) : void()), ...); }, args);
      }
    } bump_on_exit{std::tie(args...)};
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.typed<R(A...)>().call(args...);
  }
};

// The operators' names and the calls users know them by.
constexpr char kFwd[] = "hipflash::fwd", kFwdOut[] = "hipflash::fwd_out",
               kVarlenFwd[] = "hipflash::varlen_fwd", kVarlenFwdOut[] = "hipflash::varlen_fwd_out",
               kVarlenFwdPaged[] = "hipflash::varlen_fwd_paged",
               kMerge[] = "hipflash::merge_attn_states", kFwdKvcache[] = "hipflash::fwd_kvcache",
               kBwd[] = "hipflash::bwd", kVarlenBwd[] = "hipflash::varlen_bwd";
constexpr char kUserFwd[] = "flash_attn_func", kUserVarlen[] = "flash_attn_varlen_func",
               kUserPaged[] = "flash_attn_varlen_func (paged KV cache)",
               kUserMerge[] = "merge_attn_states", kUserKvcache[] = "flash_attn_with_kvcache",
               kUserBwd[] = "bwd (double backward)", kUserVarlenBwd[] = "varlen_bwd (double backward)";

// ---- Ctrl-C --------------------------------------------------------------------------------

/// hipflash's interrupt check: runs Python's signal handlers (main thread only, as Python
/// does). A handler that raised (KeyboardInterrupt) stops the call; the exception is cleared
/// here and raised again by the Python wrapper from hipflash::interrupted.
/// The exception a signal handler raised during a call (KeyboardInterrupt, or the handler's
/// own), kept for the Python wrapper to raise again (take_pending_signal_error).
thread_local PyObject* t_signal_type = nullptr;
thread_local PyObject* t_signal_value = nullptr;
thread_local PyObject* t_signal_tb = nullptr;

bool python_interrupted() {
  if (!Py_IsInitialized()) return false;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  Py_XDECREF(t_signal_type);
  Py_XDECREF(t_signal_value);
  Py_XDECREF(t_signal_tb);
  PyErr_Fetch(&t_signal_type, &t_signal_value, &t_signal_tb);  // clears it until re-raised
  return true;
}

}  // namespace

TORCH_LIBRARY(hipflash, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale, bool causal, int window_left, "
        "int window_right, int num_splits, bool return_lse, float softcap=0.0, "
        "Tensor? alibi_slopes=None, Tensor? q_descale=None, Tensor? k_descale=None, "
        "Tensor? v_descale=None) -> (Tensor out, Tensor lse)");
  m.def("fwd_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!)? lse, "
        "float? softmax_scale, bool causal, int window_left, int window_right, int num_splits, "
        "bool return_lse, float softcap=0.0, Tensor? alibi_slopes=None, Tensor? q_descale=None, "
        "Tensor? k_descale=None, Tensor? v_descale=None) -> ()");
  m.def("varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, float? softmax_scale, bool causal, int window_left, "
        "int window_right, int num_splits, bool return_lse, str lse_layout, "
        "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? seqused_q=None, "
        "Tensor? seqused_k=None, Tensor? q_descale=None, Tensor? k_descale=None, "
        "Tensor? v_descale=None) -> (Tensor out, Tensor lse)");
  m.def("varlen_fwd_out(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, Tensor(a!) out, Tensor(b!)? lse, "
        "float? softmax_scale, bool causal, int window_left, int window_right, int num_splits, "
        "bool return_lse, str lse_layout, float softcap=0.0, Tensor? alibi_slopes=None, "
        "Tensor? seqused_q=None, Tensor? seqused_k=None, Tensor? q_descale=None, "
        "Tensor? k_descale=None, Tensor? v_descale=None) -> ()");
  m.def("varlen_fwd_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, Tensor block_table, int max_seqlen_q, int max_seqlen_k, "
        "float? softmax_scale, bool causal, int window_left, int window_right, int num_splits, "
        "bool return_lse, str lse_layout, float softcap=0.0, Tensor? alibi_slopes=None, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor out, Tensor lse)");
  m.def("merge_attn_states(Tensor outs, Tensor lses) -> (Tensor out, Tensor lse)");
  m.def("fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
        "Tensor? cache_seqlens, Tensor? block_table, float? softmax_scale, bool causal, "
        "int window_left, int window_right, int num_splits, bool return_lse, "
        "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? k_scale=None, "
        "Tensor? v_scale=None, Tensor? cache_batch_idx=None, Tensor? cache_leftpad=None, "
        "int[]? cache_seqlens_host=None, int[]? cache_leftpad_host=None) -> "
        "(Tensor out, Tensor lse)");
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "float? softmax_scale, bool causal, int window_left, int window_right, "
        "bool deterministic, float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
        "float? softmax_scale, bool causal, int window_left, int window_right, "
        "bool deterministic, str lse_layout, float softcap=0.0, Tensor? alibi_slopes=None, "
        "Tensor? seqused_q=None, Tensor? seqused_k=None) "
        "-> (Tensor dq, Tensor dk, Tensor dv)");
}

/// The backend kernels: one function for both dispatch keys (the launcher picks the backend
/// from the tensors' location); the Autograd key gets each one's Autograd<...>::call.
#define HIPFLASH_OPERATORS(X)                        \
  X(fwd, kFwd, kUserFwd)                             \
  X(fwd_out, kFwdOut, kUserFwd)                      \
  X(varlen_fwd, kVarlenFwd, kUserVarlen)             \
  X(varlen_fwd_out, kVarlenFwdOut, kUserVarlen)      \
  X(varlen_fwd_paged, kVarlenFwdPaged, kUserPaged)   \
  X(merge_attn_states, kMerge, kUserMerge)           \
  X(fwd_kvcache, kFwdKvcache, kUserKvcache)          \
  X(bwd, kBwd, kUserBwd)                             \
  X(varlen_bwd, kVarlenBwd, kUserVarlenBwd)

static void register_backend_kernels(torch::Library& m) {
#define HIPFLASH_IMPL(name, op, user) m.impl(#name, &name);
  HIPFLASH_OPERATORS(HIPFLASH_IMPL)
#undef HIPFLASH_IMPL
}

TORCH_LIBRARY_IMPL(hipflash, CPU, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(hipflash, CUDA, m) { register_backend_kernels(m); }

TORCH_LIBRARY_IMPL(hipflash, Autograd, m) {
#define HIPFLASH_AUTOGRAD(name, op, user) \
  m.impl(#name, &Autograd<op, user, std::remove_pointer_t<decltype(&name)>>::call);
  HIPFLASH_OPERATORS(HIPFLASH_AUTOGRAD)
#undef HIPFLASH_AUTOGRAD
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hipflash C++ extension: registers torch.ops.hipflash.* (use the `hipflash` package)";
#ifdef HIPFLASH_VERSION
  m.attr("__version__") = HIPFLASH_VERSION;
#endif  // HIPFLASH_VERSION
  hipflash::set_interrupt_check(&python_interrupted);

  // SPEC §4 for the helpers below (the operators raise c10 errors of these types themselves).
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hipflash::dtype_error& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const hipflash::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const hipflash::not_implemented& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    } catch (const hipflash::runtime_error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  m.def(
      "resolve_num_splits",
      [](const at::Tensor& q, const at::Tensor& k, bool causal, int64_t window_left,
         int64_t window_right, int64_t num_splits) {
        return hipflash::resolve_num_splits(
            to_ref(q, "q", Role::operand), to_ref(k, "k", Role::operand),
            fwd_options(c10::nullopt, causal, window_left, window_right, num_splits, false, 0.0));
      },
      py::arg("q"), py::arg("k"), py::arg("causal") = false, py::arg("window_left") = -1,
      py::arg("window_right") = -1, py::arg("num_splits") = 0,
      "The split count a dense call with these q, k and options runs with (num_splits=0 "
      "resolves by heuristic; passing the result explicitly gives bitwise the same output).");
  m.def(
      "take_pending_signal_error",
      []() {
        // Raises what the signal handler raised during the interrupted call (if anything).
        if (t_signal_type == nullptr) return;
        PyErr_Restore(t_signal_type, t_signal_value, t_signal_tb);
        t_signal_type = t_signal_value = t_signal_tb = nullptr;
        throw py::error_already_set();
      },
      "Raises the exception a signal handler raised during the last interrupted call.");
  m.def(
      "check_written_buffers",
      [](const std::vector<std::pair<at::Tensor, std::string>>& written,
         const std::vector<std::pair<at::Tensor, std::string>>& read) {
        // TensorRefs of the tensors (names outlive them in the pairs), then the C++ check.
        std::vector<hipflash::TensorRef> refs;
        refs.reserve(written.size() + read.size());
        for (const auto& group : {&written, &read})
          for (const auto& [t, name] : *group) refs.push_back(memory_ref(t, name.c_str()));
        std::vector<hipflash::NamedRef> w, r;
        for (size_t i = 0; i < written.size(); ++i)
          w.push_back({&refs[i], written[i].second.c_str()});
        for (size_t i = 0; i < read.size(); ++i)
          r.push_back({&refs[written.size() + i], read[i].second.c_str()});
        hipflash::check_written_buffers(w, r);
      },
      py::arg("written"), py::arg("read"),
      "SPEC §4's aliasing rules for buffers written (by PyTorch ops) before a hipflash call "
      "reads them: ValueError if a written tensor overlaps itself, another written one or a "
      "read one. Each argument: a list of (tensor, name).");
  m.def("gpu_available", &hipflash::gpu_available,
        "Whether this build has GPU kernels and a GPU is visible.");
  m.def("build_info", &hipflash::build_info, "What this build can run, e.g. 'cpu+cuda(...)'.");
  m.def("last_kernel_name", &hipflash::last_kernel_name,
        "Name of the kernel the last forward on this thread ran.");
}
