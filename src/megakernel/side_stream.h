// mok — a second stream for the backward's weight gradients. After FC2's dgrad + SwiGLU' nothing
// orders FC1's dgrad against the weight gradients: the dgrad reads d_gu and writes the d_x rows,
// the weight gradients read d_gu, x, d_y and h and write dW (and their carries / holds). On one
// stream each of those persistent GEMMs ends with a partial last wave and a drain; forked, the
// next kernel's CTAs take the SMs the previous one frees. Used by the bf16 backward (the routed
// experts' weight gradients, resident and per window with the window's parts and hold copy; the
// shared expert's) and the FP8 one (dW_down with h's token blocks). At EP 1 the fork is joined
// before the pushes: behind persistent GEMMs a push's CTAs would start one by one and delay the
// next GEMM, whose static tile stride gives every CTA the same work (measured: notes/backward.md).
// At EP > 1 the pushes run beside the weight gradients on SMs those leave free, and the join
// follows them (routed_dgrads; over windows also the pulls a window ahead on a third stream). Every
// kernel is the same, so the bits are the same (the layer's backward tests compare one stream
// with two). Under stream capture it is the usual fork / join of a graph.
// MOK_BWD_STREAMS=0 keeps everything on the caller's stream (an A/B knob).
#pragma once

#include <cuda_runtime.h>

namespace mok {

// One event that orders a stream after the work another has enqueued so far (record, then wait);
// reused: a wait takes the record before it in host order.
class StreamMark {
 public:
  StreamMark() = default;
  ~StreamMark();
  StreamMark(const StreamMark&) = delete;
  StreamMark& operator=(const StreamMark&) = delete;
  void create(int device);  // (not under stream capture)
  void record(cudaStream_t s);
  void wait(cudaStream_t s) const;

 private:
  int device_ = -1;
  cudaEvent_t e_ = nullptr;
};

class SideStream {
 public:
  SideStream();  // reads MOK_BWD_STREAMS (0 or 1; named error otherwise)
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  // The stream and its two events on `device` (not under stream capture: the layer's first
  // backward, which allocates, calls it). A no-op when off or already made.
  void create(int device);
  bool on() const { return on_ && side_ != nullptr; }
  // The side waits for what `main` has enqueued so far; target() is the side stream until join().
  void fork(cudaStream_t main);
  // `main` waits for what the side has enqueued since fork() (a no-op without a fork).
  void join(cudaStream_t main);
  cudaStream_t target(cudaStream_t main) const { return forked_ ? side_ : main; }

  // Joins on scope exit if still forked (a host check that threw between fork and join): the
  // side's kernels stay ordered before the caller's later work. Errors there are not raised.
  class Joiner {
   public:
    Joiner(SideStream& s, cudaStream_t main) : s_(s), main_(main) {}
    ~Joiner() { s_.join_quietly(main_); }
    Joiner(const Joiner&) = delete;
    Joiner& operator=(const Joiner&) = delete;

   private:
    SideStream& s_;
    cudaStream_t main_;
  };

 private:
  void join_quietly(cudaStream_t main) noexcept;
  bool on_ = true;
  bool forked_ = false;
  int device_ = -1;
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
};

}  // namespace mok
