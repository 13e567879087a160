// mok — a minimal, non-owning tensor descriptor used at the API boundary.
//
// The library is called from PyTorch and from plain C++; both hand over raw pointers plus sizes
// and strides. TensorRef carries exactly that, and check_tensor() validates dtype, rank, sizes and
// layout with errors that name the argument.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace mok {

enum class DType { BF16, F32, I32, I64, FP8_E4M3, U8 };

const char* to_string(DType t);
int64_t size_of(DType t);

struct TensorRef {
  const void* data = nullptr;
  DType dtype = DType::BF16;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // in elements; empty = contiguous row-major

  int64_t numel() const;
  bool is_contiguous() const;

  static TensorRef contiguous(const void* data, DType dtype, std::vector<int64_t> sizes);
};

// Throws mok::Error unless `t` has one of `dtypes`, exactly the `sizes` given, and a contiguous
// row-major layout. A null data pointer is accepted only for tensors with zero elements.
void check_tensor(const std::string& name, const TensorRef& t, std::initializer_list<DType> dtypes,
                  const std::vector<int64_t>& sizes);

}  // namespace mok
