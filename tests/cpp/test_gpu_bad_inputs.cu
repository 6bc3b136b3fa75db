// SPEC §4 on the GPU: every row of tests/cpp/bad_input_cases.hpp with its buffers in device
// memory (copies of the host buffers; views and aliases keep their offsets), read back after
// the refused call and compared bit for bit. The cross-device rows put one buffer on the host.
#include <map>
#include <memory>

#include "bad_input_cases.hpp"
#include "gpu_test_util.hpp"

namespace hipflash::test::bad_input {
namespace {

/// The GPU suite's fixture (skips without a GPU), with a table row as its parameter.
class GpuBadInput : public Gpu, public ::testing::WithParamInterface<Case> {};

void run_on_gpu(const Case& c) {
  std::map<const HostTensor*, std::unique_ptr<DeviceTensor>> device;
  auto place = [&](HostTensor& t) {
    auto& d = device[&t];
    d = std::make_unique<DeviceTensor>(t);
    return d->ref;
  };
  std::vector<std::unique_ptr<HostTensor>> read;
  auto read_back = [&](HostTensor& t) -> HostTensor& {
    read.push_back(std::make_unique<HostTensor>(t));
    device.at(&t)->download(*read.back());
    return *read.back();
  };
  run_bad_input_case(c, place, read_back, Location{Location::gpu, 0},
                     Location{Location::cpu, 0});
}

TEST_P(GpuBadInput, RefusedAndNothingWritten) {
  run_on_gpu(GetParam());
  sync();  // nothing was launched, and nothing failed late either
}

INSTANTIATE_TEST_SUITE_P(Table, GpuBadInput, ::testing::ValuesIn(cases()),
                         CaseName());

}  // namespace
}  // namespace hipflash::test::bad_input
