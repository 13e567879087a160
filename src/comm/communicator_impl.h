// mok — the state behind mok::comm::Communicator (include/mok/comm.hpp): the NCCL communicator, its
// symmetric windows, the device communicator, the wait-error record and the call bookkeeping, with
// the set-up and teardown steps that own them. Private to src/comm (communicator.cpp builds and
// uses it); split out so that file stays readable.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <deque>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/abort_word.h"
#include "comm/flat_alias.h"
#include "comm/host_wait.h"
#include "comm/nccl_check.h"
#include "common/cuda_check.h"
#include "mok/comm.hpp"

namespace mok::comm {

struct Communicator::Impl {
  ncclComm_t comm = nullptr;
  bool owned = false;
  int rank = 0, nranks = 0, device = -1;
  CommOptions options;
  ncclDevComm dev{};
  bool dev_created = false;
  std::deque<Window> windows;  // deque: references returned by window()/add_window() stay valid
  std::vector<bool> released;  // per window: given back with release_window, free for reuse
  int64_t exchanges = 0;       // handshake exchanges so far (all ranks make the same ones)
  WaitErrorRecord* record_host = nullptr;
  WaitErrorRecord* record_dev = nullptr;
  Window abort_w;                   // the abort words (one per rank), not in `windows`
  uint32_t* claim_dev = nullptr;    // this rank's abort word, as kernels address it (flat alias)
  uint32_t* record_claim = nullptr;  // device word: the record is written once
  std::unique_ptr<Error> first_error;  // the failure that poisoned the communicator
  cudaEvent_t call_done = nullptr;  // end of the last layer call (begin_call / end_call)
  std::mutex call_mutex;            // held from begin_call to end_call
  cudaStream_t call_stream = nullptr;
  cudaStream_t stream = nullptr;
  bool poisoned = false;
  // An NCCL call or collective kernel of ours timed out and may still be running (in NCCL's
  // thread, on `stream`): the communicator takes no other call than ncclCommAbort.
  bool nccl_pending = false;
  // Where NCCL writes results. A non-blocking communicator writes them from its own thread, maybe
  // after a timeout; so this is leaked, not freed, while a user's communicator is still pending.
  struct NcclOut {
    ncclWindow_t window = nullptr;
    ncclDevComm dev{};
  };
  std::unique_ptr<NcclOut> out = std::make_unique<NcclOut>();

  ~Impl() { teardown(); }

  // nccl_complete with this communicator's bound. A call that NCCL accepted but that timed out or
  // failed later leaves the communicator pending: NCCL guarantees nothing about work it had in
  // flight then.
  void complete(ncclResult_t issued, const std::string& what) {
    try {
      host::nccl_complete(issued, comm, options.bootstrap_timeout_s, what);
    } catch (...) {
      if (issued == ncclSuccess || issued == ncclInProgress) poisoned = nccl_pending = true;
      throw;
    }
  }

