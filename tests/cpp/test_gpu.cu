// The GPU suite (CUDA builds): device forward against the fp64 reference (SPEC §6) on the grid
// of the GPU issue. Every test skips, with the reason, when no GPU is usable.
//
// Inputs are generated on the host (test_util.hpp), copied whole (storage, padding and NaN
// poison included) to cudaMalloc'd memory, run with loc = {gpu, 0}, and copied back; the
// checks then run on the host. Large problems check an evenly spread subset of rows against
// the reference (the NaN scan always covers every row).
#include <cuda_runtime.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <tuple>

#include "gpu_test_util.hpp"
#include "hostile_cases.hpp"
#include "kvcache_cases.hpp"

namespace hipflash::test {
namespace {

/// Runs a dense problem on the GPU; out and lse come back into t's host buffers.
void run_gpu(Dense& t, cudaStream_t stream = nullptr) {
  DeviceTensor q(t.q), k(t.k), v(t.v), out(t.out), lse(t.lse);
  forward(q.ref, k.ref, v.ref, out.ref, t.opts.return_lse ? &lse.ref : nullptr, t.opts, stream);
  sync(stream);
  out.download(t.out);
  lse.download(t.lse);
}

void run_gpu(Varlen& t) {
  DeviceTensor q(t.q), k(t.k), v(t.v), out(t.out), lse(t.lse), cq(t.cu_q), ck(t.cu_k);
  varlen_forward(q.ref, k.ref, v.ref, out.ref, t.opts.return_lse ? &lse.ref : nullptr, cq.ref,
                 ck.ref, t.opts);
  sync();
  out.download(t.out);
  lse.download(t.lse);
}

/// SPEC §6 on a subset of rows sized so that the host reference stays well under a second
/// (about 4e8 multiply-adds: 768 rows at Sk = 1024, D = 256; 31 rows at Sk = 100k, D = 128).
ref::CheckResult check_rows(const Dense& t, int64_t max_rows = 768) {
  const double per_row = double(std::max<int64_t>(t.k.ref.sizes[1], 1)) * double(t.q.ref.sizes[3]);
  ref::CheckOptions co;
  co.max_rows = std::max<int64_t>(16, std::min<int64_t>(max_rows, int64_t(4e8 / per_row)));
  return ref::check(t.problem(), t.out.ref, t.opts.return_lse ? &t.lse.ref : nullptr, co);
}

float max_abs_diff(const HostTensor& a, const HostTensor& b) {
  float worst = 0;
  const int64_t n = a.storage_elems();
  for (int64_t i = 0; i < n; ++i) {
    const float x = a.get_raw(i), y = b.get_raw(i);
    if (std::isnan(x) && std::isnan(y)) continue;  // the poisoned guard words around the view
    if (std::isnan(x) || std::isnan(y)) return kInf;
    if (std::isinf(x) && x == y) continue;
    worst = std::max(worst, std::abs(x - y));
  }
  return worst;
}


// ---- The dense grid ----------------------------------------------------------------------------

Dense make(const Case& c, uint32_t seed = 5) { return make_dense(c, seed); }

class GpuForward : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!gpu_available())
      GTEST_SKIP() << "no usable GPU (" << build_info() << "): the GPU suite needs a CUDA device";
  }
};

TEST_P(GpuForward, MatchesReference) {
  Dense t = make(GetParam());
  run_gpu(t);
  EXPECT_EQ(last_kernel_name().rfind("fwd_", 0), 0u) << last_kernel_name();
  EXPECT_REF_OK(check_rows(t)) << " kernel " << last_kernel_name();
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return info.param.name(); }

/// Every head dim x every (Sq, Sk) of the issue, causal and not; dtype, head ratio and split
/// count rotate through their values so that each appears with every length.
std::vector<Case> main_grid() {
  const std::pair<int64_t, int64_t> lens[] = {{1, 1},      {113, 203}, {128, 217}, {1023, 1024}, {1024, 1023},
                                              {239, 1},    {799, 3},   {2, 5},     {5, 2}};
  const std::pair<int64_t, int64_t> heads[] = {{6, 6}, {6, 2}, {6, 1}, {32, 8}};
  const int splits[] = {1, 0, 3};
  std::vector<Case> v;
  int i = 0;
  for (int64_t d : {32, 64, 96, 128, 256})
    for (auto [sq, sk] : lens)
      for (bool causal : {false, true}) {
        auto [hq, hkv] = heads[i % 4];
        if (sq >= 1023 && hq == 32) hq = 8, hkv = 2;  // keep the host reference cheap
        const int64_t b = sq * sk > 100000 ? 1 : 2;
        v.push_back({i % 2 ? DType::f16 : DType::bf16, b, sq, sk, hq, hkv, d, causal, -1, -1,
                     splits[(i / 2) % 3]});
        ++i;
      }
  return v;
}
INSTANTIATE_TEST_SUITE_P(Grid, GpuForward, ::testing::ValuesIn(main_grid()), case_name);

std::vector<Case> windows() {
  const std::pair<int64_t, int64_t> wins[] = {{0, 0}, {16, 3}, {-1, 7}, {64, -1}, {200, 200}};
  std::vector<Case> v;
  int i = 0;
  for (auto [wl, wr] : wins)
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{113, 203}, {1024, 1023}, {799, 3}}) {
      v.push_back({i % 2 ? DType::f16 : DType::bf16, 1, sq, sk, 6, 2, i % 3 ? 64 : 128, false, wl,
                   wr, i % 2 ? 3 : 1});
      ++i;
    }
  v.push_back({DType::bf16, 2, 1023, 1024, 6, 1, 128, true, 128, -1, 0});  // sliding causal
  v.push_back({DType::f16, 2, 128, 217, 6, 6, 64, true, 16, -1, 2});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Windows, GpuForward, ::testing::ValuesIn(windows()), case_name);

