// Reliability of the GPU layer: bad input never corrupts results and never faults, failure is
// collective and named, results are deterministic, and buffers over 2^31 bytes work.
//   BadRouting   invalid expert ids (E, 10^6, int64 2^32, -2) and router weights (NaN, Inf, < 0)
//                through forward and backward on both paths: every output bitwise equal to the
//                same routing with those slots empty, check() naming the entry after each call;
//                a backward given other routing than its forward is named.
//   BadPointers  misaligned, host, too small and wrong-device pointers for every argument: a
//                named mok::Error before anything is enqueued, and the context still healthy.
//   Determinism  100 forward + backward calls bitwise identical; the same bits across comm SM
//                counts, minibatch sizes, ring sizes and the two paths.
//   LargeBuffers a forward whose buffers exceed 2^31 bytes, sampled against the spec.
//   LatePeer, ConfigMismatch, Concurrency: collective failure, the cross-rank agreement and one
//                call at a time (the 2-GPU ones skip loudly on one GPU); a rank refusing its
//                weights at construction is named on the other rank (2 GPUs).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_util.h"
#include "layer_test_util.h"
#include "mok/comm.hpp"
#include "mok/layer.hpp"
#include "mok/reference.hpp"
#include "mok/workload.hpp"

namespace {

using mok::test::bit_diffs;
using mok::test::download;
using mok::test::RankData;
using mok::test::RankGrads;
using mok::test::ranks_on_gpus;
using mok::test::upload;

mok::Config config_for(mok::ForwardPath path) {
  mok::Config cfg;
  cfg.forward_path = path;
  cfg.fwd_comm_sms = 8;
  if (const char* t = std::getenv("MOK_TEST_WAIT_TIMEOUT_S")) cfg.wait_timeout_s = std::atof(t);
  return cfg;
}

// The issue's small shape (EP 1), with a shared expert so the merges have both terms.
const mok::LayerShape kSmall{{256}, 256, 128, 8, 2, 128};

// Everything one forward + backward produces, as raw bits.
struct Outputs {
  std::vector<mok::bf16> out;
  std::vector<std::vector<float>> grads;  // RankGrads::fetch order
};

bool same_bits(const Outputs& a, const Outputs& b, std::string& what) {
  if (bit_diffs(a.out, b.out) != 0) return what = "out", false;
  const char* names[] = {"d_x", "d_topk_w", "dW_gate", "dW_up", "dW_down", "dWs_gate", "dWs_up", "dWs_down"};
  for (size_t o = 0; o < a.grads.size(); ++o) {
    if (a.grads[o].size() != b.grads[o].size() ||
        std::memcmp(a.grads[o].data(), b.grads[o].data(), a.grads[o].size() * sizeof(float)) != 0)
      return what = names[o], false;
  }
  return true;
}

// Runs `fn` expecting a mok::Error; returns its argument ("" when nothing was thrown).
std::string error_argument(const std::function<void()>& fn, std::string* message = nullptr) {
  try {
    fn();
  } catch (const mok::Error& e) {
    if (message) *message = e.what();
    return e.argument();
  }
  return "";
}

// One rank's layer with its data on one GPU (EP 1), and one forward + backward through it.
struct OneRank {
  mok::LayerShape shape;
  mok::Config cfg;
  mok::Workload wl;
  mok::comm::LocalGroup group;
  std::unique_ptr<RankData> d;
  std::unique_ptr<RankGrads> g;
  mok::bf16* d_out = nullptr;
  std::unique_ptr<mok::Layer> layer;
  OneRank(const mok::LayerShape& s, const mok::Config& c, uint64_t seed)
      : shape(s), cfg(c), wl(mok::make_workload(s, mok::Routing::Uniform, seed)), group(ranks_on_gpus(1, s, c)) {
    d = std::make_unique<RankData>(shape, wl, 0);
    g = std::make_unique<RankGrads>(shape, 0);
    d_out = upload(wl.d_out[0].data(), wl.d_out[0].size());
    layer = std::make_unique<mok::Layer>(comm(), shape, cfg, d->dw);
  }
  ~OneRank() {
    layer.reset();
    cudaFree(d_out);
  }
  mok::comm::Communicator& comm() { return group[0]; }
  mok::TensorRef dref() const {
    return mok::TensorRef::contiguous(d_out, mok::DType::BF16, {shape.tokens_of(0), shape.hidden});
  }
  // Forward + backward with `in`; `errors` gets the argument check() names after each (or "").
  Outputs step(const mok::RoutingRefs& in, std::string errors[2]) {
    Outputs o;
    d->poison();
    layer->forward(in, d->out_ref(), comm().stream());
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(comm().stream()));
    errors[0] = error_argument([&] { layer->check(); });
    o.out = d->result();
    g->poison();
    layer->backward(in, dref(), g->g, comm().stream());
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(comm().stream()));
    errors[1] = error_argument([&] { layer->check(); });
    o.grads = g->fetch();
    return o;
  }
};

