// hipflash-bench — the C++ benchmark, for C++ users (no PyTorch): times hipflash::forward on
// FlashAttention's grid (B*S = 16k, H*D = 2048, D 64/128, S 512..16k, causal and not) and a
// decode subset (Sq 1, GQA 32/8, D 128, Sk 8k..128k, B 1/8), LSE off and on, and prints the
// kernel name, the median time, TFLOP/s (decode: also GB/s of K/V read).
//
//   hipflash-bench                      # GPU build: grid + decode; CPU build: a tiny grid
//   hipflash-bench --quick              # fewer cells (S 1k/4k/16k, decode B 8)
//   hipflash-bench --suite grid|decode|all  --lse off|on|both  --csv FILE  --device cpu|gpu
//   hipflash-bench --smoke              # two tiny cells, a few calls: the CTest smoke test
//
// Method (see /work/.library/device/METHOD.md, bench/README.md): inputs drawn at random
// (approximately standard normal, never zeros), enough input sets rotated that they exceed 4x
// the L2; each cell first runs once into NaN-poisoned out/lse buffers and is checked against the
// fp64 reference (SPEC §6, sampled rows, every element scanned for NaN): a FAIL is not timed.
// GPU timing: device events around batches of back-to-back calls (so the launch queue stays
// full), warm-up first, median over the batches. CPU timing: steady_clock, median.
//
// Exit code: 0 all checked cells pass, 1 a cell FAILed, 2 an error stopped the run.
// This file is plain C++; its GPU path uses the device runtime directly, like hipflash-run.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hipflash/detail/host_numeric.hpp"
#include "hipflash/hipflash.hpp"
#include "reference.hpp"  // the fp64 oracle (tests/cpp)

#include "device_runtime.hpp"

namespace {

using namespace hipflash;
using Clock = std::chrono::steady_clock;

// ---- Options ---------------------------------------------------------------------------------

struct Args {
  std::string suite = "all";  // grid | decode | all
  std::string lse = "both";   // off | on | both
  std::string device = "auto";
  std::string csv;
  DType dtype = DType::bf16;
  bool quick = false, smoke = false;
  double target_ms = 200;  // timed time per (cell, LSE flag)
};

[[noreturn]] void usage(const std::string& why, int code = 2) {
  std::fprintf(code ? stderr : stdout,
               "hipflash-bench: %s\n"
               "usage: hipflash-bench [--quick] [--smoke] [--suite grid|decode|all]\n"
               "         [--lse off|on|both] [--dtype bf16|f16] [--device cpu|gpu|auto]\n"
               "         [--target-ms MS (timed per cell, default 200)] [--csv FILE]\n",
               why.c_str());
  std::exit(code);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(f + " expects a value");
      return argv[++i];
    };
    if (f == "--quick") a.quick = true;
    else if (f == "--smoke") a.smoke = true;
    else if (f == "--suite") a.suite = value();
    else if (f == "--lse") a.lse = value();
    else if (f == "--device") a.device = value();
    else if (f == "--csv") a.csv = value();
    else if (f == "--target-ms") a.target_ms = std::atof(value().c_str());
    else if (f == "--dtype") {
      const std::string d = value();
      if (d == "bf16") a.dtype = DType::bf16;
      else if (d == "f16") a.dtype = DType::f16;
      else usage("--dtype expects bf16 or f16, got '" + d + "'");
    } else if (f == "--help" || f == "-h") {
      usage("times hipflash::forward on FlashAttention's grid and a decode subset", 0);
    } else {
      usage("unknown flag '" + f + "'");
    }
  }
  if (a.suite != "grid" && a.suite != "decode" && a.suite != "all")
    usage("--suite expects grid, decode or all");
  if (a.lse != "off" && a.lse != "on" && a.lse != "both") usage("--lse expects off, on or both");
  if (a.device != "cpu" && a.device != "gpu" && a.device != "auto")
    usage("--device expects cpu, gpu or auto");
  if (!(a.target_ms > 0)) usage("--target-ms must be > 0");
  return a;
}

// ---- Cells -----------------------------------------------------------------------------------

struct Cell {
  std::string name;
  int64_t B, Sq, Sk, Hq, Hkv, D;
  bool causal;
  bool decode;

