// Kernels shared by the communication layer's GPU tests and the multi-process worker.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/device.cuh"

namespace mok::comm::test {

using dev::DeviceComm;

// Wait ids of the tests (names registered by register_test_wait_names()).
enum : uint32_t {
  kWaitTestCredit = kWaitUserBase + 1,
  kWaitTestHandoff = kWaitUserBase + 2,
  kWaitTestWithheld = kWaitUserBase + 3,
};

inline void register_test_wait_names() {
  register_wait_name(kWaitTestCredit, "test.handoff_credit");
  register_wait_name(kWaitTestHandoff, "test.handoff_flag");
  register_wait_name(kWaitTestWithheld, "test.withheld_flag");
}

__host__ __device__ inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
__host__ __device__ inline uint32_t pattern(uint32_t src, uint32_t dst, uint32_t i, uint32_t salt) {
  return mix32(src * 0x9E3779B1U ^ dst * 0x85EBCA77U ^ i * 0xC2B2AE3DU ^ salt) | 1u;  // never 0
}

// ---------------------------------------------------------------------------------------------
// Peer store / load on every pair. Window layout: uint32 [src rank][n].
// ---------------------------------------------------------------------------------------------
__global__ void pattern_push(__grid_constant__ const DeviceComm dc, ncclWindow_t win, uint32_t n,
                             uint32_t salt) {
  const size_t total = static_cast<size_t>(dc.nranks) * n;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int p = static_cast<int>(idx / n);
    const uint32_t i = static_cast<uint32_t>(idx % n);
    uint32_t* dst = dev::peer_ptr<uint32_t>(win, (static_cast<size_t>(dc.rank) * n + i) * 4, p);
    *dst = pattern(static_cast<uint32_t>(dc.rank), static_cast<uint32_t>(p), i, salt);
  }
}

// One CTA: an LSA barrier on `index`; ok[0] = 1 if it completed.
__global__ void barrier_once(__grid_constant__ const DeviceComm dc, uint32_t index, uint32_t* ok) {
  const bool done = dev::lsa_barrier(dc, index);
  if (threadIdx.x == 0) ok[0] = done ? 1u : 0u;
}

// errors[0]: wrong values this rank received (push check); errors[1]: wrong values read from peers
// (pull check); errors[2]: number of checks done.
__global__ void pattern_verify(__grid_constant__ const DeviceComm dc, ncclWindow_t win, uint32_t n,
                               uint32_t salt, unsigned long long* errors) {
  const size_t total = static_cast<size_t>(dc.nranks) * n;
  unsigned long long bad_push = 0, bad_pull = 0, checks = 0;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint32_t s = static_cast<uint32_t>(idx / n);
    const uint32_t i = static_cast<uint32_t>(idx % n);
    const size_t off = (static_cast<size_t>(s) * n + i) * 4;
    const uint32_t mine = *dev::local_ptr<uint32_t>(win, off);
    bad_push += mine != pattern(s, static_cast<uint32_t>(dc.rank), i, salt);
    ++checks;
    for (int p = 0; p < dc.nranks; ++p) {
      const uint32_t theirs = *dev::peer_ptr<uint32_t>(win, off, p);
      bad_pull += theirs != pattern(s, static_cast<uint32_t>(p), i, salt);
      ++checks;
    }
  }
  if (bad_push) atomicAdd(&errors[0], bad_push);
  if (bad_pull) atomicAdd(&errors[1], bad_pull);
  atomicAdd(&errors[2], checks);
}

// ---------------------------------------------------------------------------------------------
// Barrier correctness: every CTA b, for `iters` rounds, stores the round number into its slot on
// every rank (plain stores), crosses barrier b, checks that every rank's slot in its own memory
// holds this round, crosses barrier b again. Window layout: uint32 [cta][src][blockDim.x].
// result[0] += wrong values, result[1] += completed rounds, result[2] += failed barriers.
// ---------------------------------------------------------------------------------------------
__global__ void barrier_rounds(__grid_constant__ const DeviceComm dc, ncclWindow_t win, uint32_t iters,
                               unsigned long long* result) {
  const uint32_t b = blockIdx.x, t = threadIdx.x, T = blockDim.x;
  const int W = dc.nranks;
  unsigned long long bad = 0;
  uint32_t it = 1;
  bool ok = true;
  for (; it <= iters && ok; ++it) {
    for (int p = 0; p < W; ++p) {
      *dev::peer_ptr<uint32_t>(win, ((static_cast<size_t>(b) * W + dc.rank) * T + t) * 4, p) = it;
    }
    ok = dev::lsa_barrier(dc, b);
    if (!ok) break;
    for (int s = 0; s < W; ++s) {
      bad += *dev::local_ptr<uint32_t>(win, ((static_cast<size_t>(b) * W + s) * T + t) * 4) != it;
    }
    ok = dev::lsa_barrier(dc, b);
  }
  if (bad) atomicAdd(&result[0], bad);
  if (t == 0) {
    atomicAdd(&result[1], static_cast<unsigned long long>(ok ? iters : it - 1));
    if (!ok) atomicAdd(&result[2], 1ull);
  }
}