// ---------------------------------------------------------------------------------------------
// BadRouting
// ---------------------------------------------------------------------------------------------
struct BadValue {
  const char* name;
  bool weight;     // the bad value is topk_w[5,1] (else topk_idx[5,0])
  int64_t id;      // for ids
  float w;         // for weights
  bool int64_ids;  // topk_idx passed as int64
};

class BadRouting : public ::testing::TestWithParam<std::tuple<mok::ForwardPath, BadValue>> {};

TEST_P(BadRouting, InvalidSlotIsAnEmptySlotEverywhereAndNamed) {
  MOK_REQUIRE_GPUS(1);
  const auto [path, bad] = GetParam();
  OneRank r(kSmall, config_for(path), 77);
  const int64_t T = kSmall.tokens_of(0), k = kSmall.top_k;
  const int64_t slot = bad.weight ? 5 * k + 1 : 5 * k + 0;
  const auto& in0 = r.wl.inputs[0];
  // The caller's tensors: ids as int32 or int64, weights as given.
  std::vector<int64_t> ids(in0.topk_idx.begin(), in0.topk_idx.end());
  std::vector<float> w = in0.topk_w;
  auto refs_for = [&](const std::vector<int64_t>& id_values, const std::vector<float>& w_values, void*& id_buf,
                      float*& w_buf) {
    if (bad.int64_ids) {
      id_buf = upload(id_values);
    } else {
      std::vector<int32_t> i32(id_values.begin(), id_values.end());
      id_buf = upload(i32);
    }
    w_buf = upload(w_values);
    mok::RoutingRefs refs = r.d->refs;
    refs.topk_idx = mok::TensorRef::contiguous(id_buf, bad.int64_ids ? mok::DType::I64 : mok::DType::I32, {T, k});
    refs.topk_w = mok::TensorRef::contiguous(w_buf, mok::DType::F32, {T, k});
    return refs;
  };
  // 1. Poison the combine slot first: a forward in which the slot is valid and x's row 5 is NaN
  //    leaves NaN in slot (5, j) of the combine window (and in the backward's slots).
  {
    std::vector<mok::bf16> x_nan = in0.x;
    for (int64_t c = 0; c < kSmall.hidden; ++c) x_nan[5 * kSmall.hidden + c] = mok::bf16(NAN);
    MOK_ASSERT_CUDA(cudaMemcpy(r.d->x, x_nan.data(), x_nan.size() * 2, cudaMemcpyHostToDevice));
    std::string e[2];
    (void)r.step(r.d->refs, e);
    MOK_ASSERT_CUDA(cudaMemcpy(r.d->x, in0.x.data(), in0.x.size() * 2, cudaMemcpyHostToDevice));
  }
  // 2. The bad routing.
  std::vector<int64_t> bad_ids = ids;
  std::vector<float> bad_w = w;
  if (bad.weight) {
    bad_w[slot] = bad.w;
  } else {
    bad_ids[slot] = bad.id;
  }
  void* bid = nullptr;
  float* bw = nullptr;
  const mok::RoutingRefs bad_refs = refs_for(bad_ids, bad_w, bid, bw);
  std::string bad_err[2];
  const Outputs got = r.step(bad_refs, bad_err);
  // 3. The same routing with the slot empty.
  std::vector<int64_t> clean_ids = ids;
  clean_ids[slot] = -1;
  void* cid = nullptr;
  float* cw = nullptr;
  const mok::RoutingRefs clean_refs = refs_for(clean_ids, w, cid, cw);
  std::string clean_err[2];
  const Outputs want = r.step(clean_refs, clean_err);
  const std::string entry = bad.weight ? "topk_w[5,1]" : "topk_idx[5,0]";
  EXPECT_EQ(bad_err[0], entry) << "after forward";
  EXPECT_EQ(bad_err[1], entry) << "after backward";
  EXPECT_EQ(clean_err[0], "");
  EXPECT_EQ(clean_err[1], "");
  std::string what;
  EXPECT_TRUE(same_bits(got, want, what)) << what << " differs from the same routing with the slot empty";
  EXPECT_EQ(got.grads[1][slot], 0.0f) << "d_topk_w of the invalid slot";
  for (void* p : {bid, static_cast<void*>(bw), cid, static_cast<void*>(cw)}) cudaFree(p);
}

