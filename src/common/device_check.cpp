#include "common/device_check.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>

#include "mok/errors.hpp"

namespace mok {

namespace {

using MemGetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// cuMemGetAddressRange through the runtime's driver entry point (no link against libcuda).
MemGetAddressRange address_range_fn() {
  static MemGetAddressRange fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<MemGetAddressRange>(p);
  });
  return fn;
}

const char* memory_kind(cudaMemoryType t) {
  switch (t) {
    case cudaMemoryTypeHost: return "pinned host memory";
    case cudaMemoryTypeDevice: return "device memory";
    case cudaMemoryTypeManaged: return "managed memory";
    default: return "host memory not known to CUDA";
  }
}

}  // namespace

void check_device_memory(const std::string& name, const void* p, int64_t bytes, int device, int64_t align) {
  if (bytes == 0 && p == nullptr) return;
  MOK_REQUIRE(p != nullptr, name, "must be a device buffer of ", bytes, " bytes, got a null pointer");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  MOK_REQUIRE(align <= 1 || addr % static_cast<uintptr_t>(align) == 0, name, "must be ", align,
              "-byte aligned (the kernels load it in ", align, "-byte vectors), got address 0x", std::hex, addr);
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // an unknown pointer leaves a sticky-free error: clear it
    throw Error(ErrorKind::InvalidArgument, name,
                detail::concat("must be device memory of GPU ", device, " (CUDA does not know this pointer: ",
                               cudaGetErrorString(e), ")"));
  }
  MOK_REQUIRE(a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged, name,
              "must be device memory of GPU ", device, ", got ", memory_kind(a.type));
  MOK_REQUIRE(a.type == cudaMemoryTypeManaged || a.device == device, name, "must be device memory of GPU ", device,
              " (this rank's), got memory of GPU ", a.device);
  if (a.type != cudaMemoryTypeDevice || bytes <= 0) return;
  const MemGetAddressRange range = address_range_fn();
  if (range == nullptr) return;  // the driver lacks the entry point: size unchecked
  CUdeviceptr base = 0;
  size_t size = 0;
  if (range(&base, &size, static_cast<CUdeviceptr>(addr)) != CUDA_SUCCESS) return;
  const uint64_t have = static_cast<uint64_t>(base) + size - addr;
  MOK_REQUIRE(have >= static_cast<uint64_t>(bytes), name, "needs ", bytes, " bytes from its address on, but the ",
              "allocation holding it ends after ", have);
}

void check_device_tensor(const std::string& name, const TensorRef& t, int device, int64_t align) {
  check_device_memory(name, t.data, t.numel() * size_of(t.dtype), device, align);
}

void check_device_weight_set(const std::string& prefix, const TensorRef& gate, const TensorRef& up,
                             const TensorRef& down, const TensorRef& s_gate, const TensorRef& s_up,
                             const TensorRef& s_down, bool shared, int device) {
  check_device_tensor(prefix + "_gate", gate, device);
  check_device_tensor(prefix + "_up", up, device);
  check_device_tensor(prefix + "_down", down, device);
  if (!shared) return;
  check_device_tensor(prefix + "s_gate", s_gate, device);
  check_device_tensor(prefix + "s_up", s_up, device);
  check_device_tensor(prefix + "s_down", s_down, device);
}

}  // namespace mok
