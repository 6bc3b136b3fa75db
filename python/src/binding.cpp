// hipflash._C — the pybind11 binding: at::Tensor -> hipflash::TensorRef, nothing else.
//
// Every check of SPEC §4 lives in the C++ launcher; this file only describes tensors (pointer,
// dtype, sizes, strides, device), forwards the call with the GIL released, and turns the typed
// C++ errors into Python exceptions. The CUDA/HIP stream arrives from Python as an integer
// (torch.cuda.current_stream(dev).cuda_stream), so no device headers are needed here.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hipflash/hipflash.hpp"

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
    default:
      if (role == Role::index)  // cu_seqlens: a ValueError, as for any non-int32 dtype (SPEC §4)
        HIPFLASH_CHECK(false, name, " must have dtype int32, got ", dtype_str(t.scalar_type()));
      HIPFLASH_CHECK_AS(dtype_error, false, name, " must have dtype ",
                        role == Role::lse ? "float32" : "float16 or bfloat16", ", got ",
                        dtype_str(t.scalar_type()));
  }
  switch (t.device().type()) {
    case at::kCPU: r.loc = {hipflash::Location::cpu, 0}; break;
    case at::kCUDA:  // also ROCm torch's HIP devices
      r.loc = {hipflash::Location::gpu, t.device().has_index() ? t.device().index() : 0};
      break;
    default:
      HIPFLASH_CHECK_AS(not_implemented, false, name, " is on device '", t.device(),
                        "'; hipflash runs on cpu and cuda/hip tensors");
  }
  r.rank = int(t.dim());
  for (int i = 0; i < r.rank; ++i) {
    r.sizes[i] = t.size(i);
    r.strides[i] = t.stride(i);
  }
  r.data = t.numel() == 0 ? nullptr : t.data_ptr();
  return r;
}

hipflash::FwdOptions fwd_options(std::optional<double> softmax_scale, bool causal,
                                 int64_t window_left, int64_t window_right, int num_splits,
                                 bool return_lse) {
  hipflash::FwdOptions o;
  if (softmax_scale) o.softmax_scale = float(*softmax_scale);
  o.causal = causal;
  o.window_left = window_left;
  o.window_right = window_right;
  o.num_splits = num_splits;
  o.return_lse = return_lse;
  return o;
}

hipflash::Stream as_stream(uintptr_t stream) { return reinterpret_cast<hipflash::Stream>(stream); }

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

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
             const std::optional<at::Tensor>& lse, std::optional<double> softmax_scale,
             bool causal, int64_t window_left, int64_t window_right, int num_splits,
             bool return_lse, uintptr_t stream) {
  const auto qr = to_ref(q, "q", Role::operand), kr = to_ref(k, "k", Role::operand),
             vr = to_ref(v, "v", Role::operand), outr = to_ref(out, "out", Role::operand);
  std::optional<hipflash::TensorRef> lser;
  if (lse) lser = to_ref(*lse, "lse", Role::lse);
  const auto opts =
      fwd_options(softmax_scale, causal, window_left, window_right, num_splits, return_lse);
  std::vector<at::Tensor> keep;
  py::gil_scoped_release no_gil;
  hipflash::forward(qr, kr, vr, outr, lser ? &*lser : nullptr, opts, as_stream(stream),
                    torch_workspace(q, keep));
}

void varlen_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const std::optional<at::Tensor>& lse,
                    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                    int64_t max_seqlen_q, int64_t max_seqlen_k,
                    std::optional<double> softmax_scale, bool causal, int64_t window_left,
                    int64_t window_right, int num_splits, bool return_lse,
                    const std::string& lse_layout, uintptr_t stream) {
  HIPFLASH_CHECK(lse_layout == "padded" || lse_layout == "packed",
                 "lse_layout must be 'padded' or 'packed', got '", lse_layout, "'");
  const auto qr = to_ref(q, "q", Role::operand), kr = to_ref(k, "k", Role::operand),
             vr = to_ref(v, "v", Role::operand), outr = to_ref(out, "out", Role::operand);
  const auto cuq = to_ref(cu_seqlens_q, "cu_seqlens_q", Role::index);
  const auto cuk = to_ref(cu_seqlens_k, "cu_seqlens_k", Role::index);
  std::optional<hipflash::TensorRef> lser;
  if (lse) lser = to_ref(*lse, "lse", Role::lse);
  hipflash::VarlenOptions opts;
  static_cast<hipflash::FwdOptions&>(opts) =
      fwd_options(softmax_scale, causal, window_left, window_right, num_splits, return_lse);
  opts.max_seqlen_q = max_seqlen_q;
  opts.max_seqlen_k = max_seqlen_k;
  opts.lse_layout =
      lse_layout == "packed" ? hipflash::LseLayout::packed : hipflash::LseLayout::padded;
  std::vector<at::Tensor> keep;
  py::gil_scoped_release no_gil;
  hipflash::varlen_forward(qr, kr, vr, outr, lser ? &*lser : nullptr, cuq, cuk, opts,
                           as_stream(stream), torch_workspace(q, keep));
}

int resolve_num_splits(const at::Tensor& q, const at::Tensor& k, bool causal,
                       int64_t window_left, int64_t window_right, int num_splits) {
  return hipflash::resolve_num_splits(
      to_ref(q, "q", Role::operand), to_ref(k, "k", Role::operand),
      fwd_options(std::nullopt, causal, window_left, window_right, num_splits, false));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hipflash C++ extension: flash-attention forward with LSE (use the `hipflash` package)";
#ifdef HIPFLASH_VERSION
  m.attr("__version__") = HIPFLASH_VERSION;
#endif  // HIPFLASH_VERSION

  // SPEC §4: typed C++ errors -> Python exceptions. One translator, most-derived first
  // (dtype_error is an invalid_argument).
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

  m.def("forward", &forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("softmax_scale"), py::arg("causal"), py::arg("window_left"),
        py::arg("window_right"), py::arg("num_splits"), py::arg("return_lse"),
        py::arg("stream") = 0,
        "Dense forward into preallocated out (and lse when return_lse). Use "
        "hipflash.flash_attn_func.");
  m.def("varlen_forward", &varlen_forward, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
        py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("softmax_scale"),
        py::arg("causal"), py::arg("window_left"), py::arg("window_right"),
        py::arg("num_splits"), py::arg("return_lse"), py::arg("lse_layout"),
        py::arg("stream") = 0,
        "Varlen forward into preallocated out (and lse). Use hipflash.flash_attn_varlen_func.");
  m.def("resolve_num_splits", &resolve_num_splits, py::arg("q"), py::arg("k"),
        py::arg("causal") = false, py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("num_splits") = 0,
        "The split count a dense call with these q, k and options runs with (num_splits=0 "
        "resolves by heuristic; passing the result explicitly gives bitwise the same output).");
  m.def("gpu_available", &hipflash::gpu_available,
        "Whether this build has GPU kernels and a GPU is visible.");
  m.def("build_info", &hipflash::build_info, "What this build can run, e.g. 'cpu+cuda(...)'.");
  m.def("last_kernel_name", &hipflash::last_kernel_name,
        "Name of the kernel the last forward on this thread ran.");
}