const BadValue kBadValues[] = {
    {"id_E", false, 8, 0, false},          {"id_1e6", false, 1000000, 0, false},
    {"id_2pow32_int64", false, int64_t(1) << 32, 0, true}, {"id_minus2", false, -2, 0, false},
    {"id_E_int64", false, 8, 0, true},     {"w_nan", true, 0, NAN, false},
    {"w_inf", true, 0, INFINITY, false},   {"w_negative", true, 0, -0.5f, false},
};

INSTANTIATE_TEST_SUITE_P(Paths, BadRouting,
                         ::testing::Combine(::testing::Values(mok::ForwardPath::Megakernel, mok::ForwardPath::Unfused),
                                            ::testing::ValuesIn(kBadValues)),
                         [](const auto& p) {
                           return std::string(mok::to_string(std::get<0>(p.param))) + "_" + std::get<1>(p.param).name;
                         });

TEST(BadRoutingBackward, OtherRoutingThanTheForwardIsNamed) {
  MOK_REQUIRE_GPUS(1);
  OneRank r(kSmall, config_for(mok::ForwardPath::Megakernel), 78);
  r.layer->forward(r.d->refs, r.d->out_ref(), r.comm().stream());
  MOK_ASSERT_CUDA(cudaStreamSynchronize(r.comm().stream()));
  r.layer->check();
  std::vector<int32_t> other = r.wl.inputs[0].topk_idx;
  other[7 * kSmall.top_k + 1] = -1;  // an empty slot the forward routed
  int32_t* id = upload(other);
  mok::RoutingRefs refs = r.d->refs;
  refs.topk_idx.data = id;
  r.layer->backward(refs, r.dref(), r.g->g, r.comm().stream());
  MOK_ASSERT_CUDA(cudaStreamSynchronize(r.comm().stream()));
  std::string msg;
  EXPECT_EQ(error_argument([&] { r.layer->check(); }, &msg), "topk_idx[7,1]") << msg;
  EXPECT_NE(msg.find("routing forward() used"), std::string::npos) << msg;
  cudaFree(id);
}

// ---------------------------------------------------------------------------------------------
// BadPointers
// ---------------------------------------------------------------------------------------------
// A faulty variant of one argument's pointer.
enum class Fault { Misaligned, Host, PinnedHost, TooSmall };
const char* fault_name(Fault f) {
  switch (f) {
    case Fault::Misaligned: return "misaligned";
    case Fault::Host: return "host";
    case Fault::PinnedHost: return "pinned_host";
    default: return "too_small";
  }
}

