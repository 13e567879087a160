// mok — bootstrap without MPI: environment parsing and a small TCP broadcast of the NCCL unique id.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "mok/comm.hpp"

namespace mok::comm {
namespace {

using Clock = std::chrono::steady_clock;

const char* lookup_var(const EnvLookup& lookup, const char* name) {
  const char* v = lookup ? lookup(name) : std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

// Parses a decimal integer in [lo, hi]; the error names the variable.
int parse_int(const char* name, const char* text, long lo, long hi, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0') {
    throw Error(ErrorKind::InvalidArgument, name,
                detail::concat("must be a decimal integer (", what, "), got '", text, "'"));
  }
  if (v < lo || v > hi) {
    throw Error(ErrorKind::InvalidArgument, name,
                detail::concat("must satisfy ", lo, " <= ", name, " <= ", hi, " (", what, "), got ", v));
  }
  return static_cast<int>(v);
}

const char* require_var(const EnvLookup& lookup, const char* name, const char* why) {
  const char* v = lookup_var(lookup, name);
  if (v == nullptr) {
    throw Error(ErrorKind::InvalidArgument, name, detail::concat("must be set (", why, ")"));
  }
  return v;
}

double seconds_left(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

std::string errno_text() { return std::strerror(errno); }

struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      if (fd >= 0) ::close(fd);
      fd = o.fd;
      o.fd = -1;
    }
    return *this;
  }
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Waits until fd is ready for `events` or the deadline passes.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const double left = seconds_left(deadline);
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int ms = static_cast<int>(std::min(left * 1000.0 + 1.0, 1000.0));
    const int r = ::poll(&p, 1, ms);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

void send_all(int fd, const void* data, size_t n, Clock::time_point deadline, const char* what) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    if (!wait_fd(fd, POLLOUT, deadline)) {
      throw Error(ErrorKind::Timeout, detail::concat("bootstrap: ", what), "peer stopped reading");
    }
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw Error(ErrorKind::Runtime, detail::concat("bootstrap: ", what), errno_text());
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void recv_all(int fd, void* data, size_t n, Clock::time_point deadline, const char* what) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    if (!wait_fd(fd, POLLIN, deadline)) {
      throw Error(ErrorKind::Timeout, detail::concat("bootstrap: ", what), "no data from rank 0");
    }
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k == 0) {
      throw Error(ErrorKind::Runtime, detail::concat("bootstrap: ", what), "rank 0 closed the connection");
    }
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw Error(ErrorKind::Runtime, detail::concat("bootstrap: ", what), errno_text());
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

constexpr uint64_t kMagic = 0x6d6f6b2d75696431ull;  // "mok-uid1"

}  // namespace

BootstrapEnv parse_bootstrap_env(const EnvLookup& lookup) {
  BootstrapEnv env;
  const int kMaxRanks = 1 << 20;
  if (lookup_var(lookup, "RANK") != nullptr || lookup_var(lookup, "WORLD_SIZE") != nullptr) {
    env.launcher = "torchrun";
    env.world_size = parse_int("WORLD_SIZE",
                               require_var(lookup, "WORLD_SIZE", "number of ranks, set by torchrun"),
                               1, kMaxRanks, "number of ranks");
    env.rank = parse_int("RANK", require_var(lookup, "RANK", "this process's rank, set by torchrun"), 0,
                         env.world_size - 1, detail::concat("WORLD_SIZE = ", env.world_size));
    const char* lr = lookup_var(lookup, "LOCAL_RANK");
    env.local_rank = lr ? parse_int("LOCAL_RANK", lr, 0, 1023, "GPU index on this node") : env.rank;
  } else if (lookup_var(lookup, "OMPI_COMM_WORLD_RANK") != nullptr ||
             lookup_var(lookup, "OMPI_COMM_WORLD_SIZE") != nullptr) {
    env.launcher = "mpirun";
    env.world_size = parse_int("OMPI_COMM_WORLD_SIZE",
                               require_var(lookup, "OMPI_COMM_WORLD_SIZE", "number of ranks, set by mpirun"),
                               1, kMaxRanks, "number of ranks");
    env.rank = parse_int("OMPI_COMM_WORLD_RANK",
                         require_var(lookup, "OMPI_COMM_WORLD_RANK", "this process's rank, set by mpirun"),
                         0, env.world_size - 1, detail::concat("OMPI_COMM_WORLD_SIZE = ", env.world_size));
    const char* lr = lookup_var(lookup, "OMPI_COMM_WORLD_LOCAL_RANK");
    env.local_rank = lr ? parse_int("OMPI_COMM_WORLD_LOCAL_RANK", lr, 0, 1023, "GPU index on this node")
                        : env.rank;
  } else {
    throw Error(ErrorKind::InvalidArgument, "RANK",
                "must be set (with WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, as torchrun does; "
                "or run under mpirun, which sets OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK)");
  }

  if (const char* id = lookup_var(lookup, "NCCL_COMM_ID")) env.nccl_comm_id = id;
  const bool need_master = env.world_size > 1 && env.nccl_comm_id.empty();
  if (const char* addr = lookup_var(lookup, "MASTER_ADDR")) {
    env.master_addr = addr;
  } else if (need_master) {
    require_var(lookup, "MASTER_ADDR", "address of rank 0, where mok serves the NCCL unique id");
  }
  if (const char* port = lookup_var(lookup, "MASTER_PORT")) {
    env.master_port = parse_int("MASTER_PORT", port, 1, 65534, "TCP port of rank 0");
  } else if (need_master && lookup_var(lookup, "MOK_BOOTSTRAP_PORT") == nullptr) {
    require_var(lookup, "MASTER_PORT", "mok serves the NCCL unique id on MASTER_PORT+1 unless MOK_BOOTSTRAP_PORT is set");
  }
  if (const char* bp = lookup_var(lookup, "MOK_BOOTSTRAP_PORT")) {
    env.bootstrap_port = parse_int("MOK_BOOTSTRAP_PORT", bp, 1, 65535, "TCP port where rank 0 serves the NCCL unique id");
  } else if (env.master_port > 0) {
    env.bootstrap_port = env.master_port + 1;
  }
  return env;
}

