// hipflash — the launch every forward kernel shares (internal): per-kernel launch traits
// (tile, scheduler, kernel, name, host-side argument preparation) drive one generic path — the
// grid of work tiles (query block, split, head, batch) that BlockInfo decodes, its size check,
// the kernel's dynamic shared memory (set once per device), and error checks naming the kernel.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "backend.hpp"  // device_arch
#include "common/kv_source.hpp"  // KvRows
#include "gpu/device_guard.hpp"
#include "gpu/launch_api.hpp"
#include "hipflash/kvcache.hpp"  // grouped_page_size

namespace hipflash::gpu {

/// Sets kKernel's dynamic shared-memory limit on the current device, once per device: the
/// attribute belongs to the function on each device, so a process that uses two GPUs must set
/// it on both (a per-process flag would leave the second one at the 48 KiB default).
template <auto kKernel>
void set_smem_once_per_device(int bytes, const char* name) {
  static PerDeviceBit done;
  int device = 0;
  port::check(port::get_device(&device), "querying the current device");
  done.get(device, [&] {
    port::check(port::set_max_dynamic_smem(kKernel, bytes),
                (std::string("setting the ") + name + " kernel's shared-memory size").c_str());
    return true;
  });
}

/// Heads one work tile covers: Tile::kHeads where the tile has it (the head-group decode
/// kernel: every kv head of a batch), else one.
template <class Tile, class = void>
struct HeadsPerTile : std::integral_constant<int, 1> {};
template <class Tile>
struct HeadsPerTile<Tile, std::void_t<decltype(Tile::kHeads)>>
    : std::integral_constant<int, Tile::kHeads> {};

/// The one launch path of the forward kernels. `Launch` is a kernel's launch traits:
///   Tile       kBlockM (query rows per work tile), kThreads, kSmemBytes (dynamic shared memory),
///              optionally kHeads (heads per work tile, HeadsPerTile; else one)
///   Scheduler  the map from the grid to work tiles (kernels/common/scheduler.hpp), the same
///              type the kernel runs its tiles with
///   kKernel    the __global__ function, called as kKernel(p, num_m_blocks)
///   kName      its name in error messages
///   prepare(p, num_m_blocks, tiles)
///              the kernel's arguments after (p, num_m_blocks), as a tuple: none for most
///              kernels; the TMA tensor maps and the tile divisors for the warp-specialised
///              sm90 kernel
template <class Launch>
void launch_fwd(const FwdParams& p, port::stream_t stream) {
  using Tile = typename Launch::Tile;
  const int64_t num_m_blocks = (p.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM;
  constexpr int kHeadsPerTile = HeadsPerTile<Tile>::value;
  const int64_t head_tiles = (p.heads_q + kHeadsPerTile - 1) / kHeadsPerTile;
  const int64_t tiles = num_m_blocks * p.num_splits * head_tiles * p.batch;
  int64_t slots = 0;  // blocks resident at once: only a persistent grid is sized by them
  if constexpr (Launch::Scheduler::kPersistent) {
    int device = 0;
    port::check(port::get_device(&device), "querying the current device");
    slots = int64_t(device_arch(device).num_sms) * Tile::kMinBlocks;
  }
  const int64_t blocks = Launch::Scheduler::template grid<Tile>(p, num_m_blocks, tiles, slots);
  HIPFLASH_CHECK(blocks <= 0x7fffffff, "problem too large for one launch: ", blocks,
                 " thread blocks (batch * heads_q * query blocks * splits) exceed 2^31 - 1");
  auto extra = Launch::prepare(p, num_m_blocks, tiles);
  set_smem_once_per_device<Launch::kKernel>(Tile::kSmemBytes, Launch::kName);
  port::error_t err = port::kSuccess;
  std::apply(
      [&](const auto&... args) {
        Launch::kKernel<<<dim3(unsigned(blocks)), dim3(Tile::kThreads), Tile::kSmemBytes,
                          stream>>>(p, int(num_m_blocks), args...);
        err = port::get_last_error();
      },
      extra);
  if (err != port::kSuccess)
    port::check(err, (std::string("launching the ") + Launch::kName + " forward kernel").c_str());
}

/// A kernel with instantiations for each place K / V live (common::KvRows): contiguous rows, a
/// paged cache in pages of a power of two from 16 rows (a 16-row group shares a page), or in
/// pages of any other size or from a cache_leftpad row (each row gathered through the block
/// table): the one the call needs.
template <template <class, common::KvRows> class Launch, class Traits>
void launch_fwd_paged_or_not(const FwdParams& p, port::stream_t stream) {
  using common::KvRows;
  if (p.block_table == nullptr)
    launch_fwd<Launch<Traits, KvRows::contiguous>>(p, stream);
  else if (grouped_page_size(p.page_size) && p.cache_leftpad == nullptr)
    launch_fwd<Launch<Traits, KvRows::pages>>(p, stream);
  else
    launch_fwd<Launch<Traits, KvRows::gathered>>(p, stream);
}

/// Launch traits whose kernel takes nothing beyond (p, num_m_blocks).
struct NoPrepare {
  static std::tuple<> prepare(const FwdParams&, int64_t /*num_m_blocks*/, int64_t /*tiles*/) {
    return {};
  }
};

}  // namespace hipflash::gpu
