// mok — host-side helpers of the communicator: the options check, the current-device guard and
// the bounded host waits for the other ranks (a stream with a collective on it, an NCCL call of a non-blocking
// communicator). Private to src/comm.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <string>
#include <thread>

#include "comm/nccl_check.h"
#include "common/cuda_check.h"
#include "mok/errors.hpp"

namespace mok::comm {
struct CommOptions;
}

namespace mok::comm::host {

// Checks the options a communicator is created with (throws mok::Error naming the field).
// `sm_count`: the device's SMs when known (0 before a device is chosen: the target parts' 132).
void validate_options(const CommOptions& o, int nranks, int sm_count = 0);

using Clock = std::chrono::steady_clock;

// Restores the caller's current device on scope exit.
struct DeviceGuard {
  int saved = -1;
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&saved) != cudaSuccess) saved = -1;
    MOK_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (saved >= 0) (void)cudaSetDevice(saved);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

inline Clock::time_point deadline_after(double timeout_s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
}

// Waits for `stream` with a host-side deadline (a collective whose peer never comes must not hang
// start-up forever).
inline void wait_stream(cudaStream_t stream, double timeout_s, const char* what) {
  const auto deadline = deadline_after(timeout_s);
  while (true) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      throw Error(ErrorKind::Runtime, what, detail::concat(cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
    }
    if (Clock::now() > deadline) {
      throw Error(ErrorKind::Timeout, what,
                  detail::concat("the other ranks did not join within ", timeout_s,
                                 " s (did every rank create its communicator at the same point?)"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Completes an NCCL host call on `comm` that may wait for the other ranks. A non-blocking
// communicator returns before the work is done: with ncclInProgress, or even with ncclSuccess
// (NCCL 2.28's window registration and ncclDevCommCreate return the group's launch status; the
// outcome arrives later in the communicator's state). So the state is polled until it settles,
// which on a blocking communicator it already has. Until then NCCL refuses any other call on the
// communicator, and a collective's kernel is not yet on its stream.
inline void nccl_complete(ncclResult_t issued, ncclComm_t comm, double timeout_s, const std::string& what) {
  if (issued != ncclSuccess && issued != ncclInProgress) throw nccl_error(issued, comm, what);
  const auto deadline = deadline_after(timeout_s);
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) throw nccl_error(r, comm, what + " (ncclCommGetAsyncError)");
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) throw nccl_error(state, comm, what);
    if (Clock::now() > deadline) {
      throw Error(ErrorKind::Timeout, what,
                  detail::concat("the call did not complete within options.bootstrap_timeout_s = ", timeout_s,
                                 " s: a peer did not join (dead, stuck, or not making the same call?)"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace mok::comm::host
