#include "common/device_error.h"

#include <cuda_runtime.h>

#include "common/cuda_check.h"
#include "common/error_word.h"
#include "mok/errors.hpp"

namespace mok {

DeviceErrorWord::DeviceErrorWord() {
  void* p = nullptr;
  MOK_CUDA_CHECK(cudaHostAlloc(&p, sizeof(unsigned long long), cudaHostAllocMapped));
  host_ = static_cast<unsigned long long*>(p);
  *host_ = 0;
  void* d = nullptr;
  MOK_CUDA_CHECK(cudaHostGetDevicePointer(&d, p, 0));
  device_ = static_cast<unsigned long long*>(d);
}

DeviceErrorWord::~DeviceErrorWord() {
  if (host_) cudaFreeHost(host_);
}

uint64_t DeviceErrorWord::peek() const { return *static_cast<volatile unsigned long long*>(host_); }

void DeviceErrorWord::clear() { *static_cast<volatile unsigned long long*>(host_) = 0; }

void DeviceErrorWord::check(int64_t top_k) {
  const uint64_t w = peek();
  if (w == 0) return;
  clear();
  const int rank = device_error_rank(w);
  const uint64_t d = device_error_detail(w);
  const std::string entry = detail::concat("[", d / static_cast<uint64_t>(top_k), ",", d % static_cast<uint64_t>(top_k), "]");
  switch (device_error_code(w)) {
    case DeviceErrorCode::InvalidExpertId:
      throw Error(ErrorKind::InvalidArgument, "topk_idx" + entry,
                  "expert ids must satisfy -1 <= id < E (found on the GPU; the entry was "
                  "treated as an empty slot)",
                  detail::concat("rank ", rank));
    case DeviceErrorCode::InvalidRouterWeight:
      throw Error(ErrorKind::InvalidArgument, "topk_w" + entry,
                  "router weights of routed slots must be finite and >= 0 (found on the GPU; the slot was "
                  "treated as an empty slot)",
                  detail::concat("rank ", rank));
    case DeviceErrorCode::RoutingChanged:
      throw Error(ErrorKind::InvalidArgument, "topk_idx" + entry,
                  "backward() must get the routing forward() used (this entry differs; the backward used "
                  "the forward's)",
                  detail::concat("rank ", rank));
    case DeviceErrorCode::ForwardIdDiffers:
      throw Error(ErrorKind::InvalidArgument, "backward.forward_id",
                  detail::concat("every rank must run the backward of the same forward of the same layer "
                                 "(collective): rank ", d >> 40, " ran the backward of forward ", d & 0xffffffffffull,
                                 " (or of another layer), not this rank's; the gradients of this call are wrong"),
                  detail::concat("rank ", rank));
    default:
      throw Error(ErrorKind::Runtime, "device error word",
                  detail::concat("unknown code ", static_cast<unsigned>(device_error_code(w))),
                  detail::concat("rank ", rank));
  }
}

}  // namespace mok
