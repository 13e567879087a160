// mok — checks that a pointer handed to the GPU layer is memory its kernels may use, before
// anything is enqueued: a bad pointer is a named mok::Error, never a fault that kills the CUDA
// context (a misaligned 16-byte load or a read past an allocation would).
#pragma once

#include <cstdint>
#include <string>

#include "mok/tensor.hpp"

namespace mok {

// `p` (null only when bytes == 0) must be device (or managed) memory of GPU `device`, aligned to
// `align` bytes, and lie in one allocation that holds all `bytes` from `p` on. Throws
// InvalidArgument naming `name` and the violated constraint.
void check_device_memory(const std::string& name, const void* p, int64_t bytes, int device, int64_t align = 16);
// The same for a tensor whose shape was checked already: its numel() * size_of(dtype) bytes.
void check_device_tensor(const std::string& name, const TensorRef& t, int device, int64_t align = 16);
// A set of tensors shaped like one rank's weights (the weights, or their gradients): routed
// gate, up, down, and the shared expert's three when `shared`. Named prefix + "_gate", ... and
// prefix + "s_gate", ... (prefix "weights.w" names "weights.w_gate" and "weights.ws_gate").
void check_device_weight_set(const std::string& prefix, const TensorRef& gate, const TensorRef& up,
                             const TensorRef& down, const TensorRef& s_gate, const TensorRef& s_up,
                             const TensorRef& s_down, bool shared, int device);

}  // namespace mok
