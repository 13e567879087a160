// CPU tests of the communication layer's host logic: environment bootstrap, the TCP unique-id
// broadcast, the NCCL version check and the handshake's mismatch messages.
#include <gtest/gtest.h>

#include <bit>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mok/comm.hpp"

namespace mc = mok::comm;

namespace {

mc::EnvLookup env_of(const std::map<std::string, std::string>& vars) {
  auto copy = std::make_shared<std::map<std::string, std::string>>(vars);
  return [copy](const char* name) -> const char* {
    auto it = copy->find(name);
    return it == copy->end() ? nullptr : it->second.c_str();
  };
}

// Runs f, expects a mok::Error of `kind` whose argument is `arg` and whose message contains every
// string of `parts`.
template <typename F>
void expect_error(F&& f, mok::ErrorKind kind, const std::string& arg, std::vector<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected mok::Error about '" << arg << "'";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_EQ(e.argument(), arg) << e.what();
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
}

int free_port_guess() {
  std::random_device rd;
  return 20000 + static_cast<int>(rd() % 20000);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Environment parsing
// ---------------------------------------------------------------------------------------------
TEST(CommBootstrapEnv, Torchrun) {
  auto env = mc::parse_bootstrap_env(env_of({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "3"},
                                            {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 3);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.bootstrap_port, 29501);  // MASTER_PORT is torch's TCPStore; mok uses the next one
  EXPECT_TRUE(env.nccl_comm_id.empty());
}

TEST(CommBootstrapEnv, BootstrapPortOverrideAndLocalRankDefault) {
  auto env = mc::parse_bootstrap_env(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
                                            {"MASTER_PORT", "29500"}, {"MOK_BOOTSTRAP_PORT", "40000"}}));
  EXPECT_EQ(env.bootstrap_port, 40000);
  EXPECT_EQ(env.local_rank, 1);  // LOCAL_RANK absent: RANK (one node)
}

TEST(CommBootstrapEnv, Mpirun) {
  auto env = mc::parse_bootstrap_env(env_of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"MASTER_ADDR", "node0"},
                                            {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(env.launcher, "mpirun");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.bootstrap_port, 1235);
}

TEST(CommBootstrapEnv, NcclCommIdNeedsNoMaster) {
  auto env = mc::parse_bootstrap_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"NCCL_COMM_ID", "127.0.0.1:5000"}}));
  EXPECT_EQ(env.nccl_comm_id, "127.0.0.1:5000");
  EXPECT_TRUE(env.master_addr.empty());
}

TEST(CommBootstrapEnv, SingleRankNeedsNoMaster) {
  auto env = mc::parse_bootstrap_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}}));
  EXPECT_EQ(env.world_size, 1);
}

// from_unique_id refuses a rank outside the world, an empty world and a negative device by name,
// before any NCCL or CUDA call (so this runs without a GPU).
TEST(CommFromUniqueId, ArgumentsAreNamedBeforeAnyNcclCall) {
  using K = mok::ErrorKind;
  ncclUniqueId id{};
  mc::CommOptions opt;
  expect_error([&] { mc::Communicator::from_unique_id(id, 0, 0, 0, opt); }, K::InvalidArgument, "world_size",
               {">= 1", "got 0"});
  expect_error([&] { mc::Communicator::from_unique_id(id, 2, 2, 0, opt); }, K::InvalidArgument, "rank",
               {"[0, world_size = 2)", "got 2"});
  expect_error([&] { mc::Communicator::from_unique_id(id, -1, 2, 0, opt); }, K::InvalidArgument, "rank", {"got -1"});
  expect_error([&] { mc::Communicator::from_unique_id(id, 0, 2, -3, opt); }, K::InvalidArgument, "device",
               {"got -3"});
  opt.config.wait_timeout_s = 0;
  expect_error([&] { mc::Communicator::from_unique_id(id, 0, 1, 0, opt); }, K::InvalidArgument,
               "config.wait_timeout_s", {"(0, 3600]"});
}