/// Grids with more work tiles than a persistent kernel has blocks (Hopper's sm90_ws: one block
/// per SM walking its tiles, the next tile's Q loaded while the last one's output is written):
/// every tile reached once, each with its own Q, the pipeline's barrier phases carried from tile
/// to tile. About 2-4 tiles per block on a 132-SM H200 at every head dim. Causal and window
/// cases walk the snake (common::SnakeScheduler) where its host model pays on the H200's 132
/// SMs — the last six, which tests/cpp/test_scheduler.cpp checks the model still sends to the
/// walk, and the 520 x 1000 window — and one block per tile otherwise (700 x 700, 300 x 333, and
/// the single-batch hd64 cases, whose tiles fit one wave).
std::vector<Case> persistent() {
  return {
      {DType::bf16, 2, 700, 700, 24, 8, 128, true, -1, -1, 1},
      {DType::f16, 2, 700, 700, 24, 8, 128, false, -1, -1, 1},
      {DType::bf16, 3, 520, 1000, 32, 32, 64, true, 100, 0, 1},
      {DType::f16, 3, 520, 1000, 32, 32, 64, false, -1, -1, 1},
      {DType::bf16, 2, 300, 333, 48, 16, 256, true, -1, -1, 1},
      {DType::f16, 2, 300, 333, 48, 16, 256, false, -1, -1, 1},  // output staged over Q
      {DType::bf16, 2, 700, 700, 24, 8, 128, true, -1, -1, 2},
      {DType::f16, 2, 700, 700, 24, 8, 128, false, -1, -1, 2},  // split partials, persistent
      // Masked hd64: the two-consumer tile, a single batch.
      {DType::bf16, 1, 1100, 1300, 6, 2, 64, true, -1, -1, 1},
      {DType::f16, 1, 1500, 1500, 4, 4, 64, false, 300, 0, 1},
      {DType::bf16, 1, 1100, 1300, 6, 2, 64, true, -1, -1, 3},
      // The snake: 4-10 tiles per block.
      {DType::bf16, 4, 1000, 1000, 16, 4, 128, true, -1, -1, 1},
      {DType::f16, 4, 1000, 1300, 16, 16, 128, false, 200, 0, 1},  // sliding window
      {DType::bf16, 4, 1000, 1300, 16, 2, 256, true, -1, -1, 1},
      {DType::f16, 4, 1000, 1300, 16, 16, 256, true, -1, -1, 2},  // split partials
      {DType::bf16, 3, 700, 1000, 32, 8, 64, false, 150, 0, 1},  // sliding window, GQA
      {DType::bf16, 2, 1100, 1300, 24, 8, 64, true, -1, -1, 3},
      // Masked hd64 with long rows: the three-consumer tile (sm90ws::long_row_tile: enough
      // heads for two tiles per SM of a 132-SM H200), its last 192-row tile partly empty;
      // causal, a causal sliding window, a right window alone, more rows than keys (the first
      // rows see none).
      {DType::bf16, 1, 8200, 8300, 8, 2, 64, true, -1, -1, 1},
      {DType::f16, 1, 4500, 9000, 12, 4, 64, false, 5000, 0, 1},
      {DType::bf16, 1, 4100, 9000, 12, 1, 64, false, -1, 64, 1},
      {DType::f16, 1, 10000, 9200, 6, 2, 64, true, -1, -1, 1},
      // Unmasked hd128 with long rows: the 176-key tile (8192 keys or more), the last key
      // block partly empty; hd96 padded to it; GQA; fewer query rows than one tile.
      {DType::bf16, 1, 1000, 8300, 8, 2, 128, false, -1, -1, 1},
      {DType::f16, 2, 300, 8192, 4, 4, 96, false, -1, -1, 1},
      {DType::bf16, 1, 50, 9000, 3, 1, 128, false, -1, -1, 1},
  };
}
INSTANTIATE_TEST_SUITE_P(Persistent, GpuForward, ::testing::ValuesIn(persistent()), case_name);

std::vector<Case> splits() {
  std::vector<Case> v;
  for (int s : {1, 2, 3, 5, 17, 0}) {
    v.push_back({DType::bf16, 1, 1, 4097, 6, 1, 128, false, -1, -1, s});
    v.push_back({DType::f16, 1, 113, 2000, 6, 2, 64, true, -1, -1, s});
  }
  // More splits than the combine kernel keeps in flight in one round (4 warps x 8), up to
  // kMaxSplits; every padded head-dim pitch of the workspace (64, 256).
  for (int s : {40, kMaxSplits}) {
    v.push_back({DType::bf16, 1, 1, 20000, 8, 2, 256, false, -1, -1, s});
    v.push_back({DType::f16, 2, 3, 17000, 4, 4, 64, true, -1, -1, s});
  }
  return v;
}
INSTANTIATE_TEST_SUITE_P(Splits, GpuForward, ::testing::ValuesIn(splits()), case_name);

std::vector<Case> decode() {
  std::vector<Case> v;
  for (int64_t sq : {1, 3, 16}) v.push_back({DType::bf16, 2, sq, 4097, 32, 8, 128, true, -1, -1, 0});
  for (int64_t sq : {1, 16}) v.push_back({DType::f16, 1, sq, 100000, 16, 2, 128, sq > 1, -1, -1, 0});
  // More kv heads than the head-group decode kernel's eight a block (HIPFLASH_DECODE_HEADS=1
  // runs these on it):
  // two whole groups, a partial one, a key count ending inside a 16-key stage; split or not.
  v.push_back({DType::bf16, 3, 1, 5001, 32, 16, 128, false, -1, -1, 0});
  v.push_back({DType::f16, 2, 1, 333, 48, 12, 64, true, -1, -1, 3});
  v.push_back({DType::bf16, 1, 1, 70000, 40, 10, 128, false, -1, -1, 1});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Decode, GpuForward, ::testing::ValuesIn(decode()), case_name);

/// The decode kernel (<= 16 query rows per head, GQA decode packed): every head dim, causal and
/// windows, split counts; lengths that end inside a 64-key block and inside a warp's 16 keys.
std::vector<Case> decode_kernel() {
  const std::pair<int64_t, int64_t> lens[] = {{1, 1}, {1, 1000}, {3, 517}, {16, 2049}, {7, 64}};
  const std::pair<int64_t, int64_t> heads[] = {{8, 1}, {6, 2}, {4, 4}, {32, 8}};
  const std::pair<int64_t, int64_t> wins[] = {{-1, -1}, {-1, 0}, {40, 0}, {100, 9}};
  const int splits[] = {1, 0, 5};
  std::vector<Case> v;
  int i = 0;
  for (int64_t d : {32, 64, 96, 128, 256})
    for (auto [sq, sk] : lens) {
      auto [hq, hkv] = heads[i % 4];
      auto [wl, wr] = wins[(i / 4) % 4];
      v.push_back({i % 2 ? DType::f16 : DType::bf16, 2, sq, sk, hq, hkv, d, false, wl, wr,
                   splits[i % 3]});
      ++i;
    }
  return v;
}
INSTANTIATE_TEST_SUITE_P(DecodeKernel, GpuForward, ::testing::ValuesIn(decode_kernel()), case_name);