  /// Valid (query, key) pairs of one (batch, head): bottom-right aligned causal (SPEC §3).
  double pairs() const {
    if (!causal) return double(Sq) * double(Sk);
    double n = 0;
    for (int64_t i = 0; i < Sq; ++i) n += double(std::clamp<int64_t>(i + Sk - Sq + 1, 0, Sk));
    return n;
  }
  double flops() const { return 4.0 * double(B * Hq * D) * pairs(); }
  double kv_bytes(int elem) const { return 2.0 * double(B * Hkv * Sk * D) * elem; }
};

std::string kname(int64_t n) {
  return n >= 1024 && n % 1024 == 0 ? std::to_string(n / 1024) + "k" : std::to_string(n);
}

std::vector<Cell> make_cells(const Args& a, bool gpu) {
  std::vector<Cell> cells;
  if (!gpu || a.smoke) {
    // CPU backend (or the smoke test): a tiny grid that runs in seconds on 2 cores.
    std::vector<int64_t> seqs = a.smoke ? std::vector<int64_t>{128} : std::vector<int64_t>{128, 256, 512};
    for (bool causal : {false, true})
      for (int64_t s : seqs)
        cells.push_back({"hd64 S=" + kname(s) + (causal ? " causal" : ""), 1, s, s, 4, 4, 64,
                         causal, false});
    if (a.suite != "grid") {
      const int64_t sk = a.smoke ? 512 : 4096;
      cells.push_back({"decode B=1 Sk=" + kname(sk), 1, 1, sk, 8, 2, 64, false, true});
    }
    if (a.smoke) cells.erase(cells.begin() + 1);  // one dense cell and the decode cell
    if (a.suite == "decode") cells.erase(cells.begin(), cells.end() - 1);
    return cells;
  }
  if (a.suite != "decode") {
    std::vector<int64_t> seqs = a.quick ? std::vector<int64_t>{1024, 4096, 16384}
                                        : std::vector<int64_t>{512, 1024, 2048, 4096, 8192, 16384};
    for (int64_t d : {64, 128})
      for (bool causal : {false, true})
        for (int64_t s : seqs)
          cells.push_back({"hd" + std::to_string(d) + " S=" + kname(s) + (causal ? " causal" : ""),
                           16384 / s, s, s, 2048 / d, 2048 / d, d, causal, false});
  }
  if (a.suite != "grid") {
    std::vector<int64_t> bs = a.quick ? std::vector<int64_t>{8} : std::vector<int64_t>{1, 8};
    std::vector<int64_t> sks = a.quick ? std::vector<int64_t>{8192, 131072}
                                       : std::vector<int64_t>{8192, 32768, 131072};
    for (int64_t b : bs)
      for (int64_t sk : sks)
        cells.push_back({"decode B=" + std::to_string(b) + " Sk=" + kname(sk), b, 1, sk, 32, 8,
                         128, false, true});
  }
  return cells;
}

// ---- Host data -------------------------------------------------------------------------------

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Fills n 16-bit elements with approximately standard-normal values (a sum of four uniforms,
/// rescaled), element i a pure function of (seed, i); in parallel, since decode K/V run to GBs.
void fill_random(uint16_t* p, int64_t n, DType dt, uint64_t seed) {
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(),
                                                            (n + (1 << 20) - 1) >> 20));
  auto work = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint64_t r = splitmix64(seed * 0x100000001B3ull ^ uint64_t(i));
      float s = 0;
      for (int j = 0; j < 4; ++j) s += float((r >> (16 * j)) & 0xFFFF) * (1.f / 65536.f);
      const float x = (s - 2.f) * 1.7320508f;  // variance 4/12 -> 1
      p[i] = dt == DType::bf16 ? detail::float_to_bf16(x) : detail::float_to_f16(x);
    }
  };
  std::vector<std::thread> ts;
  const int64_t chunk = (n + nt - 1) / nt;
  for (int64_t t = 0; t < nt; ++t)
    ts.emplace_back(work, std::min(n, t * chunk), std::min(n, (t + 1) * chunk));
  for (auto& t : ts) t.join();
}

// ---- Device memory (or host memory for the CPU backend) --------------------------------------

