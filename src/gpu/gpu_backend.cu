// hipflash — the GPU backend: device queries, the pre-launch checks that need the device, the
// decode GQA packing, the split-K workspace, and dispatch to the instantiated launchers.
#include <cstdlib>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "decode/decode_tile.hpp"
#include "gfx950/dualwave_schedule.hpp"
#include "sm90/tile.hpp"
#include "sm90_ws/tile.hpp"
#include "generic/tile_config.hpp"
#include "gpu/device_guard.hpp"
#include "gpu/launch_api.hpp"
#include "hipflash/detail/static_switch.hpp"

namespace hipflash::gpu {
namespace {

#if defined(HIPFLASH_PLATFORM_AMD)
constexpr Arch::Vendor kVendor = Arch::amd;
#else
constexpr Arch::Vendor kVendor = Arch::nvidia;
#endif

/// Whether this build has the kernels of a registry `build` (kernels.def).
constexpr bool built_here(KernelBuild build) {
  switch (build) {
    case KernelBuild::gpu: return true;
    case KernelBuild::cuda: return kVendor == Arch::nvidia;
#if defined(HIPFLASH_HAS_SM90_KERNELS)
    case KernelBuild::cuda_sm90a: return true;
#endif  // HIPFLASH_HAS_SM90_KERNELS
#if defined(HIPFLASH_HAS_DUALWAVE_KERNELS)
    case KernelBuild::hip_gfx950: return true;
#endif  // HIPFLASH_HAS_DUALWAVE_KERNELS
    default: return false;
  }
}

/// Stream-ordered scratch, freed on scope exit (after the kernels using it are enqueued).
struct ScratchBuffer {
  void* ptr = nullptr;
  port::stream_t stream;
  ScratchBuffer(size_t bytes, port::stream_t s) : stream(s) {
    port::check(port::malloc_async(&ptr, bytes, s), "allocating a workspace");
  }
  ~ScratchBuffer() {
    if (ptr) port::check_nothrow(port::free_async(ptr, stream), "freeing a workspace");
  }
};

/// GQA decode (Sq == 1, no window): the Hq/Hkv query heads that share a kv head become the
/// rows of one query block, so K/V are read once per kv head instead of once per query head.
/// Row r of kv head hk is query head hk * G + r; strides are rewritten, nothing is copied.
void pack_gqa_decode(FwdParams& p) {
  const int64_t groups = p.heads_q / p.heads_kv;
  p.gqa_packed_heads = groups;
  p.seqlen_q = groups;
  p.heads_q = p.heads_kv;
  p.q_row_stride = p.q_head_stride;
  p.q_head_stride *= groups;
  p.o_row_stride = p.o_head_stride;
  p.o_head_stride *= groups;
  if (p.lse) {
    p.lse_row_stride = p.lse_head_stride;
    p.lse_head_stride *= groups;
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

/// `need` bytes of scratch for a call (`what` names it in errors): the caller's buffer when it
/// is large enough, else the caller's allocator, else a stream-ordered allocation that
/// `scratch` frees on scope exit (after the kernels using it are enqueued). 16-byte aligned.
void* acquire_workspace(const Workspace& ws, size_t need, port::stream_t stream,
                        std::unique_ptr<ScratchBuffer>& scratch, const char* what) {
  void* base = ws.data;
  if (base == nullptr || ws.bytes < need) {
    if (ws.allocate) {
      base = ws.allocate(need);
      HIPFLASH_CHECK_AS(runtime_error, base != nullptr,
                        "the workspace allocator returned no memory for ", need, " bytes");
    } else {
      scratch = std::make_unique<ScratchBuffer>(need, stream);
      base = scratch->ptr;
    }
  }
  HIPFLASH_CHECK(aligned16(base), what, " must be 16-byte aligned");
  return base;
}

}  // namespace

BuildCaps build_caps() {
  // Fixed for the process: the environment is read once, at the first call.
  static const BuildCaps caps = [] {
    BuildCaps c;
    c.gpu = true;
    c.gpu_vendor = kVendor;
    c.head_dim_mask = HIPFLASH_HEAD_DIM_MASK;
#if defined(HIPFLASH_HAS_SM90_KERNELS)
    // HIPFLASH_DISABLE_SM90=1 hides them, so that Hopper runs (and tests) the generic kernel.
    const char* off = std::getenv("HIPFLASH_DISABLE_SM90");
    c.sm90 = !(off && off[0] == '1');
    // HIPFLASH_DISABLE_SM90_WS=1 hides only the warp-specialised kernel (tests the cp.async one).
    const char* ws_off = std::getenv("HIPFLASH_DISABLE_SM90_WS");
    c.sm90_ws = c.sm90 && !(ws_off && ws_off[0] == '1');
#endif  // HIPFLASH_HAS_SM90_KERNELS
#if defined(HIPFLASH_PLATFORM_NVIDIA)
    // The head-group decode kernel takes the packed GQA decode calls where the H200 measured
    // it ahead (the selector's kDecodeHeadsMin*); HIPFLASH_DECODE_HEADS=0 gives them all to the
    // decode kernel, =1 every call it can run to it (tests, A/B runs).
    const char* heads = std::getenv("HIPFLASH_DECODE_HEADS");
    c.decode_heads = !heads || !heads[0] ? HeadGroupDecode::measured
                     : heads[0] == '1'   ? HeadGroupDecode::always
                                         : HeadGroupDecode::off;
#endif  // HIPFLASH_PLATFORM_NVIDIA
#if defined(HIPFLASH_HAS_DUALWAVE_KERNELS)
    // HIPFLASH_DISABLE_DUALWAVE=1 hides them, so that gfx950 runs the generic kernel.
    const char* dw_off = std::getenv("HIPFLASH_DISABLE_DUALWAVE");
    c.dualwave = !(dw_off && dw_off[0] == '1');
#endif  // HIPFLASH_HAS_DUALWAVE_KERNELS
    return c;
  }();
  return caps;
}

std::string build_info() {
  std::string s = std::string("cpu+") + HIPFLASH_GPU_NAME + " (head-dim mask " +
                  std::to_string(HIPFLASH_HEAD_DIM_MASK);
#if defined(HIPFLASH_HAS_SM90_KERNELS)
  s += ", sm90 kernels";
#endif  // HIPFLASH_HAS_SM90_KERNELS
#if defined(HIPFLASH_HAS_DUALWAVE_KERNELS)
  s += ", gfx950 dualwave kernels";
#endif  // HIPFLASH_HAS_DUALWAVE_KERNELS
  return s + ")";
}

Arch device_arch(int device) {
  static std::mutex mu;
  static std::vector<Arch> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (device >= 0 && device < int(cache.size()) && cache[device].vendor != Arch::host)
    return cache[device];
  int count = 0;
  port::check(port::device_count(&count), "counting GPUs");
  HIPFLASH_CHECK_AS(runtime_error, device >= 0 && device < count, "GPU ", device,
                    " does not exist (", count, " visible)");
  Arch a;
  a.vendor = kVendor;
#if defined(HIPFLASH_PLATFORM_AMD)
  hipDeviceProp_t prop;
  port::check(hipGetDeviceProperties(&prop, device), "querying the GPU");
  a.version = int(std::strtol(prop.gcnArchName + 3, nullptr, 16));  // "gfx90a:sramecc+..."
  a.num_sms = prop.multiProcessorCount;
#else
  cudaDeviceProp prop;
  port::check(cudaGetDeviceProperties(&prop, device), "querying the GPU");
  a.version = prop.major * 10 + prop.minor;
  a.num_sms = prop.multiProcessorCount;
  {
    // The code this build runs here (the KV-cache append kernel stands for every TU: one arch
    // list): sm_89+ machine code has the e4m3 conversions an fp8 KV cache needs.
    ScopedDevice guard(device);
    a.fp8_cvt = kvcache_append_code_version() >= kFp8KvMinSm;
  }
#endif
  if (int(cache.size()) <= device) cache.resize(size_t(device) + 1);
  cache[device] = a;
  return a;
}

int pointer_device(const void* ptr) { return port::pointer_device(ptr); }

void copy_to_host(void* dst, const void* src, size_t bytes, Stream stream) {
  port::check(port::memcpy_d2h(dst, src, bytes, static_cast<port::stream_t>(stream)),
              "copying cu_seqlens to the host");
}

bool stream_capturing(Stream stream) {
  return port::stream_capturing(static_cast<port::stream_t>(stream));
}

template <class Tile>
TileShape shape_of(int blocks_per_sm) {
  return TileShape{Tile::kBlockM, Tile::kBlockN, blocks_per_sm};
}

TileShape tile_shape(KernelKind kind, int hd, bool masked) {
  HIPFLASH_CHECK(head_dim_bit(hd) >= 0 && hd <= max_head_dim(kind), "no ", kernel_kind_name(kind),
                 " kernel tile for padded head dim ", hd);
  // Each kind's tile at the padded head dim (a kind's tiles exist up to its max_head_dim).
  return HIPFLASH_HEADDIM_SWITCH(hd, kHD, [&]() -> TileShape {
    const auto has = [&](KernelKind k) { return kind == k && kHD <= max_head_dim(k); };
#if defined(HIPFLASH_PLATFORM_NVIDIA)
    if constexpr (kHD <= max_head_dim(KernelKind::sm90)) {
      if (has(KernelKind::sm90)) return shape_of<sm90::Tile<kHD>>(sm90::Tile<kHD>::kMinBlocks);
    }
    if constexpr (kHD <= max_head_dim(KernelKind::sm90_ws)) {
      if (has(KernelKind::sm90_ws)) {  // masked tiles may differ (square at hd64 and hd128)
        using Masked = sm90_ws::Tile<kHD, true>;
        using Dense = sm90_ws::Tile<kHD, false>;
        // The fp8 tiles (split counts are sized by these shapes for fp8 calls too) match them.
        if constexpr (kHD <= fp8_max_head_dim(KernelKind::sm90_ws)) {
          using Masked8 = sm90_ws::Tile<kHD, true, false, true>;
          using Dense8 = sm90_ws::Tile<kHD, false, false, true>;
          static_assert(Masked8::kBlockM == Masked::kBlockM && Masked8::kBlockN == Masked::kBlockN &&
                            Dense8::kBlockM == Dense::kBlockM && Dense8::kBlockN == Dense::kBlockN,
                        "fp8 and 16-bit sm90_ws tiles of one shape");
        }
        return masked ? shape_of<Masked>(Masked::kMinBlocks) : shape_of<Dense>(Dense::kMinBlocks);
      }
    }
    if constexpr (kHD <= max_head_dim(KernelKind::decode)) {
      // Resident blocks per SM the split counts are sized for: two up to hd128 (the rings there
      // would let more fit; the counts were measured with two), one at hd256 (its ring: 228 KiB
      // per SM on sm_90).
      if (has(KernelKind::decode)) return shape_of<decode::DecodeTile<kHD>>(kHD <= 128 ? 2 : 1);
    }
    if constexpr (kHD <= max_head_dim(KernelKind::decode_heads)) {
      if (has(KernelKind::decode_heads)) {
        using Tile = decode::DecodeHeadsTile<kHD>;
        TileShape s = shape_of<Tile>(Tile::kMinBlocks);
        s.heads_per_block = Tile::kHeads;
        s.split_block_n = decode::DecodeTile<kHD>::kBlockN;  // the decode kernel's 64
        return s;
      }
    }
#endif  // HIPFLASH_PLATFORM_NVIDIA
#if defined(HIPFLASH_HAS_DUALWAVE_KERNELS)
    if constexpr (kHD <= max_head_dim(KernelKind::gfx950_dualwave)) {
      // One 512-thread block per CU.
      if (has(KernelKind::gfx950_dualwave)) return shape_of<gfx950::DualwaveTile<kHD>>(1);
    }
#endif  // HIPFLASH_HAS_DUALWAVE_KERNELS
    return shape_of<generic::Tile<kHD>>(1);
  });
}

/// The kernels move 16-byte vectors: every operand's base pointer and strides must keep that
/// alignment (checked before any launch); `elem_bytes`: bytes an element of the operand.
void check_vector_alignment(const void* ptr, int64_t batch_stride, int64_t row_stride,
                            int64_t head_stride, const char* name, int64_t elem_bytes) {
  HIPFLASH_CHECK(aligned16(ptr), name, " must be 16-byte aligned for the GPU kernels");
  for (int64_t s : {batch_stride, row_stride, head_stride})
    HIPFLASH_CHECK(s * elem_bytes % 16 == 0, name, " strides must be multiples of ",
                   16 / elem_bytes, " elements (16 bytes) for the GPU kernels, got ", s);
}

void check_operand_alignment(const FwdParams& p) {
  const int64_t kv_bytes = dtype_size(p.kv_dtype);
  check_vector_alignment(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, "q",
                         dtype_size(p.dtype));
  check_vector_alignment(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, "k", kv_bytes);
  check_vector_alignment(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, "v", kv_bytes);
  check_vector_alignment(p.out, p.o_batch_stride, p.o_row_stride, p.o_head_stride, "out", 2);
}

namespace {
thread_local bool t_long_row_tile = false;  // set by the sm90_ws launcher for run_forward
}  // namespace
void note_long_row_tile() { t_long_row_tile = true; }

/// Launches kernel `kind` at Traits: one case per kernel of the registry, its launcher where
/// this build has it, it has a tile for the head dim and, for an fp8 KV cache, it reads one on
/// this vendor (NVIDIA: CMake writes the _kv8 instantiations for CUDA builds only; AMD reads no
/// KV cache yet). False where it has not.
template <class Traits>
bool launch_registered(KernelKind kind, const FwdParams& p, port::stream_t stream) {
  constexpr int kHD = Traits::kHeadDim;
  constexpr bool kFp8Kv = Traits::kKvDType != Traits::kDType;
  constexpr bool kFp8KvHere = kVendor == Arch::nvidia;
  constexpr bool kFp8 = Traits::kDType == DType::e4m3;  // fp8 q, k and v
  switch (kind) {
#define HIPFLASH_HEAD_DIM(padded, also)
#define HIPFLASH_KERNEL(kind, launcher, build, max_hd, kv_cache, fp8_hd, summary)          \
  case KernelKind::kind:                                                                    \
    if constexpr (built_here(KernelBuild::build) && kHD <= max_hd &&                        \
                  (!kFp8Kv || (kFp8KvHere &&                                               \
                               KvCacheReads::kv_cache == KvCacheReads::cache_fp8)) &&       \
                  (!kFp8 || kHD <= fp8_hd)) {                                               \
      launch_##launcher##_fwd<Traits>(p, stream);                                           \
      return true;                                                                          \
    }                                                                                       \
    return false;
#include "hipflash/detail/kernels.def"
#undef HIPFLASH_KERNEL
#undef HIPFLASH_HEAD_DIM
    default:
      return false;
  }
}

Launched run_forward(const FwdParams& params, const Selection& sel, int device,
                     Stream stream_arg, Workspace ws) {
  auto stream = static_cast<port::stream_t>(stream_arg);
  t_long_row_tile = false;
  FwdParams p = params;
  check_operand_alignment(p);

  ScopedDevice guard(device);
  const int hd = sel.key.head_dim;
  // One workspace: the split-K partials, then (fp8 on widened copies) the bf16 copies.
  const size_t widen_bytes = sel.widened_fp8 ? widened_fp8_bytes(p) : 0;
  const size_t split_bytes = widen_bytes > 0 ? (splitk_workspace_bytes(p) + 255) / 256 * 256
                                             : splitk_workspace_bytes(p);
  std::unique_ptr<ScratchBuffer> scratch;
  char* base = nullptr;
  if (split_bytes + widen_bytes > 0)
    base = static_cast<char*>(acquire_workspace(ws, split_bytes + widen_bytes, stream, scratch,
                                                "the forward's workspace"));
  if (sel.widened_fp8) p = widen_fp8_operands(p, base + split_bytes, stream);
  if (p.packs_gqa_decode()) pack_gqa_decode(p);
  if (p.num_splits > 1) {
    const size_t rows = splitk_workspace_bytes(p) /
                        (size_t(hd) * sizeof(float) + sizeof(detail::SoftmaxState));
    p.out_partial = reinterpret_cast<float*>(base);
    p.state_partial = reinterpret_cast<detail::SoftmaxState*>(p.out_partial + rows * size_t(hd));
  }
  // A kernel kind the selector chose that this build or head dim does not have.
  const auto not_built = [&] {
    return not_implemented(std::string("kernel kind ") + kernel_kind_name(sel.kind) +
                           " is not built for " + HIPFLASH_GPU_NAME + " at head dim " +
                           std::to_string(hd));
  };
  HIPFLASH_INPUT_DTYPE_SWITCH(p.dtype, kDT, [&] {
    HIPFLASH_HEADDIM_SWITCH(int(p.head_dim), kHD, [&] {
      HIPFLASH_BOOL_SWITCH(p.num_splits > 1, kSplit, [&] {
        HIPFLASH_BOOL_SWITCH(p.has_window(), kMasked, [&] {
          HIPFLASH_BOOL_SWITCH(p.return_lse && !kSplit, kReturnLse, [&] {
            HIPFLASH_BOOL_SWITCH(p.kv_dtype == DType::e4m3, kFp8Kv, [&] {
              if constexpr (head_dim_in_mask(HIPFLASH_HEAD_DIM_MASK, kHD)) {
                constexpr DType kKv = kFp8Kv ? DType::e4m3 : kDT;
                using Traits = FwdTraits<kDT, kHD, kReturnLse, kMasked, kSplit, kKv>;
                if (!launch_registered<Traits>(sel.kind, p, stream)) throw not_built();
              } else {
                throw not_implemented("head dim kernel hd" + std::to_string(kHD) +
                                      " was not built");
              }
            });
          });
        });
      });
    });
  });
  if (p.num_splits > 1) launch_combine(p, hd, stream);
  run_seqused_rows(p, device, stream);  // after the launches that may still refuse the call
  return Launched{t_long_row_tile};
}

void run_backward(const BwdParams& params, int device, Stream stream_arg, Workspace ws,
                  int64_t total_q, int64_t total_k, bool zero_q, bool zero_k) {
  auto stream = static_cast<port::stream_t>(stream_arg);
  BwdParams p = params;
  check_operand_alignment(p);
  check_vector_alignment(p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride, "dout", 2);
  check_vector_alignment(p.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, "dq", 2);
  check_vector_alignment(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, "dk", 2);
  check_vector_alignment(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, "dv", 2);
  const int hd = padded_head_dim(int(p.head_dim));
  HIPFLASH_CHECK_AS(not_implemented, head_dim_in_mask(HIPFLASH_HEAD_DIM_MASK, hd),
                    "head dim kernel hd", hd, " was not built");
  // The portable kernels on AMD (the matrix-core backward is NVIDIA's mma.sync today), for a
  // softcap or ALiBi where the warp-specialised dk/dv pass does not take them
  // (bwd_score_mods_on_ws; the portable kernels' fp32 FMAs: a correct backward, not a fast one)
  // and, with HIPFLASH_BWD_PORTABLE=1, on NVIDIA too (for the tests). They are deterministic.
  static const bool portable_always = [] {
    if (kVendor == Arch::amd) return true;
    const char* e = std::getenv("HIPFLASH_BWD_PORTABLE");
    return e != nullptr && e[0] == '1';
  }();
  HIPFLASH_CHECK_AS(not_implemented,
                    kVendor != Arch::amd || !p.has_score_mods(),
                    "the softcap's and ALiBi's backward run on the CPU and NVIDIA GPUs; AMD GPUs "
                    "refuse them (as their forward does)");
  p.total_q = total_q;  // varlen: the tensors' rows (the maps' rows, FwdParams::map_rows_q)
  p.total_k = total_k;
  BwdLaunch how;
  how.zero_q = zero_q;
  how.zero_k = zero_k;
  // The wgmma dk/dv pass where it was built (sm_90a) and the device is Hopper; the switch that
  // hides the sm90 forward kernels (HIPFLASH_DISABLE_SM90=1) hides it too.
  const bool sm90 = !portable_always && build_caps().sm90 && hd <= kBwdSm90MaxHeadDim &&
                    device_arch(device).version == 90;
  const bool score_mods = p.has_score_mods();
  const bool portable =
      portable_always || (score_mods && !bwd_score_mods_on_ws(p, sm90 && sm90_ws_ok(p)));
  if (portable) p.deterministic = true;
  how.portable = portable;
  how.sm90 = !portable && sm90;

  // Workspace: lse_log2 and delta [B, Hq, rows], dq_accum [B, Hq, rows, hd] where the dk/dv pass
  // adds dq (atomic; deterministic on Hopper, where the warp-specialised pass may order it:
  // launch_bwd drops it where that pass does not run), dkv_accum (below), then dq_semaphore
  // [B, Hq, rows / 64] and, masked, the pass's tile counter (ordered);
  // rows padded to 128 (every tile's row block stays inside).
  p.seqlen_rounded = (p.seqlen_q + 127) / 128 * 128;
  p.padded_head_dim = hd;
  const bool accum = !p.deterministic || how.sm90;
  const bool ordered = p.deterministic && how.sm90;
  const size_t rows = size_t(p.batch) * size_t(p.heads_q) * size_t(p.seqlen_rounded);
  // Masked or varlen: the tile counter.
  const bool counted = ordered && (p.has_window() || p.is_varlen()) && rows > 0;
  // dkv_accum [2, slices, B, Hkv, keys padded to 128, hd] after dq_accum where the
  // warp-specialised pass's tiles take slices of a kv head's query heads (bwd_heads_per_tile).
  const int64_t key_blocks = (p.seqlen_k + kBwdSm90WsBlockN - 1) / kBwdSm90WsBlockN;
  if (how.sm90)
    p.heads_per_tile = int(bwd_heads_per_tile(
        key_blocks * p.heads_kv * p.batch, p.heads_q / p.heads_kv, device_arch(device).num_sms,
        p.has_window(), p.is_varlen()));
  p.seqlen_k_rounded = p.heads_per_tile > 0 ? key_blocks * kBwdSm90WsBlockN : 0;
  const size_t dkv_floats = size_t(2 * p.dkv_slices() * p.dkv_part());
  const size_t need = rows * sizeof(float) * (2 + (accum ? size_t(hd) : 0)) +
                      dkv_floats * sizeof(float) + (ordered ? rows / 64 * sizeof(int32_t) : 0) +
                      (counted ? sizeof(int32_t) : 0);
  ScopedDevice guard(device);
  std::unique_ptr<ScratchBuffer> scratch;
  void* base = ws.data;  // an empty problem needs none (and must not ask the allocator)
  if (need > 0)
    base = acquire_workspace(ws, need, stream, scratch, "the backward's workspace");
  else
    HIPFLASH_CHECK(aligned16(base), "the backward's workspace must be 16-byte aligned");
  p.lse_log2 = static_cast<float*>(base);
  p.delta = p.lse_log2 + rows;
  p.dq_accum = accum ? p.delta + rows : nullptr;
  p.dkv_accum = dkv_floats > 0 ? p.dq_accum + rows * hd : nullptr;
  p.dq_semaphore =
      ordered ? reinterpret_cast<int32_t*>(p.dq_accum + rows * hd + dkv_floats) : nullptr;
  p.tile_counter = counted ? p.dq_semaphore + rows / 64 : nullptr;
  HIPFLASH_DTYPE_SWITCH(p.dtype, kDT, [&] {
    HIPFLASH_HEADDIM_SWITCH(int(p.head_dim), kHD, [&] {
      HIPFLASH_BOOL_SWITCH(p.has_window(), kMasked, [&] {
        if constexpr (head_dim_in_mask(HIPFLASH_HEAD_DIM_MASK, kHD))
          launch_bwd<BwdTraits<kDT, kHD, kMasked>>(p, how, stream);
      });
    });
  });
}

}  // namespace hipflash::gpu