void tcp_broadcast(int rank, int world_size, const std::string& addr, int port,
                   std::vector<uint8_t>& blob, double timeout_s) {
  MOK_REQUIRE(world_size >= 1, "world_size", "must be >= 1, got ", world_size);
  MOK_REQUIRE(rank >= 0 && rank < world_size, "rank", "must satisfy 0 <= rank < world_size (",
              world_size, "), got ", rank);
  MOK_REQUIRE(port > 0 && port < 65536, "bootstrap port", "must be in [1, 65535], got ", port);
  MOK_REQUIRE(timeout_s > 0, "bootstrap timeout", "must be > 0 s, got ", timeout_s);
  if (world_size == 1) return;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));

  if (rank == 0) {
    Fd srv(::socket(AF_INET6, SOCK_STREAM, 0));
    bool v6 = srv.fd >= 0;
    if (!v6) srv = Fd(::socket(AF_INET, SOCK_STREAM, 0));
    if (srv.fd < 0) throw Error(ErrorKind::Runtime, "bootstrap: socket", errno_text());
    int one = 1;
    ::setsockopt(srv.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc;
    if (v6) {
      int zero = 0;
      ::setsockopt(srv.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      sockaddr_in6 sa{};
      sa.sin6_family = AF_INET6;
      sa.sin6_addr = in6addr_any;
      sa.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(srv.fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
    } else {
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_addr.s_addr = htonl(INADDR_ANY);
      sa.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(srv.fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
    }
    if (rc != 0) {
      throw Error(ErrorKind::Runtime, "bootstrap: bind",
                  detail::concat("rank 0 cannot listen on port ", port, ": ", errno_text(),
                                 " (set MOK_BOOTSTRAP_PORT to a free port)"));
    }
    if (::listen(srv.fd, 128) != 0) throw Error(ErrorKind::Runtime, "bootstrap: listen", errno_text());
    const uint64_t header[2] = {kMagic, static_cast<uint64_t>(blob.size())};
    for (int served = 0; served < world_size - 1; ++served) {
      if (!wait_fd(srv.fd, POLLIN, deadline)) {
        throw Error(ErrorKind::Timeout, "bootstrap: accept",
                    detail::concat("only ", served, " of ", world_size - 1, " ranks connected to port ", port,
                                   " within ", timeout_s, " s"));
      }
      Fd c(::accept(srv.fd, nullptr, nullptr));
      if (c.fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) { --served; continue; }
        throw Error(ErrorKind::Runtime, "bootstrap: accept", errno_text());
      }
      send_all(c.fd, header, sizeof(header), deadline, "send");
      send_all(c.fd, blob.data(), blob.size(), deadline, "send");
      // Wait for the receiver's acknowledgement so that a later close cannot drop the bytes.
      uint8_t ack = 0;
      recv_all(c.fd, &ack, 1, deadline, "acknowledgement");
    }
    return;
  }

  // Other ranks: resolve and connect, retrying until rank 0 listens.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  const int gai = ::getaddrinfo(addr.c_str(), port_text.c_str(), &hints, &res);
  if (gai != 0 || res == nullptr) {
    throw Error(ErrorKind::InvalidArgument, "MASTER_ADDR",
                detail::concat("must resolve to rank 0's address, got '", addr, "': ", gai_strerror(gai)));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> res_guard(res, &::freeaddrinfo);
  std::string last_error = "no attempt";
  while (true) {
    for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      Fd s(::socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol));
      if (s.fd < 0) { last_error = errno_text(); continue; }
      if (::connect(s.fd, ai->ai_addr, ai->ai_addrlen) != 0) { last_error = errno_text(); continue; }
      uint64_t header[2] = {0, 0};
      recv_all(s.fd, header, sizeof(header), deadline, "receive");
      if (header[0] != kMagic || header[1] != blob.size()) {
        throw Error(ErrorKind::Runtime, "bootstrap: receive",
                    detail::concat("unexpected data on ", addr, ":", port,
                                   " (another service on that port? set MOK_BOOTSTRAP_PORT)"));
      }
      recv_all(s.fd, blob.data(), blob.size(), deadline, "receive");
      const uint8_t ack = 1;
      send_all(s.fd, &ack, 1, deadline, "acknowledgement");
      return;
    }
    if (seconds_left(deadline) <= 0) {
      throw Error(ErrorKind::Timeout, "bootstrap: connect",
                  detail::concat("rank ", rank, " could not reach rank 0 at ", addr, ":", port, " within ",
                                 timeout_s, " s (last error: ", last_error, ")"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace mok::comm
