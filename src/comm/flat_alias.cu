#include "comm/flat_alias.h"

#include <nccl_device.h>

#include "common/cuda_check.h"

namespace mok::comm {

namespace {
__global__ void flat_alias_kernel(ncclWindow_t w, size_t offset, int peer, void** out) {
  *out = ncclGetLsaPointer(w, offset, peer);
}
__global__ void tell_peers_kernel(ncclWindow_t w, int rank, int nranks, uint32_t code) {
  for (int p = 0; p < nranks; ++p)
    if (p != rank) atomicCAS_system(static_cast<unsigned int*>(ncclGetLsaPointer(w, 0, p)), 0u, code);
  __threadfence_system();
}
}  // namespace

void tell_peers(ncclWindow_t abort_win, int rank, int nranks, uint32_t code, int device, cudaStream_t stream) {
  if (abort_win == nullptr || nranks < 2) return;
  int saved = -1;
  MOK_CUDA_CHECK(cudaGetDevice(&saved));
  MOK_CUDA_CHECK(cudaSetDevice(device));
  tell_peers_kernel<<<1, 1, 0, stream>>>(abort_win, rank, nranks, code);
  const cudaError_t launch = cudaGetLastError();
  const cudaError_t sync = cudaStreamSynchronize(stream);
  (void)cudaSetDevice(saved);
  MOK_CUDA_CHECK(launch);
  MOK_CUDA_CHECK(sync);
}

void* flat_alias(ncclWindow_t w, size_t offset, int peer, int device, cudaStream_t stream) {
  int saved = -1;
  MOK_CUDA_CHECK(cudaGetDevice(&saved));
  MOK_CUDA_CHECK(cudaSetDevice(device));
  void** d = nullptr;
  void* h = nullptr;
  MOK_CUDA_CHECK(cudaMalloc(&d, sizeof(void*)));
  flat_alias_kernel<<<1, 1, 0, stream>>>(w, offset, peer, d);
  const cudaError_t launch = cudaGetLastError();
  const cudaError_t copy = cudaMemcpyAsync(&h, d, sizeof(void*), cudaMemcpyDeviceToHost, stream);
  const cudaError_t sync = cudaStreamSynchronize(stream);
  (void)cudaFree(d);
  (void)cudaSetDevice(saved);
  MOK_CUDA_CHECK(launch);
  MOK_CUDA_CHECK(copy);
  MOK_CUDA_CHECK(sync);
  return h;
}

}  // namespace mok::comm
