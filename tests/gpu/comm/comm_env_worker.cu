// One rank of a multi-process test of Communicator::from_env (started by test_comm_env.cu with
// torchrun-style variables). Usage:
//   mok_comm_env_worker basic|handshake|timeout|init_timeout|handshake_timeout
// Exit codes: 0 = the expected outcome, 2 = Timeout error, 3 = InvalidArgument error, 4 = other
// mok::Error, 5 = wrong data, 6 = unexpected outcome.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/device.cuh"
#include "comm_test_kernels.cuh"
#include "mok/comm.hpp"

namespace mc = mok::comm;
namespace mt = mok::comm::test;

namespace {

#define WORKER_CUDA(expr)                                                                         \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "worker: %s failed: %s\n", #expr, cudaGetErrorString(e_));             \
      return 4;                                                                                   \
    }                                                                                             \
  } while (0)

// init_timeout / handshake_timeout: rank 1 takes the NCCL id from rank 0 and then stays away from
// the next collective step, alive like a stuck peer: it never calls ncclCommInitRankConfig, or it
// initializes NCCL but never joins mok's handshake. Rank 0's from_env must give up within its
// bound with a Timeout naming that step, tear down, and leave its GPU usable.
int run_peer_never_joins(const std::string& mode) {
  const double bound_s = mode == "init_timeout" ? 3.0 : 8.0;  // 8: room for NCCL's own init
  const mc::BootstrapEnv env = mc::parse_bootstrap_env();
  if (env.rank != 0) {
    std::vector<uint8_t> blob(sizeof(ncclUniqueId));
    mc::tcp_broadcast(env.rank, env.world_size, env.master_addr, env.bootstrap_port, blob, 60);
    ncclComm_t nccl = nullptr;
    if (mode == "handshake_timeout") {
      ncclUniqueId id;
      std::memcpy(&id, blob.data(), sizeof(id));
      WORKER_CUDA(cudaSetDevice(env.local_rank));
      if (ncclCommInitRank(&nccl, env.world_size, id, env.rank) != ncclSuccess) return 4;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(bound_s + 3));
    if (nccl) (void)ncclCommAbort(nccl);
    std::printf("rank %d stayed away\n", env.rank);
    return 0;
  }
  mc::CommOptions o;
  o.bootstrap_timeout_s = bound_s;
  o.windows = {{"w", 1 << 16}};
  const auto start = std::chrono::steady_clock::now();
  try {
    auto comm = mc::Communicator::from_env(o);
    std::fprintf(stderr, "rank 0: from_env returned without its peer\n");
    return 6;
  } catch (const mok::Error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("rank 0 got after %.1f s: %s\n", s, e.what());
    if (e.kind() != mok::ErrorKind::Timeout) return 6;
    WORKER_CUDA(cudaDeviceSynchronize());  // nothing of the aborted communicator is left running
    std::printf("rank 0 tore down\n");
    return s >= bound_s && s < bound_s + 15 ? 0 : 6;
  }
}

int run(const std::string& mode) {
  if (mode == "init_timeout" || mode == "handshake_timeout") return run_peer_never_joins(mode);
  mt::register_test_wait_names();
  mc::CommOptions o;
  o.config.wait_timeout_s = mode == "timeout" ? 0.5 : 10.0;
  o.bootstrap_timeout_s = 60;
  o.lsa_barrier_count = 4;
  const uint32_t elems = 1u << 16;
  int world = std::atoi(std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : "1");
  o.windows = {{"pp", static_cast<size_t>(world) * elems * 4}};
  if (mode == "handshake") {
    const char* h = std::getenv("MOK_TEST_HIDDEN");
    o.shape = mok::LayerShape::uniform(world, 256, h ? std::atoll(h) : 7168, 2048, 8 * world, 2);
  }
  auto comm = mc::Communicator::from_env(o);
  const auto dc = mc::dev::make_device_comm(*comm);
  cudaStream_t s = comm->stream();
  unsigned long long* counters = nullptr;
  WORKER_CUDA(cudaMalloc(&counters, 4 * sizeof(unsigned long long)));
  WORKER_CUDA(cudaMemset(counters, 0, 4 * sizeof(unsigned long long)));
  auto* ok = reinterpret_cast<uint32_t*>(counters + 3);
  if (mode == "handshake") {
    std::fprintf(stderr, "rank %d: handshake unexpectedly passed\n", comm->rank());
    return 6;
  }
  if (mode == "basic") {
    mt::pattern_push<<<16, 256, 0, s>>>(dc, comm->window("pp").handle, elems, 99);
    mt::barrier_once<<<1, 64, 0, s>>>(dc, 0, ok);
    mt::pattern_verify<<<16, 256, 0, s>>>(dc, comm->window("pp").handle, elems, 99, counters);
    mt::barrier_once<<<1, 64, 0, s>>>(dc, 0, ok);
    WORKER_CUDA(cudaGetLastError());
    comm->sync_and_check(s);
    unsigned long long h[3];
    WORKER_CUDA(cudaMemcpy(h, counters, sizeof(h), cudaMemcpyDeviceToHost));
    std::printf("rank %d of %d on GPU %d: %llu checks, %llu push errors, %llu pull errors\n", comm->rank(),
                comm->world_size(), comm->device(), h[2], h[0], h[1]);
    WORKER_CUDA(cudaFree(counters));
    return (h[0] == 0 && h[1] == 0 && h[2] == static_cast<unsigned long long>(world) * elems * (1 + world)) ? 0 : 5;
  }
  if (mode == "timeout") {
    if (comm->rank() == 0) {
      mt::wait_withheld<<<1, 64, 0, s>>>(dc, comm->window("pp").handle, 1, ok);
      WORKER_CUDA(cudaGetLastError());
      try {
        comm->sync_and_check(s);
      } catch (const mok::Error& e) {
        std::printf("rank 0 got: %s\n", e.what());
        const bool named = e.kind() == mok::ErrorKind::Timeout && e.argument() == "test.withheld_flag";
        comm.reset();  // teardown after the timeout
        std::printf("rank 0 tore down\n");
        return named ? 0 : 6;
      }
      std::fprintf(stderr, "rank 0: no timeout reported\n");
      return 6;
    }
    comm.reset();  // rank 1 withholds its flag and tears down
    std::printf("rank %s tore down\n", std::getenv("RANK"));
    return 0;
  }
  std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
  return 6;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "basic";
  try {
    return run(mode);
  } catch (const mok::Error& e) {
    std::fprintf(stderr, "rank %s: %s\n", std::getenv("RANK") ? std::getenv("RANK") : "?", e.what());
    if (e.kind() == mok::ErrorKind::Timeout) return 2;
    if (e.kind() == mok::ErrorKind::InvalidArgument) return 3;
    return 4;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %s: %s\n", std::getenv("RANK") ? std::getenv("RANK") : "?", e.what());
    return 4;
  }
}
