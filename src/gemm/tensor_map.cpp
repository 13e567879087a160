// mok — TMA tensor maps (see tensor_map.h).
#include "gemm/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <mutex>

#include "mok/errors.hpp"

namespace mok::gemm {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    if (e == cudaSuccess && q == cudaDriverEntryPointSuccess) fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  if (fn == nullptr) {
    throw Error(ErrorKind::Runtime, "cuTensorMapEncodeTiled",
                "the CUDA driver entry point could not be loaded (driver too old?)");
  }
  return fn;
}

}  // namespace

int element_bytes(MapType t) { return t == MapType::E4M3 ? 1 : (t == MapType::F32 || t == MapType::F32Tile) ? 4 : 2; }

CUtensorMap make_tensor_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides_elems,
                            const uint32_t* box, MapType type) {
  MOK_REQUIRE(rank >= 2 && rank <= 3, "tensor map rank", "2 or 3, got ", rank);
  MOK_REQUIRE(reinterpret_cast<uintptr_t>(base) % 16 == 0, "tensor base address",
              "must be 16-byte aligned");
  const int eb = element_bytes(type);
  const bool swizzled = type != MapType::F32;
  if (swizzled) {
    MOK_REQUIRE(box[0] * uint32_t(eb) == 128, "tensor map box", "inner box must be 128 bytes (128-byte swizzle): ",
                128 / eb, " elements, got ", box[0]);
  } else {
    MOK_REQUIRE(box[0] * uint32_t(eb) % 16 == 0, "tensor map box", "inner box must be a multiple of 16 bytes (",
                16 / eb, " elements), got ", box[0]);
  }
  cuuint64_t gdim[3] = {1, 1, 1};
  cuuint64_t gstride[2] = {0, 0};
  cuuint32_t gbox[3] = {1, 1, 1};
  cuuint32_t estride[3] = {1, 1, 1};
  for (int i = 0; i < rank; ++i) {
    MOK_REQUIRE(dims[i] >= 1, "tensor map dims", "every dim must be >= 1");
    MOK_REQUIRE(box[i] >= 1 && box[i] <= 256, "tensor map box", "1..256 per dim, got ", box[i]);
    gdim[i] = dims[i];
    gbox[i] = box[i];
  }
  for (int i = 0; i + 1 < rank; ++i) {
    const uint64_t bytes = strides_elems[i] * uint64_t(eb);
    MOK_REQUIRE(bytes % 16 == 0, "tensor map strides", "row strides must be multiples of 16 bytes (",
                16 / eb, " elements), got ", strides_elems[i]);
    gstride[i] = bytes;
  }
  CUtensorMap map{};
  const CUtensorMapDataType dt = type == MapType::E4M3  ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                 : element_bytes(type) == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                                        : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode_fn()(&map, dt, static_cast<cuuint32_t>(rank),
                                 const_cast<void*>(base), gdim, gstride, gbox, estride,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 swizzled ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error(ErrorKind::Runtime, "cuTensorMapEncodeTiled",
                detail::concat("CUresult ", static_cast<int>(r), " for dims ", dims[0], "x", dims[1],
                               rank == 3 ? "x" : "", rank == 3 ? dims[2] : 0));
  }
  return map;
}

CUtensorMap make_map_2d(const void* base, uint64_t rows, uint64_t cols, uint32_t box_rows, MapType type) {
  const uint64_t dims[2] = {cols, rows};
  const uint64_t strides[1] = {cols};
  const uint32_t box[2] = {uint32_t(128 / element_bytes(type)), box_rows};
  return make_tensor_map(base, 2, dims, strides, box, type);
}

CUtensorMap make_map_rows_f32(const float* base, uint64_t rows, uint64_t cols, uint32_t box_cols) {
  const uint64_t dims[2] = {cols, rows};
  const uint64_t strides[1] = {cols};
  const uint32_t box[2] = {box_cols, 1};
  return make_tensor_map(base, 2, dims, strides, box, MapType::F32);
}

CUtensorMap make_map_3d(const void* base, uint64_t batch, uint64_t rows, uint64_t cols, uint32_t box_rows,
                        MapType type) {
  const uint64_t dims[3] = {cols, rows, batch};
  const uint64_t strides[2] = {cols, rows * cols};
  const uint32_t box[3] = {uint32_t(128 / element_bytes(type)), box_rows, 1};
  return make_tensor_map(base, 3, dims, strides, box, type);
}

}  // namespace mok::gemm
