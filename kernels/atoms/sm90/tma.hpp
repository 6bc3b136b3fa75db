// hipflash — the Hopper (sm_90a) asynchronous-copy atoms of the warp-specialised kernel:
// transaction mbarriers, the tensor-memory-accelerator (TMA) tile load and store, the 1-d bulk
// copy and bulk reduction, named barriers between warpgroups and the register reallocation
// between producer and consumers (PTX ISA: "mbarrier", "cp.async.bulk.tensor",
// "cp.async.bulk", "cp.reduce.async.bulk", "bar.sync / bar.arrive", "setmaxnreg").
//
// A tensor map (atoms/sm90/tensor_map.hpp: a CUtensorMap's 128 bytes) is built on the host
// (src/gpu/tma_host.hpp) and passed as a __grid_constant__ kernel parameter; the device side
// only names its address.
#pragma once

#include <cstdint>

#include "hipflash/port/port.hpp"

namespace hipflash::atom::sm90 {

#if defined(HIPFLASH_HAS_WGMMA)

/// A 64-bit mbarrier in shared memory, addressed by its 32-bit shared-window address. Phases
/// alternate parity 0, 1, 0, ...; a fresh barrier is in phase 0, so waiting on parity 1 (the
/// phase "before" it) returns at once — the producer's first pass over an empty ring.
struct Mbarrier {
  uint32_t addr;

  /// One thread, before any use (then fence_init() and a block-wide barrier).
  __device__ __forceinline__ void init(uint32_t arrivals) const {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(arrivals));
  }
  /// Makes initialised barriers visible to the other threads and to the async proxy (TMA).
  __device__ __forceinline__ static void fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  /// One arrival that also announces `bytes` of TMA transactions for the current phase.
  __device__ __forceinline__ void arrive_expect_tx(uint32_t bytes) const {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr),
                 "r"(bytes)
                 : "memory");
  }
  __device__ __forceinline__ void arrive() const {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
  }
  /// Blocks until the phase of parity `parity` has completed.
  __device__ __forceinline__ void wait(uint32_t parity) const {
    uint32_t done;
    do {
      asm volatile(
          "{\n.reg .pred p;\n"
          "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          "selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(addr), "r"(parity)
          : "memory");
    } while (!done);
  }
};

namespace tma {

/// Loads the box at coordinates (c0 .. c3) of the 4-d tensor map `map` (a __grid_constant__
/// parameter) into shared memory at `dst`; completion is counted in bytes on `bar`.
__device__ __forceinline__ void load_4d(uint32_t dst, const void* map, const Mbarrier& bar,
                                        int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar.addr), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

/// Stores the box in shared memory at `src` to coordinates (c0 .. c3) of the 4-d tensor map
/// `map`; the box's rows and columns outside the tensor are not written. The writer thread
/// then commits the bulk group (commit_group) and, before `src` is written again, waits until
/// the group has read it (wait_group_read).
__device__ __forceinline__ void store_4d(const void* map, uint32_t src, int c0, int c1, int c2,
                                         int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
/// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to
/// shared memory at `dst`; completion is counted in bytes on `bar` (no tensor map: a 1-d run).
__device__ __forceinline__ void load_1d(uint32_t dst, const void* src, uint32_t bytes,
                                        const Mbarrier& bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar.addr)
      : "memory");
}
/// Adds the `bytes` of fp32 values at shared `src` to global `dst` element-wise (one bulk
/// reduction, performed at L2), in this thread's current bulk group (commit_group after).
__device__ __forceinline__ void reduce_add_1d(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
      "r"(src), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void commit_group() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
/// Until at most kPending of this thread's bulk groups have not yet read their source.
template <int kPending>
__device__ __forceinline__ void wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

/// Until at most kPending of this thread's bulk groups are complete (their writes performed).
template <int kPending>
__device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

/// Brings a tensor map's 128 bytes into the TMA unit's cache ahead of its first use.
__device__ __forceinline__ void prefetch_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

}  // namespace tma

/// Named barrier `id` (1 .. 15; 0 is __syncthreads) over `threads` threads (a multiple of 32):
/// sync waits for the count, arrive adds this warp's threads and moves on.
template <int kThreads>
__device__ __forceinline__ void named_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
template <int kThreads>
__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

/// Register reallocation between the warpgroups of a block (every warp of the warpgroup runs
/// it): the producer gives registers back, the consumers take them.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

#endif  // HIPFLASH_HAS_WGMMA

}  // namespace hipflash::atom::sm90
