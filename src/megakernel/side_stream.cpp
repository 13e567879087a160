// mok — the backward's side stream (side_stream.h).
#include "megakernel/side_stream.h"

#include "common/cuda_check.h"
#include "common/env_flag.h"
#include "mok/errors.hpp"

namespace mok {

SideStream::SideStream() : on_(env_flag("MOK_BWD_STREAMS", true)) {}

void SideStream::create(int device) {
  if (!on_ || side_ != nullptr) return;
  int prev = -1;
  MOK_CUDA_CHECK(cudaGetDevice(&prev));
  MOK_CUDA_CHECK(cudaSetDevice(device));
  device_ = device;
  MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  MOK_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  MOK_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  MOK_CUDA_CHECK(cudaSetDevice(prev));
}

void SideStream::fork(cudaStream_t main) {
  if (!on()) return;
  // (A wait takes the event's last record at the time of the call: the two events are reused. A
  // second fork before a join, e.g. after a backward that threw, orders the side again.)
  MOK_CUDA_CHECK(cudaEventRecord(fork_, main));
  MOK_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
  forked_ = true;
}

void SideStream::join(cudaStream_t main) {
  if (!forked_) return;
  forked_ = false;
  MOK_CUDA_CHECK(cudaEventRecord(join_, side_));
  MOK_CUDA_CHECK(cudaStreamWaitEvent(main, join_, 0));
}

void SideStream::join_quietly(cudaStream_t main) noexcept {
  if (!forked_) return;
  forked_ = false;
  if (cudaEventRecord(join_, side_) == cudaSuccess) (void)cudaStreamWaitEvent(main, join_, 0);
}

void StreamMark::create(int device) {
  if (e_ != nullptr) return;
  int prev = -1;
  MOK_CUDA_CHECK(cudaGetDevice(&prev));
  MOK_CUDA_CHECK(cudaSetDevice(device));
  device_ = device;
  MOK_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming));
  MOK_CUDA_CHECK(cudaSetDevice(prev));
}

void StreamMark::record(cudaStream_t s) { MOK_CUDA_CHECK(cudaEventRecord(e_, s)); }

void StreamMark::wait(cudaStream_t s) const { MOK_CUDA_CHECK(cudaStreamWaitEvent(s, e_, 0)); }

StreamMark::~StreamMark() {
  if (e_ == nullptr) return;
  int prev = -1;
  const bool restore = cudaGetDevice(&prev) == cudaSuccess;
  if (cudaSetDevice(device_) == cudaSuccess) (void)cudaEventDestroy(e_);
  if (restore) (void)cudaSetDevice(prev);
}

SideStream::~SideStream() {
  if (side_ == nullptr) return;
  int prev = -1;
  const bool restore = cudaGetDevice(&prev) == cudaSuccess;
  if (cudaSetDevice(device_) == cudaSuccess) {
    (void)cudaStreamSynchronize(side_);
    (void)cudaEventDestroy(fork_);
    (void)cudaEventDestroy(join_);
    (void)cudaStreamDestroy(side_);
  }
  if (restore) (void)cudaSetDevice(prev);
}

}  // namespace mok
