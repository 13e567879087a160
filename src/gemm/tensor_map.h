// mok — TMA tensor maps for the GEMM engine (host side).
//
// cuTensorMapEncodeTiled is a driver entry point; it is fetched once through the runtime
// (cudaGetDriverEntryPointByVersion, the non-deprecated form of cudaGetDriverEntryPoint), so mok
// does not link libcuda. Maps are passed to kernels by value as __grid_constant__ parameters.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace mok::gemm {

// The element type of a map (the engine's operand types, engine_mainloop.cuh): bf16, or FP8
// E4M3 (one byte, encoded as UINT8: TMA moves bytes); F32: fp32 scales, unswizzled (the FP8
// wgrad's per-stage scales, read by the consumers' shared-memory loads); F32Tile: fp32 tiles with the
// 128-byte swizzle of the operand maps (32 floats per box row: the fp32 weight gradients that the
// accumulate epilogue reduces into).
enum class MapType { BF16, E4M3, F32, F32Tile };
int element_bytes(MapType t);

// A tensor of rank 2 or 3, dims innermost first (dims[0] is contiguous), row strides in
// elements; box dims innermost first. The operand maps use the 128-byte swizzle, so box[0] must be
// 128 bytes (64 bf16, 128 FP8, 32 floats for F32Tile); F32 maps are unswizzled (box[0] a multiple of 4 floats, <= 256).
// Out-of-bounds elements read as zero and are not written by stores.
CUtensorMap make_tensor_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides_elems,
                            const uint32_t* box, MapType type = MapType::BF16);

// Convenience: [rows, cols] row-major matrix (cols contiguous), box {128 bytes, box_rows}.
CUtensorMap make_map_2d(const void* base, uint64_t rows, uint64_t cols, uint32_t box_rows,
                        MapType type = MapType::BF16);
// [rows, cols] fp32 row-major, box {box_cols, 1}: one row's run of scales per load.
CUtensorMap make_map_rows_f32(const float* base, uint64_t rows, uint64_t cols, uint32_t box_cols);
// [batch, rows, cols] row-major (cols contiguous), box {128 bytes, box_rows, 1}.
CUtensorMap make_map_3d(const void* base, uint64_t batch, uint64_t rows, uint64_t cols, uint32_t box_rows,
                        MapType type = MapType::BF16);

}  // namespace mok::gemm