TEST_F(Gpu, KernelKindFollowsTheQueryRows) {
  // GQA decode (32/8 packs 4 rows) and Sq <= 16 take the decode kernel; longer queries on
  // Hopper where built (unless HIPFLASH_DISABLE_SM90=1): the TMA warp-specialised kernel for
  // dense calls (unless HIPFLASH_DISABLE_SM90_WS=1), the cp.async wgmma kernel for varlen; else
  // generic.
  int device = 0, major = 0, minor = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), cudaSuccess);
  const auto env_on = [](const char* name) {
    const char* v = std::getenv(name);
    return v && v[0] == '1';
  };
  const bool sm90 = major * 10 + minor == 90 && !env_on("HIPFLASH_DISABLE_SM90") &&
                    build_info().find("sm90") != std::string::npos;
  const bool ws = sm90 && !env_on("HIPFLASH_DISABLE_SM90_WS");
  const std::string wgmma = sm90 ? "fwd_sm90_bf16" : "fwd_generic_";
  const std::string tma = ws ? "fwd_sm90_ws_" : wgmma;
  const std::string generic = "fwd_generic_";
  for (auto [sq, hq, hkv, d, kind] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, std::string>{1, 32, 8, 128, "fwd_decode_"},
        {16, 6, 6, 64, "fwd_decode_"},
        {17, 6, 6, 128, tma},
        {1, 64, 2, 64, tma},  // 32 packed rows
        {300, 4, 4, 256, ws ? tma : generic}}) {
    Dense t = make({DType::bf16, 1, sq, 300, hq, hkv, d, false, -1, -1, 1});
    run_gpu(t);
    EXPECT_EQ(last_kernel_name().rfind(kind, 0), 0u) << last_kernel_name() << " for Sq=" << sq;
  }
  // Packed GQA decode with eight kv heads or more: the head-group decode kernel on sm_90 for
  // every such call where HIPFLASH_DECODE_HEADS=1 (head dims 64 and 128), else the decode
  // kernel for these 300-key calls (by default it takes only long ones, from 128k keys
  // with 32 head groups x batches; the selector's gtest checks that rule).
  const bool heads = major * 10 + minor == 90 && env_on("HIPFLASH_DECODE_HEADS");
  for (auto [hq, hkv, d] : {std::tuple<int64_t, int64_t, int64_t>{32, 8, 128}, {48, 12, 64},
                            {32, 16, 256}, {8, 2, 128}}) {
    Dense t = make({DType::bf16, 2, 1, 300, hq, hkv, d, false, -1, -1, 0});
    run_gpu(t);
    const bool want = heads && d <= 128 && hkv >= 8;
    EXPECT_EQ(last_kernel_name().rfind(want ? "fwd_decode_heads_" : "fwd_decode_", 0), 0u)
        << last_kernel_name() << " for " << hq << "/" << hkv << " d" << d;
    if (!want) EXPECT_EQ(last_kernel_name().rfind("fwd_decode_heads_", 0), std::string::npos);
    EXPECT_REF_OK(check_rows(t)) << last_kernel_name();
  }
}

TEST_F(Gpu, LongRowTileIsNamed) {
  // Calls with long rows run the sm90_ws kernel's long-row tile (masked hd64: three consumers;
  // unmasked hd128: 176-key blocks), and the launch says so (the name is what the launcher
  // ran); short ones keep the default tile.
  Dense t = make({DType::bf16, 1, 8200, 8300, 8, 2, 64, true, -1, -1, 1});
  run_gpu(t);
  const std::string name = last_kernel_name();
  if (name.rfind("fwd_sm90_ws_", 0) != 0) GTEST_SKIP() << "not the sm90_ws kernel here: " << name;
  EXPECT_NE(name.find("_longrows_"), std::string::npos) << name;
  EXPECT_REF_OK(check_rows(t)) << " kernel " << name;
  Dense s = make({DType::bf16, 1, 2048, 2048, 4, 2, 64, true, -1, -1, 1});
  run_gpu(s);
  EXPECT_EQ(last_kernel_name().find("_longrows_"), std::string::npos) << last_kernel_name();
  // Unmasked hd128 from 8192 keys: the 176-key tile.
  Dense u = make({DType::f16, 1, 700, 8200, 4, 2, 128, false, -1, -1, 1});
  run_gpu(u);
  EXPECT_NE(last_kernel_name().find("_longrows_"), std::string::npos) << last_kernel_name();
  EXPECT_REF_OK(check_rows(u)) << " kernel " << last_kernel_name();
  Dense v = make({DType::f16, 1, 700, 4096, 4, 2, 128, false, -1, -1, 1});
  run_gpu(v);
  EXPECT_EQ(last_kernel_name().find("_longrows_"), std::string::npos) << last_kernel_name();
}

// ---- Split count, determinism ------------------------------------------------------------------

TEST_F(Gpu, SplitLseMatchesUnsplit) {
  for (const Case base : {Case{DType::bf16, 1, 1, 4097, 6, 1, 128, false, -1, -1, 1},
                          Case{DType::f16, 1, 113, 2000, 6, 2, 64, true, -1, -1, 1}}) {
    Dense ref1 = make(base);
    run_gpu(ref1);
    for (int s : {2, 3, 5, 17}) {
      Case c = base;
      c.splits = s;
      Dense t = make(c);
      run_gpu(t);
      EXPECT_LE(max_abs_diff(ref1.lse, t.lse), 1e-4f) << c;
    }
  }
}

TEST_F(Gpu, ZeroSplitsEqualsTheResolvedCountBitwise) {
  bool saw_split = false;
  for (const Case c : {Case{DType::bf16, 1, 1, 100000 / 4, 8, 1, 128, false, -1, -1, 0},
                       Case{DType::f16, 1, 16, 4097, 32, 8, 64, true, -1, -1, 0},
                       Case{DType::bf16, 2, 113, 2000, 6, 2, 96, false, -1, -1, 0}}) {
    Dense a = make(c);
    std::unique_ptr<DeviceTensor> q = std::make_unique<DeviceTensor>(a.q);
    std::unique_ptr<DeviceTensor> k = std::make_unique<DeviceTensor>(a.k);
    const int resolved = resolve_num_splits(q->ref, k->ref, a.opts);
    saw_split |= resolved > 1;
    run_gpu(a);
    Dense b = make(c);
    b.opts.num_splits = resolved;
    run_gpu(b);
    EXPECT_TRUE(a.out.bitwise_equal(b.out)) << c << " resolved " << resolved;
    EXPECT_TRUE(a.lse.bitwise_equal(b.lse)) << c << " resolved " << resolved;
  }
  EXPECT_TRUE(saw_split) << "the decode cases should resolve to a split count > 1";
}

/// Device scratch for the workspace tests, every byte 0xFF (NaN as fp32).
struct NaNBuffer {
  void* ptr = nullptr;
  explicit NaNBuffer(size_t bytes) {
    CUDA_CHECK(cudaMalloc(&ptr, bytes));
    CUDA_CHECK(cudaMemset(ptr, 0xFF, bytes));
  }
  ~NaNBuffer() { (void)cudaFree(ptr); }
};