// Owns the memory of a faulty pointer for a tensor of `bytes`.
struct FaultyPointer {
  void* dev = nullptr;
  void* pinned = nullptr;
  std::vector<unsigned char> host;
  const void* p = nullptr;
  FaultyPointer(Fault f, int64_t bytes) {
    switch (f) {
      case Fault::Misaligned:
        EXPECT_EQ(cudaSuccess, cudaMalloc(&dev, bytes + 64));
        p = static_cast<char*>(dev) + 2;
        break;
      case Fault::Host:
        host.resize(static_cast<size_t>(bytes) + 64);
        p = reinterpret_cast<const void*>((reinterpret_cast<uintptr_t>(host.data()) + 63) & ~uintptr_t(63));
        break;
      case Fault::PinnedHost:
        EXPECT_EQ(cudaSuccess, cudaMallocHost(&pinned, bytes));
        p = pinned;
        break;
      case Fault::TooSmall:
        EXPECT_EQ(cudaSuccess, cudaMalloc(&dev, std::max<int64_t>(16, bytes / 4)));
        p = dev;
        break;
    }
  }
  ~FaultyPointer() {
    if (dev) cudaFree(dev);
    if (pinned) cudaFreeHost(pinned);
  }
};

class BadPointers : public ::testing::TestWithParam<Fault> {};

TEST_P(BadPointers, EveryArgumentIsNamedAndTheContextStaysHealthy) {
  MOK_REQUIRE_GPUS(1);
  const Fault fault = GetParam();
  OneRank r(kSmall, config_for(mok::ForwardPath::Megakernel), 79);
  std::string e[2];
  const Outputs good = r.step(r.d->refs, e);
  ASSERT_EQ(e[0] + e[1], "");
  auto bytes_of = [](const mok::TensorRef& t) { return t.numel() * mok::size_of(t.dtype); };
  // Forward arguments.
  struct Arg {
    const char* name;
    std::function<void(const void*)> call;
    int64_t bytes;
  };
  const mok::RoutingRefs& in = r.d->refs;
  const mok::TensorRef out = r.d->out_ref();
  cudaStream_t s = r.comm().stream();
  std::vector<Arg> args = {
      {"x", [&](const void* p) { auto v = in; v.x.data = p; r.layer->forward(v, out, s); }, bytes_of(in.x)},
      {"topk_idx", [&](const void* p) { auto v = in; v.topk_idx.data = p; r.layer->forward(v, out, s); },
       bytes_of(in.topk_idx)},
      {"topk_w", [&](const void* p) { auto v = in; v.topk_w.data = p; r.layer->forward(v, out, s); },
       bytes_of(in.topk_w)},
      {"out", [&](const void* p) { auto o = out; o.data = p; r.layer->forward(in, o, s); }, bytes_of(out)},
  };
  // Backward arguments (after a valid forward each time: the refusal must come first).
  const mok::GradRefs& g = r.g->g;
  using GradField = mok::TensorRef mok::GradRefs::*;
  const GradField grad_fields[] = {&mok::GradRefs::d_x,      &mok::GradRefs::d_topk_w,
                                                        &mok::GradRefs::d_w_gate, &mok::GradRefs::d_w_up,
                                                        &mok::GradRefs::d_w_down, &mok::GradRefs::d_ws_gate,
                                                        &mok::GradRefs::d_ws_up,  &mok::GradRefs::d_ws_down};
  const char* grad_names[] = {"grads.d_x",     "grads.d_topk_w", "grads.d_w_gate", "grads.d_w_up",
                              "grads.d_w_down", "grads.d_ws_gate", "grads.d_ws_up", "grads.d_ws_down"};
  args.push_back({"d_out", [&](const void* p) { auto d = r.dref(); d.data = p; r.layer->backward(in, d, g, s); },
                  bytes_of(r.dref())});
  for (int i = 0; i < 8; ++i) {
    auto field = grad_fields[i];
    args.push_back({grad_names[i], [&, field](const void* p) {
                      mok::GradRefs bad = g;
                      (bad.*field).data = p;
                      r.layer->backward(in, r.dref(), bad, s);
                    },
                    bytes_of(g.*field)});
  }
  for (const Arg& a : args) {
    // d_topk_w and topk_idx/topk_w need only element alignment: a 2-byte offset still breaks it.
    FaultyPointer fp(fault, a.bytes);
    std::string msg;
    EXPECT_EQ(error_argument([&] { a.call(fp.p); }, &msg), a.name) << fault_name(fault) << ": " << msg;
  }
  // Weights at construction.
  const char* wnames[] = {"weights.w_gate", "weights.w_up", "weights.w_down",
                          "weights.ws_gate", "weights.ws_up", "weights.ws_down"};
  using WeightField = mok::TensorRef mok::WeightRefs::*;
  const WeightField wfields[] = {&mok::WeightRefs::w_gate,  &mok::WeightRefs::w_up,
                                                &mok::WeightRefs::w_down,  &mok::WeightRefs::ws_gate,
                                                &mok::WeightRefs::ws_up,   &mok::WeightRefs::ws_down};
  for (int i = 0; i < 6; ++i) {
    mok::DeviceWeights w = r.d->dw;
    FaultyPointer fp(fault, bytes_of(w.*wfields[i]));
    (w.*wfields[i]).data = fp.p;
    std::string msg;
    EXPECT_EQ(error_argument([&] { mok::Layer bad(r.comm(), r.shape, r.cfg, w); }, &msg), wnames[i])
        << fault_name(fault) << ": " << msg;
  }
  // The context is healthy: the same call again gives the same bits.
  const Outputs again = r.step(r.d->refs, e);
  EXPECT_EQ(e[0] + e[1], "");
  std::string what;
  EXPECT_TRUE(same_bits(good, again, what)) << what << " changed after the refused calls";
}

