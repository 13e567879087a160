// mok — the communicator: NCCL bootstrap, start-up checks, symmetric windows, bounded-wait errors.
//
// A Communicator wraps one rank of an NCCL communicator (one GPU) together with what mok's kernels
// need from the NCCL 2.28 device API: symmetric windows (ncclMemAlloc + ncclCommWindowRegister),
// one ncclDevComm (passed by value to kernels; see src/comm/device.cuh for the device side) and a
// host-mapped record into which a kernel writes which bounded wait expired.
//
// Three ways to create one:
//   * Communicator::from_nccl_comm(comm, ...)   an existing ncclComm_t it does not own (a torch
//                                                ProcessGroupNCCL's, `pg._get_backend(dev)._comm_ptr()`);
//   * Communicator::from_unique_id(id, ...)      an NCCL unique id the caller passed to every rank
//                                                (e.g. over a torch ProcessGroup: mok.MoE's group);
//                                                mok creates and owns the NCCL communicator;
//   * Communicator::from_env(...)                torchrun / mpirun variables (RANK, WORLD_SIZE,
//                                                LOCAL_RANK, MASTER_ADDR, MASTER_PORT, or OMPI_*);
//                                                the NCCL unique id travels over a small TCP exchange
//                                                (or NCCL's own NCCL_COMM_ID bootstrap when set);
//   * LocalGroup::create({0, 1, ...}, ...)       one process driving several local GPUs (tests, bench).
//
// Creation is collective over the ranks. It checks, in this order, and throws mok::Error naming
// what failed: the NCCL library loaded at run time is the one the device code was compiled against;
// all ranks agree on world size, layer shape, config, window names/sizes and barrier count
// (handshake); NCCL reports symmetric-memory support (window registered, ncclDevCommCreate ok,
// lsaSize == nRanks on one node). NVLink multicast (NVLS) is never requested.
//
// Bounded waits: every device-side spin has a deadline (Config::wait_timeout_s). On expiry the
// kernel records the wait id, rank, peer and values in a host-mapped WaitErrorRecord, tells every
// peer through its abort word (src/comm/abort_word.h: the peers' waits give up at once and their
// kernels that touch peer memory return at entry), and returns. check_waits() turns that into
// mok::Error(ErrorKind::Timeout, "<wait name>", ...) naming the rank whose wait expired, on that
// rank and on every peer. Failure is collective and final: after it the communicator is poisoned
// on every rank (barrier epochs and flags are no longer consistent between ranks), every later
// check_usable() / check_waits() raises again, and it must be destroyed. Destruction never
// blocks on a peer kernel, so teardown is clean.
//
// Host calls that wait for the other ranks (NCCL initialization, window registration,
// ncclDevCommCreate, the handshake and barrier collectives, finalize) are bounded by
// CommOptions::bootstrap_timeout_s: on expiry they throw mok::Error(Timeout, "<NCCL call>", ...)
// and leave the communicator poisoned. Communicators mok creates are non-blocking NCCL
// communicators for that reason; a user's keeps its mode (a non-blocking one works too, but mok
// cannot abort it: after such a timeout its owner must call ncclCommAbort).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mok/config.hpp"
#include "mok/errors.hpp"

struct ncclDevComm;

namespace mok::comm {

// ---------------------------------------------------------------------------------------------
// Bootstrap from environment variables (no MPI needed).
// ---------------------------------------------------------------------------------------------
struct BootstrapEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;   // rank 0's address (unused when world_size == 1 or NCCL_COMM_ID is set)
  int master_port = 0;       // torchrun's MASTER_PORT (its TCPStore); mok does not listen on it
  int bootstrap_port = 0;    // where rank 0 serves the NCCL unique id: MOK_BOOTSTRAP_PORT or MASTER_PORT+1
  std::string nccl_comm_id;  // NCCL_COMM_ID when set: NCCL's own bootstrap is used instead of mok's TCP
  std::string launcher;      // which variables were read: "torchrun" or "mpirun"
};

// Reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (torchrun; LOCAL_RANK defaults to
// RANK when absent), else OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK (mpirun; MASTER_ADDR/MASTER_PORT
// still needed unless NCCL_COMM_ID is set). Optional: MOK_BOOTSTRAP_PORT. Throws
// mok::Error(InvalidArgument) naming the variable and the constraint. `lookup` replaces getenv
// (tests); nullptr means the process environment.
using EnvLookup = std::function<const char*(const char*)>;
BootstrapEnv parse_bootstrap_env(const EnvLookup& lookup = nullptr);

// Rank 0 sends `blob` to ranks 1..world_size-1 over TCP (rank 0 listens on `port`, the others
// connect to addr:port); on the others `blob` is replaced by what rank 0 sent. Every step has a
// deadline of `timeout_s`; on expiry throws mok::Error(Timeout, "bootstrap: ...").
void tcp_broadcast(int rank, int world_size, const std::string& addr, int port,
                   std::vector<uint8_t>& blob, double timeout_s);

// ---------------------------------------------------------------------------------------------
// Start-up checks (pure functions; the Communicator calls them, the CPU tests too).
// ---------------------------------------------------------------------------------------------
// Throws mok::Error(Unsupported, "NCCL version", ...) unless runtime == compiled.
void check_nccl_version(int runtime_version, int compiled_version);

struct WindowSpec {
  std::string name;
  size_t bytes = 0;
};

// One value every rank must agree on. Doubles travel as their bit pattern.
struct HandshakeField {
  std::string name;
  int64_t value = 0;
  bool is_double = false;
};

// Number of int64 words one rank contributes to the handshake exchange (fixed, so that the
// exchange itself cannot disagree).
inline constexpr size_t kHandshakeWords = 512;

// The fields, in the order they are compared: protocol, NCCL versions, world size, barrier count,
// shape (if given), config, then the window list.
std::vector<HandshakeField> handshake_fields(const std::optional<LayerShape>& shape,
                                             const Config& config,
                                             const std::vector<WindowSpec>& windows,
                                             int world_size, int lsa_barrier_count,
                                             int nccl_runtime_version);
// Packs fields into kHandshakeWords words (throws InvalidArgument if they do not fit).
std::vector<int64_t> pack_handshake(const std::vector<HandshakeField>& fields);
// `all[r]` is rank r's packed record. Throws mok::Error(InvalidArgument, "handshake: <field>",
// "all ranks must pass the same value: rank 0 has ..., rank 1 has ...") for the first field on
// which some rank differs from `mine`.
void check_handshake(const std::vector<HandshakeField>& mine,
                     const std::vector<std::vector<int64_t>>& all);

// Window pool: which released window a request for `bytes` reuses: the smallest free window of at
// least `bytes` (the lowest index on ties), or -1 (register a new one). `sizes[i]` and `is_free[i]`
// describe window i. Pure, so ranks with the same history pick the same window.
int pick_free_window(const std::vector<size_t>& sizes, const std::vector<bool>& is_free, size_t bytes);

// ---------------------------------------------------------------------------------------------
// Bounded-wait error record (host-mapped; written by the device, read by the host).
// ---------------------------------------------------------------------------------------------
struct alignas(64) WaitErrorRecord {
  uint32_t status;     // 0 = none, 1 = being written, 2 = complete
  uint32_t wait_id;    // which wait (see wait ids below and register_wait_name)
  int32_t rank;        // rank that wrote the record
  int32_t origin;      // rank whose wait expired: == rank, or the peer that told this rank
  int32_t peer;        // peer it waited for (-1 = not one peer, or not known here)
  uint32_t block;      // blockIdx.x of the waiting thread
  uint32_t thread;     // threadIdx.x
  uint64_t expected;   // value waited for
  uint64_t observed;   // last value seen
  uint64_t waited_ns;  // how long it waited
};

// Wait ids of the communication layer; other components register theirs (>= kWaitUserBase).
enum WaitId : uint32_t {
  kWaitNone = 0,
  kWaitLsaBarrier = 1,  // "comm.lsa_barrier": a peer did not arrive at an LSA barrier
  kWaitFlag = 2,        // "comm.flag": a flag did not reach its value
  kWaitCounter = 3,     // "comm.counter": a counter did not reach its target
  kWaitUserBase = 1000,
};
// Names a wait id for error messages (thread-safe; later registrations replace earlier ones).
void register_wait_name(uint32_t wait_id, std::string name);
std::string wait_name(uint32_t wait_id);
// The error a WaitErrorRecord stands for (ErrorKind::Timeout, argument = wait name).
Error wait_error(const WaitErrorRecord& record, double timeout_s);