TEST(CommBootstrapEnv, ErrorsNameTheVariable) {
  using K = mok::ErrorKind;
  expect_error([] { mc::parse_bootstrap_env(env_of({})); }, K::InvalidArgument, "RANK",
               {"must be set", "torchrun", "mpirun"});
  expect_error([] { mc::parse_bootstrap_env(env_of({{"RANK", "0"}})); }, K::InvalidArgument, "WORLD_SIZE",
               {"must be set"});
  expect_error([] { mc::parse_bootstrap_env(env_of({{"RANK", "x1"}, {"WORLD_SIZE", "2"}})); }, K::InvalidArgument,
               "RANK", {"decimal integer", "'x1'"});
  expect_error([] { mc::parse_bootstrap_env(env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}})); }, K::InvalidArgument,
               "RANK", {"0 <= RANK <= 1", "got 2"});
  expect_error([] { mc::parse_bootstrap_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}})); }, K::InvalidArgument,
               "WORLD_SIZE", {"1 <= WORLD_SIZE", "got 0"});
  expect_error([] { mc::parse_bootstrap_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "-1"}})); },
               K::InvalidArgument, "LOCAL_RANK", {"got -1"});
  expect_error([] { mc::parse_bootstrap_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}})); },
               K::InvalidArgument, "MASTER_ADDR", {"must be set"});
  expect_error([] { mc::parse_bootstrap_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}})); },
               K::InvalidArgument, "MASTER_PORT", {"must be set", "MOK_BOOTSTRAP_PORT"});
  expect_error([] {
    mc::parse_bootstrap_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}}));
  }, K::InvalidArgument, "MASTER_PORT", {"got 70000"});
  expect_error([] { mc::parse_bootstrap_env(env_of({{"OMPI_COMM_WORLD_RANK", "0"}})); }, K::InvalidArgument,
               "OMPI_COMM_WORLD_SIZE", {"must be set"});
}

// ---------------------------------------------------------------------------------------------
// TCP broadcast of the unique id
// ---------------------------------------------------------------------------------------------
TEST(CommBootstrapTcp, BroadcastToThreeRanks) {
  const int world = 4;
  std::vector<uint8_t> payload(128);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7 + 3);
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int port = free_port_guess();
    std::vector<std::vector<uint8_t>> got(world, std::vector<uint8_t>(128, 0));
    got[0] = payload;
    std::vector<std::string> errors(world);
    std::vector<std::thread> threads;
    // Receivers first: they must retry until rank 0 listens.
    for (int r = world - 1; r >= 0; --r) {
      threads.emplace_back([&, r] {
        try {
          mc::tcp_broadcast(r, world, "127.0.0.1", port, got[static_cast<size_t>(r)], 20.0);
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
      });
      if (r == world - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    for (auto& t : threads) t.join();
    if (errors[0].find("bind") != std::string::npos) continue;  // port taken: try another
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
      EXPECT_EQ(got[static_cast<size_t>(r)], payload) << "rank " << r;
    }
    return;
  }
  FAIL() << "no free port found";
}

TEST(CommBootstrapTcp, ConnectTimesOutWithNamedError) {
  std::vector<uint8_t> blob(128);
  try {
    mc::tcp_broadcast(1, 2, "127.0.0.1", free_port_guess(), blob, 0.3);
    FAIL() << "expected a timeout";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.kind(), mok::ErrorKind::Timeout);
    EXPECT_EQ(e.argument(), "bootstrap: connect");
    EXPECT_NE(std::string(e.what()).find("could not reach rank 0"), std::string::npos) << e.what();
  }
}

