// SPEC §4: every bad input throws the right typed error, names the argument, writes nothing.
#include <functional>

#include "test_util.hpp"

namespace hipflash::test {
namespace {

enum class Err { invalid, dtype, not_impl };

/// Runs `call`, expects exactly the error kind `want` (dtype_error is an invalid_argument, but
/// an invalid_argument that is not about a dtype must not be a dtype_error: Python maps them to
/// ValueError vs TypeError) with `substr` in its message.
void expect_error(Err want, const std::string& substr, const std::function<void()>& call) {
  try {
    call();
    ADD_FAILURE() << "no exception; expected one mentioning '" << substr << "'";
  } catch (const dtype_error& e) {
    EXPECT_EQ(want, Err::dtype) << "got dtype_error: " << e.what();
    EXPECT_NE(std::string(e.what()).find(substr), std::string::npos) << e.what();
  } catch (const invalid_argument& e) {
    EXPECT_EQ(want, Err::invalid) << "got invalid_argument: " << e.what();
    EXPECT_NE(std::string(e.what()).find(substr), std::string::npos) << e.what();
  } catch (const not_implemented& e) {
    EXPECT_EQ(want, Err::not_impl) << "got not_implemented: " << e.what();
    EXPECT_NE(std::string(e.what()).find(substr), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception type: " << e.what();
  }
}

/// A small valid dense problem whose pieces a test breaks one at a time.
struct DenseCall : Dense {
  DenseCall() : Dense(DType::bf16, 2, 5, 7, 4, 2, 64) {}
  TensorRef q_ = q.ref, k_ = k.ref, v_ = v.ref, out_ = out.ref, lse_ = lse.ref;
  const TensorRef* lse_ptr = &lse_;

  void call() { forward(q_, k_, v_, out_, lse_ptr, opts); }
  /// Expects the call to be rejected and nothing written.
  void rejected(Err want, const std::string& substr) {
    expect_error(want, substr, [&] { call(); });
    EXPECT_TRUE(out.all_nan()) << "out was written by a rejected call";
    EXPECT_TRUE(lse.all_nan()) << "lse was written by a rejected call";
  }
};

TEST(Validation, ValidCallSucceeds) {
  DenseCall c;
  c.call();
  EXPECT_REF_OK(c.check());
}

TEST(Validation, WrongRank) {
  for (TensorRef DenseCall::*t : {&DenseCall::q_, &DenseCall::k_, &DenseCall::v_, &DenseCall::out_}) {
    DenseCall c;
    (c.*t).rank = 3;
    const char* name = t == &DenseCall::q_ ? "q must have rank 4"
                     : t == &DenseCall::k_ ? "k must have rank 4"
                     : t == &DenseCall::v_ ? "v must have rank 4" : "out must have rank 4";
    c.rejected(Err::invalid, name);
  }
}

TEST(Validation, NegativeSize) {
  DenseCall c;
  c.k_.sizes[1] = -1;
  c.rejected(Err::invalid, "k has a negative size");
}

TEST(Validation, ShapesThatDisagree) {
  { DenseCall c; c.k_.sizes[0] = 1; c.rejected(Err::invalid, "batch size differs"); }
  { DenseCall c; c.v_.sizes[0] = 3; c.rejected(Err::invalid, "batch size differs"); }
  { DenseCall c; c.k_.sizes[3] = 32; c.rejected(Err::invalid, "head dim differs"); }
  { DenseCall c; c.v_.sizes[3] = 32; c.rejected(Err::invalid, "head dim differs"); }
  { DenseCall c; c.v_.sizes[1] = 6; c.rejected(Err::invalid, "k and v must have the same seqlen_k"); }
  { DenseCall c; c.v_.sizes[2] = 1; c.rejected(Err::invalid, "k and v must have the same number of heads"); }
  { DenseCall c; c.out_.sizes[1] = 4; c.rejected(Err::invalid, "out must have the shape of q"); }
  { DenseCall c; c.out_.sizes[2] = 2; c.rejected(Err::invalid, "out must have the shape of q"); }
}

TEST(Validation, HeadsMustDivide) {
  { DenseCall c; c.k_.sizes[2] = c.v_.sizes[2] = 3; c.rejected(Err::invalid, "must divide"); }
  { DenseCall c; c.k_.sizes[2] = c.v_.sizes[2] = 0; c.rejected(Err::invalid, "must divide"); }
}

TEST(Validation, Dtypes) {
  { DenseCall c; c.q_.dtype = DType::f32; c.rejected(Err::dtype, "q must have dtype"); }
  { DenseCall c; c.q_.dtype = DType::i32; c.rejected(Err::dtype, "q must have dtype"); }
  { DenseCall c; c.k_.dtype = DType::f16; c.rejected(Err::dtype, "k must have dtype"); }
  { DenseCall c; c.v_.dtype = DType::f16; c.rejected(Err::dtype, "v must have dtype"); }
  { DenseCall c; c.out_.dtype = DType::f16; c.rejected(Err::dtype, "out must have dtype"); }
  { DenseCall c; c.lse_.dtype = DType::bf16; c.rejected(Err::dtype, "lse must have dtype float32"); }
}

TEST(Validation, Devices) {
  { DenseCall c; c.k_.loc = {Location::gpu, 0}; c.rejected(Err::invalid, "k is on gpu:0 but q is on cpu"); }
  { DenseCall c; c.v_.loc = {Location::gpu, 0}; c.rejected(Err::invalid, "v is on gpu:0"); }
  { DenseCall c; c.out_.loc = {Location::gpu, 1}; c.rejected(Err::invalid, "out is on gpu:1"); }
  { DenseCall c; c.lse_.loc = {Location::gpu, 0}; c.rejected(Err::invalid, "lse is on gpu:0"); }
}

TEST(Validation, GpuTensorsWithoutGpuBuild) {
  if (gpu_available()) GTEST_SKIP() << "this build has a usable GPU";
  if (build_info().find("HIPFLASH_GPU=none") == std::string::npos)
    GTEST_SKIP() << "GPU build without a GPU: launching would touch the device runtime";
  DenseCall c;
  for (TensorRef* t : {&c.q_, &c.k_, &c.v_, &c.out_, &c.lse_}) t->loc = {Location::gpu, 0};
  c.rejected(Err::not_impl, "built without GPU kernels");
}

// Nothing is read before validation passes, so the views below need not fit their storage.
TEST(Validation, LastDimStride) {
  for (TensorRef DenseCall::*t : {&DenseCall::q_, &DenseCall::k_, &DenseCall::v_, &DenseCall::out_}) {
    DenseCall c;
    (c.*t).strides[3] = 2;
    c.rejected(Err::invalid, "contiguous last dimension");
  }
}

TEST(Validation, UnsupportedHeadDim) {
  for (int64_t d : {0, 16, 48, 80, 160, 512}) {
    DenseCall c;
    for (TensorRef* t : {&c.q_, &c.k_, &c.v_, &c.out_}) t->sizes[3] = d;
    c.rejected(Err::invalid, "supported head dims are 32, 64, 96, 128, 256");
  }
}

TEST(Validation, ReturnLseWithoutBuffer) {
  DenseCall c;
  c.lse_ptr = nullptr;
  c.rejected(Err::invalid, "no lse buffer");
}

TEST(Validation, LseWrongShape) {
  { DenseCall c; c.lse_.sizes[2] = 4; c.rejected(Err::invalid, "lse buffer has shape [2, 4, 4]"); }
  { DenseCall c; c.lse_.sizes[0] = 1; c.rejected(Err::invalid, "[batch, heads_q, seqlen_q]"); }
  { DenseCall c; c.lse_.rank = 2; c.lse_.sizes[1] = 20; c.rejected(Err::invalid, "lse buffer has shape"); }
}

TEST(Validation, LseNotContiguous) {
  DenseCall c;
  c.lse_.strides[0] = 24;  // [2, 4, 5] with a padded head stride
  c.lse_.strides[1] = 6;
  c.rejected(Err::invalid, "lse must be contiguous");
}

TEST(Validation, LseNoData) {
  DenseCall c;
  c.lse_.data = nullptr;
  c.rejected(Err::invalid, "lse buffer has no data pointer");
}

TEST(Validation, LseAliasingOut) {
  DenseCall c;
  // An fp32 [2, 4, 5] view placed inside out's storage (out has 2*5*4*64 halves).
  c.lse_.data = c.out.ref.data;
  expect_error(Err::invalid, "lse must not alias out", [&] { c.call(); });
  EXPECT_TRUE(c.out.all_nan());
}

TEST(Validation, LseAliasingInputs) {
  DenseCall c;
  c.lse_.data = c.k.ref.data;
  std::vector<uint32_t> before = c.k.words;
  expect_error(Err::invalid, "lse must not alias k", [&] { c.call(); });
  EXPECT_TRUE(c.out.all_nan());
  EXPECT_EQ(before, c.k.words);
}

TEST(Validation, OutAliasingInputs) {
  {
    DenseCall c;
    c.out_.data = c.q.ref.data;
    expect_error(Err::invalid, "out must not alias q", [&] { c.call(); });
    EXPECT_TRUE(c.lse.all_nan());
  }
  {
    DenseCall c;
    c.out_.data = static_cast<uint16_t*>(c.v.ref.data) + 64;  // a partial overlap
    c.out_.sizes[0] = 1;
    c.q_.sizes[0] = c.k_.sizes[0] = c.v_.sizes[0] = c.lse_.sizes[0] = 1;
    expect_error(Err::invalid, "out must not alias v", [&] { c.call(); });
    EXPECT_TRUE(c.lse.all_nan());
  }
}

TEST(Validation, SoftmaxScale) {
  for (float s : {0.f, -1.f, kNaN, kInf}) {
    DenseCall c;
    c.opts.softmax_scale = s;
    c.rejected(Err::invalid, "softmax_scale");
  }
}

TEST(Validation, WindowSize) {
  { DenseCall c; c.opts.window_left = -2; c.rejected(Err::invalid, "window_size"); }
  { DenseCall c; c.opts.window_right = -5; c.rejected(Err::invalid, "window_size"); }
}

TEST(Validation, NumSplits) {
  { DenseCall c; c.opts.num_splits = -1; c.rejected(Err::invalid, "num_splits"); }
  { DenseCall c; c.opts.num_splits = 257; c.rejected(Err::invalid, "num_splits"); }
}

TEST(Validation, NoLseRequestedTouchesNoLse) {
  DenseCall c;
  c.opts.return_lse = false;
  c.lse_ptr = nullptr;
  c.call();
  EXPECT_TRUE(c.lse.all_nan());
  EXPECT_REF_OK(ref::check(c.problem(), c.out.ref, nullptr));
}

// ---- varlen ------------------------------------------------------------------------------------

struct VarlenCall : Varlen {
  explicit VarlenCall(LseLayout layout = LseLayout::padded)
      : Varlen(DType::f16, {3, 0, 5}, {4, 2, 6}, 4, 2, 64, layout) {}
  TensorRef q_ = q.ref, k_ = k.ref, v_ = v.ref, out_ = out.ref, lse_ = lse.ref;
  TensorRef cq_ = cu_q.ref, ck_ = cu_k.ref;
  const TensorRef* lse_ptr = &lse_;

  void call() { varlen_forward(q_, k_, v_, out_, lse_ptr, cq_, ck_, opts); }
  void rejected(Err want, const std::string& substr) {
    expect_error(want, substr, [&] { call(); });
    EXPECT_TRUE(out.all_nan()) << "out was written by a rejected call";
    EXPECT_TRUE(lse.all_nan()) << "lse was written by a rejected call";
  }
};

TEST(ValidationVarlen, ValidCallsSucceed) {
  for (LseLayout layout : {LseLayout::padded, LseLayout::packed}) {
    VarlenCall c(layout);
    c.call();
    EXPECT_REF_OK(c.check());
  }
}

TEST(ValidationVarlen, Ranks) {
  { VarlenCall c; c.q_.rank = 4; c.rejected(Err::invalid, "q must have rank 3"); }
  { VarlenCall c; c.v_.rank = 2; c.rejected(Err::invalid, "v must have rank 3"); }
  { VarlenCall c; c.out_.sizes[0] = 7; c.rejected(Err::invalid, "out must have the shape of q"); }
  { VarlenCall c; c.v_.sizes[0] = 11; c.rejected(Err::invalid, "k and v must have the same shape"); }
}

TEST(ValidationVarlen, CuSeqlensDtypeIsAValueError) {
  // SPEC §4: cu_seqlens not int32 is a ValueError in Python, so not a dtype_error.
  { VarlenCall c; c.cq_.dtype = DType::f32; c.rejected(Err::invalid, "cu_seqlens_q must have dtype int32"); }
  { VarlenCall c; c.ck_.dtype = DType::f16; c.rejected(Err::invalid, "cu_seqlens_k must have dtype int32"); }
}

TEST(ValidationVarlen, CuSeqlensLength) {
  { VarlenCall c; c.ck_.sizes[0] = 3; c.rejected(Err::invalid, "cu_seqlens_k must have the length"); }
  { VarlenCall c; c.cq_.sizes[0] = 0; c.rejected(Err::invalid, "cu_seqlens_q must be a 1-D tensor"); }
  { VarlenCall c; c.cq_.rank = 2; c.rejected(Err::invalid, "cu_seqlens_q must be a 1-D tensor"); }
}

TEST(ValidationVarlen, CuSeqlensDevice) {
  { VarlenCall c; c.cq_.loc = {Location::gpu, 0}; c.rejected(Err::invalid, "cu_seqlens_q is on gpu:0"); }
  { VarlenCall c; c.ck_.loc = {Location::gpu, 0}; c.rejected(Err::invalid, "cu_seqlens_k is on gpu:0"); }
}

TEST(ValidationVarlen, CuSeqlensNotMonotone) {
  VarlenCall c;
  c.cu_q.i32()[2] = 1;  // {0, 3, 1, 8}
  c.rejected(Err::invalid, "cu_seqlens_q must be non-decreasing");
  VarlenCall d;
  d.cu_k.i32()[0] = -1;
  d.rejected(Err::invalid, "cu_seqlens_k[0] must be >= 0");
}

TEST(ValidationVarlen, CuSeqlensPastTheTensor) {
  VarlenCall c;
  c.cu_k.i32()[3] = 13;  // total_k is 12
  c.opts.max_seqlen_k = 7;
  c.rejected(Err::invalid, "cu_seqlens_k[-1] = 13 exceeds");
}

TEST(ValidationVarlen, MaxSeqlenTooSmall) {
  { VarlenCall c; c.opts.max_seqlen_k = 5; c.rejected(Err::invalid, "max_seqlen_k = 5 is too small"); }
  {
    VarlenCall c;
    c.opts.max_seqlen_q = 4;
    c.lse_ = make_tensor(c.lse.ref.data, DType::f32, {3, 4, 4});  // consistent padded lse
    c.rejected(Err::invalid, "max_seqlen_q = 4 is too small");
  }
  { VarlenCall c; c.opts.max_seqlen_q = -1; c.rejected(Err::invalid, "max_seqlen_q"); }
}

TEST(ValidationVarlen, LseShapes) {
  { VarlenCall c(LseLayout::padded); c.lse_.sizes[2] = 4; c.rejected(Err::invalid, "lse_layout='padded'"); }
  {
    VarlenCall c(LseLayout::packed);
    c.lse_.sizes[1] = 5;
    c.lse_.strides[0] = 5;
    c.rejected(Err::invalid, "lse_layout='packed'");
  }
  { VarlenCall c(LseLayout::packed); c.lse_ptr = nullptr; c.rejected(Err::invalid, "no lse buffer"); }
  { VarlenCall c(LseLayout::packed); c.lse_.dtype = DType::f16; c.rejected(Err::dtype, "lse must have dtype float32"); }
  {
    VarlenCall c(LseLayout::packed);
    c.lse_.data = c.out.ref.data;
    expect_error(Err::invalid, "lse must not alias out", [&] { c.call(); });
    EXPECT_TRUE(c.out.all_nan());
  }
}

TEST(ValidationVarlen, CommonChecksApply) {
  { VarlenCall c; c.k_.sizes[1] = c.v_.sizes[1] = 3; c.rejected(Err::invalid, "must divide"); }
  { VarlenCall c; c.v_.dtype = DType::bf16; c.rejected(Err::dtype, "v must have dtype"); }
  { VarlenCall c; c.q_.strides[2] = 2; c.q_.sizes[2] = 32; c.k_.sizes[2] = c.v_.sizes[2] = c.out_.sizes[2] = 32;
    c.rejected(Err::invalid, "contiguous last dimension"); }
}

TEST(ResolveNumSplits, RejectsBadRankAndHeadDim) {
  Dense d(DType::bf16, 1, 4, 4, 2, 2, 64);
  TensorRef q = d.q.ref;
  q.rank = 3;
  expect_error(Err::invalid, "q must have rank 4", [&] { resolve_num_splits(q, d.k.ref, {}); });
  q = d.q.ref;
  q.sizes[3] = 40;
  expect_error(Err::invalid, "supported head dims", [&] { resolve_num_splits(q, d.k.ref, {}); });
  // What the forward refuses of its q, k and options (a split count for a call that cannot
  // run means nothing).
  q = d.q.ref;
  q.sizes[3] = (int64_t(1) << 32) + 64;  // int(head_dim) would be 64
  expect_error(Err::invalid, "supported head dims", [&] { resolve_num_splits(q, d.k.ref, {}); });
  FwdOptions o;
  o.num_splits = 257;
  expect_error(Err::invalid, "num_splits", [&] { resolve_num_splits(d.q.ref, d.k.ref, o); });
  o = {};
  o.window_left = -7;
  expect_error(Err::invalid, "window_size", [&] { resolve_num_splits(d.q.ref, d.k.ref, o); });
  TensorRef k = d.k.ref;
  k.sizes[2] = 0;
  expect_error(Err::invalid, "k/v heads", [&] { resolve_num_splits(d.q.ref, k, {}); });
  k = d.k.ref;
  k.dtype = DType::f16;
  expect_error(Err::dtype, "k must have dtype", [&] { resolve_num_splits(d.q.ref, k, {}); });
}

}  // namespace
}  // namespace hipflash::test