INSTANTIATE_TEST_SUITE_P(Faults, BadPointers,
                         ::testing::Values(Fault::Misaligned, Fault::Host, Fault::PinnedHost, Fault::TooSmall),
                         [](const auto& p) { return std::string(fault_name(p.param)); });

// Memory of GPU 1 handed to rank 0's layer (needs 2 GPUs).
TEST(BadPointersWrongDevice, OtherGpusMemoryIsNamed) {
  MOK_REQUIRE_GPUS(2);
  OneRank r(kSmall, config_for(mok::ForwardPath::Megakernel), 80);
  void* other = nullptr;
  MOK_ASSERT_CUDA(cudaSetDevice(1));
  MOK_ASSERT_CUDA(cudaMalloc(&other, r.d->out_ref().numel() * 2));
  MOK_ASSERT_CUDA(cudaSetDevice(0));
  mok::TensorRef out = r.d->out_ref();
  out.data = other;
  std::string msg;
  EXPECT_EQ(error_argument([&] { r.layer->forward(r.d->refs, out, r.comm().stream()); }, &msg), "out") << msg;
  EXPECT_NE(msg.find("GPU 1"), std::string::npos) << msg;
  cudaFree(other);
}

// ---------------------------------------------------------------------------------------------
// Determinism
// ---------------------------------------------------------------------------------------------
// A small DeepSeek-like layer: many experts, top-8, a shared expert.
const mok::LayerShape kDeepSeekLike{{640}, 1024, 256, 32, 8, 256};

TEST(Determinism, HundredForwardBackwardCallsAreBitwiseIdentical) {
  MOK_REQUIRE_GPUS(1);
  OneRank r(kDeepSeekLike, config_for(mok::ForwardPath::Megakernel), 81);
  const int runs = 100;
  std::string e[2];
  const Outputs first = r.step(r.d->refs, e);
  ASSERT_EQ(e[0] + e[1], "");
  int identical = 1;
  for (int i = 1; i < runs; ++i) {
    const Outputs o = r.step(r.d->refs, e);
    std::string what;
    if (!same_bits(first, o, what)) {
      ADD_FAILURE() << "call " << i << ": " << what << " differs from the first";
      break;
    }
    ++identical;
  }
  RecordProperty("runs", identical);
  RecordProperty("bitwise", identical == runs ? 1 : 0);
  std::printf("[determinism] %d of %d forward + backward calls bitwise identical\n", identical, runs);
}