TEST(CommBootstrapTcp, AcceptTimesOutWithNamedError) {
  std::vector<uint8_t> blob(128);
  try {
    mc::tcp_broadcast(0, 3, "127.0.0.1", free_port_guess(), blob, 0.3);
    FAIL() << "expected a timeout";
  } catch (const mok::Error& e) {
    if (e.argument() == "bootstrap: bind") GTEST_SKIP() << "port taken";
    EXPECT_EQ(e.kind(), mok::ErrorKind::Timeout);
    EXPECT_EQ(e.argument(), "bootstrap: accept");
    EXPECT_NE(std::string(e.what()).find("only 0 of 2 ranks"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// NCCL version check
// ---------------------------------------------------------------------------------------------
TEST(CommVersion, MismatchIsAClearError) {
  EXPECT_NO_THROW(mc::check_nccl_version(22809, 22809));
  try {
    mc::check_nccl_version(22803, 22809);
    FAIL();
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.kind(), mok::ErrorKind::Unsupported);
    EXPECT_EQ(e.argument(), "NCCL version");
    const std::string m = e.what();
    EXPECT_NE(m.find("2.28.3 (22803)"), std::string::npos) << m;
    EXPECT_NE(m.find("2.28.9 (22809)"), std::string::npos) << m;
    EXPECT_NE(m.find("MOK_NCCL_ROOT"), std::string::npos) << m;
  }
}

// ---------------------------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------------------------
namespace {

struct Rank {
  std::optional<mok::LayerShape> shape = mok::LayerShape::uniform(2, 4096, 7168, 2048, 256, 8);
  mok::Config config;
  std::vector<mc::WindowSpec> windows = {{"x", 1 << 20}, {"combine", 2 << 20}};
  int barriers = 64;
  int nccl = 22809;
  std::vector<mc::HandshakeField> fields() const {
    return mc::handshake_fields(shape, config, windows, 2, barriers, nccl);
  }
};

// Checks rank 0's view of the exchange of `a` (rank 0) and `b` (rank 1).
void check_pair(const Rank& a, const Rank& b) {
  mc::check_handshake(a.fields(), {mc::pack_handshake(a.fields()), mc::pack_handshake(b.fields())});
}

}  // namespace

TEST(CommWindowPool, PicksTheSmallestFreeWindowThatFits) {
  using mc::pick_free_window;
  EXPECT_EQ(pick_free_window({}, {}, 16), -1);
  EXPECT_EQ(pick_free_window({100, 50, 200}, {false, false, false}, 10), -1);  // none free
  EXPECT_EQ(pick_free_window({100, 50, 200}, {true, true, true}, 10), 1);      // smallest
  EXPECT_EQ(pick_free_window({100, 50, 200}, {true, true, true}, 60), 0);      // smallest that fits
  EXPECT_EQ(pick_free_window({100, 50, 200}, {true, true, true}, 200), 2);     // exact
  EXPECT_EQ(pick_free_window({100, 50, 200}, {true, true, true}, 201), -1);    // too big
  EXPECT_EQ(pick_free_window({64, 64, 64}, {false, true, true}, 64), 1);       // lowest index on ties
  expect_error([] { pick_free_window({1, 2}, {true}, 1); }, mok::ErrorKind::InvalidArgument, "window pool",
               {"one entry per window"});
}

TEST(CommHandshake, IdenticalRanksAgree) {
  Rank a, b;
  EXPECT_NO_THROW(check_pair(a, b));
  b.config.cpu_threads = 7;  // host-only knob: may differ
  EXPECT_NO_THROW(check_pair(a, b));
}

TEST(CommHandshake, MismatchNamesTheField) {
  using K = mok::ErrorKind;
  {
    Rank a, b;
    b.shape->hidden = 2048;
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: shape.hidden",
                 {"all ranks must pass the same value", "rank 0 has 7168", "rank 1 has 2048"});
  }
  {
    Rank a, b;
    b.shape->tokens[1] = 100;
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: shape.tokens[1]",
                 {"rank 0 has 4096", "rank 1 has 100"});
  }
  {
    Rank a, b;
    b.config.wait_timeout_s = 2.5;
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: config.wait_timeout_s",
                 {"rank 0 has 5", "rank 1 has 2.5"});
  }
  {
    Rank a, b;
    b.config.fwd_comm_sms = 24;
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: config.fwd_comm_sms",
                 {"rank 0 has 0", "rank 1 has 24"});
  }
  {
    Rank a, b;
    b.config.dispatch = mok::DispatchPath::Push;  // one rank pushing while the other pulls would lose rows
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: config.dispatch",
                 {"rank 0 has 0", "rank 1 has 1"});
  }
  {
    Rank a, b;
    b.config.fp8_keep_weight_codes_t = true;  // the backward's workspace differs: the windows would too
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: config.fp8_keep_weight_codes_t",
                 {"rank 0 has 0", "rank 1 has 1"});
  }
  {
    Rank a, b;
    b.windows[1].bytes = 3 << 20;
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: windows[1].bytes ('combine')",
                 {"rank 0 has 2097152", "rank 1 has 3145728"});
  }
  {
    Rank a, b;
    b.windows[0].name = "y";
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: windows[0].name", {"name hash"});
  }
  {
    Rank a, b;
    b.windows.pop_back();
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: windows.count",
                 {"rank 0 has 2", "rank 1 has 1"});
  }
  {
    Rank a, b;
    b.shape.reset();
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: shape.given",
                 {"rank 0 has 1", "rank 1 has 0"});
  }
  {
    Rank a, b;
    b.nccl = 22803;
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: nccl.runtime_version",
                 {"rank 0 has 22809", "rank 1 has 22803"});
  }
  {
    Rank a, b;
    b.barriers = 8;
    expect_error([&] { check_pair(a, b); }, K::InvalidArgument, "handshake: lsa_barrier_count",
                 {"rank 0 has 64", "rank 1 has 8"});
  }
}

