// SPEC §4 on the CPU backend: every row of tests/cpp/bad_input_cases.hpp, on host memory.
#include "bad_input_cases.hpp"

namespace hipflash::test::bad_input {
namespace {

class BadInput : public ::testing::TestWithParam<Case> {};

TEST_P(BadInput, RefusedAndNothingWritten) {
  run_bad_input_case(
      GetParam(), [](HostTensor& t) { return t.ref; }, [](HostTensor& t) -> HostTensor& { return t; },
      Location{Location::cpu, 0}, Location{Location::gpu, 0});
}

INSTANTIATE_TEST_SUITE_P(Table, BadInput, ::testing::ValuesIn(cases()),
                         CaseName());

}  // namespace
}  // namespace hipflash::test::bad_input