/// One buffer on the benchmark's device: device memory on GPU, a vector on CPU.
class Buffer {
 public:
  Buffer(size_t bytes, bool gpu) : bytes_(std::max<size_t>(bytes, 16)), gpu_(gpu) {
    if (gpu_) {
#if defined(HF_RT)
      rt_check(HF_RT(Malloc)(&ptr_, bytes_), "device malloc");
#endif  // HF_RT
    } else {
      host_.resize(bytes_);
      ptr_ = host_.data();
    }
  }
  ~Buffer() {
#if defined(HF_RT)
    if (gpu_ && ptr_) rt_warn(HF_RT(Free)(ptr_), "device free");
#endif  // HF_RT
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return ptr_; }
  void upload(const void* src, size_t n) {
    if (!gpu_) { std::memcpy(ptr_, src, n); return; }
#if defined(HF_RT)
    rt_check(HF_RT(Memcpy)(ptr_, src, n, HF_RT(MemcpyHostToDevice)), "copy to device");
#endif  // HF_RT
  }
  void download(void* dst, size_t n) const {
    if (!gpu_) { std::memcpy(dst, ptr_, n); return; }
#if defined(HF_RT)
    rt_check(HF_RT(Memcpy)(dst, ptr_, n, HF_RT(MemcpyDeviceToHost)), "copy to host");
#endif  // HF_RT
  }
  /// Every byte 0xFF: NaN as bf16, f16 and fp32, so an element the kernel skips is caught.
  void poison(size_t n) {
    if (!gpu_) { std::memset(ptr_, 0xFF, n); return; }
#if defined(HF_RT)
    rt_check(HF_RT(Memset)(ptr_, 0xFF, n), "poison");
#endif  // HF_RT
  }

 private:
  size_t bytes_;
  bool gpu_;
  void* ptr_ = nullptr;
  std::vector<uint8_t> host_;
};

struct Sync {
  bool gpu;
  void operator()() const {
#if defined(HF_RT)
    if (gpu) rt_check(HF_RT(DeviceSynchronize)(), "forward (device synchronize)");
#endif  // HF_RT
  }
};

// ---- One cell --------------------------------------------------------------------------------

struct Result {
  std::string status = "n/a";  // ok | FAIL | n/a
  std::string note, kernel;
  double ms = 0;
  int reps = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

class CellRunner {
 public:
  CellRunner(const Cell& c, const Args& a, bool gpu, int dev, size_t l2_bytes)
      : c_(c), a_(a), gpu_(gpu), loc_{gpu ? Location::gpu : Location::cpu, dev} {
    const int el = dtype_size(a.dtype);
    q_elems_ = c.B * c.Sq * c.Hq * c.D;
    k_elems_ = c.B * c.Sk * c.Hkv * c.D;
    lse_elems_ = c.B * c.Hq * c.Sq;
    const size_t set_bytes = size_t(2 * q_elems_ + 2 * k_elems_) * el + size_t(lse_elems_) * 4;
    nsets_ = !gpu ? 1 : set_bytes >= 4 * l2_bytes ? 1 : int((4 * l2_bytes + set_bytes - 1) / set_bytes);
    nsets_ = std::min(nsets_, 32);
    // Host copy of set 0 for the reference; every set gets its own random data.
    hq_.resize(size_t(q_elems_));
    hk_.resize(size_t(k_elems_));
    hv_.resize(size_t(k_elems_));
    const uint64_t seed = std::hash<std::string>{}(c.name);
    for (int s = 0; s < nsets_; ++s) {
      fill_random(hq_.data(), q_elems_, a.dtype, seed + 3 * s + 0);
      fill_random(hk_.data(), k_elems_, a.dtype, seed + 3 * s + 1);
      fill_random(hv_.data(), k_elems_, a.dtype, seed + 3 * s + 2);
      sets_.push_back(std::make_unique<Set>(*this, gpu));
      Set& t = *sets_.back();
      t.q.upload(hq_.data(), size_t(q_elems_) * el);
      t.k.upload(hk_.data(), size_t(k_elems_) * el);
      t.v.upload(hv_.data(), size_t(k_elems_) * el);
    }
    if (nsets_ > 1) {  // the host copy must be set 0's data
      fill_random(hq_.data(), q_elems_, a.dtype, seed + 0);
      fill_random(hk_.data(), k_elems_, a.dtype, seed + 1);
      fill_random(hv_.data(), k_elems_, a.dtype, seed + 2);
    }
  }

  int nsets() const { return nsets_; }

