// GPU tests of the communication layer (label gpu): one process driving all local GPUs through a
// LocalGroup, an adopted NCCL communicator, and (test_comm_env.cu) separate processes.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <string>
#include <vector>

#include "comm/device.cuh"
#include "comm_test_kernels.cuh"
#include "gpu_test_util.h"
#include "mok/comm.hpp"

namespace mc = mok::comm;
namespace mt = mok::comm::test;

namespace {

std::vector<int> first_gpus(int n) {
  std::vector<int> d;
  for (int i = 0; i < n; ++i) d.push_back(i);
  return d;
}

int gpus_for_test() { return std::min(mok::test::visible_gpus(), 8); }

mc::CommOptions options(std::vector<mc::WindowSpec> windows, double timeout_s = 10.0) {
  mc::CommOptions o;
  o.windows = std::move(windows);
  o.config.wait_timeout_s = timeout_s;
  o.lsa_barrier_count = 32;
  return o;
}

// Device buffer of `n` 64-bit counters, zeroed; freed on scope exit.
struct Counters {
  unsigned long long* p = nullptr;
  size_t n;
  explicit Counters(size_t count) : n(count) {
    if (cudaMalloc(&p, n * sizeof(*p)) != cudaSuccess || cudaMemset(p, 0, n * sizeof(*p)) != cudaSuccess) {
      throw std::runtime_error("cudaMalloc/cudaMemset failed");
    }
  }
  ~Counters() { (void)cudaFree(p); }
  std::vector<unsigned long long> read() const {
    std::vector<unsigned long long> h(n);
    if (cudaMemcpy(h.data(), p, n * sizeof(*p), cudaMemcpyDeviceToHost) != cudaSuccess) {
      throw std::runtime_error("cudaMemcpy failed");
    }
    return h;
  }
};

void check_launch() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("launch failed: ") + cudaGetErrorString(e));
}

}  // namespace

TEST(CommGpu, LocalGroupStartupChecks) {
  MOK_REQUIRE_GPUS(2);
  const int n = gpus_for_test();
  auto group = mc::LocalGroup::create(first_gpus(n), options({{"a", 1 << 20}, {"b", 12345}}));
  ASSERT_EQ(group.size(), static_cast<size_t>(n));
  for (size_t i = 0; i < group.size(); ++i) {
    auto& c = group[i];
    EXPECT_EQ(c.rank(), static_cast<int>(i));
    EXPECT_EQ(c.world_size(), n);
    EXPECT_EQ(c.device(), static_cast<int>(i));
    EXPECT_EQ(c.lsa_size(), n);
    EXPECT_TRUE(c.owns_nccl_comm());
    ASSERT_EQ(c.window_count(), 2u);
    EXPECT_NE(c.window("a").handle, nullptr);
    EXPECT_NE(c.window("b").ptr, nullptr);
    EXPECT_EQ(c.window("b").bytes, 12345u);
    EXPECT_THROW(c.window("zz"), mok::Error);
    EXPECT_NO_THROW(c.check_waits());
    EXPECT_FALSE(c.poisoned());
  }
  // A window added later is registered on every rank and usable (collective).
  // References to windows stay valid while more are added (callers keep them).
  group.run([](mc::Communicator& c, size_t) {
    const mc::Window& first = c.add_window("late", 4096);
    const ncclWindow_t handle = first.handle;
    for (int i = 0; i < 40; ++i) c.add_window("more" + std::to_string(i), 4096);
    EXPECT_EQ(first.name, "late");
    EXPECT_EQ(first.handle, handle);
    EXPECT_EQ(&first, &c.window("late"));
  });
  for (size_t i = 0; i < group.size(); ++i) EXPECT_NE(group[i].window("late").handle, nullptr);
}