TEST(CommHandshake, ForeignRecordIsRejected) {
  Rank a;
  std::vector<int64_t> junk(mc::kHandshakeWords, 42);
  expect_error([&] { mc::check_handshake(a.fields(), {mc::pack_handshake(a.fields()), junk}); },
               mok::ErrorKind::InvalidArgument, "handshake: mok.protocol", {"rank 1 sent something else"});
}

TEST(CommHandshake, TooManyFieldsIsAnError) {
  Rank a;
  a.windows.assign(300, {"w", 4096});
  expect_error([&] { mc::pack_handshake(a.fields()); }, mok::ErrorKind::InvalidArgument, "handshake",
               {"at most"});
}

// ---------------------------------------------------------------------------------------------
// Wait names and the timeout error
// ---------------------------------------------------------------------------------------------
TEST(CommWaitError, NamesTheWaitRankAndPeer) {
  EXPECT_EQ(mc::wait_name(mc::kWaitLsaBarrier), "comm.lsa_barrier");
  mc::register_wait_name(mc::kWaitUserBase + 17, "test.dispatch_ready");
  EXPECT_EQ(mc::wait_name(mc::kWaitUserBase + 17), "test.dispatch_ready");
  EXPECT_EQ(mc::wait_name(99999), "wait#99999");
  mc::WaitErrorRecord r{};
  r.status = 2;
  r.wait_id = mc::kWaitUserBase + 17;
  r.rank = 0;
  r.peer = 1;
  r.expected = 5;
  r.observed = 4;
  r.waited_ns = 1500000000ull;
  const mok::Error e = mc::wait_error(r, 1.5);
  EXPECT_EQ(e.kind(), mok::ErrorKind::Timeout);
  EXPECT_EQ(e.argument(), "test.dispatch_ready");
  const std::string m = e.what();
  EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
  EXPECT_NE(m.find("peer 1"), std::string::npos) << m;
  EXPECT_NE(m.find("to reach 5, last saw 4"), std::string::npos) << m;
}

// A peer's failure as the rank it told reports it: the wait's name, the rank it expired on.
TEST(CommWaitError, PeerNoticeNamesTheOriginRank) {
  mc::WaitErrorRecord r{};
  r.status = 2;
  r.wait_id = mc::kWaitLsaBarrier;
  r.rank = 1;
  r.origin = 0;
  r.peer = -1;
  const mok::Error e = mc::wait_error(r, 0.5);
  EXPECT_EQ(e.kind(), mok::ErrorKind::Timeout);
  EXPECT_EQ(e.argument(), "comm.lsa_barrier");
  const std::string m = e.what();
  EXPECT_NE(m.find("rank 0 gave up"), std::string::npos) << m;
  EXPECT_NE(m.find("told rank 1"), std::string::npos) << m;
}
