// mok — Communicator: NCCL communicator + symmetric windows + ncclDevComm + wait-error record
// (its state: communicator_impl.h).
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <chrono>
#include <deque>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/abort_word.h"
#include "comm/communicator_impl.h"
#include "comm/flat_alias.h"
#include "comm/host_wait.h"
#include "comm/nccl_check.h"
#include "common/cuda_check.h"
#include "mok/comm.hpp"

namespace mok::comm {
namespace {

using host::Clock;
using host::deadline_after;
using host::DeviceGuard;
using host::nccl_complete;
using host::wait_stream;
using host::validate_options;

}  // namespace

void host::validate_options(const CommOptions& o, int nranks, int sm_count) {
  MOK_REQUIRE(o.lsa_barrier_count >= 1 && o.lsa_barrier_count <= 4096, "options.lsa_barrier_count",
              "must be in [1, 4096], got ", o.lsa_barrier_count);
  MOK_REQUIRE(o.config.wait_timeout_s > 0 && o.config.wait_timeout_s <= 3600,
              "config.wait_timeout_s", "must be in (0, 3600] seconds, got ", o.config.wait_timeout_s);
  MOK_REQUIRE(o.bootstrap_timeout_s > 0, "options.bootstrap_timeout_s", "must be > 0, got ",
              o.bootstrap_timeout_s);
  if (o.shape) {
    MOK_REQUIRE(o.shape->world_size() == nranks, "shape.tokens",
                "needs one entry per rank of the communicator (", nranks, " ranks), got ",
                o.shape->world_size());
    o.config.validate(*o.shape, sm_count);
  }
  for (size_t i = 0; i < o.windows.size(); ++i) {
    const auto& w = o.windows[i];
    MOK_REQUIRE(!w.name.empty(), detail::concat("windows[", i, "].name"), "must not be empty");
    MOK_REQUIRE(w.bytes > 0, detail::concat("windows[", i, "].bytes ('", w.name, "')"),
                "must be > 0");
    for (size_t j = 0; j < i; ++j) {
      MOK_REQUIRE(o.windows[j].name != w.name, detail::concat("windows[", i, "].name"),
                  "window names must be unique, '", w.name, "' is also windows[", j, "]");
    }
  }
}

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;

std::unique_ptr<Communicator> Communicator::create(ncclComm_t comm, bool owned, const CommOptions& options) {
  MOK_REQUIRE(comm != nullptr, "comm", "must be an initialized ncclComm_t, got null");
  auto impl = std::make_unique<Impl>();
  impl->comm = comm;
  impl->owned = owned;
  impl->options = options;

  // 1. The NCCL library this process loaded must be the one the device code was compiled against.
  int runtime = 0;
  MOK_NCCL_CHECK(ncclGetVersion(&runtime), nullptr, "ncclGetVersion");
  try {
    check_nccl_version(runtime, NCCL_VERSION_CODE);
  } catch (...) {
    impl->comm = nullptr;  // never touch a communicator of another NCCL build
    throw;
  }

  // A user's non-blocking communicator may still be completing its previous call (torch creates
  // them lazily); NCCL takes no other call until it has.
  impl->complete(ncclSuccess, "communicator state on entry (ncclCommGetAsyncError)");
  int device = -1;
  MOK_NCCL_CHECK(ncclCommCuDevice(comm, &device), comm, "ncclCommCuDevice");
  MOK_NCCL_CHECK(ncclCommUserRank(comm, &impl->rank), comm, "ncclCommUserRank");
  MOK_NCCL_CHECK(ncclCommCount(comm, &impl->nranks), comm, "ncclCommCount");
  DeviceGuard guard(device);
  impl->device = device;
  int sms = 0;  // the minibatch (and so the ring's check) depends on the device's SM count
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  validate_options(options, impl->nranks, sms);
  MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));

  // 2. Every rank must describe the same layer, config, windows and barriers.
  impl->handshake(options.windows, /*with_config=*/true);

  // 3. Wait-error record in host-mapped memory.
  void* rec = nullptr;
  MOK_CUDA_CHECK(cudaHostAlloc(&rec, sizeof(WaitErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  impl->record_host = static_cast<WaitErrorRecord*>(rec);
  std::memset(rec, 0, sizeof(WaitErrorRecord));
  void* rec_dev = nullptr;
  MOK_CUDA_CHECK(cudaHostGetDevicePointer(&rec_dev, rec, 0));
  impl->record_dev = static_cast<WaitErrorRecord*>(rec_dev);
  MOK_CUDA_CHECK(cudaMalloc(&impl->record_claim, sizeof(uint32_t)));
  MOK_CUDA_CHECK(cudaMemsetAsync(impl->record_claim, 0, sizeof(uint32_t), impl->stream));

  // 4. Symmetric windows (collective), zeroed; first the abort words (one 128-byte line per rank).
  impl->abort_w = impl->register_window({"mok.abort", 128}, /*keep=*/false);
  for (const auto& spec : options.windows) impl->register_window(spec);

  // 5. Device communicator: LSA barriers only; never multimem (NVLS).
  ncclDevCommRequirements reqs;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
  reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  std::memset(&reqs, 0, sizeof(reqs));
#endif
  reqs.lsaMultimem = false;
  reqs.lsaBarrierCount = options.lsa_barrier_count;
  try {
    impl->complete(ncclDevCommCreate(comm, &reqs, &impl->out->dev), "ncclDevCommCreate");
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Timeout) throw;
    throw Error(ErrorKind::Unsupported, "ncclDevCommCreate",
                detail::concat("NCCL could not create a device communicator (", e.constraint(),
                               "); mok needs symmetric memory with load/store access between all GPUs "
                               "(CUDA P2P over NVLink)"));
  }
  impl->dev = impl->out->dev;
  impl->dev_created = true;
  impl->claim_dev = static_cast<uint32_t*>(flat_alias(impl->abort_w.handle, 0, impl->rank, impl->device, impl->stream));
  if (impl->dev.lsaSize != impl->nranks) {
    throw Error(ErrorKind::Unsupported, "ncclDevComm.lsaSize",
                detail::concat("all ranks must reach each other by load/store (one NVLink domain): lsaSize = ",
                               impl->dev.lsaSize, ", nRanks = ", impl->nranks,
                               " (multi-node needs NCCL GIN, not supported yet)"));
  }

  // 6. Windows are zeroed on every rank before any kernel of any rank may touch them.
  MOK_CUDA_CHECK(cudaStreamSynchronize(impl->stream));
  impl->barrier();
  return std::unique_ptr<Communicator>(new Communicator(std::move(impl)));
}

std::unique_ptr<Communicator> Communicator::from_nccl_comm(ncclComm_t comm, const CommOptions& options) {
  return create(comm, /*owned=*/false, options);
}

std::unique_ptr<Communicator> Communicator::from_env(const CommOptions& options) {
  int runtime = 0;
  MOK_NCCL_CHECK(ncclGetVersion(&runtime), nullptr, "ncclGetVersion");
  check_nccl_version(runtime, NCCL_VERSION_CODE);
  const BootstrapEnv env = parse_bootstrap_env();
  validate_options(options, env.world_size);
  int ndev = 0;
  MOK_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  MOK_REQUIRE(env.local_rank < ndev, env.launcher == "mpirun" ? "OMPI_COMM_WORLD_LOCAL_RANK" : "LOCAL_RANK",
              "must be < the number of visible GPUs (", ndev, "), got ", env.local_rank);
  MOK_CUDA_CHECK(cudaSetDevice(env.local_rank));

  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (!env.nccl_comm_id.empty() || env.world_size == 1) {
    // NCCL_COMM_ID set: every rank derives the same id from it (NCCL's own bootstrap).
    MOK_NCCL_CHECK(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
  } else {
    std::vector<uint8_t> blob(sizeof(id));
    if (env.rank == 0) {
      MOK_NCCL_CHECK(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
      std::memcpy(blob.data(), &id, sizeof(id));
    }
    tcp_broadcast(env.rank, env.world_size, env.master_addr, env.bootstrap_port, blob,
                  options.bootstrap_timeout_s);
    std::memcpy(&id, blob.data(), sizeof(id));
  }
  return from_unique_id(id, env.rank, env.world_size, env.local_rank, options);
}

std::unique_ptr<Communicator> Communicator::from_unique_id(const ncclUniqueId& id, int rank, int world_size,
                                                           int device, const CommOptions& options) {
  MOK_REQUIRE(world_size >= 1, "world_size", "must be >= 1, got ", world_size);
  MOK_REQUIRE(rank >= 0 && rank < world_size, "rank", "must be in [0, world_size = ", world_size, "), got ", rank);
  MOK_REQUIRE(device >= 0, "device", "must be a GPU index >= 0, got ", device);
  validate_options(options, world_size);
  int runtime = 0;
  MOK_NCCL_CHECK(ncclGetVersion(&runtime), nullptr, "ncclGetVersion");
  check_nccl_version(runtime, NCCL_VERSION_CODE);
  int ndev = 0;
  MOK_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  MOK_REQUIRE(device < ndev, "device", "must be < the number of visible GPUs (", ndev, "), got ", device);
  DeviceGuard guard(device);  // NCCL binds the communicator to the current device
  ncclComm_t comm = nullptr;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;  // so that every later call on it can be bounded (nccl_complete)
  const ncclResult_t issued = ncclCommInitRankConfig(&comm, world_size, id, rank, &cfg);
  try {
    nccl_complete(issued, comm, options.bootstrap_timeout_s, "ncclCommInitRankConfig");
  } catch (...) {
    if (comm) (void)ncclCommAbort(comm);  // also stops an initialization still running in NCCL's thread
    throw;
  }
  return create(comm, /*owned=*/true, options);  // on failure create()'s Impl destroys `comm`
}

int Communicator::rank() const { return impl_->rank; }
int Communicator::world_size() const { return impl_->nranks; }
int Communicator::device() const { return impl_->device; }
int Communicator::lsa_size() const { return impl_->dev.lsaSize; }
bool Communicator::owns_nccl_comm() const { return impl_->owned; }
ncclComm_t Communicator::nccl_comm() const { return impl_->comm; }
const ncclDevComm& Communicator::dev_comm() const { return impl_->dev; }
cudaStream_t Communicator::stream() const { return impl_->stream; }
const CommOptions& Communicator::options() const { return impl_->options; }
size_t Communicator::window_count() const { return impl_->windows.size(); }

const Window& Communicator::window(size_t index) const {
  MOK_REQUIRE(index < impl_->windows.size(), "window index", "must be < ", impl_->windows.size(),
              ", got ", index);
  return impl_->windows[index];
}

const Window& Communicator::window(const std::string& name) const {
  for (const auto& w : impl_->windows) {
    if (w.name == name) return w;
  }
  std::string known;
  for (const auto& w : impl_->windows) known += (known.empty() ? "'" : ", '") + w.name + "'";
  throw Error(ErrorKind::InvalidArgument, "window name",
              detail::concat("no window named '", name, "' (known: ", known.empty() ? "none" : known, ")"));
}

const Window& Communicator::add_window(const std::string& name, size_t bytes) {
  impl_->check_window_request("add_window", name, bytes);
  DeviceGuard guard(impl_->device);
  for (const auto& w : impl_->windows) {
    MOK_REQUIRE(w.name != name, "window name", "must be unique, '", name, "' exists");
  }
  const WindowSpec spec{name, bytes};
  impl_->handshake({spec}, /*with_config=*/false);
  impl_->register_window(spec);
  MOK_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  impl_->barrier();
  impl_->options.windows.push_back(spec);
  return impl_->windows.back();
}

const Window& Communicator::acquire_window(const std::string& name, size_t bytes) {
  impl_->check_window_request("acquire_window", name, bytes);
  DeviceGuard guard(impl_->device);
  std::vector<size_t> sizes;
  for (const auto& w : impl_->windows) sizes.push_back(w.bytes);
  const int pick = pick_free_window(sizes, impl_->released, bytes);
  // The ranks must ask for the same size and reuse the same window (same history of acquires and
  // releases); a disagreement would make peers address different buffers.
  impl_->exchange({{detail::concat("acquire_window('", name, "').bytes"), static_cast<int64_t>(bytes), false},
                   {detail::concat("acquire_window('", name, "').reused_window (-1: new)"), pick, false}});
  if (pick >= 0) {
    // Every rank picked it, so every rank had released it after its own kernels on it were done;
    // the exchange above has therefore ordered all of them before this point. Zeroed, like a new one.
    const Window& w = impl_->windows[static_cast<size_t>(pick)];
    MOK_CUDA_CHECK(cudaMemsetAsync(w.ptr, 0, w.bytes, impl_->stream));
    MOK_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
    impl_->released[static_cast<size_t>(pick)] = false;
    return w;
  }
  std::string unique = name;
  const auto taken = [&](const std::string& n) {
    for (const auto& w : impl_->windows)
      if (w.name == n) return true;
    return false;
  };
  for (size_t i = impl_->windows.size(); taken(unique); ++i) unique = detail::concat(name, "#", i);
  return add_window(unique, bytes);
}

void Communicator::release_window(const Window& w) {
  for (size_t i = 0; i < impl_->windows.size(); ++i) {
    if (&impl_->windows[i] == &w) {
      MOK_REQUIRE(!impl_->released[i], "release_window", "window '", w.name, "' was already released");
      impl_->released[i] = true;
      return;
    }
  }
  throw Error(ErrorKind::InvalidArgument, "release_window",
              detail::concat("window '", w.name, "' does not belong to this communicator"));
}

WaitErrorRecord* Communicator::wait_error_device() const { return impl_->record_dev; }
const volatile WaitErrorRecord* Communicator::wait_error_host() const { return impl_->record_host; }
uint32_t* Communicator::wait_claim_device() const { return impl_->claim_dev; }
ncclWindow_t Communicator::abort_window() const { return impl_->abort_w.handle; }
uint32_t* Communicator::record_claim_device() const { return impl_->record_claim; }

uint64_t Communicator::wait_timeout_ns() const {
  return static_cast<uint64_t>(impl_->options.config.wait_timeout_s * 1e9);
}

void Communicator::check_waits() {
  if (impl_->first_error) throw *impl_->first_error;
  const volatile WaitErrorRecord* r = impl_->record_host;
  if (r == nullptr) return;
  if (r->status == 0) {
    // No record: either nothing failed, or only the abort word tells (a kernel's internal pipeline
    // wait claims it with its site and writes no record; a peer's notice arrived but no kernel
    // here has seen it yet).
    uint32_t claim = 0;
    if (impl_->abort_w.ptr != nullptr) {
      DeviceGuard guard(impl_->device);
      MOK_CUDA_CHECK(cudaMemcpy(&claim, impl_->abort_w.ptr, sizeof(claim), cudaMemcpyDeviceToHost));
    }
    if (claim == 0) return;
    const int origin = abort_origin(claim, impl_->rank);
    if (origin != impl_->rank) {
      WaitErrorRecord notice{};
      notice.status = 2;
      notice.wait_id = abort_id(claim);
      notice.rank = impl_->rank;
      notice.origin = origin;
      notice.peer = -1;
      impl_->fail(wait_error(notice, impl_->options.config.wait_timeout_s));
    }
    // This rank's own comm wait claimed the word: its record follows (give it a moment).
    for (int i = 0; abort_has_origin(claim) && i < 1000 && r->status == 0; ++i)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (r->status == 0) {
      // A kernel-internal pipeline wait (a site code, no record): only this GPU saw it, and this
      // rank will run no barrier any more (the communicator is poisoned now) to pass it on, so
      // tell the peers here; their next waits then give up naming this rank.
      const uint32_t site = abort_id(claim);
      try {
        // Not while an NCCL call of ours may still occupy the stream (it could wait forever).
        if (!impl_->nccl_pending)
          tell_peers(impl_->abort_w.handle, impl_->rank, impl_->nranks, encode_abort(impl_->rank, site),
                   impl_->device, impl_->stream);
      } catch (const Error&) {
        // the local error below is raised either way
      }
      impl_->fail(Error(ErrorKind::Timeout, wait_name(site),
                        detail::concat("every wait completes within config.wait_timeout_s = ",
                                       impl_->options.config.wait_timeout_s, " s"),
                        detail::concat("rank ", impl_->rank, ": a kernel's internal pipeline wait expired (site 0x",
                                       std::hex, site, std::dec,
                                       "); the peers were told; the communicator is unusable now on every rank: "
                                       "destroy it")));
    }
  }
  // A writer may still be filling the record (status 1): give it a moment.
  for (int i = 0; i < 1000 && r->status != 2; ++i) std::this_thread::sleep_for(std::chrono::microseconds(100));
  WaitErrorRecord copy;
  copy.status = r->status;
  copy.wait_id = r->wait_id;
  copy.rank = r->rank;
  copy.origin = r->origin;
  copy.peer = r->peer;
  copy.block = r->block;
  copy.thread = r->thread;
  copy.expected = r->expected;
  copy.observed = r->observed;
  copy.waited_ns = r->waited_ns;
  impl_->fail(wait_error(copy, impl_->options.config.wait_timeout_s));
}

void Communicator::check_usable() {
  if (impl_->first_error) throw *impl_->first_error;
  if (impl_->poisoned)
    throw Error(ErrorKind::Runtime, "communicator", "unusable after an earlier failure (a host-side NCCL call timed out): destroy it");
  if (impl_->record_host != nullptr && impl_->record_host->status != 0) check_waits();  // throws
}

void Communicator::agree(const std::vector<HandshakeField>& fields) {
  check_usable();
  DeviceGuard guard(impl_->device);
  impl_->exchange(fields);
}

void Communicator::begin_call(cudaStream_t stream, const char* who) {
  impl_->call_mutex.lock();
  try {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    MOK_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    if (capturing != cudaStreamCaptureStatusNone || impl_->call_done == nullptr || impl_->call_stream == stream) return;
    const cudaError_t e = cudaStreamWaitEvent(stream, impl_->call_done, 0);
    if (e != cudaSuccess)
      throw Error(ErrorKind::Runtime, "stream",
                  detail::concat(who, " could not be ordered after the previous call on this communicator (",
                                 cudaGetErrorString(e), ")"));
  } catch (...) {
    impl_->call_mutex.unlock();
    throw;
  }
}

void Communicator::end_call(cudaStream_t stream) {
  struct Unlock {
    std::mutex& m;
    ~Unlock() { m.unlock(); }
  } unlock{impl_->call_mutex};
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MOK_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return;
  DeviceGuard guard(impl_->device);
  if (impl_->call_done == nullptr) MOK_CUDA_CHECK(cudaEventCreateWithFlags(&impl_->call_done, cudaEventDisableTiming));
  MOK_CUDA_CHECK(cudaEventRecord(impl_->call_done, stream));
  impl_->call_stream = stream;
}

void Communicator::sync_and_check(cudaStream_t stream) {
  DeviceGuard guard(impl_->device);
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  check_waits();
}

bool Communicator::poisoned() const { return impl_->poisoned; }

void Communicator::host_barrier() {
  DeviceGuard guard(impl_->device);
  impl_->barrier();
}

}  // namespace mok::comm