// The window pool: a released window is reused by the next request it fits (smallest first), a
// request nothing fits registers a new window, and ranks whose requests differ get a named error
// on every rank instead of addressing different buffers.
TEST(CommGpu, WindowPoolReusesReleasedWindows) {
  MOK_REQUIRE_GPUS(2);
  const int n = gpus_for_test();
  auto group = mc::LocalGroup::create(first_gpus(n), options({}));
  group.run([](mc::Communicator& c, size_t) {
    const mc::Window& a = c.acquire_window("a", 1 << 20);
    const mc::Window& b = c.acquire_window("b", 4096);
    EXPECT_EQ(c.window_count(), 2u);
    c.release_window(a);
    c.release_window(b);
    EXPECT_THROW(c.release_window(b), mok::Error);  // twice
    const mc::Window& small = c.acquire_window("c", 1000);  // smallest fit: b
    EXPECT_EQ(&small, &b);
    const mc::Window& big = c.acquire_window("d", 1 << 19);  // a
    EXPECT_EQ(&big, &a);
    const mc::Window& fresh = c.acquire_window("a", 64);  // nothing free: new, name made unique
    EXPECT_EQ(c.window_count(), 3u);
    EXPECT_NE(fresh.name, "a");
    EXPECT_NE(fresh.handle, nullptr);
  });
  // Rank 0 asks for more than rank 1: both ranks get the same named error.
  std::vector<std::string> arg(static_cast<size_t>(n));
  group.run([&](mc::Communicator& c, size_t r) {
    try {
      c.acquire_window("e", r == 0 ? 8192 : 4096);
      ADD_FAILURE() << "rank " << r << " accepted a mismatched window request";
    } catch (const mok::Error& e) {
      arg[r] = e.argument();
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(arg[static_cast<size_t>(r)], "handshake: acquire_window('e').bytes");
  // Only rank 0 gives a window back: the next request of that size would reuse it on rank 0 and
  // register a new one elsewhere; every rank gets the same named error instead.
  group.run([&](mc::Communicator& c, size_t r) {
    const mc::Window& f = c.acquire_window("f", 2048);
    if (r == 0) c.release_window(f);
    try {
      c.acquire_window("g", 2048);
      ADD_FAILURE() << "rank " << r << " accepted a different pick";
    } catch (const mok::Error& e) {
      arg[r] = e.argument();
    }
    // The communicator stays usable: a request nothing fits is a new window on every rank.
    const size_t before = c.window_count();
    EXPECT_NO_THROW(c.acquire_window("h", 1 << 21));
    EXPECT_EQ(c.window_count(), before + 1);
  });
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(arg[static_cast<size_t>(r)], "handshake: acquire_window('g').reused_window (-1: new)");
  // A window of another communicator is refused.
  EXPECT_THROW(group[0].release_window(group[1].window(0)), mok::Error);
}

TEST(CommGpu, PeerStoreLoadEveryPair) {
  MOK_REQUIRE_GPUS(2);
  const int n = gpus_for_test();
  const uint32_t elems = 1u << 18;  // 1 MiB per (src, dst) pair
  auto group = mc::LocalGroup::create(first_gpus(n), options({{"pp", static_cast<size_t>(n) * elems * 4}}));
  for (uint32_t salt : {1u, 0xabcdu}) {  // twice: the second overwrites the first
    std::vector<std::vector<unsigned long long>> res(group.size());
    group.run([&](mc::Communicator& c, size_t i) {
      const auto dc = mc::dev::make_device_comm(c);
      const ncclWindow_t w = c.window("pp").handle;
      Counters errors(3), ok(1);
      mt::pattern_push<<<64, 256, 0, c.stream()>>>(dc, w, elems, salt);
      check_launch();
      mt::barrier_once<<<1, 128, 0, c.stream()>>>(dc, 0, reinterpret_cast<uint32_t*>(ok.p));
      check_launch();
      mt::pattern_verify<<<64, 256, 0, c.stream()>>>(dc, w, elems, salt, errors.p);
      check_launch();
      mt::barrier_once<<<1, 128, 0, c.stream()>>>(dc, 0, reinterpret_cast<uint32_t*>(ok.p));  // before overwrite
      check_launch();
      c.sync_and_check(c.stream());
      res[i] = errors.read();
    });
    for (size_t i = 0; i < group.size(); ++i) {
      EXPECT_EQ(res[i][0], 0u) << "rank " << i << ": values pushed to it by peers";
      EXPECT_EQ(res[i][1], 0u) << "rank " << i << ": values pulled from peers";
      EXPECT_EQ(res[i][2], static_cast<unsigned long long>(n) * elems * (1 + n)) << "rank " << i;
    }
  }
}

TEST(CommGpu, BarrierRounds) {
  MOK_REQUIRE_GPUS(2);
  const int n = gpus_for_test();
  const uint32_t ctas = 8, threads = 256, iters = 2000;
  auto group = mc::LocalGroup::create(first_gpus(n), options({{"bar", static_cast<size_t>(ctas) * n * threads * 4}}));
  std::vector<std::vector<unsigned long long>> res(group.size());
  group.run([&](mc::Communicator& c, size_t i) {
    Counters r(3);
    mt::barrier_rounds<<<ctas, threads, 0, c.stream()>>>(mc::dev::make_device_comm(c), c.window("bar").handle,
                                                         iters, r.p);
    check_launch();
    c.sync_and_check(c.stream());
    res[i] = r.read();
  });
  for (size_t i = 0; i < group.size(); ++i) {
    EXPECT_EQ(res[i][0], 0u) << "rank " << i << ": values seen before/after the barrier";
    EXPECT_EQ(res[i][1], static_cast<unsigned long long>(ctas) * iters) << "rank " << i;
    EXPECT_EQ(res[i][2], 0u) << "rank " << i;
  }
}

TEST(CommGpu, FlagHandoffsUnderLoad) {
  MOK_REQUIRE_GPUS(2);
  const int n = gpus_for_test();
  using L = mt::HandoffLayout;
  const uint32_t msgs = 25000;  // per channel and direction: 4 x 25000 = 10^5 hand-offs into each rank
  const size_t bulk = 64ull << 20;
  const uint32_t load_ctas = 16;
  auto group = mc::LocalGroup::create(first_gpus(n), options({{"handoff", L::bytes()}, {"bulk", bulk}}, 20.0));
  mt::register_test_wait_names();
  std::vector<std::vector<unsigned long long>> res(group.size());
  std::vector<double> ms(group.size());
  group.run([&](mc::Communicator& c, size_t i) {
    Counters r(6);
    int4* scratch = nullptr;
    MOK_ASSERT_CUDA(cudaMalloc(&scratch, bulk));
    MOK_ASSERT_CUDA(cudaMemsetAsync(c.window("bulk").ptr, 0x5a, bulk, c.stream()));
    c.sync_and_check(c.stream());
    c.host_barrier();
    const auto t0 = std::chrono::steady_clock::now();
    mt::handoff_under_load<<<2 * L::kChannels + load_ctas, 256, 0, c.stream()>>>(
        mc::dev::make_device_comm(c), c.window("handoff").handle, c.window("bulk").handle, bulk, scratch, msgs, r.p);
    check_launch();
    c.sync_and_check(c.stream());
    ms[i] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    res[i] = r.read();
    (void)cudaFree(scratch);
  });
  for (size_t i = 0; i < group.size(); ++i) {
    std::printf("rank %zu: %llu hand-offs received in %.1f ms (%.2f us each per channel), %.1f GB pulled as load\n", i,
                res[i][2], ms[i], ms[i] * 1e3 / msgs, static_cast<double>(res[i][4]) / 1e9);
    EXPECT_EQ(res[i][0], 0u) << "rank " << i << ": payload words wrong (data lost or reordered)";
    EXPECT_EQ(res[i][1], 0u) << "rank " << i << ": flag seen with an unexpected sequence number";
    EXPECT_EQ(res[i][2], static_cast<unsigned long long>(L::kChannels) * msgs) << "rank " << i;
    EXPECT_EQ(res[i][5], 0u) << "rank " << i << ": aborted waits";
    EXPECT_GT(res[i][4], 0u) << "rank " << i << ": the load CTAs moved nothing";
  }
}

// One rank withholds its flag: the other gets the named Timeout error; both tear down; the
// process (and its CUDA contexts) stay healthy.
TEST(CommGpu, TimeoutIsNamedAndTeardownIsClean) {
  MOK_REQUIRE_GPUS(2);
  mt::register_test_wait_names();
  const double timeout_s = 0.5;
  {
    auto group = mc::LocalGroup::create({0, 1}, options({{"flags", 4096}}, timeout_s));
    std::vector<std::string> errors(2);
    std::vector<int> kinds(2, -1);
    const auto t0 = std::chrono::steady_clock::now();
    group.run([&](mc::Communicator& c, size_t i) {
      Counters ok(1);
      if (i == 0) {
        mt::wait_withheld<<<1, 64, 0, c.stream()>>>(mc::dev::make_device_comm(c), c.window("flags").handle, 1,
                                                    reinterpret_cast<uint32_t*>(ok.p));
        check_launch();
      }  // rank 1 withholds the flag
      try {
        c.sync_and_check(c.stream());
      } catch (const mok::Error& e) {
        errors[i] = e.what();
        kinds[i] = static_cast<int>(e.kind());
        EXPECT_EQ(e.argument(), "test.withheld_flag");
      }
    });
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(kinds[0], static_cast<int>(mok::ErrorKind::Timeout)) << errors[0];
    EXPECT_NE(errors[0].find("rank 0"), std::string::npos) << errors[0];
    EXPECT_NE(errors[0].find("peer 1"), std::string::npos) << errors[0];
    EXPECT_EQ(errors[1], "");
    EXPECT_TRUE(group[0].poisoned());
    EXPECT_LT(waited, timeout_s + 5.0);
    std::printf("timeout error after %.2f s: %s\n", waited, errors[0].c_str());
    // No trap: the context of GPU 0 still works.
    MOK_ASSERT_CUDA(cudaSetDevice(0));
    void* p = nullptr;
    MOK_ASSERT_CUDA(cudaMalloc(&p, 1024));
    MOK_ASSERT_CUDA(cudaMemset(p, 0, 1024));
    MOK_ASSERT_CUDA(cudaDeviceSynchronize());
    MOK_ASSERT_CUDA(cudaFree(p));
    const auto t1 = std::chrono::steady_clock::now();
    group.destroy();
    const double teardown = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    std::printf("teardown after the timeout: %.2f s\n", teardown);
    EXPECT_LT(teardown, 30.0);
  }
  {
    // A barrier that one rank never enters names the barrier.
    auto group = mc::LocalGroup::create({0, 1}, options({}, timeout_s));
    std::vector<std::string> args(2);
    group.run([&](mc::Communicator& c, size_t i) {
      Counters ok(1);
      if (i == 1) {
        mt::barrier_once<<<1, 128, 0, c.stream()>>>(mc::dev::make_device_comm(c), 3, reinterpret_cast<uint32_t*>(ok.p));
        check_launch();
      }
      try {
        c.sync_and_check(c.stream());
      } catch (const mok::Error& e) {
        args[i] = e.argument();
        EXPECT_NE(std::string(e.what()).find("peer 0"), std::string::npos) << e.what();
      }
    });
    EXPECT_EQ(args[0], "");
    EXPECT_EQ(args[1], "comm.lsa_barrier");
  }
  // The process can build a fresh group and use it.
  auto group = mc::LocalGroup::create({0, 1}, options({{"pp", 2 * 4096 * 4}}));
  group.run([&](mc::Communicator& c, size_t) {
    Counters ok(1);
    mt::barrier_once<<<1, 128, 0, c.stream()>>>(mc::dev::make_device_comm(c), 0, reinterpret_cast<uint32_t*>(ok.p));
    check_launch();
    c.sync_and_check(c.stream());
    EXPECT_EQ(ok.read()[0], 1u);
  });
}

// A communicator the caller owns (torch's case): mok uses it and leaves it working.
TEST(CommGpu, AdoptsAnExistingNcclComm) {
  MOK_REQUIRE_GPUS(2);
  const int n = gpus_for_test();
  std::vector<ncclComm_t> comms(static_cast<size_t>(n));
  std::vector<int> devs = first_gpus(n);
  ASSERT_EQ(ncclCommInitAll(comms.data(), n, devs.data()), ncclSuccess);
  {
    auto group = mc::LocalGroup::adopt(comms, options({{"pp", static_cast<size_t>(n) * 4096 * 4}}));
    group.run([&](mc::Communicator& c, size_t i) {
      EXPECT_FALSE(c.owns_nccl_comm());
      EXPECT_EQ(c.nccl_comm(), comms[i]);
      Counters errors(3), ok(1);
      const auto dc = mc::dev::make_device_comm(c);
      mt::pattern_push<<<8, 256, 0, c.stream()>>>(dc, c.window("pp").handle, 4096, 7);
      mt::barrier_once<<<1, 128, 0, c.stream()>>>(dc, 1, reinterpret_cast<uint32_t*>(ok.p));
      mt::pattern_verify<<<8, 256, 0, c.stream()>>>(dc, c.window("pp").handle, 4096, 7, errors.p);
      mt::barrier_once<<<1, 128, 0, c.stream()>>>(dc, 1, reinterpret_cast<uint32_t*>(ok.p));
      check_launch();
      c.sync_and_check(c.stream());
      const auto e = errors.read();
      EXPECT_EQ(e[0] + e[1], 0u);
    });
  }
  // Still usable by its owner after mok is gone: an all-reduce, then the owner destroys it.
  std::vector<int*> bufs(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    MOK_ASSERT_CUDA(cudaSetDevice(i));
    MOK_ASSERT_CUDA(cudaMalloc(&bufs[static_cast<size_t>(i)], sizeof(int)));
    const int v = i + 1;
    MOK_ASSERT_CUDA(cudaMemcpy(bufs[static_cast<size_t>(i)], &v, sizeof(int), cudaMemcpyHostToDevice));
  }
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(ncclAllReduce(bufs[static_cast<size_t>(i)], bufs[static_cast<size_t>(i)], 1, ncclInt32, ncclSum,
                            comms[static_cast<size_t>(i)], nullptr),
              ncclSuccess);
  }
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  for (int i = 0; i < n; ++i) {
    MOK_ASSERT_CUDA(cudaSetDevice(i));
    MOK_ASSERT_CUDA(cudaDeviceSynchronize());
    int v = 0;
    MOK_ASSERT_CUDA(cudaMemcpy(&v, bufs[static_cast<size_t>(i)], sizeof(int), cudaMemcpyDeviceToHost));
    EXPECT_EQ(v, n * (n + 1) / 2);
    MOK_ASSERT_CUDA(cudaFree(bufs[static_cast<size_t>(i)]));
  }
  for (auto c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
}

// Ranks that disagree fail at creation with an error naming the field, on every rank.
TEST(CommGpu, HandshakeMismatchFailsOnEveryRank) {
  MOK_REQUIRE_GPUS(2);
  std::vector<ncclComm_t> comms(2);
  std::vector<int> devs = {0, 1};
  ASSERT_EQ(ncclCommInitAll(comms.data(), 2, devs.data()), ncclSuccess);
  std::vector<std::string> what(2), arg(2);
  mc::parallel_for_ranks(2, [&](size_t i) {
    auto o = options({{"x", 1 << 20}});
    o.shape = mok::LayerShape::uniform(2, 1024, i == 0 ? 7168 : 2048, 2048, 16, 4);
    try {
      auto c = mc::Communicator::from_nccl_comm(comms[i], o);
      ADD_FAILURE() << "rank " << i << " accepted a mismatched shape";
    } catch (const mok::Error& e) {
      what[i] = e.what();
      arg[i] = e.argument();
    }
  });
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(arg[i], "handshake: shape.hidden") << what[i];
    EXPECT_NE(what[i].find("rank 0 has 7168, rank 1 has 2048"), std::string::npos) << what[i];
  }
  mc::parallel_for_ranks(2, [&](size_t i) { EXPECT_EQ(ncclCommDestroy(comms[i]), ncclSuccess); });
}
