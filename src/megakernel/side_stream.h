// mok — a second stream for the backward's weight gradients (the unfused bf16 backward, resident
// and over windows). After FC2's dgrad + SwiGLU' nothing orders FC1's dgrad and the pushes
// against the two weight gradients: the dgrad reads d_gu and writes the d_x rows, the weight
// gradients read d_gu, x, d_y and h and write dW (and their carries / holds). On one stream each
// of those persistent GEMMs ends with a partial last wave and a drain; forked, the next kernel's
// CTAs take the SMs the previous one frees, and at EP > 1 the d_x push over NVLink runs beside
// the weight gradients. Every kernel is the same, so the bits are the same (the layer's backward
// tests run with it). The fork is joined before anything that writes what the side reads (the
// next window's pulls), and under stream capture it is the usual fork / join of a graph.
// MOK_BWD_STREAMS=0 keeps everything on the caller's stream (an A/B knob).
#pragma once

#include <cuda_runtime.h>

namespace mok {

class SideStream {
 public:
  SideStream();  // reads MOK_BWD_STREAMS (0 or 1; named error otherwise)
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  // The stream and its two events on the current device (not under stream capture: the layer's
  // first backward, which allocates, calls it). A no-op when off or already made.
  void create();
  bool on() const { return on_ && side_ != nullptr; }
  // The side waits for what `main` has enqueued so far; target() is the side stream until join().
  void fork(cudaStream_t main);
  // `main` waits for what the side has enqueued since fork() (a no-op without a fork).
  void join(cudaStream_t main);
  cudaStream_t target(cudaStream_t main) const { return forked_ ? side_ : main; }

 private:
  bool on_ = true;
  bool forked_ = false;
  int device_ = -1;
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
};

}  // namespace mok