TEST_F(Gpu, CallerWorkspaceGivesTheSameResult) {
  // A split decode call with the launcher's own scratch, with a lent NaN-filled buffer, with a
  // too-small buffer plus an allocator, and with an allocator alone: bitwise the same out and
  // lse. An allocator that returns nothing and a misaligned buffer are errors before any
  // launch; a call that does not split never asks.
  const Case c{DType::bf16, 1, 1, 20000, 8, 2, 128, false, -1, -1, 5};
  constexpr size_t kBytes = size_t(1) << 20;
  auto run_with = [&](const Case& cs, const Workspace& ws) {
    Dense t = make(cs);
    DeviceTensor q(t.q), k(t.k), v(t.v), out(t.out), lse(t.lse);
    forward(q.ref, k.ref, v.ref, out.ref, &lse.ref, t.opts, nullptr, ws);
    sync();
    out.download(t.out);
    lse.download(t.lse);
    return t;
  };
  const Dense own = run_with(c, {});
  EXPECT_REF_OK(check_rows(own));

  NaNBuffer lent(kBytes), pool(kBytes);
  int calls = 0;
  size_t asked = 0;
  auto allocate = [&](size_t bytes) {
    ++calls;
    asked = bytes;
    return bytes <= kBytes ? pool.ptr : nullptr;
  };
  Workspace given;
  given.data = lent.ptr;
  given.bytes = kBytes;
  Workspace small_then_allocator;
  small_then_allocator.data = lent.ptr;
  small_then_allocator.bytes = 16;
  small_then_allocator.allocate = allocate;
  Workspace allocator_only;
  allocator_only.allocate = allocate;
  for (const Workspace* ws : {&given, &small_then_allocator, &allocator_only}) {
    const int calls_before = calls;
    const Dense t = run_with(c, *ws);
    EXPECT_TRUE(t.out.bitwise_equal(own.out));
    EXPECT_TRUE(t.lse.bitwise_equal(own.lse));
    EXPECT_EQ(calls - calls_before, ws == &given ? 0 : 1);
  }
  EXPECT_GT(asked, size_t(16));

  Workspace none;
  none.allocate = [&](size_t) -> void* {
    ++calls;
    return nullptr;
  };
  {
    Dense t = make(c);
    const HostTensor out0 = t.out, lse0 = t.lse;
    DeviceTensor q(t.q), k(t.k), v(t.v), out(t.out), lse(t.lse);
    EXPECT_THROW(forward(q.ref, k.ref, v.ref, out.ref, &lse.ref, t.opts, nullptr, none),
                 hipflash::runtime_error);
    sync();
    out.download(t.out);
    lse.download(t.lse);
    EXPECT_TRUE(t.out.bitwise_equal(out0)) << "nothing may be written";
    EXPECT_TRUE(t.lse.bitwise_equal(lse0)) << "nothing may be written";
  }

  Workspace misaligned;
  misaligned.data = static_cast<char*>(lent.ptr) + 4;
  misaligned.bytes = kBytes - 4;
  {
    Dense t = make(c);
    const HostTensor out0 = t.out;
    DeviceTensor q(t.q), k(t.k), v(t.v), out(t.out), lse(t.lse);
    EXPECT_THROW(forward(q.ref, k.ref, v.ref, out.ref, &lse.ref, t.opts, nullptr, misaligned),
                 hipflash::invalid_argument);
    sync();
    out.download(t.out);
    EXPECT_TRUE(t.out.bitwise_equal(out0)) << "nothing may be written";
  }

  Case unsplit = c;
  unsplit.splits = 1;
  const int calls_before = calls;
  (void)run_with(unsplit, none);
  EXPECT_EQ(calls, calls_before) << "a call that does not split needs no workspace";
}

TEST_F(Gpu, RepeatedRunsAreBitwiseIdentical) {
  for (int s : {1, 3, 0}) {
    Dense t = make({DType::bf16, 2, 1023, 1024, 6, 2, 128, true, -1, -1, s});
    run_gpu(t);
    const HostTensor out1 = t.out, lse1 = t.lse;
    t.poison();
    run_gpu(t);
    EXPECT_TRUE(t.out.bitwise_equal(out1)) << "splits " << s;
    EXPECT_TRUE(t.lse.bitwise_equal(lse1)) << "splits " << s;
  }
}

TEST_F(Gpu, MatchesTheCpuBackend) {
  Dense g = make({DType::bf16, 2, 239, 1, 6, 1, 64, true, -1, -1, 0});
  Dense c = g;
  run_gpu(g);
  c.run();
  EXPECT_REF_OK(check_rows(g));
  EXPECT_TRUE(g.lse.bitwise_equal(c.lse) || max_abs_diff(g.lse, c.lse) <= 1e-4f);
}

// ---- Hostile numerics (SPEC §3): NaN through every kernel and split count, tied scores ----------

class GpuNan : public ::testing::TestWithParam<NanCase> {
 protected:
  void SetUp() override {
    if (!gpu_available())
      GTEST_SKIP() << "no usable GPU (" << build_info() << "): the GPU suite needs a CUDA device";
  }
};

TEST_P(GpuNan, ReachesExactlyWhatTheReferenceReaches) {
  Dense t = make_nan_problem(GetParam());
  run_gpu(t);
  EXPECT_REF_OK(check_nan(t)) << last_kernel_name();
}

INSTANTIATE_TEST_SUITE_P(Grid, GpuNan, ::testing::ValuesIn(nan_cases()),
                         [](const auto& info) { return info.param.name(); });

TEST_F(Gpu, TiedHugeScoresAreWeightedByKeyCounts) {
  for (int splits : {1, 2, 3, 5})
    for (int64_t sq : {1, 4, 130}) {  // decode, short and long rows: every kernel family
      Dense t = make_tied_problem({DType::bf16, 1, sq, 300, 2, 1, 64, false, -1, -1, splits});
      run_gpu(t);
      EXPECT_REF_OK(t.check()) << "splits " << splits << " sq " << sq << " " << last_kernel_name();
    }
}

// ---- Poison and views --------------------------------------------------------------------------

TEST_F(Gpu, ViewsInsideNaNStorage) {
  // q, k, v are views into NaN-filled storage: extra heads, extra rows past Sk (which the
  // kernel must never let into a result) and a batch gap. Offsets keep 16-byte alignment.
  const int64_t B = 2, Sq = 113, Sk = 203, Hq = 6, Hkv = 2, D = 64, pad_rows = 70;
  const DType dt = DType::f16;
  auto nan_view = [&](int64_t rows, int64_t heads, int64_t extra_heads, int64_t extra_rows) {
    const int64_t row = (heads + extra_heads) * D, batch = (rows + extra_rows) * row + 8 * D;
    HostTensor t = HostTensor::strided(dt, {B, rows, heads, D}, {batch, row, D, 1}, B * batch + D);
    t.fill(kNaN);
    t.ref.data = static_cast<uint16_t*>(t.ref.data) + extra_heads * D;  // skip the first heads
    return t;
  };
  HostTensor q = nan_view(Sq, Hq, 2, 0), k = nan_view(Sk, Hkv, 1, pad_rows),
             v = nan_view(Sk, Hkv, 3, pad_rows);
  std::mt19937 rng(9);
  q.randomize(rng);
  k.randomize(rng);
  v.randomize(rng);
  for (bool causal : {false, true})
    for (int splits : {1, 3}) {
      HostTensor out(dt, {B, Sq, Hq, D}), lse(DType::f32, {B, Hq, Sq});
      out.fill(kNaN);
      lse.fill(kNaN);
      FwdOptions opts;
      opts.return_lse = true;
      opts.causal = causal;
      opts.num_splits = splits;
      {
        DeviceTensor dq(q), dk(k), dv(v), dout(out), dlse(lse);
        forward(dq.ref, dk.ref, dv.ref, dout.ref, &dlse.ref, opts);
        sync();
        dout.download(out);
        dlse.download(lse);
      }
      ref::CheckOptions co;
      co.max_rows = 1024;
      EXPECT_REF_OK(ref::check(ref::Problem::dense(q.ref, k.ref, v.ref, opts), out.ref, &lse.ref, co))
          << "causal " << causal << " splits " << splits;
    }
}

TEST_F(Gpu, NoLseRequestedLeavesLseUntouched) {
  Dense t = make({DType::bf16, 2, 128, 217, 6, 2, 128, true, -1, -1, 3});
  t.opts.return_lse = false;
  run_gpu(t);
  EXPECT_TRUE(t.lse.all_nan());
  EXPECT_REF_OK(check_rows(t));
}