  // Never throws; safe on a partially built Impl.
  void teardown() noexcept {
    if (device < 0) {
      // Failed before the device was known: only the communicator itself can be held.
      if (owned && comm) (void)ncclCommAbort(comm);
      comm = nullptr;
      return;
    }
    if (cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
    if (nccl_pending && !owned) {
      // mok cannot abort a user's communicator, and NCCL's thread or kernel may still use the
      // windows, the stream and `out`; freeing memory would even wait for that kernel. All of it
      // is left to the owner's ncclCommAbort (and leaked here).
      (void)out.release();
      if (stream) (void)cudaStreamDestroy(stream);  // returns at once; released once idle
      windows.clear();
      released.clear();
      record_host = record_dev = nullptr;
      claim_dev = record_claim = nullptr;
      abort_w = Window{};
      call_done = nullptr;
      stream = nullptr;
      comm = nullptr;
      (void)cudaGetLastError();
      device = -1;
      return;
    }
    if (nccl_pending && owned && comm) {
      // Stops NCCL's kernels and joins its thread, so that nothing below races with them; NCCL
      // releases its device communicator and window registrations itself.
      (void)ncclCommAbort(comm);
      comm = nullptr;
    }
    if (stream) (void)cudaStreamSynchronize(stream);  // our own work only; kernels have deadlines
    if (dev_created && comm) (void)ncclDevCommDestroy(comm, &dev);
    dev_created = false;
    windows.push_back(abort_w);
    for (auto& w : windows) {
      if (w.handle && comm) (void)ncclCommWindowDeregister(comm, w.handle);
      if (w.ptr) (void)ncclMemFree(w.ptr);
    }
    windows.clear();
    released.clear();
    abort_w = Window{};
    if (record_host) (void)cudaFreeHost(record_host);
    record_host = record_dev = nullptr;
    if (record_claim) (void)cudaFree(record_claim);
    claim_dev = record_claim = nullptr;
    if (call_done) (void)cudaEventDestroy(call_done);
    call_done = nullptr;
    if (stream) (void)cudaStreamDestroy(stream);
    stream = nullptr;
    if (owned && comm) {
      bool finalized = false;
      if (!poisoned) {
        try {
          // Finalize may wait for the peers: bounded like every other collective host call.
          host::nccl_complete(ncclCommFinalize(comm), comm, options.bootstrap_timeout_s, "ncclCommFinalize");
          finalized = true;
        } catch (...) {
        }
      }
      // Abort is local: it never waits for a peer that may be gone.
      (void)(finalized ? ncclCommDestroy(comm) : ncclCommAbort(comm));
    }
    comm = nullptr;
    (void)cudaGetLastError();
    device = -1;
  }

  // Collective: allocates and registers a symmetric window, zeroed on `stream`; kept in `windows`
  // unless `keep` is false (the communicator's own abort window).
  Window register_window(const WindowSpec& spec, bool keep = true) {
    Window w;
    w.name = spec.name;
    w.bytes = spec.bytes;
    const std::string what = detail::concat("window '", spec.name, "'");
    MOK_NCCL_CHECK(ncclMemAlloc(&w.ptr, spec.bytes), comm, what + ": ncclMemAlloc");
    try {
      out->window = nullptr;
      complete(ncclCommWindowRegister(comm, w.ptr, spec.bytes, &out->window, NCCL_WIN_COLL_SYMMETRIC),
               what + ": ncclCommWindowRegister");
    } catch (...) {
      if (!nccl_pending) (void)ncclMemFree(w.ptr);  // else NCCL may still be mapping it: leaked
      throw;
    }
    w.handle = out->window;
    if (w.handle == nullptr) {
      (void)ncclMemFree(w.ptr);
      throw Error(ErrorKind::Unsupported, what,
                  "NCCL did not register it as a symmetric window: this communicator has no "
                  "symmetric-memory support (it needs CUDA P2P load/store between all GPUs of the "
                  "node, NCCL_CUMEM_ENABLE unset or 1, NCCL_WIN_ENABLE unset or 1)");
    }
    if (keep) {
      windows.push_back(w);
      released.push_back(false);
    }
    MOK_CUDA_CHECK(cudaMemsetAsync(w.ptr, 0, spec.bytes, stream));
    return w;
  }

  // Poisons the communicator with `e` (the first failure is kept and raised again) and throws it.
  [[noreturn]] void fail(const Error& e) {
    poisoned = true;
    if (!first_error) first_error = std::make_unique<Error>(e);
    throw e;
  }

  void handshake(const std::vector<WindowSpec>& specs, bool with_config) {
    int runtime = 0;
    MOK_NCCL_CHECK(ncclGetVersion(&runtime), comm, "ncclGetVersion");
    std::vector<HandshakeField> fields;
    if (with_config) {
      fields = handshake_fields(options.shape, options.config, specs, nranks, options.lsa_barrier_count, runtime);
    } else {
      // add_window: only the new window.
      fields = handshake_fields(std::nullopt, Config{}, specs, nranks, options.lsa_barrier_count, runtime);
    }
    exchange(fields);
  }

  // Every rank's `fields` gathered and compared (throws naming the first field that differs).
  // The first field is this communicator's exchange count, so exchanges that pair up out of step
  // (one rank skipped one) are caught rather than compared field by field by chance.
  void exchange(std::vector<HandshakeField> fields) {
    fields.insert(fields.begin(), HandshakeField{"exchange sequence number", exchanges++, false});
    const std::vector<int64_t> packed = pack_handshake(fields);
    int64_t* buf = nullptr;
    const size_t words = kHandshakeWords;
    MOK_CUDA_CHECK(cudaMalloc(&buf, words * sizeof(int64_t) * (1 + static_cast<size_t>(nranks))));
    std::vector<int64_t> gathered(words * static_cast<size_t>(nranks));
    try {
      MOK_CUDA_CHECK(cudaMemcpyAsync(buf, packed.data(), words * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
      // Before the copy below: a non-blocking communicator puts the kernel on `stream` only then.
      complete(ncclAllGather(buf, buf + words, words, ncclInt64, comm, stream), "handshake: ncclAllGather");
      MOK_CUDA_CHECK(cudaMemcpyAsync(gathered.data(), buf + words, gathered.size() * sizeof(int64_t),
                                     cudaMemcpyDeviceToHost, stream));
      host::wait_stream(stream, options.bootstrap_timeout_s, "handshake");
    } catch (const Error& e) {
      // A peer never joined (or NCCL failed): the all-gather may still be queued on `buf` (freeing
      // it could wait for it forever), and later collectives would pair up out of step. Leak it
      // and refuse further collectives.
      if (e.kind() == ErrorKind::Timeout) poisoned = nccl_pending = true;
      if (!nccl_pending) (void)cudaFree(buf);
      throw;
    } catch (...) {
      if (!nccl_pending) (void)cudaFree(buf);
      throw;
    }
    MOK_CUDA_CHECK(cudaFree(buf));
    std::vector<std::vector<int64_t>> all(static_cast<size_t>(nranks));
    for (size_t r = 0; r < all.size(); ++r) {
      all[r].assign(gathered.begin() + static_cast<std::ptrdiff_t>(r * words),
                    gathered.begin() + static_cast<std::ptrdiff_t>((r + 1) * words));
    }
    check_handshake(fields, all);
  }

  // Checks common to add_window and acquire_window (`what`), before any collective step.
  void check_window_request(const char* what, const std::string& name, size_t bytes) const {
    if (poisoned) throw Error(ErrorKind::Runtime, what, "the communicator is unusable after a wait timeout");
    MOK_REQUIRE(!name.empty(), "window name", "must not be empty");
    MOK_REQUIRE(bytes > 0, detail::concat("window '", name, "' bytes"), "must be > 0");
  }

  void barrier() {
    int* buf = nullptr;
    MOK_CUDA_CHECK(cudaMalloc(&buf, sizeof(int)));
    try {
      MOK_CUDA_CHECK(cudaMemsetAsync(buf, 0, sizeof(int), stream));
      complete(ncclAllReduce(buf, buf, 1, ncclInt32, ncclSum, comm, stream), "host_barrier: ncclAllReduce");
      host::wait_stream(stream, options.bootstrap_timeout_s, "host_barrier");
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Timeout) poisoned = nccl_pending = true;
      if (!nccl_pending) (void)cudaFree(buf);  // else leaked, as in exchange()
      throw;
    } catch (...) {
      if (!nccl_pending) (void)cudaFree(buf);
      throw;
    }
    MOK_CUDA_CHECK(cudaFree(buf));
  }
};

}  // namespace mok::comm
