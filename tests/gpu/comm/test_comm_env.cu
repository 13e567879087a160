// Multi-process tests of Communicator::from_env: starts one mok_comm_env_worker per GPU with
// torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and checks
// their exit codes and output.
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_util.h"

extern char** environ;

#ifndef MOK_COMM_ENV_WORKER
#error "MOK_COMM_ENV_WORKER must name the worker executable"
#endif

namespace {

struct Outcome {
  int exit_code = -1;  // -1: killed after the deadline
  std::string output;
};

// A TCP port that is free right now: the kernel picks it for a socket bound to port 0. (A random
// port in 30000-49999 once collided with a port in use — that range overlaps Linux's ephemeral
// ports — and rank 0's bind failed.) Falls back to a random port if the query fails.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = 0;
  socklen_t len = sizeof(sa);
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0)
    port = ntohs(sa.sin_port);
  if (fd >= 0) ::close(fd);
  if (port > 0) return port;
  std::random_device rd;
  return 20000 + static_cast<int>(rd() % 10000);
}

// Starts `world` workers, waits up to `deadline_s`, kills the ones still running after that.
std::vector<Outcome> run_workers(const std::string& mode, int world, double deadline_s,
                                 const std::vector<std::vector<std::string>>& extra_env = {}) {
  // MASTER_PORT+1 (the default bootstrap port) need not be free even when MASTER_PORT is: a
  // run on the GPU machine once failed to bind 60718, one above the queried port. So the test
  // queries the bootstrap port itself and passes it as MOK_BOOTSTRAP_PORT.
  const int port = free_port();
  int bootstrap_port = free_port();
  if (bootstrap_port == port) bootstrap_port = free_port();
  std::vector<pid_t> pids(static_cast<size_t>(world), -1);
  std::vector<std::string> logs(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env;
    auto dropped = [](const std::string& kv) {
      for (const char* drop : {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "MASTER_ADDR=", "MASTER_PORT=",
                               "MOK_BOOTSTRAP_PORT=", "NCCL_COMM_ID=", "OMPI_COMM_WORLD_"}) {
        if (kv.rfind(drop, 0) == 0) return true;
      }
      return false;
    };
    for (char** e = environ; *e; ++e) {
      if (!dropped(*e)) env.push_back(*e);
    }
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(world));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(port));
    env.push_back("MOK_BOOTSTRAP_PORT=" + std::to_string(bootstrap_port));
    env.push_back("NCCL_NVLS_ENABLE=0");
    if (static_cast<size_t>(r) < extra_env.size()) {
      for (const auto& kv : extra_env[static_cast<size_t>(r)]) env.push_back(kv);
    }
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    logs[static_cast<size_t>(r)] = "/tmp/mok_comm_env_" + std::to_string(::getpid()) + "_" + mode + "_" + std::to_string(r) + ".log";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, logs[static_cast<size_t>(r)].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    std::string exe = MOK_COMM_ENV_WORKER;
    std::vector<char*> argv = {exe.data(), const_cast<char*>(mode.c_str()), nullptr};
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    EXPECT_EQ(rc, 0) << "posix_spawn " << exe;
    pids[static_cast<size_t>(r)] = rc == 0 ? pid : -1;
  }
  std::vector<Outcome> out(static_cast<size_t>(world));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(deadline_s);
  int left = world;
  while (left > 0) {
    for (int r = 0; r < world; ++r) {
      pid_t& pid = pids[static_cast<size_t>(r)];
      if (pid <= 0) continue;
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        out[static_cast<size_t>(r)].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        pid = -1;
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (pid_t& pid : pids) {
        if (pid > 0) {
          ::kill(pid, SIGKILL);
          ::waitpid(pid, nullptr, 0);
          pid = -1;
        }
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    std::ifstream f(logs[static_cast<size_t>(r)]);
    std::stringstream ss;
    ss << f.rdbuf();
    out[static_cast<size_t>(r)].output = ss.str();
    std::printf("--- rank %d (exit %d) ---\n%s", r, out[static_cast<size_t>(r)].exit_code,
                out[static_cast<size_t>(r)].output.c_str());
    ::unlink(logs[static_cast<size_t>(r)].c_str());
  }
  return out;
}

}  // namespace

TEST(CommEnv, TwoProcessesBootstrapAndMoveData) {
  MOK_REQUIRE_GPUS(2);
  auto out = run_workers("basic", 2, 120);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(out[static_cast<size_t>(r)].exit_code, 0) << out[static_cast<size_t>(r)].output;
}

TEST(CommEnv, HandshakeMismatchNamesTheFieldOnBothRanks) {
  MOK_REQUIRE_GPUS(2);
  auto out = run_workers("handshake", 2, 120, {{"MOK_TEST_HIDDEN=7168"}, {"MOK_TEST_HIDDEN=2048"}});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(out[static_cast<size_t>(r)].exit_code, 3) << out[static_cast<size_t>(r)].output;
    EXPECT_NE(out[static_cast<size_t>(r)].output.find("handshake: shape.hidden"), std::string::npos);
    EXPECT_NE(out[static_cast<size_t>(r)].output.find("rank 0 has 7168, rank 1 has 2048"), std::string::npos);
  }
}

// Runs worker `mode` on two processes: rank 0 must fail with a timeout naming `what`, tear down
// and exit cleanly, rank 1 exit cleanly, all within `max_s` seconds.
static void expect_rank0_timeout(const char* mode, const std::string& what, int max_s) {
  const auto start = std::chrono::steady_clock::now();
  auto out = run_workers(mode, 2, max_s + 5);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(out[0].exit_code, 0) << out[0].output;
  EXPECT_NE(out[0].output.find("timeout in '" + what), std::string::npos) << out[0].output;
  EXPECT_NE(out[0].output.find("rank 0 tore down"), std::string::npos) << out[0].output;
  EXPECT_EQ(out[1].exit_code, 0) << out[1].output;
  EXPECT_LT(s, double(max_s));
}

TEST(CommEnv, TimeoutInOneProcessAndBothTearDown) {
  MOK_REQUIRE_GPUS(2);
  expect_rank0_timeout("timeout", "test.withheld_flag'", 115);
}

// A peer that takes the NCCL id but never initializes NCCL: rank 0 gives up after its bound
// (options.bootstrap_timeout_s = 3 s) with a Timeout naming ncclCommInitRankConfig instead of
// waiting forever, aborts the communicator and exits cleanly. Rank 1 needs no GPU.
TEST(CommEnv, InitTimesOutWhenAPeerNeverJoins) {
  MOK_REQUIRE_GPUS(1);
  expect_rank0_timeout("init_timeout", "ncclCommInitRankConfig'", 25);
}

// A peer that initializes NCCL but never joins mok's handshake: rank 0's all-gather (NCCL's
// connection setup inside the call, or its kernel) gives up after options.bootstrap_timeout_s =
// 8 s; teardown aborts the communicator while NCCL still waits inside it, and rank 0 exits cleanly.
TEST(CommEnv, HandshakeTimesOutWhenAPeerNeverJoins) {
  MOK_REQUIRE_GPUS(2);
  expect_rank0_timeout("handshake_timeout", "handshake", 30);
}