TEST_F(Gpu, NonDefaultStream) {
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Dense t = make({DType::f16, 2, 1023, 1024, 6, 2, 64, false, -1, -1, 0});
  run_gpu(t, stream);
  CUDA_CHECK(cudaStreamDestroy(stream));
  EXPECT_REF_OK(check_rows(t));
}

// ---- Varlen ------------------------------------------------------------------------------------

TEST_F(Gpu, VarlenWithZeroLengthSequences) {
  struct V { std::vector<int32_t> lq, lk; bool causal; int splits; int64_t d; };
  const V cases[] = {
      {{5, 0, 17, 1, 0, 300}, {7, 3, 0, 203, 0, 1024}, false, 1, 64},
      {{5, 0, 17, 1, 0, 300}, {7, 3, 0, 203, 0, 1024}, true, 3, 128},
      {{1023, 2, 0}, {217, 5, 9}, true, 0, 96},  // Sq > Sk in a sequence: empty causal rows
      {{0, 0}, {0, 0}, false, 1, 64},
  };
  int i = 0;
  for (const V& c : cases)
    for (LseLayout layout : {LseLayout::padded, LseLayout::packed}) {
      Varlen t(i++ % 2 ? DType::f16 : DType::bf16, c.lq, c.lk, 6, 2, c.d, layout);
      t.opts.causal = c.causal;
      t.opts.num_splits = c.splits;
      run_gpu(t);
      ref::CheckOptions co;
      co.lse_layout = layout;
      co.max_rows = 1024;
      const ref::CheckResult r =
          ref::check(t.problem(), t.out.ref, &t.lse.ref, co);
      EXPECT_REF_OK(r) << " layout " << int(layout) << " causal " << c.causal << " splits "
                       << c.splits;
    }
}

// ---- Launch limits -----------------------------------------------------------------------------

TEST_F(Gpu, Batch65536) {
  for (int64_t sq : {1, 3}) {
    Dense t = make({DType::bf16, 65536, sq, 5, 2, 1, 64, sq > 1, -1, -1, 0});
    run_gpu(t);
    EXPECT_REF_OK(check_rows(t, 4096)) << "sq " << sq;
  }
}

TEST_F(Gpu, Heads65536) {
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{65536, 65536}, {65536, 1}}) {
    for (int64_t sq : {1, 3}) {
      Dense t = make({DType::f16, 1, sq, 5, hq, hkv, 64, false, -1, -1, 0});
      run_gpu(t);
      EXPECT_REF_OK(check_rows(t, 4096)) << "hq " << hq << " hkv " << hkv << " sq " << sq;
    }
  }
}

TEST_F(Gpu, EmptyProblems) {
  for (auto [b, sq, sk] : {std::tuple<int64_t, int64_t, int64_t>{0, 17, 33}, {2, 0, 33}, {2, 17, 0}}) {
    Dense t = make({DType::bf16, b, sq, sk, 6, 2, 64, false, -1, -1, 0});
    run_gpu(t);
    EXPECT_REF_OK(check_rows(t));  // Sk = 0: out 0 and lse -inf everywhere
  }
}

// ---- Errors on the device path -----------------------------------------------------------------

TEST_F(Gpu, MixedDevicesAreRejectedBeforeLaunch) {
  Dense t = make({DType::bf16, 1, 17, 33, 6, 2, 64, false, -1, -1, 0});
  DeviceTensor q(t.q), v(t.v), out(t.out), lse(t.lse);
  EXPECT_THROW(forward(q.ref, t.k.ref, v.ref, out.ref, &lse.ref, t.opts), invalid_argument);
  HostTensor back = t.out;
  out.download(back);
  EXPECT_TRUE(back.all_nan());
}

TEST_F(Gpu, CuSeqlensOnTheHostAreRejected) {
  Varlen t(DType::bf16, {3, 5}, {4, 4}, 2, 2, 64, LseLayout::packed);
  DeviceTensor q(t.q), k(t.k), v(t.v), out(t.out), lse(t.lse);
  try {
    varlen_forward(q.ref, k.ref, v.ref, out.ref, &lse.ref, t.cu_q.ref, t.cu_k.ref, t.opts);
    ADD_FAILURE() << "host cu_seqlens with device q were accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cu_seqlens_q"), std::string::npos) << e.what();
  }
  HostTensor back = t.lse;
  lse.download(back);
  EXPECT_TRUE(back.all_nan());
}

// ---- merge_attn_states on the GPU (SPEC §7) ----------------------------------------------------
//
// The GPU merge against the CPU merge over the same inputs: the same sequence of softmax-state
// operations (MergeParams::total_state), so they differ only by the device's exp2/log2 and fused
// multiply-adds: NaN, +-inf and -inf LSEs at exactly the same places, finite values within a
// rounding step of the output dtype.

struct MergeCase {
  DType dt;
  int64_t parts, batch, seqlen, heads, dim;
  bool dense;          ///< lses [N, B, H, S] (else packed [N, H, T], T = B * S)
  int64_t offset = 0;  ///< elements before outs' first element (1: misaligned, scalar path)
  std::string name() const {
    return std::string(dtype_name(dt)) + "_n" + std::to_string(parts) + "_b" + std::to_string(batch) +
           "_s" + std::to_string(seqlen) + "_h" + std::to_string(heads) + "_d" + std::to_string(dim) +
           (dense ? "_dense" : "_packed") + (offset ? "_off" + std::to_string(offset) : "");
  }
};

/// The inputs and both results of one merge.
struct MergeData {
  HostTensor outs, lses, out, lse;
  MergeData(const MergeCase& c, uint32_t seed) {
    const int64_t T = c.batch * c.seqlen, N = c.parts, H = c.heads, D = c.dim;
    outs = HostTensor::strided(c.dt, {N, T, H, D}, {T * H * D, H * D, D, 1}, N * T * H * D + c.offset);
    outs.fill(kNaN);  // storage outside the view: poison
    outs.ref.data = static_cast<char*>(outs.ref.data) + c.offset * dtype_size(c.dt);
    std::mt19937 rng(seed);
    outs.randomize(rng, 2.f);
    lses = c.dense ? HostTensor(DType::f32, {N, c.batch, H, c.seqlen}) : HostTensor(DType::f32, {N, H, T});
    out = HostTensor(c.dt, {T, H, D});
    lse = c.dense ? HostTensor(DType::f32, {c.batch, H, c.seqlen}) : HostTensor(DType::f32, {H, T});
    out.fill(kNaN);
    lse.fill(kNaN);
    // LSEs in [-6, 6]; every 7th entry an empty part (-inf); every (row, head) with
    // (t + h) % 11 == 3 has every part empty.
    std::uniform_real_distribution<float> u(-6.f, 6.f);
    const int64_t n_lse = lses.ref.numel();
    for (int64_t e = 0; e < n_lse; ++e) lses.f32()[e] = e % 7 == 5 ? -kInf : u(rng);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          if ((t + h) % 11 == 3) lses.f32()[lse_index(c, i, t, h)] = -kInf;
  }
  static int64_t lse_index(const MergeCase& c, int64_t i, int64_t t, int64_t h) {
    const int64_t T = c.batch * c.seqlen;
    return c.dense ? ((i * c.batch + t / c.seqlen) * c.heads + h) * c.seqlen + t % c.seqlen
                   : (i * c.heads + h) * T + t;
  }
};

