// mok — turning CUDA runtime failures into mok::Error.
#pragma once

#include <cuda_runtime.h>

#include "mok/errors.hpp"

#define MOK_CUDA_CHECK(expr)                                                                   \
  do {                                                                                         \
    const cudaError_t mok_err_ = (expr);                                                       \
    if (mok_err_ != cudaSuccess) {                                                             \
      throw ::mok::Error(::mok::ErrorKind::Runtime, #expr,                                     \
                         ::mok::detail::concat(cudaGetErrorName(mok_err_), ": ",               \
                                               cudaGetErrorString(mok_err_)),                  \
                         ::mok::detail::concat(__FILE__, ":", __LINE__));                      \
    }                                                                                          \
  } while (0)
