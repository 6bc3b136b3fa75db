// The pure kernel selector and the split heuristic (include/hipflash/detail/selector.hpp).
#include <gtest/gtest.h>

#include <string>

#include "backend.hpp"  // widened_fp8_params
#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/detail/selector.hpp"
#include "sm90_ws/tile.hpp"

namespace hipflash {
namespace {

const Arch kHost{Arch::host, 0, 1};
const Arch kSm80{Arch::nvidia, 80, 108};
const Arch kSm90{Arch::nvidia, 90, 132};
const Arch kSm75{Arch::nvidia, 75, 40};
const Arch kGfx90a{Arch::amd, 0x90a, 104};
const Arch kGfx942{Arch::amd, 0x942, 304};
const Arch kGfx950{Arch::amd, 0x950, 256};
const Arch kGfx1100{Arch::amd, 0x1100, 48};
const BuildCaps kCuda{true, Arch::nvidia, 0b111};
const BuildCaps kHip{true, Arch::amd, 0b111};
const BuildCaps kNone{};

Problem problem(DType dt, int d, bool lse = true, bool masked = false, int splits = 1) {
  Problem p;
  p.dtype = dt;
  p.head_dim = d;
  p.return_lse = lse;
  p.masked = masked;
  p.num_splits = splits;
  return p;
}

TEST(Selector, PaddedHeadDim) {
  EXPECT_EQ(padded_head_dim(32), 64);
  EXPECT_EQ(padded_head_dim(64), 64);
  EXPECT_EQ(padded_head_dim(96), 128);
  EXPECT_EQ(padded_head_dim(128), 128);
  EXPECT_EQ(padded_head_dim(256), 256);
  for (int d : {0, 16, 48, 80, 160, 192, 512}) EXPECT_EQ(padded_head_dim(d), 0) << d;
}

TEST(Selector, ArchNames) {
  EXPECT_EQ(kHost.name(), "cpu");
  EXPECT_EQ(kSm90.name(), "sm90");
  EXPECT_EQ(kGfx90a.name(), "gfx90a");
  EXPECT_EQ(kGfx950.name(), "gfx950");
  EXPECT_STREQ(kernel_kind_name(KernelKind::generic), "generic");
  EXPECT_STREQ(kernel_kind_name(KernelKind::cpu_reference), "cpu");
}

TEST(Selector, HostRunsTheCpuBackend) {
  for (BuildCaps caps : {kNone, kCuda, kHip}) {
    const Selection s = select_kernel(problem(DType::bf16, 96), kHost, caps);
    EXPECT_EQ(s.kind, KernelKind::cpu_reference);
    EXPECT_TRUE(s.reason.empty());
    EXPECT_EQ(s.key.head_dim, 128);
  }
}

TEST(Selector, KeyCarriesTheFoldedFlags) {
  const Selection s = select_kernel(problem(DType::bf16, 32, false, true, 3), kSm90, kCuda);
  EXPECT_EQ(s.kind, KernelKind::generic);
  EXPECT_EQ(s.key.dtype, DType::bf16);
  EXPECT_EQ(s.key.head_dim, 64);
  EXPECT_TRUE(s.key.masked);
  EXPECT_TRUE(s.key.split);
  EXPECT_EQ(s.key.name(), "bf16_hd64_masked_splitk");
  const Selection t = select_kernel(problem(DType::f16, 128, true, false, 1), kSm80, kCuda);
  EXPECT_FALSE(t.key.split);
  EXPECT_EQ(t.key.name(), "fp16_hd128_lse");
}

TEST(Selector, NvidiaArchs) {
  EXPECT_EQ(select_kernel(problem(DType::f16, 64), kSm80, kCuda).kind, KernelKind::generic);
  EXPECT_EQ(select_kernel(problem(DType::f16, 64), kSm90, kCuda).kind, KernelKind::generic);
  const Selection old = select_kernel(problem(DType::f16, 64), kSm75, kCuda);
  EXPECT_EQ(old.kind, KernelKind::unsupported);
  EXPECT_NE(old.reason.find("sm_80"), std::string::npos) << old.reason;
}

TEST(Selector, FewQueryRowsTakeTheDecodeKernelOnNvidia) {
  for (int64_t rows : {int64_t(1), int64_t(4), kDecodeMaxRows}) {
    Problem p = problem(DType::bf16, 128);
    p.query_rows = rows;
    EXPECT_EQ(select_kernel(p, kSm80, kCuda).kind, KernelKind::decode) << rows;
    EXPECT_EQ(select_kernel(p, kSm90, kCuda).kind, KernelKind::decode) << rows;
    EXPECT_EQ(select_kernel(p, kGfx942, kHip).kind, KernelKind::generic) << rows;  // mma.sync only
    EXPECT_EQ(select_kernel(p, kHost, kCuda).kind, KernelKind::cpu_reference) << rows;
  }
  Problem p = problem(DType::f16, 64);
  p.query_rows = kDecodeMaxRows + 1;
  EXPECT_EQ(select_kernel(p, kSm90, kCuda).kind, KernelKind::generic);
  EXPECT_STREQ(kernel_kind_name(KernelKind::decode), "decode");
}

// ALiBi's slopes are per query head: packed GQA decode rows carry a slope each, which only the
// decode kernels read; so with slopes a call packs only where its heads fit a decode block.
TEST(Selector, AlibiPacksGqaDecodeOnlyIntoADecodeBlock) {
  const float slopes[64] = {};
  FwdParams p;
  p.seqlen_q = 1;
  p.heads_kv = 2;
  for (int64_t group : {int64_t(2), kDecodeMaxRows, kDecodeMaxRows + 1, int64_t(32)}) {
    p.heads_q = p.heads_kv * group;
    p.alibi_slopes = nullptr;
    EXPECT_TRUE(p.packs_gqa_decode()) << group;
    p.alibi_slopes = slopes;
    EXPECT_EQ(p.packs_gqa_decode(), group <= kDecodeMaxRows) << group;
    EXPECT_EQ(p.gpu_query_rows(), group <= kDecodeMaxRows ? group : 1) << group;
  }
}

TEST(Selector, PackedGqaDecodeTakesTheHeadGroupKernelWhereEnabled) {
  BuildCaps on = kCuda;
  on.decode_heads = HeadGroupDecode::always;
  for (int d : {32, 64, 96, 128, 256}) {
    Problem p = problem(DType::bf16, d);
    p.query_rows = 4;
    p.gqa_decode = true;
    p.heads_kv = 4;  // fewer kv heads than a group: the decode kernel
    EXPECT_EQ(select_kernel(p, kSm90, on).kind, KernelKind::decode) << d;
    p.heads_kv = kDecodeHeadsPerBlock;
    const KernelKind want = d <= 128 ? KernelKind::decode_heads : KernelKind::decode;
    EXPECT_EQ(select_kernel(p, kSm90, on).kind, want) << d;
    EXPECT_EQ(select_kernel(p, kSm80, on).kind, KernelKind::decode) << d << ": sm_90's memory";
    EXPECT_EQ(select_kernel(p, kSm90, kCuda).kind, KernelKind::decode) << d << ": built without";
    p.gqa_decode = false;  // decode rows that are not packed GQA heads
    EXPECT_EQ(select_kernel(p, kSm90, on).kind, KernelKind::decode) << d;
  }
  EXPECT_STREQ(kernel_kind_name(KernelKind::decode_heads), "decode_heads");
}

TEST(Selector, HeadGroupDecodeByDefaultWhereMeasuredAhead) {
  // The default: many long key ranges (batch x head groups >= 8, keys >= 32k) at hd128 alone.
  BuildCaps measured = kCuda;
  measured.decode_heads = HeadGroupDecode::measured;
  BuildCaps off = measured;
  off.decode_heads = HeadGroupDecode::off;
  Problem p = problem(DType::bf16, 128);
  p.query_rows = 4;
  p.gqa_decode = true;
  p.heads_kv = 8;
  const auto kind = [&](int64_t batch, int64_t keys, const BuildCaps& caps = kCuda) {
    Problem q = p;
    q.batch = batch;
    q.keys = keys;
    return select_kernel(q, kSm90, caps).kind;
  };
  for (auto [batch, keys, want] : {std::tuple<int64_t, int64_t, bool>{32, 131072, true},
                                   {64, 262144, true}, {32, 131071, false}, {32, 65536, false},
                                   {32, 4096, false}, {31, 131072, false}, {8, 131072, false},
                                   {1, 131072, false}}) {
    EXPECT_EQ(kind(batch, keys, measured), want ? KernelKind::decode_heads : KernelKind::decode)
        << "B=" << batch << " Sk=" << keys;
    EXPECT_EQ(kind(batch, keys, off), KernelKind::decode) << "B=" << batch << " Sk=" << keys;
  }
  p.kv_heads_in_rows = false;  // a head-major cache: the decode kernel by default
  EXPECT_EQ(kind(32, 131072, measured), KernelKind::decode);
  EXPECT_EQ(kind(64, 262144, measured), KernelKind::decode);
  BuildCaps forced = measured;
  forced.decode_heads = HeadGroupDecode::always;
  EXPECT_EQ(kind(32, 131072, forced), KernelKind::decode_heads) << "it runs them when told";
  p.kv_heads_in_rows = true;
  p.heads_kv = 16;  // two head groups a batch: B = 16 makes the 32 tiles
  EXPECT_EQ(kind(16, 131072, measured), KernelKind::decode_heads);
  EXPECT_EQ(kind(15, 131072, measured), KernelKind::decode);
  p.head_dim = 64;  // not measured at hd64: HIPFLASH_DECODE_HEADS=1 only
  p.heads_kv = 8;
  EXPECT_EQ(kind(32, 131072, measured), KernelKind::decode);
  BuildCaps always = measured;
  always.decode_heads = HeadGroupDecode::always;
  EXPECT_EQ(kind(32, 131072, always), KernelKind::decode_heads);
}

TEST(Selector, HopperTakesTheWgmmaKernelWhereBuilt) {
  BuildCaps with_sm90 = kCuda;
  with_sm90.sm90 = true;
  for (int d : {32, 64, 96, 128}) {
    EXPECT_EQ(select_kernel(problem(DType::bf16, d), kSm90, with_sm90).kind, KernelKind::sm90) << d;
    EXPECT_EQ(select_kernel(problem(DType::bf16, d), kSm90, kCuda).kind, KernelKind::generic) << d;
    EXPECT_EQ(select_kernel(problem(DType::bf16, d), kSm80, with_sm90).kind, KernelKind::generic) << d;
  }
  EXPECT_EQ(select_kernel(problem(DType::f16, 256), kSm90, with_sm90).kind, KernelKind::generic);
  Problem decode = problem(DType::f16, 128);
  decode.query_rows = 4;
  EXPECT_EQ(select_kernel(decode, kSm90, with_sm90).kind, KernelKind::decode);
  EXPECT_STREQ(kernel_kind_name(KernelKind::sm90), "sm90");
}

TEST(Selector, HopperTakesTheTmaKernelForDenseAndVarlenCalls) {
  BuildCaps caps = kCuda;
  caps.sm90 = caps.sm90_ws = true;
  auto dense = [](int d) {
    Problem p = problem(DType::bf16, d);
    p.tma_compatible = true;
    return p;
  };
  for (int d : {32, 64, 96, 128, 256})
    EXPECT_EQ(select_kernel(dense(d), kSm90, caps).kind, KernelKind::sm90_ws) << d;
  Problem short_causal = dense(64);  // short causal rows too (no cp.async exception since
  short_causal.masked = true;         // the tile decode by divisors: design-decisions.md)
  for (int64_t rows : {17, 512, 513})
    for (int d : {64, 128}) {
      short_causal.query_rows = rows;
      short_causal.head_dim = d;
      EXPECT_EQ(select_kernel(short_causal, kSm90, caps).kind, KernelKind::sm90_ws) << rows << d;
    }
  BuildCaps no_cpasync = caps;  // a build without the cp.async kernel
  no_cpasync.sm90 = false;
  // Varlen: the packed rows as one batch of the maps (the kernel zeroes what a box reads past
  // its sequence); where a map cannot describe them, the cp.async kernel up to hd128.
  for (int d : {64, 128, 256}) {
    Problem varlen = dense(d);
    varlen.varlen = true;
    varlen.mean_query_rows = kWsVarlenHd64MinMeanRows;
    EXPECT_EQ(select_kernel(varlen, kSm90, caps).kind, KernelKind::sm90_ws) << d;
    varlen.mean_query_rows = kWsVarlenHd64MinMeanRows - 1;  // short sequences: hd64 on cp.async
    EXPECT_EQ(select_kernel(varlen, kSm90, caps).kind,
              d == 64 ? KernelKind::sm90 : KernelKind::sm90_ws) << d;
    EXPECT_EQ(select_kernel(varlen, kSm90, no_cpasync).kind, KernelKind::sm90_ws) << d;
    varlen.mean_query_rows = kWsVarlenHd64MinMeanRows;
    varlen.tma_compatible = false;
    EXPECT_EQ(select_kernel(varlen, kSm90, caps).kind,
              d <= 128 ? KernelKind::sm90 : KernelKind::generic) << d;
  }
  Problem odd = dense(128);  // strides a tensor map cannot describe
  odd.tma_compatible = false;
  EXPECT_EQ(select_kernel(odd, kSm90, caps).kind, KernelKind::sm90);
  BuildCaps no_ws = caps;  // HIPFLASH_DISABLE_SM90_WS=1
  no_ws.sm90_ws = false;
  EXPECT_EQ(select_kernel(dense(128), kSm90, no_ws).kind, KernelKind::sm90);
  EXPECT_EQ(select_kernel(dense(128), kSm80, caps).kind, KernelKind::generic);
  Problem decode = dense(128);
  decode.query_rows = 4;
  EXPECT_EQ(select_kernel(decode, kSm90, caps).kind, KernelKind::decode);
  EXPECT_STREQ(kernel_kind_name(KernelKind::sm90_ws), "sm90_ws");
}

TEST(Selector, LongRowTileOnlyForLongRows) {
  // sm90_ws::long_row_tile (the sm90_ws launcher's tile), never split. Masked hd64: 4k rows or
  // more, rows seeing 4096 keys on average, two 192-row tiles per SM; on the FA grid (32 heads,
  // B * S = 16k, 132 SMs) causal 8k and 16k. Unmasked hd128 (the padded head dim: hd96 too):
  // 8k keys or more, whatever the query rows.
  const auto pick = [](int hd, bool masked, bool split, int64_t sq, int64_t sk, int64_t wl,
                       int64_t wr, int64_t heads = 32) {
    return sm90_ws::long_row_tile(hd, masked, split, sq, sk, wl, wr, heads, 132);
  };
  for (int64_t s : {512, 1024, 2048, 4096})
    EXPECT_FALSE(pick(64, true, false, s, s, -1, 0));
  for (int64_t s : {8192, 16384}) EXPECT_TRUE(pick(64, true, false, s, s, -1, 0));
  EXPECT_FALSE(pick(64, false, false, 16384, 16384, -1, -1));  // unmasked: three already
  EXPECT_FALSE(pick(128, true, false, 16384, 16384, -1, 0));   // masked hd128
  for (int64_t s : {512, 1024, 2048, 4096}) EXPECT_FALSE(pick(128, false, false, s, s, -1, -1));
  for (int64_t s : {8192, 16384}) EXPECT_TRUE(pick(128, false, false, s, s, -1, -1, 16));
  EXPECT_TRUE(pick(128, false, false, 64, 8192, -1, -1, 1));   // few rows, long rows
  EXPECT_FALSE(pick(128, false, false, 8192, 8191, -1, -1));
  EXPECT_FALSE(pick(128, false, true, 16384, 16384, -1, -1));  // split
  EXPECT_FALSE(pick(256, false, false, 16384, 16384, -1, -1));
  EXPECT_FALSE(pick(64, true, true, 16384, 16384, -1, 0));     // split
  EXPECT_FALSE(pick(64, true, false, 16384, 16384, 1000, 0));  // a short window
  EXPECT_TRUE(pick(64, true, false, 16384, 16384, 5000, 0));
  EXPECT_TRUE(pick(64, true, false, 4096, 9000, -1, 0));    // keys 6952
  EXPECT_FALSE(pick(64, true, false, 2048, 65536, -1, 0));  // short sequences
  EXPECT_TRUE(pick(64, true, false, 4100, 9000, -1, 64));   // a right window alone
  // Too few tiles to fill the SMs twice over: 43 tiles a head at 8k.
  EXPECT_FALSE(pick(64, true, false, 8192, 8192, -1, 0, 6));
  EXPECT_TRUE(pick(64, true, false, 8192, 8192, -1, 0, 7));
}

TEST(Selector, LongRowTileInstantiations) {
  // The traits with a long-row instantiation (what long_row_tile may pick): masked hd64 in 16
  // bits and fp8 (three consumers, as unmasked hd64), unmasked hd128 in 16 bits only (fp8's Vt
  // ring is one 128-key block); never a split, never the long-row traits themselves.
  using sm90_ws::kHasLongRowTile;
  constexpr DType e4 = DType::e4m3;
  using Bf16Hd64Causal = FwdTraits<DType::bf16, 64, true, true, false>;
  using F16Hd128 = FwdTraits<DType::f16, 128, false, false, false>;
  using Fp8Hd64Causal = FwdTraits<e4, 64, false, true, false>;
  using Fp8Hd64CausalLse = FwdTraits<e4, 64, true, true, false>;
  using Fp8Hd64 = FwdTraits<e4, 64, false, false, false>;
  using Fp8Hd64CausalSplit = FwdTraits<e4, 64, true, true, true>;
  using Fp8Hd128 = FwdTraits<e4, 128, false, false, false>;
  using Fp8Hd128Causal = FwdTraits<e4, 128, false, true, false>;
  using Fp8Hd64CausalLong = sm90_ws::LongRows<Fp8Hd64Causal>;
  EXPECT_TRUE(kHasLongRowTile<Bf16Hd64Causal>);
  EXPECT_TRUE(kHasLongRowTile<F16Hd128>);
  EXPECT_TRUE(kHasLongRowTile<Fp8Hd64Causal>);
  EXPECT_TRUE(kHasLongRowTile<Fp8Hd64CausalLse>);
  EXPECT_FALSE(kHasLongRowTile<Fp8Hd64>);  // three consumers already
  EXPECT_FALSE(kHasLongRowTile<Fp8Hd64CausalSplit>);
  EXPECT_FALSE(kHasLongRowTile<Fp8Hd128>);
  EXPECT_FALSE(kHasLongRowTile<Fp8Hd128Causal>);
  EXPECT_FALSE(kHasLongRowTile<Fp8Hd64CausalLong>);
  EXPECT_EQ(sm90_ws::TileOf<Fp8Hd64CausalLong>::kConsumers, 3);
  EXPECT_EQ(sm90_ws::TileOf<Fp8Hd64Causal>::kConsumers, 2);
  EXPECT_EQ(sm90_ws::TileOf<Fp8Hd64CausalLong>::kBlockN, 128);
}

TEST(Selector, KvCacheTakesOnlyTheDecodeOrGenericKernel) {
  // Only the decode and generic loaders read a KV cache (common::PagedRows): calls the sm90 kernels
  // would take run on the generic kernel instead, decode calls stay on the decode kernel, and the
  // AMD kernels refuse one.
  BuildCaps caps = kCuda;
  caps.sm90 = caps.sm90_ws = true;
  for (int d : {32, 64, 96, 128, 256})
    for (bool masked : {false, true})
      for (int64_t rows : {int64_t(17), int64_t(512), int64_t(4096)}) {
        Problem p = problem(DType::bf16, d, true, masked);
        p.tma_compatible = true;
        p.query_rows = rows;
        const KernelKind dense = select_kernel(p, kSm90, caps).kind;
        EXPECT_EQ(dense, KernelKind::sm90_ws) << d << " " << rows;
        p.kv_cache = true;
        const Selection s = select_kernel(p, kSm90, caps);
        EXPECT_EQ(s.kind, KernelKind::generic) << d << " " << masked << " " << rows;
        EXPECT_TRUE(s.reason.empty()) << s.reason;
        EXPECT_EQ(select_kernel(p, kSm80, caps).kind, KernelKind::generic) << d;
        p.tma_compatible = false;  // the cp.async kernel's domain
        EXPECT_EQ(select_kernel(p, kSm90, caps).kind, KernelKind::generic) << d;
      }
  for (int64_t rows : {int64_t(1), int64_t(8), kDecodeMaxRows}) {
    Problem decode = problem(DType::f16, 128);
    decode.query_rows = rows;
    decode.tma_compatible = decode.kv_cache = true;
    EXPECT_EQ(select_kernel(decode, kSm90, caps).kind, KernelKind::decode) << rows;
    EXPECT_EQ(select_kernel(decode, kSm80, caps).kind, KernelKind::decode) << rows;
  }
  Problem on_host = problem(DType::bf16, 128);  // the CPU backend reads a KV cache itself
  on_host.kv_cache = true;
  EXPECT_EQ(select_kernel(on_host, kHost, kNone).kind, KernelKind::cpu_reference);
  BuildCaps dw = kHip;
  dw.dualwave = true;
  for (Arch a : {kGfx90a, kGfx942, kGfx950}) {
    const Selection amd = select_kernel(on_host, a, dw);
    EXPECT_EQ(amd.kind, KernelKind::unsupported) << a.name();
    EXPECT_NE(amd.reason.find("KV cache"), std::string::npos) << amd.reason;
  }
}

TEST(Selector, Fp8InputsTakeTheTmaKernelOnHopperAndTheGenericOneOnCdna3) {
  // fp8 q, k and v (e4m3): the sm90_ws kernel's fp8 tiles (kernels.def: fp8_head_dim 128), for
  // dense and varlen TMA-describable calls on Hopper, short query blocks included; on AMD
  // gfx94x / gfx950 the generic kernel's MFMA fp8 body (fp8_head_dim 256, dense calls). Every
  // other call — hd256 on NVIDIA, odd strides, ALiBi, AMD varlen, other archs, builds without
  // the fp8 tiles — takes the kernel its bf16 copies select (Problem::widened), marked
  // widened_fp8; a KV cache, or a call whose copies no kernel takes, is refused with why.
  BuildCaps caps = kCuda;
  caps.sm90 = caps.sm90_ws = true;
  EXPECT_EQ(fp8_max_head_dim(KernelKind::sm90_ws), 128);
  EXPECT_EQ(fp8_max_head_dim(KernelKind::generic), 256);
  EXPECT_EQ(fp8_max_head_dim(KernelKind::decode), 0);
  auto fp8 = [](int d) {
    Problem p = problem(DType::e4m3, d);
    p.kv_dtype = DType::e4m3;
    p.tma_compatible = true;
    Problem wide = p;
    wide.dtype = wide.kv_dtype = DType::bf16;
    p.widened = std::make_shared<const Problem>(wide);
    return p;
  };
  for (int d : {32, 64, 96, 128})
    for (int64_t rows : {int64_t(1), int64_t(4096)})
      for (bool masked : {false, true}) {
        Problem p = fp8(d);
        p.query_rows = rows;
        p.masked = masked;
        const Selection s = select_kernel(p, kSm90, caps);
        EXPECT_EQ(s.kind, KernelKind::sm90_ws) << d << " " << rows << " " << s.reason;
        EXPECT_FALSE(s.widened_fp8);
        EXPECT_EQ(s.key.name().rfind("fp8_hd", 0), 0u) << s.key.name();
      }
  // What the bf16 copies select, marked widened.
  auto widened = [&](const Problem& p, const Arch& a, const BuildCaps& c, const char* why) {
    const Selection s = select_kernel(p, a, c);
    const Selection want = select_kernel(*p.widened, a, c);
    ASSERT_NE(want.kind, KernelKind::unsupported) << why << ": " << want.reason;
    EXPECT_EQ(s.kind, want.kind) << why << ": " << s.reason;
    EXPECT_TRUE(s.widened_fp8) << why;
    EXPECT_EQ(s.key.name(), want.key.name()) << why;
    EXPECT_EQ(s.key.name().rfind("bf16_hd", 0), 0u) << why << ": " << s.key.name();
  };
  widened(fp8(256), kSm90, caps, "hd256");
  EXPECT_EQ(select_kernel(fp8(256), kSm90, caps).kind, KernelKind::sm90_ws);
  Problem varlen = fp8(128);
  varlen.varlen = true;
  EXPECT_EQ(select_kernel(varlen, kSm90, caps).kind, KernelKind::sm90_ws);
  EXPECT_FALSE(select_kernel(varlen, kSm90, caps).widened_fp8);
  varlen.tma_compatible = false;  // the copies are contiguous: a TMA map describes them
  widened(varlen, kSm90, caps, "varlen strides");
  Problem odd = fp8(128);
  odd.tma_compatible = false;
  widened(odd, kSm90, caps, "strides");
  Problem alibi = fp8(128);
  alibi.alibi = true;
  widened(alibi, kSm90, caps, "ALiBi");
  widened(fp8(128), kSm80, caps, "sm_80");
  BuildCaps no_ws = caps;
  no_ws.sm90_ws = false;
  widened(fp8(128), kSm90, no_ws, "no sm90_ws kernels");
  for (int d : {64, 128, 256})
    for (Arch a : {kGfx942, kGfx950}) {
      const Selection s = select_kernel(fp8(d), a, kHip);
      EXPECT_EQ(s.kind, KernelKind::generic) << a.name() << " " << d << " " << s.reason;
      EXPECT_FALSE(s.widened_fp8);
    }
  widened(fp8(128), kGfx90a, kHip, "gfx90a: no fp8 MFMA");
  Problem amd_varlen = fp8(128);
  amd_varlen.varlen = true;
  widened(amd_varlen, kGfx942, kHip, "AMD varlen");
  EXPECT_EQ(select_kernel(fp8(128), kHost, kCuda).kind, KernelKind::cpu_reference);
  // Refused: a KV cache (no copies are described), and copies no kernel takes.
  auto refused = [&](const Problem& p, const Arch& a, const BuildCaps& c, const char* why) {
    const Selection s = select_kernel(p, a, c);
    EXPECT_EQ(s.kind, KernelKind::unsupported) << why;
    EXPECT_FALSE(s.widened_fp8) << why;
    EXPECT_NE(s.reason.find("float8_e4m3fn q, k and v"), std::string::npos) << s.reason;
  };
  Problem cache = fp8(128);
  cache.kv_cache = true;
  cache.widened = nullptr;  // make_problem describes none for a KV cache
  refused(cache, kSm90, caps, "a KV cache");
  refused(fp8(128), kSm75, caps, "sm_75: no bf16 kernel either");
}

TEST(Selector, Fp8KvCacheTakesTheDecodeKernelFromSm89) {
  // An fp8 (e4m3) cache: the decode kernel reads one in decode calls, the generic kernel in
  // longer ones (kernels.def: cache_fp8), where the device runs sm_89+ code of this build (their
  // cvt); never the head-group or sm90 kernels; older archs or code and AMD are refused with a
  // reason.
  BuildCaps caps = kCuda;
  caps.sm90 = caps.sm90_ws = true;
  caps.decode_heads = HeadGroupDecode::always;
  EXPECT_TRUE(reads_fp8_kv_cache(KernelKind::decode));
  EXPECT_TRUE(reads_fp8_kv_cache(KernelKind::generic));
  EXPECT_FALSE(reads_fp8_kv_cache(KernelKind::decode_heads));
  EXPECT_FALSE(reads_fp8_kv_cache(KernelKind::sm90_ws));
  Arch sm89{Arch::nvidia, 89, 128}, sm90 = kSm90;
  sm89.fp8_cvt = sm90.fp8_cvt = true;  // the device runs this build's sm_89+ code

  for (int d : {32, 64, 96, 128, 256})
    for (int64_t rows : {int64_t(1), int64_t(4), kDecodeMaxRows}) {
      Problem p = problem(DType::bf16, d);
      p.kv_cache = p.gqa_decode = p.tma_compatible = true;
      p.kv_dtype = DType::e4m3;
      p.query_rows = rows;
      p.heads_kv = kDecodeHeadsPerBlock;
      for (Arch a : {sm90, sm89}) {
        const Selection s = select_kernel(p, a, caps);
        EXPECT_EQ(s.kind, KernelKind::decode) << d << " " << rows << " " << s.reason;
        EXPECT_EQ(s.key.kv_dtype, DType::e4m3);
        EXPECT_NE(s.key.name().find("_kvfp8"), std::string::npos) << s.key.name();
      }
      const Selection old = select_kernel(p, kSm80, caps);
      EXPECT_EQ(old.kind, KernelKind::unsupported);
      EXPECT_NE(old.reason.find("sm_89"), std::string::npos) << old.reason;
      // An sm_90 device running code built for an older arch (no sm_90 in the build's list).
      const Selection older_code = select_kernel(p, kSm90, caps);
      EXPECT_EQ(older_code.kind, KernelKind::unsupported);
      EXPECT_NE(older_code.reason.find("HIPFLASH_CUDA_ARCHS"), std::string::npos)
          << older_code.reason;
      // Longer queries (chunked prefill): the generic kernel, which widens the cache in shared
      // memory; still sm_89+ code only.
      p.query_rows = kDecodeMaxRows + 1;
      for (Arch a : {sm90, sm89}) {
        const Selection longer = select_kernel(p, a, caps);
        EXPECT_EQ(longer.kind, KernelKind::generic) << d << " " << longer.reason;
        EXPECT_NE(longer.key.name().find("_kvfp8"), std::string::npos) << longer.key.name();
      }
      EXPECT_EQ(select_kernel(p, kSm80, caps).kind, KernelKind::unsupported);
      const Selection amd = select_kernel(p, kGfx942, kHip);
      EXPECT_EQ(amd.kind, KernelKind::unsupported);
    }
  // Packed GQA decode with an fp8 cache packs only into one decode block, as ALiBi does.
  FwdParams fp;
  fp.seqlen_q = 1;
  fp.heads_kv = 2;
  fp.kv_dtype = DType::e4m3;
  for (int64_t group : {int64_t(2), kDecodeMaxRows, kDecodeMaxRows + 1, int64_t(32)}) {
    fp.heads_q = fp.heads_kv * group;
    EXPECT_EQ(fp.packs_gqa_decode(), group <= kDecodeMaxRows) << group;
    EXPECT_EQ(fp.gpu_query_rows(), group <= kDecodeMaxRows ? group : 1) << group;
  }
}

TEST(Selector, AmdArchs) {
  for (Arch a : {kGfx90a, kGfx942, kGfx950})
    EXPECT_EQ(select_kernel(problem(DType::bf16, 128), a, kHip).kind, KernelKind::generic)
        << a.name();
  const Selection rdna = select_kernel(problem(DType::bf16, 128), kGfx1100, kHip);
  EXPECT_EQ(rdna.kind, KernelKind::unsupported);
  EXPECT_NE(rdna.reason.find("MFMA"), std::string::npos) << rdna.reason;
}

TEST(Selector, Gfx950TakesTheDualwaveKernelWhereBuilt) {
  BuildCaps dw = kHip;
  dw.dualwave = true;
  for (int hd : {32, 64, 96, 128})
    for (bool lse : {false, true}) {
      Problem p = problem(DType::f16, hd);
      p.return_lse = lse;
      p.masked = lse;
      EXPECT_EQ(select_kernel(p, kGfx950, dw).kind, KernelKind::gfx950_dualwave) << hd;
    }
  Problem decode = problem(DType::bf16, 128);
  decode.query_rows = 1;  // no AMD decode kernel: dualwave takes decode shapes too
  EXPECT_EQ(select_kernel(decode, kGfx950, dw).kind, KernelKind::gfx950_dualwave);
  EXPECT_EQ(select_kernel(problem(DType::bf16, 256), kGfx950, dw).kind, KernelKind::generic);
  // Only gfx950 has the instructions; without the kernels built gfx950 runs generic.
  for (Arch a : {kGfx90a, kGfx942})
    EXPECT_EQ(select_kernel(problem(DType::bf16, 128), a, dw).kind, KernelKind::generic);
  EXPECT_EQ(select_kernel(problem(DType::bf16, 128), kGfx950, kHip).kind, KernelKind::generic);
  EXPECT_EQ(std::string(kernel_kind_name(KernelKind::gfx950_dualwave)), "gfx950_dualwave");
}

TEST(Selector, BuildWithoutKernelsForTheDevice) {
  const Selection none = select_kernel(problem(DType::bf16, 128), kSm90, kNone);
  EXPECT_EQ(none.kind, KernelKind::unsupported);
  EXPECT_NE(none.reason.find("HIPFLASH_GPU=cuda"), std::string::npos) << none.reason;
  const Selection wrong_vendor = select_kernel(problem(DType::bf16, 128), kGfx942, kCuda);
  EXPECT_EQ(wrong_vendor.kind, KernelKind::unsupported);
  EXPECT_NE(wrong_vendor.reason.find("HIPFLASH_GPU=hip"), std::string::npos) << wrong_vendor.reason;
}

TEST(Selector, HeadDimNotBuilt) {
  const BuildCaps only128{true, Arch::nvidia, 0b010};
  EXPECT_EQ(select_kernel(problem(DType::bf16, 96), kSm90, only128).kind, KernelKind::generic);
  const Selection s = select_kernel(problem(DType::bf16, 256), kSm90, only128);
  EXPECT_EQ(s.kind, KernelKind::unsupported);
  EXPECT_NE(s.reason.find("HIPFLASH_HEAD_DIMS"), std::string::npos) << s.reason;
}

TEST(Selector, UnsupportedHeadDimAndDtype) {
  const Selection d = select_kernel(problem(DType::bf16, 80), kSm90, kCuda);
  EXPECT_EQ(d.kind, KernelKind::unsupported);
  EXPECT_NE(d.reason.find("32, 64, 96, 128, 256"), std::string::npos) << d.reason;
  const Selection t = select_kernel(problem(DType::f32, 64), kHost, kNone);
  EXPECT_EQ(t.kind, KernelKind::unsupported);
  EXPECT_NE(t.reason.find("float32"), std::string::npos) << t.reason;
}

TEST(Selector, IsPure) {
  const Problem p = problem(DType::f16, 96, true, true, 4);
  const Selection a = select_kernel(p, kGfx950, kHip), b = select_kernel(p, kGfx950, kHip);
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.key.name(), b.key.name());
  EXPECT_EQ(a.reason, b.reason);
}

// ---- num_splits_heuristic ----------------------------------------------------------------------

TEST(SplitHeuristic, NoSplitWhenNothingToSplit) {
  EXPECT_EQ(num_splits_heuristic(0, 132, 1, 100), 1);     // no work
  EXPECT_EQ(num_splits_heuristic(10, 0, 1, 100), 1);      // no SMs (defensive)
  EXPECT_EQ(num_splits_heuristic(1, 132, 1, 1), 1);       // one key block
  EXPECT_EQ(num_splits_heuristic(1, 132, 1, 0), 1);       // Sk = 0
  EXPECT_EQ(num_splits_heuristic(132, 132, 1, 1000), 1);  // a full wave already
  EXPECT_EQ(num_splits_heuristic(106, 132, 1, 1000), 1);  // >= 80% of a wave
  EXPECT_EQ(num_splits_heuristic(212, 132, 2, 1000), 1);  // >= 80% of the resident slots
  EXPECT_EQ(num_splits_heuristic(100000, 132, 2, 1000), 1);
}

TEST(SplitHeuristic, SplitsSmallProblemsWithinBounds) {
  for (int64_t work : {1, 2, 3, 7, 16, 40, 100}) {
    for (int64_t sms : {2, 8, 108, 132, 304}) {
      for (int64_t per_sm : {1, 2}) {
        for (int64_t kb : {2, 5, 17, 64, 2000}) {
          for (int max_splits : {4, 128}) {
            const int s = num_splits_heuristic(work, sms, per_sm, kb, max_splits);
            EXPECT_GE(s, 1);
            EXPECT_LE(s, std::max<int64_t>(1, std::min<int64_t>({max_splits, kb / 4, sms * per_sm})));
            EXPECT_EQ(s, num_splits_heuristic(work, sms, per_sm, kb, max_splits));  // pure
            if (work * 10 >= sms * per_sm * 8) {
              EXPECT_EQ(s, 1);
            }
          }
        }
      }
    }
  }
}

// The heuristic's cost of s splits: rounds of the resident slots, each 1/s of an item long.
double rounds(int64_t work, int64_t slots, int s) {
  return double((work * s + slots - 1) / slots) / s;
}

TEST(SplitHeuristic, DecodeFillsTheResidentSlots) {
  // One work item on 132 SMs, plenty of key blocks: 128 splits (max_splits) in one round;
  // the fewest within 4% of that, 124.
  EXPECT_EQ(num_splits_heuristic(1, 132, 1, 1000), 124);
  // H200 decode, GQA 32/8 packed (8 items per sequence), two blocks per SM (264 slots):
  // B = 1 -> 32 (256 blocks; 33 would fill all 264, within 4%), B = 2 -> 16, 4 -> 8, 8 -> 4.
  EXPECT_EQ(num_splits_heuristic(8, 132, 2, 2048), 32);  // Sk = 128k
  EXPECT_EQ(num_splits_heuristic(16, 132, 2, 512), 16);
  EXPECT_EQ(num_splits_heuristic(32, 132, 2, 512), 8);
  EXPECT_EQ(num_splits_heuristic(64, 132, 2, 512), 4);
  // Sk = 4k (64 key blocks): at least four key blocks per split -> 16 (measured best there).
  EXPECT_EQ(num_splits_heuristic(8, 132, 2, 64), 16);
  // Three sequences (24 items): 11 splits fill the 264 slots exactly.
  EXPECT_EQ(num_splits_heuristic(24, 132, 2, 512), 11);
  EXPECT_DOUBLE_EQ(rounds(24, 264, 11), 1.0 / 11);
  // Limited by the key blocks: at least four per split.
  EXPECT_EQ(num_splits_heuristic(1, 132, 1, 7), 1);
  EXPECT_EQ(num_splits_heuristic(1, 132, 1, 8), 2);
  EXPECT_EQ(num_splits_heuristic(1, 132, 1, 64), 16);
  // A tiny problem (2 or 3 key blocks) stays whole: a split would cost more than it saves.
  EXPECT_EQ(num_splits_heuristic(16, 264, 2, 2), 1);
  EXPECT_EQ(num_splits_heuristic(16, 264, 2, 3), 1);
  // Limited by max_splits.
  EXPECT_EQ(num_splits_heuristic(1, 132, 1, 1000, 16), 16);
  // 2 CPU threads, one row: 2 splits.
  EXPECT_EQ(num_splits_heuristic(1, 2, 1, 16), 2);
}

TEST(SplitHeuristic, FewestSplitsWithinFourPercentOfTheBest) {
  for (int64_t work : {1, 3, 8, 24, 50, 100}) {
    for (int64_t sms : {8, 108, 132}) {
      const int64_t kb = 4000, slots = sms * 2;
      const int s = num_splits_heuristic(work, sms, 2, kb);
      if (work * 10 >= slots * 8) {  // most of the resident slots already
        EXPECT_EQ(s, 1);
        continue;
      }
      const int limit = int(std::min<int64_t>({128, kb / 4, slots}));
      double best = rounds(work, slots, 1);
      for (int other = 2; other <= limit; ++other) best = std::min(best, rounds(work, slots, other));
      EXPECT_LE(rounds(work, slots, s), 1.04 * best) << "work " << work << " sms " << sms;
      for (int other = 1; other < s; ++other)
        EXPECT_GT(rounds(work, slots, other), 1.04 * best) << "work " << work << " sms " << sms;
    }
  }
}


TEST(Selector, Fp8CallsWidenIntoContiguousBf16Copies) {
  // widened_fp8_params / widened_fp8_bytes (src/backend.hpp): the copies an fp8 call that no
  // fp8 kernel takes runs on — q, then k, then v, each contiguous and starting on 256 bytes —,
  // bf16, without descales; the rest of the call as it was.
  const float scale = 0.5f;
  FwdParams p;
  p.dtype = p.kv_dtype = DType::e4m3;
  p.out_dtype = DType::bf16;
  p.batch = 2, p.seqlen_q = 5, p.seqlen_k = 7, p.heads_q = 4, p.heads_kv = 2, p.head_dim = 72;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = 4096;  // the call's own strides: not kept
  p.q_descale = p.k_descale = p.v_descale = Descale{&scale, 0, 0};
  p.window_left = 3;
  char* const base = reinterpret_cast<char*>(uintptr_t(1) << 20);  // never dereferenced
  const size_t q_bytes = 5888, kv_bytes = 4096;  // 2 x 5 x 4 x 72 and 2 x 7 x 2 x 72, x 2 bytes
  EXPECT_EQ(widened_fp8_bytes(p), q_bytes + 2 * kv_bytes);
  FwdParams w = widened_fp8_params(p, base);
  EXPECT_EQ(w.q, base);
  EXPECT_EQ(w.k, base + q_bytes);
  EXPECT_EQ(w.v, base + q_bytes + kv_bytes);
  EXPECT_EQ(w.dtype, DType::bf16);
  EXPECT_EQ(w.kv_dtype, DType::bf16);
  EXPECT_EQ(w.out_dtype, DType::bf16);
  EXPECT_EQ(w.q_descale.ptr, nullptr);
  EXPECT_EQ(w.k_descale.ptr, nullptr);
  EXPECT_EQ(w.v_descale.ptr, nullptr);
  EXPECT_EQ(w.window_left, 3);
  EXPECT_EQ(w.q_head_stride, 72);
  EXPECT_EQ(w.q_row_stride, 288);
  EXPECT_EQ(w.q_batch_stride, 1440);
  for (int64_t s : {w.k_head_stride, w.v_head_stride}) EXPECT_EQ(s, 72);
  for (int64_t s : {w.k_row_stride, w.v_row_stride}) EXPECT_EQ(s, 144);
  for (int64_t s : {w.k_batch_stride, w.v_batch_stride}) EXPECT_EQ(s, 1008);
  EXPECT_EQ(widened_fp8_params(p, nullptr).k, nullptr);  // the layout alone (the selector's)
  // Varlen: the packed rows, batch strides 0.
  const int32_t cu[3] = {0, 4, 9};
  p.cu_seqlens_q = p.cu_seqlens_k = cu;
  p.total_q = 9, p.total_k = 13;
  w = widened_fp8_params(p, base);
  EXPECT_EQ(widened_fp8_bytes(p), size_t(5376 + 2 * 3840));  // 9 x 4 x 72, 13 x 2 x 72 (x 2)
  EXPECT_EQ(w.k, base + 5376);
  EXPECT_EQ(w.q_batch_stride, 0);
  EXPECT_EQ(w.k_batch_stride, 0);
  EXPECT_EQ(w.v_batch_stride, 0);
  EXPECT_EQ(w.q_row_stride, 288);
}

}  // namespace
}  // namespace hipflash