/// Runs the merge of d's inputs on the GPU; out and lse come back into d's host buffers.
void run_gpu_merge(MergeData& d, bool with_lse = true) {
  DeviceTensor outs(d.outs), lses(d.lses), out(d.out), lse(d.lse);
  merge_attn_states(outs.ref, lses.ref, out.ref, with_lse ? &lse.ref : nullptr);
  sync();
  out.download(d.out);
  lse.download(d.lse);
}

/// Element by element over the whole storage (guard words included): NaN and infinities at the
/// same places, finite values within `rel` * max(1, |cpu|).
::testing::AssertionResult same_up_to_rounding(const HostTensor& gpu, const HostTensor& cpu,
                                               float rel) {
  const int64_t n = cpu.storage_elems();
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    const float g = gpu.get_raw(i), c = cpu.get_raw(i);
    bool ok;
    if (std::isnan(c) || std::isnan(g)) ok = std::isnan(c) && std::isnan(g);
    else if (std::isinf(c) || std::isinf(g)) ok = g == c;
    else ok = std::abs(g - c) <= rel * std::max(1.f, std::abs(c));
    if (!ok && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << n << " elements differ; first at "
                                       << first << ": gpu " << gpu.get_raw(first) << " cpu "
                                       << cpu.get_raw(first);
}

float merge_tolerance(DType dt) {
  return dt == DType::bf16 ? 8e-3f : dt == DType::f16 ? 1e-3f : 1e-5f;  // ~2 ulp of the dtype
}

class GpuMerge : public ::testing::TestWithParam<MergeCase> {
 protected:
  void SetUp() override {
    if (!gpu_available())
      GTEST_SKIP() << "no usable GPU (" << build_info() << "): the GPU suite needs a CUDA device";
  }
};

TEST_P(GpuMerge, MatchesTheCpuMerge) {
  const MergeCase& c = GetParam();
  MergeData gpu(c, 11), cpu(c, 11);
  run_gpu_merge(gpu);
  merge_attn_states(cpu.outs.ref, cpu.lses.ref, cpu.out.ref, &cpu.lse.ref);
  EXPECT_TRUE(same_up_to_rounding(gpu.out, cpu.out, merge_tolerance(c.dt))) << "out";
  EXPECT_TRUE(same_up_to_rounding(gpu.lse, cpu.lse, 1e-5f)) << "lse";
  // Without an lse buffer the LSE stays untouched (NaN poison) and out is the same.
  MergeData no_lse(c, 11);
  run_gpu_merge(no_lse, false);
  EXPECT_TRUE(no_lse.lse.all_nan());
  EXPECT_TRUE(no_lse.out.bitwise_equal(gpu.out)) << "out differs without an lse buffer";
}

std::string merge_case_name(const ::testing::TestParamInfo<MergeCase>& info) {
  return info.param.name();
}

/// Two-way and N-way (past the kernel's batch of parts in flight, up to kMaxMergeParts),
/// dense and packed LSEs, every dtype, vector path (head dims 64, 128, 96, 40) and scalar path
/// (head dims 36 and 1, a misaligned view).
std::vector<MergeCase> merge_grid() {
  return {
      {DType::bf16, 2, 2, 37, 4, 64, true},     {DType::f16, 2, 1, 300, 8, 128, false},
      {DType::f32, 2, 3, 5, 2, 128, true},      {DType::bf16, 3, 2, 17, 6, 96, false},
      {DType::f16, 5, 1, 64, 4, 40, true},      {DType::bf16, 9, 2, 33, 2, 128, true},
      {DType::f32, 17, 1, 20, 3, 64, false},    {DType::bf16, kMaxMergeParts, 1, 7, 2, 64, false},
      {DType::bf16, 2, 1, 50, 3, 36, true},     {DType::f16, 4, 2, 9, 5, 1, false},
      {DType::bf16, 2, 2, 31, 4, 128, true, 1}, {DType::f32, 3, 1, 40, 2, 64, false, 3},
      {DType::bf16, 1, 2, 16, 2, 64, true},     {DType::f16, 2, 0, 16, 2, 64, true},
  };
}
INSTANTIATE_TEST_SUITE_P(Grid, GpuMerge, ::testing::ValuesIn(merge_grid()), merge_case_name);

TEST_F(Gpu, MergeNanReachesWhatItTouchesAndEmptyPartsAreNeverUsed) {
  const int64_t T = 4, H = 2, D = 64;
  MergeCase c{DType::bf16, 2, 1, T, H, D, false};
  MergeData d(c, 3);
  auto lse_at = [&](int64_t i, int64_t t, int64_t h) -> float& {
    return d.lses.f32()[MergeData::lse_index(c, i, t, h)];
  };
  auto out_at = [&](int64_t i, int64_t t, int64_t h, int64_t e) {
    return d.outs.base() + ((i * T + t) * H + h) * D + e;
  };
  for (int64_t h = 0; h < H; ++h) {
    lse_at(0, 0, h) = kNaN, lse_at(1, 0, h) = 0.f;  // row 0: a NaN LSE: every column NaN
    lse_at(0, 1, h) = 0.f, lse_at(1, 1, h) = -30.f;  // row 1: a NaN at weight ~1e-13
    d.outs.set_raw(out_at(1, 1, h, 5), kNaN);
    lse_at(0, 2, h) = -kInf, lse_at(1, 2, h) = 1.f;  // row 2: part 0 empty, its out NaN
    for (int64_t e = 0; e < D; ++e) d.outs.set_raw(out_at(0, 2, h, e), kNaN);
    lse_at(0, 3, h) = -kInf, lse_at(1, 3, h) = -kInf;  // row 3: both empty
  }
  MergeData cpu = d;
  run_gpu_merge(d);
  merge_attn_states(cpu.outs.ref, cpu.lses.ref, cpu.out.ref, &cpu.lse.ref);
  EXPECT_TRUE(same_up_to_rounding(d.out, cpu.out, merge_tolerance(c.dt)));
  EXPECT_TRUE(same_up_to_rounding(d.lse, cpu.lse, 1e-5f));
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_TRUE(std::isnan(d.lse.f32()[h * T + 0]));
    EXPECT_FALSE(std::isnan(d.lse.f32()[h * T + 1]));
    EXPECT_NEAR(d.lse.f32()[h * T + 2], 1.f, 1e-6f);
    EXPECT_EQ(d.lse.f32()[h * T + 3], -kInf);
    for (int64_t e = 0; e < D; ++e) {
      const int64_t o = (0 * H + h) * D + e;
      EXPECT_TRUE(std::isnan(d.out.get_raw(o))) << e;                           // row 0
      EXPECT_EQ(std::isnan(d.out.get_raw(o + 1 * H * D)), e == 5) << e;          // row 1
      EXPECT_EQ(d.out.get_raw(o + 2 * H * D), d.outs.get_raw(out_at(1, 2, h, e)));  // row 2
      EXPECT_EQ(d.out.get_raw(o + 3 * H * D), 0.f) << e;                        // row 3
    }
  }
}