// The same routing under other execution settings: the same bits (forward; forward + backward
// where the ring holds every row).
TEST(Determinism, SameBitsAcrossCommSmsMinibatchesRingsAndPaths) {
  MOK_REQUIRE_GPUS(1);
  struct Setting {
    const char* name;
    int comm;
    int64_t mb, ring;
    mok::ForwardPath path;
  };
  const Setting settings[] = {{"default", 8, 0, 0, mok::ForwardPath::Megakernel},
                              {"comm2", 2, 0, 0, mok::ForwardPath::Megakernel},
                              {"comm16", 16, 0, 0, mok::ForwardPath::Megakernel},
                              {"mb128", 8, 128, 0, mok::ForwardPath::Megakernel},
                              {"mb1024", 8, 1024, 0, mok::ForwardPath::Megakernel},
                              {"ring_mb128_macro256", 8, 128, 256, mok::ForwardPath::Megakernel},
                              {"unfused", 8, 0, 0, mok::ForwardPath::Unfused}};
  Outputs base;
  for (const Setting& st : settings) {
    mok::Config cfg = config_for(st.path);
    cfg.fwd_comm_sms = st.comm;
    cfg.minibatch_tokens = st.mb;
    cfg.macrobatch_tokens = st.ring;
    OneRank r(kDeepSeekLike, cfg, 82);
    Outputs o;
    if (st.ring != 0) {  // a ring smaller than the worst case: forward only (the backward refuses it)
      r.d->poison();
      r.layer->forward(r.d->refs, r.d->out_ref(), r.comm().stream());
      MOK_ASSERT_CUDA(cudaStreamSynchronize(r.comm().stream()));
      r.layer->check();
      o.out = r.d->result();
      EXPECT_EQ(bit_diffs(o.out, base.out), 0) << st.name << ": out";
      continue;
    }
    std::string e[2];
    o = r.step(r.d->refs, e);
    ASSERT_EQ(e[0] + e[1], "") << st.name;
    if (&st == &settings[0]) {
      base = o;
      continue;
    }
    std::string what;
    EXPECT_TRUE(same_bits(base, o, what)) << st.name << ": " << what << " differs from the default setting";
  }
}

// ---------------------------------------------------------------------------------------------
// LargeBuffers: the combine slots, the routed rows and the ring exceed 2^31 bytes.
// ---------------------------------------------------------------------------------------------
TEST(LargeBuffers, ForwardOver2GiBMatchesTheSpecOnSampledTokens) {
  MOK_REQUIRE_GPUS(1);
  const mok::LayerShape shape{{20000}, 7168, 256, 32, 8, 0};
  const int64_t T = shape.tokens_of(0), H = shape.hidden, k = shape.top_k;
  ASSERT_GT(T * k * H * 2, int64_t(1) << 31);
  mok::Config cfg = config_for(mok::ForwardPath::Megakernel);
  const auto wl = mok::make_workload(shape, mok::Routing::Uniform, 83, mok::kWeights);
  auto group = ranks_on_gpus(1, shape, cfg);
  RankData d(shape, wl, 0);
  mok::Layer layer(group[0], shape, cfg, d.dw);
  const std::vector<mok::bf16> got = d.forward_once(layer, group[0]);
  // The spec on the sampled tokens alone (each token's output depends on its row only): the
  // first ones, some in the middle, and the last ones, whose combine slots lie past 2^31 bytes.
  const std::vector<int64_t> sample = {0, 1, 2, 3, 9999, 10000, 15000, T - 8, T - 7, T - 6, T - 5, T - 4, T - 3, T - 2, T - 1};
  mok::LayerShape sub = shape;
  sub.tokens = {static_cast<int64_t>(sample.size())};
  std::vector<mok::ref::RankInput> in(1);
  for (int64_t t : sample) {
    const auto& src = wl.inputs[0];
    in[0].x.insert(in[0].x.end(), src.x.begin() + t * H, src.x.begin() + (t + 1) * H);
    in[0].topk_idx.insert(in[0].topk_idx.end(), src.topk_idx.begin() + t * k, src.topk_idx.begin() + (t + 1) * k);
    in[0].topk_w.insert(in[0].topk_w.end(), src.topk_w.begin() + t * k, src.topk_w.begin() + (t + 1) * k);
  }
  const auto ref = mok::ref::Engine(sub, cfg).forward(in, wl.weights);
  double num = 0, den = 0;
  for (size_t q = 0; q < sample.size(); ++q) {
    for (int64_t c = 0; c < H; ++c) {
      const double a = float(got[sample[q] * H + c]), b = float(ref.out[0][q * H + c]);
      if (!std::isfinite(a)) num = INFINITY;
      num += (a - b) * (a - b);
      den += b * b;
    }
  }
  const double rel = std::sqrt(num / den);
  std::printf("[large] T = %lld, combine slots %.2f GB: rel err %.2e on %zu sampled tokens\n", (long long)T,
              double(T * k * H * 2) * 1e-9, rel, sample.size());
  EXPECT_LT(rel, 1e-2);
}

