// mok — LocalGroup: one process driving several local GPUs, one Communicator per device, each
// created, used and destroyed on a thread of its own (see include/mok/comm.hpp).
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/host_wait.h"
#include "mok/comm.hpp"

namespace mok::comm {

using host::DeviceGuard;
using host::nccl_complete;
using host::validate_options;

// ---------------------------------------------------------------------------------------------
// LocalGroup
// ---------------------------------------------------------------------------------------------
void parallel_for_ranks(size_t n, const std::function<void(size_t)>& fn) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        fn(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

LocalGroup LocalGroup::create(const std::vector<int>& devices, const CommOptions& options) {
  MOK_REQUIRE(!devices.empty(), "devices", "at least one device is required");
  int runtime = 0;
  MOK_NCCL_CHECK(ncclGetVersion(&runtime), nullptr, "ncclGetVersion");
  check_nccl_version(runtime, NCCL_VERSION_CODE);
  int ndev = 0;
  MOK_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  for (size_t i = 0; i < devices.size(); ++i) {
    MOK_REQUIRE(devices[i] >= 0 && devices[i] < ndev, detail::concat("devices[", i, "]"),
                "must be a visible GPU index in [0, ", ndev, "), got ", devices[i]);
  }
  validate_options(options, static_cast<int>(devices.size()));
  // ncclCommInitAll's steps, with non-blocking communicators: their calls are then bounded as in
  // from_env, so that a rank thread that fails does not hold the others forever.
  ncclUniqueId id;
  MOK_NCCL_CHECK(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  const int n = static_cast<int>(devices.size());
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  ncclResult_t issued = ncclSuccess;
  {
    DeviceGuard guard(devices[0]);
    MOK_NCCL_CHECK(ncclGroupStart(), nullptr, "ncclGroupStart");
    for (int i = 0; i < n && (issued == ncclSuccess || issued == ncclInProgress); ++i) {
      // Nothing may throw before ncclGroupEnd: the group would stay open on this thread.
      issued = cudaSetDevice(devices[static_cast<size_t>(i)]) == cudaSuccess
                   ? ncclCommInitRankConfig(&comms[static_cast<size_t>(i)], n, id, i, &cfg)
                   : ncclUnhandledCudaError;
    }
    const ncclResult_t end = ncclGroupEnd();
    if (issued == ncclSuccess || issued == ncclInProgress) issued = end;
  }
  try {
    for (size_t i = 0; i < comms.size(); ++i) {
      nccl_complete(issued, comms[i], options.bootstrap_timeout_s,
                    detail::concat("ncclCommInitRankConfig (device ", devices[i], ")"));
    }
  } catch (...) {
    for (ncclComm_t c : comms) {
      if (c) (void)ncclCommAbort(c);
    }
    throw;
  }
  LocalGroup g;
  g.comms_.resize(devices.size());
  try {
    parallel_for_ranks(devices.size(), [&](size_t i) {
      // From here on `comms[i]` is owned by the Impl that create() builds first; that Impl tears
      // it down on any failure.
      g.comms_[i] = Communicator::create(comms[i], /*owned=*/true, options);
    });
  } catch (...) {
    g.destroy();
    throw;
  }
  return g;
}

LocalGroup LocalGroup::adopt(const std::vector<ncclComm_t>& comms, const CommOptions& options) {
  LocalGroup g;
  g.comms_.resize(comms.size());
  try {
    parallel_for_ranks(comms.size(), [&](size_t i) {
      g.comms_[i] = Communicator::from_nccl_comm(comms[i], options);
    });
  } catch (...) {
    g.destroy();
    throw;
  }
  return g;
}

LocalGroup& LocalGroup::operator=(LocalGroup&& other) noexcept {
  if (this != &other) {
    destroy();
    comms_ = std::move(other.comms_);
  }
  return *this;
}

LocalGroup::~LocalGroup() { destroy(); }

void LocalGroup::run(const std::function<void(Communicator&, size_t)>& fn) {
  parallel_for_ranks(comms_.size(), [&](size_t i) {
    MOK_CUDA_CHECK(cudaSetDevice(comms_[i]->device()));
    fn(*comms_[i], i);
  });
}

void LocalGroup::destroy() {
  if (comms_.empty()) return;
  try {
    parallel_for_ranks(comms_.size(), [&](size_t i) { comms_[i].reset(); });
  } catch (...) {
  }
  comms_.clear();
}

}  // namespace mok::comm