// ---------------------------------------------------------------------------------------------
// Communicator.
// ---------------------------------------------------------------------------------------------
struct CommOptions {
  std::optional<LayerShape> shape;   // checked in the handshake when given
  Config config;                     // wait_timeout_s bounds every device wait
  std::vector<WindowSpec> windows;   // symmetric windows, allocated and registered at creation
  int lsa_barrier_count = 64;        // barrier indices kernels may use concurrently
  double bootstrap_timeout_s = 300;  // bound of every host-side wait for the other ranks
};

struct Window {
  std::string name;
  size_t bytes = 0;
  void* ptr = nullptr;            // this rank's buffer (ncclMemAlloc); for host-side CUDA calls
  ncclWindow_t handle = nullptr;  // for kernels: ncclGetLsaPointer(handle, offset, peer)
};

class Communicator {
 public:
  // Collective over `comm`'s ranks; the current CUDA device must not matter (the comm's device is
  // used). The communicator is not owned: it is never finalized or destroyed here.
  static std::unique_ptr<Communicator> from_nccl_comm(ncclComm_t comm, const CommOptions& options);
  // Collective over the processes started by torchrun/mpirun; uses GPU LOCAL_RANK.
  static std::unique_ptr<Communicator> from_env(const CommOptions& options);
  // Collective over `world_size` ranks that all pass the same `id` (made by ncclGetUniqueId on one
  // of them and sent to the others by the caller); this rank is `rank` on GPU `device`. Creates a
  // non-blocking NCCL communicator mok owns (bounded like from_env's). Throws
  // mok::Error(InvalidArgument) naming `rank`, `world_size` or a negative `device` (and bad
  // options) before any NCCL or CUDA call; a device past the visible ones is named after.
  static std::unique_ptr<Communicator> from_unique_id(const ncclUniqueId& id, int rank, int world_size, int device,
                                                      const CommOptions& options);

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int world_size() const;
  int device() const;
  int lsa_size() const;
  bool owns_nccl_comm() const;
  // An owned one is non-blocking: its calls may return ncclInProgress (see ncclCommGetAsyncError).
  ncclComm_t nccl_comm() const;
  const ncclDevComm& dev_comm() const;  // complete type in <nccl_device.h>
  cudaStream_t stream() const;          // a stream of this communicator's device
  const CommOptions& options() const;

  // Windows are never moved: references returned by window()/add_window() stay valid until the
  // communicator is destroyed.
  size_t window_count() const;
  const Window& window(size_t index) const;
  const Window& window(const std::string& name) const;  // throws InvalidArgument if unknown
  // Collective: allocates and registers one more window (name and size checked across ranks).
  const Window& add_window(const std::string& name, size_t bytes);
  // Collective: a zeroed window of at least `bytes`. Reuses a window given back with
  // release_window (see pick_free_window; the ranks check that they request the same size and
  // pick the same window), or registers a new one named `name` (made unique if taken). A reused
  // window keeps its name and size.
  const Window& acquire_window(const std::string& name, size_t bytes);
  // Local (not collective): gives `w` (from acquire_window or add_window) back for reuse. It stays
  // registered and allocated until the communicator is destroyed. The caller's kernels on it must
  // have completed; the peers' are ordered by acquire_window itself (a window is reused only once
  // every rank has released it, which the exchange in acquire_window checks).
  void release_window(const Window& w);