TEST_F(Gpu, MergeOfForwardPartsEqualsTheUnsplitAttention) {
  // Parts from the CPU forward over key ranges, merged on the GPU: the attention over all keys
  // (SPEC §6 against the reference of the whole problem).
  for (auto [dt, d, cuts] : {std::tuple<DType, int64_t, std::vector<int64_t>>{DType::bf16, 64, {0, 150, 300}},
                             {DType::f16, 128, {0, 17, 64, 65, 300}}}) {
    Dense t = make({dt, 2, 37, 300, 4, 2, d, false, -1, -1, 1}, 7);
    const int64_t B = 2, S = 37, H = 4, N = int64_t(cuts.size()) - 1;
    HostTensor outs(dt, {N, B * S, H, d}), lses(DType::f32, {N, B, H, S});
    for (int64_t i = 0; i < N; ++i) {
      TensorRef k = t.k.ref, v = t.v.ref, out = t.out.ref, lse = t.lse.ref;
      for (TensorRef* r : {&k, &v}) {
        r->data = static_cast<uint16_t*>(r->data) + cuts[size_t(i)] * r->strides[1];
        r->sizes[1] = cuts[size_t(i) + 1] - cuts[size_t(i)];
      }
      out.data = static_cast<uint16_t*>(outs.ref.data) + i * outs.ref.strides[0];
      lse.data = static_cast<float*>(lses.ref.data) + i * lses.ref.strides[0];
      FwdOptions o = t.opts;
      o.return_lse = true;
      forward(t.q.ref, k, v, out, &lse, o);
    }
    HostTensor merged(dt, {B * S, H, d}), lse(DType::f32, {B, H, S});
    merged.fill(kNaN);
    lse.fill(kNaN);
    {
      DeviceTensor o(outs), l(lses), r(merged), rl(lse);
      merge_attn_states(o.ref, l.ref, r.ref, &rl.ref);
      sync();
      r.download(merged);
      rl.download(lse);
    }
    const TensorRef as_dense = make_tensor(merged.ref.data, dt, {B, S, H, d});
    EXPECT_REF_OK(ref::check(t.problem(), as_dense, &lse.ref)) << N << " parts";
  }
}

TEST_F(Gpu, MergeGridStrideLoopCoversEveryRow) {
  // More pieces than the kernel's capped grid has threads (kMaxBlocks x 256 = 2^24): head dim 1
  // takes the scalar path, one piece per (row, head).
  const MergeCase c{DType::bf16, 2, 1, int64_t(1) << 20, 17, 1, false};
  MergeData gpu(c, 5), cpu(c, 5);
  run_gpu_merge(gpu);
  merge_attn_states(cpu.outs.ref, cpu.lses.ref, cpu.out.ref, &cpu.lse.ref);
  EXPECT_TRUE(same_up_to_rounding(gpu.out, cpu.out, merge_tolerance(c.dt))) << "out";
  EXPECT_TRUE(same_up_to_rounding(gpu.lse, cpu.lse, 1e-5f)) << "lse";
}

TEST_F(Gpu, MergeBadCallsWriteNothing) {
  MergeData d({DType::bf16, 2, 1, 8, 2, 64, false}, 1);
  DeviceTensor outs(d.outs), lses(d.lses), out(d.out), lse(d.lse);
  TensorRef short_lses = lses.ref;
  short_lses.sizes[2] = 7;
  EXPECT_THROW(merge_attn_states(outs.ref, short_lses, out.ref, &lse.ref), invalid_argument);
  EXPECT_THROW(merge_attn_states(outs.ref, lses.ref, out.ref, &d.lse.ref), invalid_argument);  // host lse
  TensorRef aliased = out.ref;
  aliased.data = outs.ref.data;
  EXPECT_THROW(merge_attn_states(outs.ref, lses.ref, aliased, &lse.ref), invalid_argument);
  sync();
  out.download(d.out);
  lse.download(d.lse);
  EXPECT_TRUE(d.out.all_nan());
  EXPECT_TRUE(d.lse.all_nan());
}

// ---- KV cache on the GPU (SPEC §7) -------------------------------------------------------------
//
// The append kernel, then the decode / generic kernel reading K/V through common::PagedRows (paged) or ContiguousRows: a paged
// and a contiguous cache give bitwise the same out and LSE, the appended caches equal the CPU
// append bitwise, and the result matches the fp64 reference of the appended keys.

class GpuKvCache : public ::testing::TestWithParam<KvCase> {
 protected:
  void SetUp() override {
    if (!gpu_available())
      GTEST_SKIP() << "no usable GPU (" << build_info() << "): the GPU suite needs a CUDA device";
  }
};

TEST_P(GpuKvCache, PagedEqualsContiguousAndMatchesTheReference) {
  const KvCase& c = GetParam();
  KvProblem t(c, 3);
  const bool append = c.s_new > 0;
  HostTensor out_c = t.out, lse_c = t.lse, out_p = t.out, lse_p = t.lse;
  HostTensor kc = t.k_cache, vc = t.v_cache, kp = t.k_pages, vp = t.v_pages;
  {
    DeviceTensor q(t.q), kn(t.k_new), vn(t.v_new), lens(t.seqlens), table(t.table);
    DeviceTensor dkc(kc), dvc(vc), dkp(kp), dvp(vp), oc(out_c), lc(lse_c), op(out_p), lp(lse_p);
    const KvCacheOptions o = c.options();
    kvcache_forward(q.ref, dkc.ref, dvc.ref, append ? &kn.ref : nullptr,
                    append ? &vn.ref : nullptr, &lens.ref, nullptr, oc.ref, &lc.ref, o);
    kvcache_forward(q.ref, dkp.ref, dvp.ref, append ? &kn.ref : nullptr,
                    append ? &vn.ref : nullptr, &lens.ref, &table.ref, op.ref, &lp.ref, o);
    sync();
    // Only the decode and generic kernels read K/V through a row source (common::PagedRows).
    EXPECT_TRUE(last_kernel_name().rfind("fwd_decode_", 0) == 0 ||
                last_kernel_name().rfind("fwd_generic_", 0) == 0)
        << last_kernel_name();
    for (auto [d, h] : {std::pair{&dkc, &kc}, {&dvc, &vc}, {&dkp, &kp}, {&dvp, &vp},
                        {&oc, &out_c}, {&lc, &lse_c}, {&op, &out_p}, {&lp, &lse_p}})
      d->download(*h);
  }
  EXPECT_TRUE(out_p.bitwise_equal(out_c)) << "out: paged differs from contiguous";
  EXPECT_TRUE(lse_p.bitwise_equal(lse_c)) << "lse: paged differs from contiguous";
  // The CPU append of the same rows, bitwise.
  HostTensor out_cpu = t.out, lse_cpu = t.lse;
  t.run(false, append, out_cpu, lse_cpu);
  t.run(true, append, out_cpu, lse_cpu);
  EXPECT_TRUE(kc.bitwise_equal(t.k_cache) && vc.bitwise_equal(t.v_cache)) << "contiguous append";
  EXPECT_TRUE(kp.bitwise_equal(t.k_pages) && vp.bitwise_equal(t.v_pages)) << "paged append";
  EXPECT_REF_OK(t.check(out_c, lse_c, c.s_new));
}

