// hipflash — the GPU backend of a build without GPU kernels (HIPFLASH_GPU=none).
// Every entry point that would need a device says so with not_implemented.
#include "../backend.hpp"

namespace hipflash::gpu {

BuildCaps build_caps() { return BuildCaps{}; }
std::string build_info() { return "cpu (built with HIPFLASH_GPU=none)"; }

[[noreturn]] static void no_gpu() {
  throw not_implemented(
      "this hipflash was built without GPU kernels (HIPFLASH_GPU=none); rebuild with "
      "HIPFLASH_GPU=cuda or hip, or pass CPU tensors");
}

Arch device_arch(int) { no_gpu(); }
int pointer_device(const void*) { return -1; }
void copy_to_host(void*, const void*, size_t, Stream) { no_gpu(); }
bool stream_capturing(Stream) { return false; }
Launched run_forward(const FwdParams&, const Selection&, int, Stream, Workspace) { no_gpu(); }
TileShape tile_shape(KernelKind, int, bool) { return TileShape{}; }
void run_merge(const MergeParams&, int, Stream) { no_gpu(); }
void run_kvcache_append(const FwdParams&, const TensorRef&, const TensorRef&, int, Stream) {
  no_gpu();
}
void run_backward(const BwdParams&, int, Stream, Workspace, int64_t, int64_t, bool, bool) {
  no_gpu();
}

}  // namespace hipflash::gpu