  // Device pointer of the host-mapped wait-error record, and its host view.
  WaitErrorRecord* wait_error_device() const;
  // This rank's abort word (device memory in a small symmetric window, as kernels address it):
  // the first failure on this GPU claims it (atomicCAS) and a failing comm wait also writes it on
  // every peer; every wait gives up once it is nonzero (codes: src/comm/abort_word.h).
  uint32_t* wait_claim_device() const;
  ncclWindow_t abort_window() const;      // the abort words' window (to reach the peers' words)
  uint32_t* record_claim_device() const;  // device word: the record is written once
  const volatile WaitErrorRecord* wait_error_host() const;
  uint64_t wait_timeout_ns() const;
  // Throws mok::Error(Timeout, "<wait name>", ...) if a kernel reported an expired wait, or
  // Timeout("<site name>") if only the claim word is set (a kernel-internal wait that
  // writes no record), and poisons the communicator; returns otherwise. Cheap: reads the
  // host-mapped record and, when it is empty, the 4-byte claim word (a synchronous cudaMemcpy).
  void check_waits();
  // cudaStreamSynchronize(stream) (CUDA failure -> Runtime error), then check_waits().
  void sync_and_check(cudaStream_t stream);
  bool poisoned() const;
  // Cheap, no device access (call it before enqueuing work): raises the communicator's first
  // failure again once it is poisoned, or the failure a kernel has already recorded in the
  // host-mapped record (an expired wait here, or a peer's failure seen here); returns otherwise.
  void check_usable();
  // Collective: every rank's `fields` are compared (as the start-up handshake compares the
  // config); throws mok::Error(InvalidArgument, "handshake: <field>") naming the first field
  // that differs, on every rank.
  void agree(const std::vector<HandshakeField>& fields);
  // One call on this communicator at a time (its layers share the LSA barrier and the abort
  // word): begin_call orders `stream` after the previous call's work when that call ran on
  // another stream (cudaStreamWaitEvent: no host wait) and holds a lock until end_call, which marks
  // the end of the call's work on `stream`; host threads calling at once are serialized, but in no
  // order the other ranks know: calls on one communicator must be issued in the same order on
  // every rank (from one thread per rank, or ordered by the caller), or layers pair up with the
  // wrong peers' calls. Every begin_call must be followed by end_call on the same thread (also
  // when the call throws). While
  // `stream` is being captured only the lock is taken (a graph's launches are ordered by its user).
  void begin_call(cudaStream_t stream, const char* who);
  void end_call(cudaStream_t stream);
  // Collective host-side barrier (a one-word ncclAllReduce on stream()).
  void host_barrier();

 private:
  struct Impl;
  explicit Communicator(std::unique_ptr<Impl> impl);
  static std::unique_ptr<Communicator> create(ncclComm_t comm, bool owned, const CommOptions& options);
  std::unique_ptr<Impl> impl_;
  friend class LocalGroup;
};

// One process driving several local GPUs: one Communicator per device, created, used and
// destroyed with one host thread per device (NCCL's collective host calls — window registration,
// ncclDevCommCreate, finalize — block until every rank has joined).
class LocalGroup {
 public:
  // Creates an NCCL communicator over `devices` owned by the group (non-blocking, as from_env's).
  static LocalGroup create(const std::vector<int>& devices, const CommOptions& options);
  // Wraps communicators the caller owns (one per rank of one NCCL communicator, in rank order).
  static LocalGroup adopt(const std::vector<ncclComm_t>& comms, const CommOptions& options);

  LocalGroup() = default;
  LocalGroup(LocalGroup&&) noexcept = default;
  LocalGroup& operator=(LocalGroup&& other) noexcept;
  ~LocalGroup();  // destroys the communicators in parallel (never throws)

  size_t size() const { return comms_.size(); }
  Communicator& operator[](size_t i) { return *comms_.at(i); }
  const Communicator& operator[](size_t i) const { return *comms_.at(i); }
  // Runs fn(comm, index) for every rank, each on its own thread with that rank's device current.
  // Rethrows the first exception (by rank order) after all threads have finished.
  void run(const std::function<void(Communicator&, size_t)>& fn);
  // Destroys every communicator now (in parallel); the group is empty afterwards.
  void destroy();

 private:
  std::vector<std::unique_ptr<Communicator>> comms_;
};

// Runs fn(i) for i in [0, n) on n threads and rethrows the first exception by index.
void parallel_for_ranks(size_t n, const std::function<void(size_t)>& fn);

}  // namespace mok::comm
