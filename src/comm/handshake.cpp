// mok — start-up agreement between ranks, the NCCL version check, and wait names.
#include <bit>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "mok/comm.hpp"

namespace mok::comm {
namespace {

constexpr int64_t kHandshakeMagic = 0x6d6f6b2d68733031;  // "mok-hs01"
// 2: the forward's paths (dispatch, combine, clusters); 3: share_workspace, saved_forwards, and the
// backward's call words after the router weights; 4: fp8_keep_weight_codes_t (a field more).
constexpr int64_t kProtocolVersion = 4;

// FNV-1a, so that window names can be compared as one word.
int64_t hash_name(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h);
}

std::string version_text(int v) {
  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z for versions >= 2.9.
  std::ostringstream s;
  if (v >= 10000) {
    s << v / 10000 << "." << (v / 100) % 100 << "." << v % 100;
  } else {
    s << v / 1000 << "." << (v / 100) % 10 << "." << v % 100;
  }
  s << " (" << v << ")";
  return s.str();
}

std::string value_text(const HandshakeField& f, int64_t v) {
  if (f.is_double) {
    std::ostringstream s;
    s << std::bit_cast<double>(v);
    return s.str();
  }
  if (f.name.ends_with(".name")) {
    std::ostringstream s;
    s << "name hash " << std::hex << static_cast<uint64_t>(v);
    return s.str();
  }
  return std::to_string(v);
}

std::mutex g_names_mutex;
std::map<uint32_t, std::string>& names() {
  static std::map<uint32_t, std::string> m = {
      {kWaitLsaBarrier, "comm.lsa_barrier"},
      {kWaitFlag, "comm.flag"},
      {kWaitCounter, "comm.counter"},
  };
  return m;
}

}  // namespace

void check_nccl_version(int runtime_version, int compiled_version) {
  if (runtime_version != compiled_version) {
    throw Error(ErrorKind::Unsupported, "NCCL version",
                detail::concat("the NCCL library loaded at run time (", version_text(runtime_version),
                               ") must be the one mok's device code was compiled against (",
                               version_text(compiled_version),
                               "): device-API structures differ between NCCL versions; rebuild mok with "
                               "-DMOK_NCCL_ROOT=<that NCCL> or load the matching libnccl.so.2"));
  }
}

std::vector<HandshakeField> handshake_fields(const std::optional<LayerShape>& shape,
                                             const Config& config,
                                             const std::vector<WindowSpec>& windows,
                                             int world_size, int lsa_barrier_count,
                                             int nccl_runtime_version) {
  std::vector<HandshakeField> f;
  auto add = [&](std::string name, int64_t v) { f.push_back({std::move(name), v, false}); };
  auto add_double = [&](std::string name, double v) {
    f.push_back({std::move(name), std::bit_cast<int64_t>(v), true});
  };
  add("mok.protocol", kProtocolVersion);
  add("nccl.compiled_version", NCCL_VERSION_CODE);
  add("nccl.runtime_version", nccl_runtime_version);
  add("world_size", world_size);
  add("lsa_barrier_count", lsa_barrier_count);
  add("shape.given", shape.has_value() ? 1 : 0);
  add("windows.count", static_cast<int64_t>(windows.size()));
  // Config (cpu_threads is host-only and may differ).
  add("config.fwd_comm_sms", config.fwd_comm_sms);
  add("config.bwd_comm_sms", config.bwd_comm_sms);
  add("config.minibatch_tokens", config.minibatch_tokens);
  add("config.macrobatch_tokens", config.macrobatch_tokens);
  add("config.precision", static_cast<int64_t>(config.precision));
  // Paths that change what one rank expects of the others (who moves rows, and where).
  add("config.forward_path", static_cast<int64_t>(config.forward_path));
  add("config.combine", static_cast<int64_t>(config.combine));
  add("config.dispatch", static_cast<int64_t>(config.dispatch));
  add("config.fwd_clusters", config.fwd_clusters ? 1 : 0);
  // Collective decisions follow from these: whether a layer's windows come from the shared
  // workspace, and which forwards' backwards a rank accepts.
  add("config.share_workspace", config.share_workspace ? 1 : 0);
  add("config.saved_forwards", config.saved_forwards);
  add("config.fp8_keep_weight_codes_t", config.fp8_keep_weight_codes_t ? 1 : 0);
  add_double("config.wait_timeout_s", config.wait_timeout_s);
  if (shape) {
    add("shape.tokens.size", static_cast<int64_t>(shape->tokens.size()));
    add("shape.hidden", shape->hidden);
    add("shape.intermediate", shape->intermediate);
    add("shape.experts", shape->experts);
    add("shape.top_k", shape->top_k);
    add("shape.shared_intermediate", shape->shared_intermediate);
    // Compared only after shape.tokens.size agreed (fields are compared in order).
    for (size_t r = 0; r < shape->tokens.size(); ++r) {
      add(detail::concat("shape.tokens[", r, "]"), shape->tokens[r]);
    }
  }
  for (size_t i = 0; i < windows.size(); ++i) {
    add(detail::concat("windows[", i, "].name"), hash_name(windows[i].name));
    add(detail::concat("windows[", i, "].bytes ('", windows[i].name, "')"),
        static_cast<int64_t>(windows[i].bytes));
  }
  return f;
}

