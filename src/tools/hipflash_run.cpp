// hipflash-run — the project's main program: one forward call on random inputs, timed, checked
// against the fp64 reference (SPEC §6), with the kernel name, time and TFLOP/s.
//
//   hipflash-run --batch 2 --heads 8 --kv-heads 2 --seqlen-q 512 --seqlen-k 512
//                --head-dim 128 --dtype bf16 --causal --splits 0 --device auto --iters 5
//
// Exit code: 0 on PASS, 1 on FAIL, 2 on an error (bad flag, rejected call, device error).
// GPU code is compiled only in GPU builds (HIPFLASH_WITH_CUDA / HIPFLASH_WITH_HIP, set by
// CMake); this file is plain C++ either way.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "hipflash/detail/host_numeric.hpp"
#include "hipflash/hipflash.hpp"
#include "reference.hpp"  // the fp64 oracle (tests/cpp)

#include "device_runtime.hpp"

namespace {

using namespace hipflash;

struct Args {
  // Defaults: a few seconds on 2 CPU cores (3 iterations + the reference check).
  int64_t batch = 2, heads = 8, kv_heads = -1 /* 2, or --heads if given */, seqlen_q = 512, seqlen_k = 512, head_dim = 128;
  DType dtype = DType::bf16;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  int splits = 0;
  bool varlen = false;
  std::string device = "auto";
  int iters = 3;
  uint32_t seed = 0;
  int64_t check_rows = 4096;  ///< reference rows to check (spread evenly); 0 = all
};

[[noreturn]] void usage(const std::string& why, int code = 2) {
  std::fprintf(code ? stderr : stdout,
               "hipflash-run: %s\n"
               "usage: hipflash-run [--batch B] [--heads HQ] [--kv-heads HKV] [--seqlen-q SQ]\n"
               "         [--seqlen-k SK] [--head-dim 32|64|96|128|256] [--dtype bf16|f16]\n"
               "         [--causal] [--window L,R] [--splits N (0 = heuristic)] [--varlen]\n"
               "         [--device cpu|gpu|auto] [--iters N] [--seed S] [--check-rows N (0 = all)]\n",
               why.c_str());
  std::exit(code);
}

int64_t parse_int(const char* flag, const char* s) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s || *end != '\0') usage(std::string(flag) + " expects an integer, got '" + s + "'");
  return v;
}

Args parse(int argc, char** argv) {
  Args a;
  bool heads_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(f + " expects a value");
      return argv[++i];
    };
    if (f == "--batch") a.batch = parse_int("--batch", value());
    else if (f == "--heads") a.heads = parse_int("--heads", value()), heads_given = true;
    else if (f == "--kv-heads") a.kv_heads = parse_int("--kv-heads", value());
    else if (f == "--seqlen-q") a.seqlen_q = parse_int("--seqlen-q", value());
    else if (f == "--seqlen-k") a.seqlen_k = parse_int("--seqlen-k", value());
    else if (f == "--head-dim") a.head_dim = parse_int("--head-dim", value());
    else if (f == "--splits") a.splits = int(parse_int("--splits", value()));
    else if (f == "--iters") a.iters = int(parse_int("--iters", value()));
    else if (f == "--seed") a.seed = uint32_t(parse_int("--seed", value()));
    else if (f == "--check-rows") a.check_rows = parse_int("--check-rows", value());
    else if (f == "--causal") a.causal = true;
    else if (f == "--varlen") a.varlen = true;
    else if (f == "--device") a.device = value();
    else if (f == "--dtype") {
      const std::string d = value();
      if (d == "bf16" || d == "bfloat16") a.dtype = DType::bf16;
      else if (d == "f16" || d == "fp16" || d == "float16") a.dtype = DType::f16;
      else usage("--dtype expects bf16 or f16, got '" + d + "'");
    } else if (f == "--window") {
      const std::string w = value();
      const size_t comma = w.find(',');
      if (comma == std::string::npos) usage("--window expects L,R (e.g. 128,0 or -1,-1)");
      a.window_left = parse_int("--window", w.substr(0, comma).c_str());
      a.window_right = parse_int("--window", w.substr(comma + 1).c_str());
    } else if (f == "--help" || f == "-h") {
      usage("one forward call, timed and checked against the fp64 reference", 0);
    } else {
      usage("unknown flag '" + f + "'");
    }
  }
  if (a.kv_heads < 0) a.kv_heads = heads_given ? a.heads : 2;  // --heads alone means MHA
  if (a.iters < 1) usage("--iters must be >= 1");
  if (a.device != "cpu" && a.device != "gpu" && a.device != "auto")
    usage("--device expects cpu, gpu or auto, got '" + a.device + "'");
  if (a.batch < 0 || a.heads < 0 || a.kv_heads < 0 || a.seqlen_q < 0 || a.seqlen_k < 0)
    usage("sizes must be >= 0");
  return a;
}

