// hipflash — the pure kernel selector: (problem, arch, what was built) -> which kernel.
// No device calls, no globals: testable on a machine without a GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "hipflash/detail/kernel_registry.hpp"
#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/params.hpp"  // kDecodeMaxRows
#include "hipflash/types.hpp"

namespace hipflash {

/// Whether a TMA tensor map can hold a dimension of `extent` at `stride` elements of `bytes`
/// bytes: a size-1 dimension's stride is never used; any other must be positive, a multiple of
/// 16 bytes and below 2^40 bytes.
constexpr bool tma_stride_ok(int64_t stride, int64_t extent, int64_t bytes) {
  return extent == 1 ||
         (stride > 0 && (stride * bytes) % 16 == 0 && stride * bytes < (int64_t(1) << 40));
}
/// The same for the three strided dimensions (row, head, batch) of one [batch, rows, heads, D]
/// tensor: the 4-d map (head dim, row, head, batch) of the sm90_ws kernel.
constexpr bool tma_strides_ok(int64_t bytes, int64_t rows, int64_t row_stride, int64_t heads,
                              int64_t head_stride, int64_t batch, int64_t batch_stride) {
  return tma_stride_ok(row_stride, rows, bytes) && tma_stride_ok(head_stride, heads, bytes) &&
         tma_stride_ok(batch_stride, batch, bytes);
}

/// The device a call runs on. `version`: NVIDIA compute capability * 10 (80, 90) or AMD gfx
/// id as hex digits (0x90a, 0x940, 0x942, 0x950).
struct Arch {
  enum Vendor : int { host = 0, nvidia = 1, amd = 2 } vendor = host;
  int version = 0;
  int num_sms = 1;  ///< multiprocessors / compute units (the split heuristic uses it)
  /// NVIDIA: the code this build runs on the device is sm_89+ machine code (e4m3 conversions:
  /// an fp8 KV cache); an sm_89 device running a build's sm_80 code, or a newer one JIT-compiling
  /// its compute_80 PTX, has not (gpu::device_arch asks the driver).
  bool fp8_cvt = false;
  std::string name() const;
};

// KernelKind, kernel_kind_name, max_head_dim and padded_head_dim: the kernel registry's
// (hipflash/detail/kernel_registry.hpp, from kernels.def).

/// The same for the wgmma (sm90) backward's dk/dv pass; larger head dims take mma.sync's.
inline constexpr int kBwdSm90MaxHeadDim = 128;
/// Keys a tile of the warp-specialised (sm90_ws) dk/dv pass (bwd::DkdvSm90WsTile::kBlockN).
inline constexpr int kBwdSm90WsBlockN = 128;
/// Tiles a multiprocessor below which a masked dk/dv pass runs its tiles heaviest first
/// (src/gpu/bwd_launch.hpp) and a GQA one splits a kv head's query heads over more tiles.
inline constexpr int64_t kBwdMinTilesPerSm = 4;

/// The query heads a tile of the warp-specialised dk/dv pass walks (0: all Hq / Hkv = `group`
/// of its kv head): a masked dense GQA call with fewer than kBwdMinTilesPerSm tiles a
/// multiprocessor (`tiles` whole-group ones) takes the fewest slices of the group that reach
/// it, if they stay within twice that (else the most that stay below it: the slices' fp32 dK /
/// dV parts are workspace, 1 KiB a key per slice at hd128), the parts summed after the pass in a
/// fixed order. Whole groups ran those tiles heaviest first across every kv head at once, each
/// reading all of its group's Q and dO: more than L2 holds (GQA 8 causal hd128 at S = 2k, H100:
/// 0.83x the dense call's TFLOP/s; 4 slices: 0.97x; a head a tile: level at GQA 8, -8% at GQA
/// 4 hd64).
constexpr int64_t bwd_heads_per_tile(int64_t tiles, int64_t group, int num_sms, bool masked,
                                     bool varlen) {
  if (!masked || varlen || group <= 1) return 0;
  const int64_t target = kBwdMinTilesPerSm * num_sms;
  int64_t below = 1;  // the most slices that stay below the target
  for (int64_t slices = 1; slices <= group; ++slices) {
    if (group % slices != 0) continue;
    if (tiles * slices >= target) {
      if (tiles * slices <= 2 * target) below = slices;
      break;
    }
    below = slices;
  }
  return below == 1 ? 0 : group / below;
}

/// The heads a deterministic masked dk/dv pass walks side by side (bwd::KeyBlock's
/// kFastestLastFirst): key block j + 1 of each before any one's j. A head's j adds each row
/// block's dq after its j + 1, which reaches the row block kBlockN / kBlockM steps earlier in its
/// walk when both start together: one step at head dim 64 (128-row steps), less than the
/// handoff's latency (bulk reduction performed, counter released, seen), so one head at a time
/// each link waited (the dQ writer waiting 40-48% of its time at dense 2k and varlen causal hd64,
/// H100 tile trace). A causal tile is about key_blocks / 2 of those steps (varlen: the caller
/// passes the mean sequence's key blocks; the longest's overstated the others' and gave too few
/// heads), so 2 x SMs / key_blocks takes start j a step later:
/// two steps' lead, as head dim 128's 64-row steps have by themselves — there side by side only
/// lost L2 sharing (+8-12% deterministic backward time, H100). At most 16 heads; 1 elsewhere.
/// A GQA tile walks `heads_walked` query heads of its kv head in turn (each a key block's rows):
/// its length is key_blocks x heads_walked steps, and each unit holds that many heads' Q, dO and
/// dq rows in L2 (16 units of 4 heads at S = 2k: 64 MB).
constexpr int64_t bwd_heads_side_by_side(int64_t key_blocks, int num_sms, int head_dim,
                                         bool deterministic, bool masked,
                                         int64_t heads_walked = 1) {
  if (!deterministic || !masked || head_dim > 64 || key_blocks <= 0 || heads_walked <= 0)
    return 1;
  const int64_t steps = key_blocks * heads_walked;
  const int64_t heads = (2 * int64_t(num_sms) + steps - 1) / steps;
  return heads < 1 ? 1 : heads > 16 ? 16 : heads;
}

/// What the caller asks for, already validated.
struct Problem {
  DType dtype = DType::bf16;
  int head_dim = 128;
  bool return_lse = false;
  bool masked = false;  ///< causal or a bounded window
  bool varlen = false;
  /// q, k and v are dense tensors a TMA tensor map can describe (tma_describable in
  /// src/forward.cpp, by tma_strides_ok).
  bool tma_compatible = false;
  /// K/V come from a KV cache (flash_attn_with_kvcache: per-sequence key counts, maybe a block
  /// table of pages). Only the loaders of the NVIDIA decode and generic kernels read one (a
  /// paged instantiation through common::PagedRows); the sm90 kernels address K/V themselves and
  /// the AMD kernels not at all yet.
  bool kv_cache = false;
  /// k and v: dtype, or e4m3 for an fp8 KV cache (read by the kernels whose registry entry says
  /// cache_fp8: the decode kernel, on sm_89 and newer, whose cvt turns e4m3 pairs into f16).
  DType kv_dtype = DType::bf16;
  int num_splits = 1;   ///< resolved (>= 1)
  /// Query rows per (batch, head) as the kernel sees them: Sq (max_seqlen_q for varlen), or
  /// Hq / Hkv for GQA decode, whose query heads are packed into the rows of one block.
  int64_t query_rows = 128;
  /// Varlen: the mean query rows of a sequence (total_q / batch; the packed rows the kernels
  /// walk in tiles sized for the longest), 0 for dense calls.
  int64_t mean_query_rows = 0;
  /// GQA decode whose query heads the GPU launcher packs into query rows (FwdParams::
  /// packs_gqa_decode: one query row, no window, not varlen, Hq > Hkv).
  bool gqa_decode = false;
  int64_t heads_kv = 1;  ///< kv heads (the head-group decode kernel's groups)
  int64_t batch = 1;
  int64_t keys = 0;  ///< seqlen_k (a KV cache's capacity)
  /// The kv heads of a key row lie within the row, for K and V alike (head strides below the
  /// row strides): [B, Sk, Hkv, D] tensors and row-major ("NHD") pages, where a key row of every
  /// head is one run of memory; not a head-major cache ([B, Hkv, Sk, D], "HND" pages) passed
  /// as a view.
  bool kv_heads_in_rows = true;
  bool alibi = false;  ///< ALiBi slopes (the fp8 kernels add no bias)
  /// fp8 q, k and v (not a KV cache): the same call on contiguous bf16 copies of them
  /// (make_problem; src/backend.hpp's widened_fp8_params), which the bf16 kernels take where no
  /// fp8 kernel does. nullptr otherwise.
  std::shared_ptr<const Problem> widened;
};

/// Varlen at head dim 64 takes the TMA kernel (sm90_ws) from this mean sequence length on, the
/// cp.async wgmma kernel below it (H100, varlen suite, 16k tokens, 32 heads; the cp.async
/// kernel's 64-row blocks, several resident a multiprocessor, against the persistent 128-row
/// tiles, about half of whose (query block, head, sequence) tiles lie past a short sequence's
/// end and each of whose sequences ends inside a key block: docs/design-decisions.md#varlen-
/// on-the-tma-kernel): at a mean of 264 rows (16..512) sm90_ws ran at 0.78x / 0.73x the
/// cp.async kernel (causal), at 1638 (128..4k) 1.23x / 1.11x; hd128 gained at both (1.06x /
/// 1.16x, 1.49x / 1.44x). The threshold lies between the two measured means.
inline constexpr int64_t kWsVarlenHd64MinMeanRows = 512;

/// The first NVIDIA arch with the e4m3 conversions the fp8 KV cache's decode kernel uses.
inline constexpr int kFp8KvMinSm = 89;

/// Packed GQA decode with at least this many kv heads may take the head-group decode kernel
/// (its block: eight kv heads, a warp each; with fewer, warps would compute on zeros).
inline constexpr int64_t kDecodeHeadsPerBlock = 8;

/// Where the head-group decode kernel is ahead of the decode kernel (H200, hd128, GQA 32/8, the
/// decode kernel on its two-stage ring; docs/design-decisions.md#head-group-kernel):
/// its blocks each read a batch's kv heads for a long key range, so it needs both many such
/// ranges and long ones. At 32 head groups x batches it gains 0.5% at 128k keys, is level at
/// 64k and loses 0.6% at 32k and 2.6-3.4% at 16k and below; at 8 it loses 0.2-1.5% from 32k to
/// 128k; at 1 (B = 1) the many short splits and their combine lose 5-45% everywhere. It reads
/// a block's kv heads as whole key rows, which only a row-major cache has (Problem::
/// kv_heads_in_rows): on a head-major one ([B, Hkv, Sk, D] views) the decode kernel, one
/// contiguous run per (batch, kv head), read 1.0% faster at B = 32, 128k keys (H200, one dense
/// cell; head-major pages and larger calls follow the same rule unmeasured), so such calls keep it.
inline constexpr int64_t kDecodeHeadsMinTiles = 32;      ///< batch x head groups
inline constexpr int64_t kDecodeHeadsMinKeys = 131072;

/// Which packed GQA decode calls the head-group decode kernel takes (CUDA builds).
enum class HeadGroupDecode : uint8_t {
  off,       ///< none (HIPFLASH_DECODE_HEADS=0; builds without it)
  measured,  ///< where the H200 measured it ahead (kDecodeHeadsMin*, hd128): the default
  always,    ///< every call it can run (HIPFLASH_DECODE_HEADS=1: tests and A/B runs)
};

/// What this build contains (from CMake options).
struct BuildCaps {
  bool gpu = false;             ///< built with GPU kernels
  Arch::Vendor gpu_vendor = Arch::host;
  unsigned head_dim_mask = ~0u;  ///< bit head_dim_bit(padded) set: that padded head dim built
  bool sm90 = false;             ///< the sm90 kernels were built (CUDA with sm_90a)
  bool sm90_ws = false;          ///< the warp-specialised sm90 kernels were built (same)
  bool dualwave = false;         ///< the gfx950 dualwave kernels were built (HIP with gfx950)
  /// Where the head-group decode kernel takes packed GQA decode calls (CUDA builds: measured
  /// by default; HIPFLASH_DECODE_HEADS=0 off, =1 always).
  HeadGroupDecode decode_heads = HeadGroupDecode::off;
};

struct Selection {
  KernelKind kind = KernelKind::unsupported;
  KernelKey key{};
  std::string reason;  ///< why unsupported (empty otherwise)
  /// An fp8 call that no fp8 kernel takes, run by `kind` (a bf16 kernel) on bf16 copies of q,
  /// k and v (Problem::widened; the launcher widens them first).
  bool widened_fp8 = false;
};

/// Pure: same inputs, same answer.
Selection select_kernel(const Problem& p, const Arch& arch, const BuildCaps& caps);

/// The split-count heuristic for num_splits = 0 (pure): split the (batch * heads * query-block)
/// work items' keys over the resident slots (`num_processors` x `blocks_per_processor`) in the
/// least time (rounds of the slots x split length), the fewest splits within 4% of that, never
/// fewer than four key blocks per split.
int num_splits_heuristic(int64_t work_items, int64_t num_processors, int64_t blocks_per_processor,
                         int64_t num_key_blocks, int max_splits = 128);

}  // namespace hipflash
