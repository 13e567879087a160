// Input validation of the layer's tensors (layouts and values), and the engine front door.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "mok/errors.hpp"
#include "mok/reference.hpp"
#include "mok/validate.hpp"
#include "mok/workload.hpp"

namespace {

struct Fixture {
  mok::LayerShape shape = mok::LayerShape::uniform(2, 8, 64, 64, 4, 2, 64);
  std::vector<mok::bf16> x = std::vector<mok::bf16>(8 * 64);
  std::vector<int32_t> idx = std::vector<int32_t>(8 * 2, 1);
  std::vector<int64_t> idx64 = std::vector<int64_t>(8 * 2, 1);
  std::vector<float> w = std::vector<float>(8 * 2, 0.5f);

  mok::RoutingRefs refs() {
    return {mok::TensorRef::contiguous(x.data(), mok::DType::BF16, {8, 64}),
            mok::TensorRef::contiguous(idx.data(), mok::DType::I32, {8, 2}),
            mok::TensorRef::contiguous(w.data(), mok::DType::F32, {8, 2})};
  }
};

void expect_arg(const std::function<void()>& fn, const std::string& arg, const std::string& needle) {
  try {
    fn();
    FAIL() << "expected an error about " << arg;
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Validate, GoodInputsPass) {
  Fixture f;
  EXPECT_NO_THROW(mok::validate_routing_values(f.shape, 0, f.refs()));
}

TEST(Validate, ExpertIdAboveRange) {
  Fixture f;
  f.idx[5] = 4;  // E = 4
  expect_arg([&] { mok::validate_routing_values(f.shape, 0, f.refs()); }, "topk_idx[2,1]",
             "-1 <= id < E (E = 4");
}

TEST(Validate, ExpertIdBelowMinusOne) {
  Fixture f;
  f.idx[0] = -2;
  expect_arg([&] { mok::validate_routing_values(f.shape, 0, f.refs()); }, "topk_idx[0,0]", "got -2");
}

TEST(Validate, Int64ExpertIdsAreChecked) {
  Fixture f;
  f.idx64[3] = int64_t{1} << 40;
  auto r = f.refs();
  r.topk_idx = mok::TensorRef::contiguous(f.idx64.data(), mok::DType::I64, {8, 2});
  expect_arg([&] { mok::validate_routing_values(f.shape, 0, r); }, "topk_idx[1,1]", "-1 <= id < E");
}

TEST(Validate, NonFiniteRouterWeight) {
  Fixture f;
  f.w[3] = std::numeric_limits<float>::quiet_NaN();
  expect_arg([&] { mok::validate_routing_values(f.shape, 0, f.refs()); }, "topk_w[1,1]", "finite");
  f.w[3] = std::numeric_limits<float>::infinity();
  expect_arg([&] { mok::validate_routing_values(f.shape, 0, f.refs()); }, "topk_w[1,1]", "finite");
}

TEST(Validate, NegativeRouterWeight) {
  Fixture f;
  f.w[7] = -0.25f;
  expect_arg([&] { mok::validate_routing_values(f.shape, 0, f.refs()); }, "topk_w[3,1]", ">= 0");
}

TEST(Validate, WrongDtype) {
  Fixture f;
  auto r = f.refs();
  r.x.dtype = mok::DType::F32;
  expect_arg([&] { mok::validate_routing_layout(f.shape, 0, r); }, "x", "dtype must be bf16, got f32");
  r = f.refs();
  r.topk_w.dtype = mok::DType::BF16;
  expect_arg([&] { mok::validate_routing_layout(f.shape, 0, r); }, "topk_w", "dtype must be f32");
  r = f.refs();
  r.topk_idx.dtype = mok::DType::F32;
  expect_arg([&] { mok::validate_routing_layout(f.shape, 0, r); }, "topk_idx", "i32 or i64");
}

TEST(Validate, WrongShape) {
  Fixture f;
  auto r = f.refs();
  r.x.sizes = {8, 128};
  expect_arg([&] { mok::validate_routing_layout(f.shape, 0, r); }, "x", "shape must be [8, 64], got [8, 128]");
  r = f.refs();
  r.topk_idx.sizes = {8, 3};
  expect_arg([&] { mok::validate_routing_layout(f.shape, 0, r); }, "topk_idx", "shape must be [8, 2]");
}

TEST(Validate, NonContiguousStrides) {
  Fixture f;
  auto r = f.refs();
  r.x.strides = {128, 1};  // a padded row pitch
  expect_arg([&] { mok::validate_routing_layout(f.shape, 0, r); }, "x", "contiguous row-major");
  r = f.refs();
  r.x.strides = {1, 8};  // transposed
  expect_arg([&] { mok::validate_routing_layout(f.shape, 0, r); }, "x", "contiguous row-major");
}

TEST(Validate, NullDataWithElements) {
  Fixture f;
  auto r = f.refs();
  r.x.data = nullptr;
  expect_arg([&] { mok::validate_routing_layout(f.shape, 0, r); }, "x", "null");
}

TEST(Validate, ZeroTokensAcceptNullData) {
  Fixture f;
  f.shape.tokens[1] = 0;
  mok::RoutingRefs r{mok::TensorRef::contiguous(nullptr, mok::DType::BF16, {0, 64}),
                     mok::TensorRef::contiguous(nullptr, mok::DType::I32, {0, 2}),
                     mok::TensorRef::contiguous(nullptr, mok::DType::F32, {0, 2})};
  EXPECT_NO_THROW(mok::validate_routing_values(f.shape, 1, r));
}

TEST(Validate, RankOutOfRange) {
  Fixture f;
  expect_arg([&] { mok::validate_routing_layout(f.shape, 2, f.refs()); }, "rank", "[0, W)");
}

TEST(Validate, WeightShapes) {
  const auto shape = mok::LayerShape::uniform(2, 8, 64, 128, 4, 2, 64);
  std::vector<mok::bf16> buf(2 * 128 * 64);
  mok::WeightRefs w{mok::TensorRef::contiguous(buf.data(), mok::DType::BF16, {2, 128, 64}),
                    mok::TensorRef::contiguous(buf.data(), mok::DType::BF16, {2, 128, 64}),
                    mok::TensorRef::contiguous(buf.data(), mok::DType::BF16, {2, 64, 128}),
                    mok::TensorRef::contiguous(buf.data(), mok::DType::BF16, {64, 64}),
                    mok::TensorRef::contiguous(buf.data(), mok::DType::BF16, {64, 64}),
                    mok::TensorRef::contiguous(buf.data(), mok::DType::BF16, {64, 64})};
  EXPECT_NO_THROW(mok::validate_weights_layout(shape, w));
  w.w_down.sizes = {2, 128, 64};  // gate layout given for down
  expect_arg([&] { mok::validate_weights_layout(shape, w); }, "w_down", "shape must be [2, 64, 128]");
}

TEST(Validate, EngineRejectsBadRoutingWithNamedError) {
  const auto shape = mok::LayerShape::uniform(2, 16, 64, 64, 4, 2);
  auto wl = mok::make_workload(shape, mok::Routing::Uniform, 1);
  wl.inputs[1].topk_idx[7] = 9;
  mok::ref::Engine eng(shape, mok::Config{});
  expect_arg([&] { eng.forward(wl.inputs, wl.weights); }, "topk_idx[3,1]", "E = 4");
}

// GradRefs::accumulate: the routed weight gradients are fp32 tensors added to; without it bf16.
// The refusal names the tensor and the flag.
TEST(Validate, AccumulatedWeightGradientsAreF32) {
  const mok::LayerShape shape = mok::LayerShape::uniform(2, 8, 64, 64, 4, 2, 0);
  const int64_t el = shape.local_experts(), H = shape.hidden, I = shape.intermediate;
  std::vector<uint16_t> dx(8 * 64), wb(size_t(el * I * H) * 3);
  std::vector<float> dtw(8 * 2), wf(size_t(el * I * H) * 3);
  mok::GradRefs g = mok::GradRefs::of(shape, 0, dx.data(), dtw.data(), wb.data(), wb.data() + el * I * H,
                                      wb.data() + 2 * el * I * H);
  mok::validate_grads_layout(shape, 0, g);  // bf16, overwritten
  g.accumulate = true;
  expect_arg([&] { mok::validate_grads_layout(shape, 0, g); }, "grads.d_w_gate (grads.accumulate)",
             "dtype must be f32");
  const auto f32 = [&](int i, std::vector<int64_t> sizes) {
    return mok::TensorRef::contiguous(wf.data() + i * el * I * H, mok::DType::F32, std::move(sizes));
  };
  g.d_w_gate = f32(0, {el, I, H});
  g.d_w_up = f32(1, {el, I, H});
  g.d_w_down = f32(2, {el, H, I});
  mok::validate_grads_layout(shape, 0, g);  // fp32, added to
  g.accumulate = false;
  expect_arg([&] { mok::validate_grads_layout(shape, 0, g); }, "grads.d_w_gate", "dtype must be bf16");
}