// ---------------------------------------------------------------------------------------------
// Flag hand-offs under load. Blocks [0, C): senders of channel c to rank+1; [C, 2C): receivers of
// channel c from rank-1; [2C, gridDim): load (pull bulk data from rank+1 until the receivers end).
// Per channel: a ring of D slots of P words + a flag per slot in the receiver's window, and a credit
// word in the sender's window (messages consumed).
// result: [0] payload errors, [1] flag-order errors, [2] messages received, [3] stop counter,
//         [4] load bytes pulled, [5] aborted waits.
// ---------------------------------------------------------------------------------------------
struct HandoffLayout {
  static constexpr uint32_t kChannels = 4, kSlots = 8, kWords = 64;
  static __host__ __device__ size_t flag(uint32_t c, uint32_t s) { return (c * kSlots + s) * 4; }
  static __host__ __device__ size_t payload(uint32_t c, uint32_t s) {
    return (kChannels * kSlots + (c * kSlots + s) * kWords) * 4;
  }
  static __host__ __device__ size_t credit(uint32_t c) {
    return (kChannels * kSlots + kChannels * kSlots * kWords + c) * 4;
  }
  static constexpr size_t bytes() { return (kChannels * kSlots * (1 + kWords) + kChannels) * 4; }
};

__global__ void handoff_under_load(__grid_constant__ const DeviceComm dc, ncclWindow_t hw, ncclWindow_t bulk,
                                   size_t bulk_bytes, int4* scratch, uint32_t msgs,
                                   unsigned long long* result) {
  using L = HandoffLayout;
  const uint32_t C = L::kChannels, D = L::kSlots, P = L::kWords;
  const uint32_t t = threadIdx.x;
  const int next = (dc.rank + 1) % dc.nranks, prev = (dc.rank + dc.nranks - 1) % dc.nranks;
  if (blockIdx.x < C) {  // sender
    const uint32_t c = blockIdx.x;
    const uint32_t* credit = dev::local_ptr<uint32_t>(hw, L::credit(c));
    for (uint32_t seq = 1; seq <= msgs; ++seq) {
      const uint32_t slot = (seq - 1) % D;
      if (seq > D && !dev::cta_wait_geq(dc, credit, seq - D, kWaitTestCredit, next)) {
        if (t == 0) atomicAdd(&result[5], 1ull);
        return;
      }
      if (t < P) {
        *dev::peer_ptr<uint32_t>(hw, L::payload(c, slot) + t * 4, next) =
            pattern(static_cast<uint32_t>(dc.rank), c, seq * P + t, 0x5eed);
      }
      __syncthreads();  // every thread's payload stores, then one release of the flag
      if (t == 0) dev::store_release(dev::peer_ptr<uint32_t>(hw, L::flag(c, slot), next), seq);
    }
  } else if (blockIdx.x < 2 * C) {  // receiver
    const uint32_t c = blockIdx.x - C;
    const uint32_t* flags = dev::local_ptr<uint32_t>(hw, L::flag(c, 0));
    uint32_t* peer_credit = dev::peer_ptr<uint32_t>(hw, L::credit(c), prev);
    unsigned long long bad = 0, order = 0;
    uint32_t seq = 1;
    for (; seq <= msgs; ++seq) {
      const uint32_t slot = (seq - 1) % D;
      if (!dev::cta_wait_geq(dc, &flags[slot], seq, kWaitTestHandoff, prev)) {
        if (t == 0) atomicAdd(&result[5], 1ull);
        break;
      }
      if (t == 0 && dev::load_relaxed(&flags[slot]) != seq) ++order;  // lost or reordered
      if (t < P) {
        const uint32_t v = *dev::local_ptr<uint32_t>(hw, L::payload(c, slot) + t * 4);
        bad += v != pattern(static_cast<uint32_t>(prev), c, seq * P + t, 0x5eed);
      }
      __syncthreads();  // all reads of the slot done before the credit returns it
      if (t == 0) dev::store_release(peer_credit, seq);
    }
    if (bad) atomicAdd(&result[0], bad);
    if (t == 0) {
      if (order) atomicAdd(&result[1], order);
      atomicAdd(&result[2], static_cast<unsigned long long>(seq - 1));
      atomicAdd(&result[3], 1ull);
    }
  } else {  // load: pull bulk rows from `next` until every receiver of this rank is done
    const int4* src = dev::peer_ptr<const int4>(bulk, 0, next);
    const size_t n = bulk_bytes / sizeof(int4);
    const uint64_t start = dev::globaltimer_ns();
    unsigned long long moved = 0;
    __shared__ int stop;
    for (uint32_t round = 0;; ++round) {
      for (size_t i = (blockIdx.x - 2 * C) * static_cast<size_t>(blockDim.x) + t; i < n;
           i += static_cast<size_t>(gridDim.x - 2 * C) * blockDim.x) {
        scratch[i] = src[i];
        moved += sizeof(int4);
      }
      if (t == 0) {
        const unsigned long long done = *reinterpret_cast<volatile unsigned long long*>(&result[3]);
        stop = done >= C || dev::globaltimer_ns() - start > dc.timeout_ns || dev::wait_aborted(dc);
      }
      __syncthreads();
      if (stop) break;
      __syncthreads();
    }
    atomicAdd(&result[4], moved);
  }
}

// ---------------------------------------------------------------------------------------------
// Timeout path: waits (one CTA) for a flag in the local window that the peer never sets.
// ---------------------------------------------------------------------------------------------
__global__ void wait_withheld(__grid_constant__ const DeviceComm dc, ncclWindow_t win, int peer, uint32_t* ok) {
  const bool done = dev::cta_wait_geq(dc, dev::local_ptr<uint32_t>(win, 0), 1u, kWaitTestWithheld, peer);
  if (threadIdx.x == 0) ok[0] = done ? 1u : 0u;
}

}  // namespace mok::comm::test