  /// Check (poisoned buffers, fp64 reference) and, if it passes, time. LSE on or off.
  Result run(bool return_lse) {
    Result r;
    FwdOptions opts;
    opts.causal = c_.causal;
    opts.return_lse = return_lse;
    Sync sync{gpu_};
    try {
      Set& s0 = *sets_[0];
      const int el = dtype_size(a_.dtype);
      s0.out.poison(size_t(q_elems_) * el);
      s0.lse.poison(size_t(lse_elems_) * 4);
      call(0, opts);
      sync();
      r.kernel = last_kernel_name();
      std::string why;
      if (!check(s0, return_lse, opts, why)) {
        r.status = "FAIL";
        r.note = why;
        return r;
      }
      time_it(opts, r);
      r.status = "ok";
    } catch (const hipflash::runtime_error&) {
      throw;  // a device fault: the context may be gone, stop the run
    } catch (const std::exception& e) {
      r.status = "n/a";
      r.note = e.what();
    }
    return r;
  }

 private:
  struct Set {
    Buffer q, k, v, out, lse;
    TensorRef tq, tk, tv, tout, tlse;
    Set(const CellRunner& r, bool gpu)
        : q(size_t(r.q_elems_) * dtype_size(r.a_.dtype), gpu),
          k(size_t(r.k_elems_) * dtype_size(r.a_.dtype), gpu),
          v(size_t(r.k_elems_) * dtype_size(r.a_.dtype), gpu),
          out(size_t(r.q_elems_) * dtype_size(r.a_.dtype), gpu),
          lse(size_t(r.lse_elems_) * 4, gpu) {
      const Cell& c = r.c_;
      tq = make_tensor(q.data(), r.a_.dtype, {c.B, c.Sq, c.Hq, c.D}, r.loc_);
      tk = make_tensor(k.data(), r.a_.dtype, {c.B, c.Sk, c.Hkv, c.D}, r.loc_);
      tv = make_tensor(v.data(), r.a_.dtype, {c.B, c.Sk, c.Hkv, c.D}, r.loc_);
      tout = make_tensor(out.data(), r.a_.dtype, {c.B, c.Sq, c.Hq, c.D}, r.loc_);
      tlse = make_tensor(lse.data(), DType::f32, {c.B, c.Hq, c.Sq}, r.loc_);
    }
  };

  void call(int i, const FwdOptions& opts) {
    Set& s = *sets_[size_t(i % nsets_)];
    forward(s.tq, s.tk, s.tv, s.tout, opts.return_lse ? &s.tlse : nullptr, opts, nullptr);
  }

  bool check(const Set& s0, bool return_lse, const FwdOptions& opts, std::string& why) {
    const int el = dtype_size(a_.dtype);
    std::vector<uint16_t> hout(static_cast<size_t>(q_elems_));
    std::vector<float> hlse(return_lse ? size_t(lse_elems_) : 0);
    s0.out.download(hout.data(), hout.size() * el);
    if (return_lse) s0.lse.download(hlse.data(), hlse.size() * 4);
    const Location host{};
    const TensorRef q = make_tensor(hq_.data(), a_.dtype, {c_.B, c_.Sq, c_.Hq, c_.D}, host);
    const TensorRef k = make_tensor(hk_.data(), a_.dtype, {c_.B, c_.Sk, c_.Hkv, c_.D}, host);
    const TensorRef v = make_tensor(hv_.data(), a_.dtype, {c_.B, c_.Sk, c_.Hkv, c_.D}, host);
    const TensorRef out = make_tensor(hout.data(), a_.dtype, {c_.B, c_.Sq, c_.Hq, c_.D}, host);
    const TensorRef lse = make_tensor(hlse.data(), DType::f32, {c_.B, c_.Hq, c_.Sq}, host);
    const ref::Problem prob = ref::Problem::dense(q, k, v, opts);
    ref::CheckOptions co;
    co.max_rows = gpu_ ? 48 : 0;  // sampled rows on the big grid; the NaN scan covers all
    const ref::CheckResult res = ref::check(prob, out, return_lse ? &lse : nullptr, co);
    why = res.message;
    return res.ok;
  }