// ---------------------------------------------------------------------------------------------
// Collective failure, the cross-rank agreement, one call at a time.
// ---------------------------------------------------------------------------------------------
// Rank 1 calls each step only after rank 0's wait has expired; both then run two more steps.
// Every call either raises by name or matches the reference: never a silent mismatch.
class LatePeer : public ::testing::TestWithParam<std::tuple<mok::DispatchPath, bool>> {};

TEST_P(LatePeer, EveryCallRaisesByNameOrMatches) {
  MOK_REQUIRE_GPUS(2);
  const auto [dispatch, backward] = GetParam();
  const mok::LayerShape shape{{300, 500}, 1024, 512, 16, 4, 0};
  mok::Config cfg = config_for(mok::ForwardPath::Megakernel);
  cfg.dispatch = dispatch;
  cfg.wait_timeout_s = 0.5;
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 84);
  const auto ref = mok::ref::Engine(shape, cfg).forward(wl.inputs, wl.weights);
  auto group = ranks_on_gpus(2, shape, cfg);
  std::mutex m;
  std::vector<std::string> log;
  int silent = 0, raised = 0;
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    RankGrads gr(shape, static_cast<int>(r));
    mok::bf16* d_out = upload(wl.d_out[r].data(), wl.d_out[r].size());
    const auto dref = mok::TensorRef::contiguous(d_out, mok::DType::BF16, {d.T, d.H});
    mok::Layer layer(comm, shape, cfg, d.dw);
    if (backward) {  // a healthy forward first; the late call is the backward
      d.forward_once(layer, comm);
      comm.host_barrier();
    }
    for (int step = 0; step < 3; ++step) {
      if (r == 1 && step == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      std::string err;
      bool matched = false;
      try {
        if (backward && step == 0) {
          layer.backward(d.refs, dref, gr.g, comm.stream());
        } else {
          d.poison();
          layer.forward(d.refs, d.out_ref(), comm.stream());
        }
        EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
        layer.check();
        if (!(backward && step == 0)) matched = bit_diffs(d.result(), ref.out[r]) == 0 ||
                                                mok::test::rel_err(mok::test::as_float(d.result(), 0, d.T * d.H),
                                                                   mok::test::as_float(ref.out[r], 0, d.T * d.H).data(),
                                                                   d.T * d.H) < 1e-2;
      } catch (const mok::Error& e) {
        err = e.what();
      }
      std::lock_guard<std::mutex> lock(m);
      log.push_back("rank " + std::to_string(r) + " step " + std::to_string(step) + ": " +
                    (err.empty() ? (matched ? "matches" : "NO ERROR AND WRONG") : err));
      if (!err.empty()) ++raised;
      if (err.empty() && !matched && !(backward && step == 0)) ++silent;
      if (err.empty() && backward && step == 0) ++silent;  // the late backward cannot have succeeded
    }
    cudaFree(d_out);
  });
  for (const auto& l : log) std::printf("[late peer] %s\n", l.c_str());
  EXPECT_EQ(silent, 0);
  EXPECT_GE(raised, 4);  // at least both ranks' later steps
  group.destroy();
}

INSTANTIATE_TEST_SUITE_P(Paths, LatePeer,
                         ::testing::Combine(::testing::Values(mok::DispatchPath::Pull, mok::DispatchPath::Push),
                                            ::testing::Bool()),
                         [](const auto& p) {
                           return std::string(mok::to_string(std::get<0>(p.param))) +
                                  (std::get<1>(p.param) ? "_backward" : "_forward");
                         });