int pick_free_window(const std::vector<size_t>& sizes, const std::vector<bool>& is_free, size_t bytes) {
  MOK_REQUIRE(sizes.size() == is_free.size(), "window pool", "sizes and free flags must have one entry per window (",
              sizes.size(), " vs ", is_free.size(), ")");
  int pick = -1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!is_free[i] || sizes[i] < bytes) continue;
    if (pick < 0 || sizes[i] < sizes[static_cast<size_t>(pick)]) pick = static_cast<int>(i);
  }
  return pick;
}

std::vector<int64_t> pack_handshake(const std::vector<HandshakeField>& fields) {
  MOK_REQUIRE(fields.size() + 2 <= kHandshakeWords, "handshake",
              "at most ", kHandshakeWords - 2, " fields fit the exchange (fewer windows or ranks), got ",
              fields.size());
  std::vector<int64_t> w(kHandshakeWords, 0);
  w[0] = kHandshakeMagic;
  w[1] = static_cast<int64_t>(fields.size());
  for (size_t i = 0; i < fields.size(); ++i) w[i + 2] = fields[i].value;
  return w;
}

void check_handshake(const std::vector<HandshakeField>& mine,
                     const std::vector<std::vector<int64_t>>& all) {
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].size() != kHandshakeWords || all[r][0] != kHandshakeMagic) {
      throw Error(ErrorKind::InvalidArgument, "handshake: mok.protocol",
                  detail::concat("all ranks must run mok's handshake; rank ", r,
                                 " sent something else (a different mok build or another program)"));
    }
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    bool differs = false;
    for (const auto& rec : all) {
      if (static_cast<size_t>(rec[1]) <= i || rec[i + 2] != mine[i].value) differs = true;
    }
    if (!differs) continue;
    std::ostringstream s;
    s << "all ranks must pass the same value:";
    for (size_t r = 0; r < all.size(); ++r) {
      s << (r ? "," : "") << " rank " << r << " has ";
      if (static_cast<size_t>(all[r][1]) <= i) {
        s << "no such field";
      } else {
        s << value_text(mine[i], all[r][i + 2]);
      }
    }
    throw Error(ErrorKind::InvalidArgument, "handshake: " + mine[i].name, s.str());
  }
}

void register_wait_name(uint32_t wait_id, std::string name) {
  std::lock_guard<std::mutex> lock(g_names_mutex);
  names()[wait_id] = std::move(name);
}

std::string wait_name(uint32_t wait_id) {
  std::lock_guard<std::mutex> lock(g_names_mutex);
  auto it = names().find(wait_id);
  if (it != names().end()) return it->second;
  return detail::concat("wait#", wait_id);
}

Error wait_error(const WaitErrorRecord& r, double timeout_s) {
  std::ostringstream s;
  if (r.origin != r.rank) {
    // A peer's failure, as this rank learned it from its abort word.
    s << "rank " << r.origin << " gave up (this wait expired there after " << timeout_s
      << " s, Config::wait_timeout_s) and told rank " << r.rank
      << ", whose kernels then stopped: the outputs of that call are not valid; the communicator is "
         "unusable now on every rank: destroy it";
    return Error(ErrorKind::Timeout, wait_name(r.wait_id), s.str());
  }
  s << "rank " << r.rank << " waited " << static_cast<double>(r.waited_ns) * 1e-9 << " s (bound "
    << timeout_s << " s, Config::wait_timeout_s) ";
  if (r.peer >= 0) s << "for peer " << r.peer << " ";
  s << "to reach " << r.expected << ", last saw " << r.observed << " (block " << r.block
    << ", thread " << r.thread << "); the communicator is unusable now on every rank: destroy it";
  return Error(ErrorKind::Timeout, wait_name(r.wait_id), s.str());
}

}  // namespace mok::comm