  void time_it(const FwdOptions& opts, Result& r) {
    Sync sync{gpu_};
    // Warm-up: at least 3 calls and 20 ms.
    const auto t0 = Clock::now();
    int n = 0;
    while (n < 3 || std::chrono::duration<double, std::milli>(Clock::now() - t0).count() < 20) {
      call(n++, opts);
      sync();
    }
    std::vector<double> samples;
    if (!gpu_) {
      const int reps = a_.smoke ? 2 : 5;
      for (int i = 0; i < reps; ++i) {
        const auto a = Clock::now();
        call(i, opts);
        samples.push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count());
      }
      r.ms = median(samples);
      r.reps = reps;
      return;
    }
#if defined(HF_RT)
    HF_RT(Event_t) e0, e1;
    rt_check(HF_RT(EventCreate)(&e0), "event create");
    rt_check(HF_RT(EventCreate)(&e1), "event create");
    auto batch_ms = [&](int calls, int first) {
      rt_check(HF_RT(EventRecord)(e0, nullptr), "event record");
      for (int j = 0; j < calls; ++j) call(first + j, opts);
      rt_check(HF_RT(EventRecord)(e1, nullptr), "event record");
      rt_check(HF_RT(EventSynchronize)(e1), "forward");
      float ms = 0;
      rt_check(HF_RT(EventElapsedTime)(&ms, e0, e1), "event time");
      return double(ms);
    };
    const double est = std::max(batch_ms(3, 0) / 3, 1e-3);
    const double target = a_.smoke ? 5.0 : (a_.quick ? a_.target_ms / 2 : a_.target_ms);
    const int reps = int(std::clamp(target / est, 10.0, 2000.0));
    // Batches of back-to-back calls of about 1 ms keep the launch queue full; their mean per
    // call is one sample; the median of the samples is reported.
    const int per = std::max(1, std::min(reps / 10, int(std::ceil(1.0 / est))));
    for (int done = 0; done < reps; done += per) samples.push_back(batch_ms(per, done) / per);
    rt_check(HF_RT(EventDestroy)(e0), "event destroy");
    rt_check(HF_RT(EventDestroy)(e1), "event destroy");
    r.ms = median(samples);
    r.reps = int(samples.size()) * per;
#endif  // HF_RT
  }

  const Cell& c_;
  const Args& a_;
  bool gpu_;
  Location loc_;
  int64_t q_elems_ = 0, k_elems_ = 0, lse_elems_ = 0;
  int nsets_ = 1;
  std::vector<uint16_t> hq_, hk_, hv_;
  std::vector<std::unique_ptr<Set>> sets_;
};

// ---- Main ------------------------------------------------------------------------------------

