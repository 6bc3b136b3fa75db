// The CPU backward's validation (include/hipflash/backward.hpp); its numerics are tested against
// fp64 autograd in tests/python/test_backward.py.
#include "test_util.hpp"

namespace hipflash::test {
namespace {

// The backward's checks (include/hipflash/backward.hpp): the forward's, then the gradients'.
TEST(Backward, BadCallsAreRefusedBeforeAnythingIsWritten) {
  Dense t = make_dense({DType::bf16, 1, 9, 12, 2, 1, 64}, 5);
  t.run();
  HostTensor dout = t.out, dq = t.q, dk = t.k, dv = t.v;
  dq.fill(kNaN);
  auto expect = [&](const std::string& what, TensorRef dq_ref, TensorRef dk_ref) {
    try {
      backward(dout.ref, t.q.ref, t.k.ref, t.v.ref, t.out.ref, t.lse.ref, dq_ref, dk_ref, dv.ref);
      ADD_FAILURE() << "no exception; expected '" << what << "'";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_TRUE(dq.all_nan());
  };
  TensorRef short_dq = dq.ref;
  short_dq.sizes[1] = 8;
  expect("dq must have the shape of q", short_dq, dk.ref);
  expect("dk must not alias dv", dq.ref, dv.ref);
  TensorRef on_gpu = dq.ref;
  expect("dq must be on the device of q", [&] { on_gpu.loc = {Location::gpu, 0}; return on_gpu; }(), dk.ref);
  // A valid call writes finite gradients.
  backward(dout.ref, t.q.ref, t.k.ref, t.v.ref, t.out.ref, t.lse.ref, dq.ref, dk.ref, dv.ref);
  EXPECT_FALSE(dq.all_nan());
}

}  // namespace
}  // namespace hipflash::test
