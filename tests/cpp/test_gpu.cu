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

class GpuForward : public GpuParam<Case> {};

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
      // Masked hd64 with long rows: the three-consumer tile (sm90_ws::long_row_tile: enough
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
  // dense and varlen calls (unless HIPFLASH_DISABLE_SM90_WS=1), else the cp.async wgmma kernel;
  // elsewhere generic.
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
  {  // varlen: its packed rows are one batch of the TMA kernel's maps
    Varlen t(DType::bf16, {300, 17}, {300, 400}, 4, 4, 128, LseLayout::packed);
    run_gpu(t);
    EXPECT_EQ(last_kernel_name().rfind(tma, 0), 0u) << last_kernel_name() << " for varlen";
    EXPECT_REF_OK(t.check()) << last_kernel_name();
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
  ~NaNBuffer() { EXPECT_EQ(cudaFree(ptr), cudaSuccess); }
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

class GpuNan : public GpuParam<NanCase> {};

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

TEST_F(Gpu, VarlenNeighboursNonFiniteRowsStayOut) {
  // On Hopper the TMA kernel's boxes read past a sequence's last key (and query row) into the
  // next sequence's rows: NaN in a neighbour's q and k and Inf in its v must reach that
  // neighbour's rows only (the mask keeps its scores out, V's rows are zeroed: 0 x Inf), and
  // the kernel is named.
  int i = 0;
  for (int64_t d : {64, 128, 256})
    for (bool causal : {false, true}) {
      const LseLayout layout = i % 2 ? LseLayout::packed : LseLayout::padded;
      // Sequences long enough for the TMA kernel at every head dim (kWsVarlenHd64MinMeanRows),
      // each ending inside a query block and a key block.
      Varlen t(i++ % 3 ? DType::bf16 : DType::f16, {700, 450, 630}, {530, 590, 700}, 4, 2, d,
               layout);
      t.opts.causal = causal;
      auto plant = [&](HostTensor& x, int64_t row0, int64_t row1, float value) {
        for (int64_t row = row0; row < row1; ++row)
          for (int64_t h = 0; h < x.ref.sizes[1]; ++h)
            for (int64_t c = 0; c < d; c += 7)
              x.set_raw(x.base() + row * x.ref.strides[0] + h * x.ref.strides[1] + c, value);
      };
      plant(t.q, 700, 704, kNaN);    // sequence 1's first query rows
      plant(t.k, 530, 534, kNaN);    // and its first keys
      plant(t.v, 534, 550, kInf);    // and values
      run_gpu(t);
      ref::CheckOptions co;
      co.lse_layout = layout;
      co.nan_inputs = true;
      co.max_rows = 1024;
      EXPECT_REF_OK(ref::check(t.problem(), t.out.ref, &t.lse.ref, co))
          << "d " << d << " causal " << causal << " " << last_kernel_name();
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

}  // namespace
}  // namespace hipflash::test