int run(const Args& a) {
  bool gpu = false;
  int dev = 0;
  size_t l2 = 60u << 20;
  std::string device_name = "CPU (hipflash CPU backend)";
#if defined(HF_RT)
  if (a.device != "cpu") {
    int count = 0;
    const HF_RT(Error_t) e = HF_RT(GetDeviceCount)(&count);
    if (e == HF_RT(Success) && count > 0 && gpu_available()) {
      gpu = true;
      rt_check(HF_RT(GetDevice)(&dev), "get device");
      DeviceProp prop{};
      rt_check(HF_RT(GetDeviceProperties)(&prop, dev), "device properties");
      int drv = 0, rtv = 0;
      rt_check(HF_RT(DriverGetVersion)(&drv), "driver version");
      rt_check(HF_RT(RuntimeGetVersion)(&rtv), "runtime version");
      l2 = prop.l2CacheSize > 0 ? size_t(prop.l2CacheSize) : l2;
      device_name = std::string(prop.name) + " (" + std::to_string(prop.multiProcessorCount) +
                    " SMs, L2 " + std::to_string(l2 >> 20) + " MiB, driver API " +
                    std::to_string(drv) + ", runtime " + std::to_string(rtv) + ")";
    } else {
      (void)HF_RT(GetLastError)();
      if (a.device == "gpu") {
        std::fprintf(stderr, "hipflash-bench: --device gpu but no usable GPU (%s)\n",
                     e == HF_RT(Success) ? "gpu_available() is false" : HF_RT(GetErrorString)(e));
        return 2;
      }
    }
  }
#else
  if (a.device == "gpu") {
    std::fprintf(stderr, "hipflash-bench: --device gpu, but this is a CPU-only build\n");
    return 2;
  }
#endif  // HF_RT

  const std::vector<Cell> cells = make_cells(a, gpu);
  std::vector<bool> flags;
  if (a.lse != "on") flags.push_back(false);
  if (a.lse != "off") flags.push_back(true);

  std::printf("hipflash-bench: %s\n  build: %s\n  dtype %s, %zu cells%s\n", device_name.c_str(),
              build_info().c_str(), std::string(dtype_name(a.dtype)).c_str(), cells.size(),
              gpu ? ", times are medians of device-event batches" : ", CPU backend");
  std::printf("\n%-22s %6s %6s %7s %4s %4s %4s  %-5s %10s %9s %9s  %s\n", "cell", "B", "Sq", "Sk",
              "Hq", "Hkv", "D", "lse", "ms", "TFLOP/s", "GB/s", "kernel / note");
  std::FILE* csv = a.csv.empty() ? nullptr : std::fopen(a.csv.c_str(), "w");
  if (!a.csv.empty() && !csv) {
    std::fprintf(stderr, "hipflash-bench: cannot write %s\n", a.csv.c_str());
    return 2;
  }
  if (csv)
    std::fprintf(csv, "cell,B,Sq,Sk,Hq,Hkv,D,causal,lse,status,ms,tflops,gbps,reps,nsets,kernel,note\n");

  int fails = 0;
  for (const Cell& c : cells) {
    std::unique_ptr<CellRunner> runner;
    try {
      runner = std::make_unique<CellRunner>(c, a, gpu, dev, l2);
    } catch (const std::exception& e) {
      std::printf("%-22s  n/a: cannot set up inputs: %s\n", c.name.c_str(), e.what());
      continue;
    }
    for (bool L : flags) {
      const Result r = runner->run(L);
      const double tf = r.status == "ok" ? c.flops() / (r.ms * 1e-3) / 1e12 : 0;
      const double gbs =
          r.status == "ok" && c.decode ? c.kv_bytes(dtype_size(a.dtype)) / (r.ms * 1e-3) / 1e9 : 0;
      if (r.status == "FAIL") ++fails;
      char ms[32] = "-", tfs[32] = "-", gb[32] = "-";
      if (r.status == "ok") {
        std::snprintf(ms, sizeof ms, "%.4f", r.ms);
        std::snprintf(tfs, sizeof tfs, gpu ? "%.1f" : "%.4f", tf);
        if (c.decode) std::snprintf(gb, sizeof gb, "%.1f", gbs);
      } else {
        std::snprintf(ms, sizeof ms, "%s", r.status.c_str());
      }
      std::printf("%-22s %6lld %6lld %7lld %4lld %4lld %4lld  %-5s %10s %9s %9s  %s%s%s\n",
                  c.name.c_str(), (long long)c.B, (long long)c.Sq, (long long)c.Sk,
                  (long long)c.Hq, (long long)c.Hkv, (long long)c.D, L ? "on" : "off", ms, tfs,
                  gb, r.kernel.c_str(), r.note.empty() ? "" : "  ", r.note.c_str());
      std::fflush(stdout);
      if (csv) {
        std::string note = r.note;
        std::replace(note.begin(), note.end(), ',', ';');
        std::replace(note.begin(), note.end(), '\n', ' ');
        char nums[96] = "";
        if (r.status == "ok") {
          if (c.decode) std::snprintf(nums, sizeof nums, "%.6f,%.4f,%.3f", r.ms, tf, gbs);
          else std::snprintf(nums, sizeof nums, "%.6f,%.4f,", r.ms, tf);
        } else {
          std::snprintf(nums, sizeof nums, ",,");
        }
        std::fprintf(csv, "%s,%lld,%lld,%lld,%lld,%lld,%lld,%d,%d,%s,%s,%d,%d,%s,%s\n",
                     c.name.c_str(), (long long)c.B, (long long)c.Sq, (long long)c.Sk,
                     (long long)c.Hq, (long long)c.Hkv, (long long)c.D, int(c.causal), int(L),
                     r.status.c_str(), nums, r.reps, runner->nsets(), r.kernel.c_str(),
                     note.c_str());
      }
    }
  }
  if (csv) std::fclose(csv);
  std::printf("\n%d FAIL\n", fails);
  return fails ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hipflash-bench: stopped: %s\n", e.what());
    return 2;
  }
}
