#include "mok/tensor.hpp"

#include <sstream>

#include "mok/errors.hpp"

namespace mok {

const char* to_string(DType t) {
  switch (t) {
    case DType::BF16: return "bf16";
    case DType::F32: return "f32";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::FP8_E4M3: return "fp8_e4m3";
    case DType::U8: return "u8";
  }
  return "?";
}

int64_t size_of(DType t) {
  switch (t) {
    case DType::BF16: return 2;
    case DType::F32: return 4;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::FP8_E4M3: return 1;
    case DType::U8: return 1;
  }
  return 0;
}

int64_t TensorRef::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

bool TensorRef::is_contiguous() const {
  if (strides.empty()) return true;
  if (strides.size() != sizes.size()) return false;
  int64_t expected = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] != 1 && strides[i] != expected) return false;
    expected *= sizes[i];
  }
  return true;
}

TensorRef TensorRef::contiguous(const void* data, DType dtype, std::vector<int64_t> sizes) {
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.sizes = std::move(sizes);
  return t;
}

namespace {
std::string shape_str(const std::vector<int64_t>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "]";
  return s.str();
}
}  // namespace

void check_tensor(const std::string& name, const TensorRef& t, std::initializer_list<DType> dtypes,
                  const std::vector<int64_t>& sizes) {
  bool dtype_ok = false;
  std::ostringstream allowed;
  for (DType d : dtypes) {
    dtype_ok = dtype_ok || d == t.dtype;
    allowed << (allowed.tellp() > 0 ? " or " : "") << to_string(d);
  }
  MOK_REQUIRE(dtype_ok, name, "dtype must be ", allowed.str(), ", got ", to_string(t.dtype));
  MOK_REQUIRE(t.sizes == sizes, name, "shape must be ", shape_str(sizes), ", got ",
              shape_str(t.sizes));
  MOK_REQUIRE(t.is_contiguous(), name, "must be contiguous row-major (strides ",
              shape_str(t.strides), " given for shape ", shape_str(t.sizes), ")");
  MOK_REQUIRE(t.data != nullptr || t.numel() == 0, name,
              "data pointer is null but the tensor has ", t.numel(), " elements");
}

}  // namespace mok