/// Host storage of one tensor (16-bit words for bf16/f16, 32-bit for fp32/int32).
struct Host {
  std::vector<uint8_t> bytes;
  TensorRef ref;
  Host(DType dt, std::initializer_list<int64_t> sizes) {
    ref = make_tensor(nullptr, dt, sizes);
    bytes.assign(size_t(std::max<int64_t>(ref.numel(), 1) * dtype_size(dt)), 0);
    ref.data = bytes.data();
  }
  Host(Host&&) = default;  // the vector keeps its buffer, so ref.data stays valid
  Host(const Host&) = delete;
  size_t nbytes() const { return size_t(ref.numel() * dtype_size(ref.dtype)); }
  /// NaN everywhere: whatever the forward call does not write shows up in the check.
  void poison() {
    for (int64_t i = 0; i < ref.numel(); ++i) {
      if (ref.dtype == DType::f32) static_cast<float*>(ref.data)[i] = std::nanf("");
      else detail::store_from_float(ref.data, i, std::nanf(""), ref.dtype);
    }
  }
  void randomize(std::mt19937& rng) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int64_t i = 0; i < ref.numel(); ++i) detail::store_from_float(ref.data, i, u(rng), ref.dtype);
  }
};

#if defined(HF_RT)
/// A device copy of a host tensor, freed on scope exit.
struct Device {
  void* ptr = nullptr;
  TensorRef ref;
  explicit Device(const Host& h) {
    ref = h.ref;
    rt_check(HF_RT(Malloc)(&ptr, std::max<size_t>(h.nbytes(), 16)), "device malloc");
    rt_check(HF_RT(Memcpy)(ptr, h.ref.data, h.nbytes(), HF_RT(MemcpyHostToDevice)), "copy to device");
    ref.data = ptr;
    ref.loc = {Location::gpu, 0};
  }
  void to_host(Host& h) const {
    rt_check(HF_RT(Memcpy)(h.ref.data, ptr, h.nbytes(), HF_RT(MemcpyDeviceToHost)), "copy to host");
  }
  ~Device() { rt_warn(HF_RT(Free)(ptr), "device free"); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
};
#endif  // HF_RT

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

int run(const Args& a) {
  const bool want_gpu = a.device == "gpu" || (a.device == "auto" && gpu_available());
  if (want_gpu) {
#if !defined(HF_RT)
    throw not_implemented("--device gpu: this hipflash-run was built without a GPU runtime "
                          "(HIPFLASH_GPU=none); use --device cpu");
#endif  // !HF_RT
    if (!gpu_available())
      throw not_implemented("--device gpu: no usable GPU (" + build_info() + ")");
  }

  // Inputs: dense [B, S, H, D], or varlen with random lengths in [0, seqlen] per sequence.
  std::mt19937 rng(a.seed);
  std::vector<int32_t> cu_q{0}, cu_k{0};
  int64_t max_q = a.seqlen_q, max_k = a.seqlen_k;
  if (a.varlen) {
    max_q = max_k = 0;
    for (int64_t b = 0; b < a.batch; ++b) {
      const int64_t lq = std::uniform_int_distribution<int64_t>(0, a.seqlen_q)(rng);
      const int64_t lk = std::uniform_int_distribution<int64_t>(0, a.seqlen_k)(rng);
      cu_q.push_back(int32_t(cu_q.back() + lq));
      cu_k.push_back(int32_t(cu_k.back() + lk));
      max_q = std::max(max_q, lq);
      max_k = std::max(max_k, lk);
    }
  }
  const int64_t D = a.head_dim, Hq = a.heads, Hkv = a.kv_heads;
  Host q = a.varlen ? Host(a.dtype, {cu_q.back(), Hq, D}) : Host(a.dtype, {a.batch, a.seqlen_q, Hq, D});
  Host k = a.varlen ? Host(a.dtype, {cu_k.back(), Hkv, D}) : Host(a.dtype, {a.batch, a.seqlen_k, Hkv, D});
  Host v = a.varlen ? Host(a.dtype, {cu_k.back(), Hkv, D}) : Host(a.dtype, {a.batch, a.seqlen_k, Hkv, D});
  Host out = a.varlen ? Host(a.dtype, {cu_q.back(), Hq, D}) : Host(a.dtype, {a.batch, a.seqlen_q, Hq, D});
  Host lse(DType::f32, {a.batch, Hq, max_q});  // dense and padded varlen
  Host cuq(DType::i32, {int64_t(cu_q.size())}), cuk(DType::i32, {int64_t(cu_k.size())});
  std::memcpy(cuq.ref.data, cu_q.data(), cu_q.size() * 4);
  std::memcpy(cuk.ref.data, cu_k.data(), cu_k.size() * 4);
  q.randomize(rng);
  k.randomize(rng);
  v.randomize(rng);
  out.poison();
  lse.poison();

  VarlenOptions opts;
  opts.causal = a.causal;
  opts.window_left = a.window_left;
  opts.window_right = a.window_right;
  opts.num_splits = a.splits;
  opts.return_lse = true;
  opts.max_seqlen_q = max_q;
  opts.max_seqlen_k = max_k;
  opts.lse_layout = LseLayout::padded;

  auto call = [&](const TensorRef& tq, const TensorRef& tk, const TensorRef& tv,
                  const TensorRef& to, const TensorRef& tl, const TensorRef& tcq,
                  const TensorRef& tck) {
    if (a.varlen) varlen_forward(tq, tk, tv, to, &tl, tcq, tck, opts);
    else forward(tq, tk, tv, to, &tl, opts);
  };

  std::vector<double> ms;
  if (!want_gpu) {
    for (int it = 0; it < a.iters; ++it) {
      const auto t0 = std::chrono::steady_clock::now();
      call(q.ref, k.ref, v.ref, out.ref, lse.ref, cuq.ref, cuk.ref);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  } else {
#if defined(HF_RT)
    Device dq(q), dk(k), dv(v), dout(out), dlse(lse), dcq(cuq), dck(cuk);
    HF_RT(Event_t) e0, e1;
    rt_check(HF_RT(EventCreate)(&e0), "event create");
    rt_check(HF_RT(EventCreate)(&e1), "event create");
    call(dq.ref, dk.ref, dv.ref, dout.ref, dlse.ref, dcq.ref, dck.ref);  // warm-up
    rt_check(HF_RT(DeviceSynchronize)(), "warm-up");
    for (int it = 0; it < a.iters; ++it) {
      rt_check(HF_RT(EventRecord)(e0, nullptr), "event record");
      call(dq.ref, dk.ref, dv.ref, dout.ref, dlse.ref, dcq.ref, dck.ref);
      rt_check(HF_RT(EventRecord)(e1, nullptr), "event record");
      rt_check(HF_RT(EventSynchronize)(e1), "forward");
      float t = 0;
      rt_check(HF_RT(EventElapsedTime)(&t, e0, e1), "event time");
      ms.push_back(t);
    }
    rt_check(HF_RT(EventDestroy)(e0), "event destroy");
    rt_check(HF_RT(EventDestroy)(e1), "event destroy");
    dout.to_host(out);
    dlse.to_host(lse);
#endif  // HF_RT
  }

  const ref::Problem prob =
      a.varlen ? ref::Problem::varlen(q.ref, k.ref, v.ref, cu_q.data(), cu_k.data(), a.batch, opts)
               : ref::Problem::dense(q.ref, k.ref, v.ref, opts);
  ref::CheckOptions co;
  co.max_rows = a.check_rows;
  co.lse_layout = LseLayout::padded;
  const ref::CheckResult r = ref::check(prob, out.ref, &lse.ref, co);

  const double t_ms = median(ms);
  const double flops = 4.0 * double(D) * prob.valid_pairs();
  std::printf("problem : %s B=%lld Hq=%lld Hkv=%lld Sq=%lld Sk=%lld D=%lld%s%s window=(%lld,%lld) splits=%d\n",
              std::string(dtype_name(a.dtype)).c_str(), (long long)a.batch, (long long)Hq,
              (long long)Hkv, (long long)a.seqlen_q, (long long)a.seqlen_k, (long long)D,
              a.causal ? " causal" : "", a.varlen ? " varlen" : "", (long long)a.window_left,
              (long long)a.window_right, a.splits);
  std::printf("backend : %s (%s)\n", want_gpu ? "gpu" : "cpu", build_info().c_str());
  std::printf("kernel  : %s\n", last_kernel_name().c_str());
  std::printf("time    : %.4f ms (median of %d)\n", t_ms, a.iters);
  std::printf("TFLOP/s : %.4g (%.4g valid (i,j) pairs x 4 D flops)\n",
              t_ms > 0 ? flops / (t_ms * 1e-3) / 1e12 : 0.0, prob.valid_pairs());
  std::printf("check   : max|out-ref| %.3g (tol %.3g = 2*max|ref_lp-ref| + 1e-5), max|lse-ref| %.3g, "
              "%lld of %lld rows checked (%lld empty), NaN %lld\n",
              r.max_out_err, r.out_tol, r.max_lse_err, (long long)r.rows_checked,
              (long long)(prob.is_varlen() ? int64_t(cu_q.back()) * Hq : a.batch * a.seqlen_q * Hq),
              (long long)r.empty_rows, (long long)r.nan_count);
  std::printf("%s\n", r.ok ? "PASS" : ("FAIL: " + r.message).c_str());
  return r.ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hipflash-run: error: %s\n", e.what());
    return 2;
  }
}