INSTANTIATE_TEST_SUITE_P(Grid, GpuKvCache, ::testing::ValuesIn(kv_grid()), kv_name);

TEST_F(Gpu, KvCacheLongDecodeSplitsAndGqaPacking) {
  // Decode (Sq 1, GQA 32/8 packed into one block) over long paged caches, split-K by the
  // heuristic: paged == contiguous bitwise, and the reference on a subset of rows.
  KvCase c;
  c.sq = 1, c.hq = 32, c.hkv = 8, c.d = 128, c.page = 256, c.splits = 0, c.s_new = 1;
  c.lens = {9000, 3, 4000};
  KvProblem t(c, 9);
  HostTensor out_c = t.out, lse_c = t.lse, out_p = t.out, lse_p = t.lse;
  HostTensor kc = t.k_cache, vc = t.v_cache;
  {
    DeviceTensor q(t.q), kn(t.k_new), vn(t.v_new), lens(t.seqlens), table(t.table);
    DeviceTensor dkc(kc), dvc(vc), dkp(t.k_pages), dvp(t.v_pages), oc(out_c), lc(lse_c),
        op(out_p), lp(lse_p);
    const KvCacheOptions o = c.options();
    kvcache_forward(q.ref, dkc.ref, dvc.ref, &kn.ref, &vn.ref, &lens.ref, nullptr, oc.ref,
                    &lc.ref, o);
    kvcache_forward(q.ref, dkp.ref, dvp.ref, &kn.ref, &vn.ref, &lens.ref, &table.ref, op.ref,
                    &lp.ref, o);
    sync();
    for (auto [d, h] : {std::pair{&dkc, &kc}, {&dvc, &vc}, {&oc, &out_c}, {&lc, &lse_c},
                        {&op, &out_p}, {&lp, &lse_p}})
      d->download(*h);
  }
  EXPECT_TRUE(out_p.bitwise_equal(out_c));
  EXPECT_TRUE(lse_p.bitwise_equal(lse_c));
  t.k_cache = kc;
  t.v_cache = vc;
  EXPECT_REF_OK(t.check(out_c, lse_c, c.s_new));
}

// Chunked prefill on the GPU (varlen_paged_forward): varlen queries against the first lens[b]
// rows of each sequence's pages match the fp64 reference, and give bitwise the out and LSE of
// varlen_forward on the same keys packed contiguously where both calls run the same kernel
// (short chunks: decode; on Hopper a long chunk of packed keys runs an sm90 kernel, the paged
// call the generic one — then both are checked against the reference).
TEST_F(Gpu, ChunkedPrefillEqualsPackedKeysAndMatchesTheReference) {
  int i = 0;
  for (int64_t sq : {3, 70})
    for (int64_t page : {16, 256})
      for (bool causal : {false, true}) {
        KvCase c;
        c.sq = sq, c.hq = 8, c.hkv = 2, c.d = i % 2 ? 128 : 64, c.page = page;
        c.dt = i % 3 ? DType::bf16 : DType::f16;
        c.lens = {int32_t(2 * page + 5), 0, int32_t(page), 90};
        c.causal = causal, c.splits = i % 2 ? 0 : 2;
        ++i;
        KvProblem t(c, 21 + uint32_t(i));
        KvProblem::Packed pk = t.packed(0);
        for (LseLayout layout : {LseLayout::padded, LseLayout::packed}) {
          pk.opts.lse_layout = layout;
          const int64_t total_q = c.batch() * c.sq;
          HostTensor lse = layout == LseLayout::padded ? t.lse : HostTensor(DType::f32, {c.hq, total_q});
          lse.fill(kNaN);
          HostTensor out_p = t.out, lse_p = lse, out_c = t.out, lse_c = lse;
          std::string kernel, packed_kernel;
          {
            DeviceTensor q(t.q), kp(t.k_pages), vp(t.v_pages), table(t.table), cq(pk.cu_q),
                ck(pk.cu_k), k(pk.k), v(pk.v), op(out_p), lp(lse_p), oc(out_c), lc(lse_c);
            varlen_paged_forward(t.varlen_view(q.ref), kp.ref, vp.ref,
                                 t.varlen_view(op.ref), &lp.ref, cq.ref, ck.ref,
                                 table.ref, pk.opts);
            kernel = last_kernel_name();
            varlen_forward(t.varlen_view(q.ref), k.ref, v.ref,
                           t.varlen_view(oc.ref), &lc.ref, cq.ref, ck.ref, pk.opts);
            packed_kernel = last_kernel_name();
            sync();
            for (auto [d, h] : {std::pair{&op, &out_p}, {&lp, &lse_p}, {&oc, &out_c}, {&lc, &lse_c}})
              d->download(*h);
          }
          const std::string what = kv_case_name(c) + (layout == LseLayout::padded ? " padded" : " packed");
          EXPECT_TRUE(kernel.rfind(sq <= 16 ? "fwd_decode_" : "fwd_generic_", 0) == 0)
              << what << ": " << kernel;
          if (kernel == packed_kernel) {
            EXPECT_TRUE(out_p.bitwise_equal(out_c)) << what << ": out, paged differs from packed";
            EXPECT_TRUE(lse_p.bitwise_equal(lse_c)) << what << ": lse, paged differs from packed";
          } else if (layout == LseLayout::padded) {
            EXPECT_REF_OK(t.check(out_c, lse_c, 0)) << what << " (packed keys, " << packed_kernel << ")";
          }
          if (layout == LseLayout::padded) EXPECT_REF_OK(t.check(out_p, lse_p, 0)) << what;
        }
      }
}

TEST_F(Gpu, KvCacheBadCallsWriteNothing) {
  KvCase c;
  c.lens = {20, 40};
  c.s_new = 2;
  KvProblem t(c, 6);
  DeviceTensor q(t.q), kn(t.k_new), vn(t.v_new), table(t.table), kp(t.k_pages), vp(t.v_pages),
      out(t.out), lse(t.lse);
  HostTensor lens = t.seqlens;
  lens.i32()[1] = int32_t(c.capacity() - 1);  // + 2 new keys: past the capacity
  DeviceTensor dlens(lens);
  EXPECT_THROW(kvcache_forward(q.ref, kp.ref, vp.ref, &kn.ref, &vn.ref, &dlens.ref, &table.ref,
                               out.ref, &lse.ref, c.options()),
               invalid_argument);
  EXPECT_THROW(kvcache_forward(q.ref, kp.ref, vp.ref, &kn.ref, &vn.ref, &t.seqlens.ref,
                               &table.ref, out.ref, &lse.ref, c.options()),
               invalid_argument);  // host cache_seqlens
  sync();
  HostTensor back = t.k_pages, out_back = t.out;
  kp.download(back);
  out.download(out_back);
  EXPECT_TRUE(back.bitwise_equal(t.k_pages));
  EXPECT_TRUE(out_back.all_nan());
}

}  // namespace
}  // namespace hipflash::test