// The layer's config differs between the ranks: named on both.
TEST(ConfigMismatch, NamedOnBothRanks) {
  MOK_REQUIRE_GPUS(2);
  const mok::LayerShape shape{{300, 500}, 1024, 512, 16, 4, 0};
  const mok::Config cfg = config_for(mok::ForwardPath::Megakernel);
  const auto wl = mok::make_workload(shape, mok::Routing::Uniform, 85);
  auto group = ranks_on_gpus(2, shape, cfg);
  std::string arg[2];
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    mok::Config mine = cfg;
    if (r == 1) mine.fwd_comm_sms = 16;
    arg[r] = error_argument([&] { mok::Layer layer(comm, shape, mine, d.dw); });
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(arg[r].find("config.fwd_comm_sms"), std::string::npos) << "rank " << r << ": " << arg[r];
}

// One rank's weights are bad (misaligned): that rank names them, the other names the refusal, and
// neither waits for the other (the agreement carries the verdict).
TEST(ConfigMismatch, ARankRefusingItsArgumentsIsNamedOnEveryRank) {
  MOK_REQUIRE_GPUS(2);
  const mok::LayerShape shape{{300, 500}, 1024, 512, 16, 4, 0};
  mok::Config cfg = config_for(mok::ForwardPath::Megakernel);
  const auto wl = mok::make_workload(shape, mok::Routing::Uniform, 87);
  auto group = ranks_on_gpus(2, shape, cfg);
  std::string arg[2];
  double seconds[2] = {0, 0};
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    mok::DeviceWeights w = d.dw;
    if (r == 0) w.w_up.data = static_cast<const char*>(w.w_up.data) + 2;
    const auto t0 = std::chrono::steady_clock::now();
    arg[r] = error_argument([&] { mok::Layer layer(comm, shape, cfg, w); });
    seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  EXPECT_EQ(arg[0], "weights.w_up");
  EXPECT_NE(arg[1].find("arguments accepted by every rank"), std::string::npos) << arg[1];
  EXPECT_LT(seconds[1], 30.0) << "rank 1 waited for rank 0";
}

__global__ void sleep_kernel(unsigned ms) {
  for (unsigned i = 0; i < ms; ++i) __nanosleep(1000000);
}

// A call on a second stream while the previous one still runs on the first is ordered after it on
// the GPU (no host wait): both give the bits of a lone call.
TEST(Concurrency, SecondStreamIsOrderedAfterTheFirst) {
  MOK_REQUIRE_GPUS(1);
  OneRank r(kSmall, config_for(mok::ForwardPath::Megakernel), 86);
  cudaStream_t a = r.comm().stream(), b = nullptr;
  MOK_ASSERT_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  r.layer->forward(r.d->refs, r.d->out_ref(), a);
  MOK_ASSERT_CUDA(cudaStreamSynchronize(a));
  r.layer->check();
  const auto lone = r.d->result();
  r.d->poison();
  mok::bf16* out2 = nullptr;
  MOK_ASSERT_CUDA(cudaMalloc(&out2, lone.size() * 2));
  MOK_ASSERT_CUDA(cudaMemset(out2, 0xff, lone.size() * 2));
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  sleep_kernel<<<1, 1, 0, a>>>(300);  // the first call is still queued when the second comes
  r.layer->forward(r.d->refs, r.d->out_ref(), a);
  r.layer->forward(r.d->refs, mok::TensorRef::contiguous(out2, mok::DType::BF16, {kSmall.tokens_of(0), kSmall.hidden}),
                   b);
  MOK_ASSERT_CUDA(cudaStreamSynchronize(b));
  MOK_ASSERT_CUDA(cudaStreamSynchronize(a));
  r.layer->check();
  EXPECT_EQ(bit_diffs(r.d->result(), lone), 0) << "first call";
  EXPECT_EQ(bit_diffs(download(out2, static_cast<int64_t>(lone.size())), lone), 0) << "second call";
  cudaFree(out2);
  cudaStreamDestroy(b);
}

}  // namespace
