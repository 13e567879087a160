// mok — host side of the device error word (src/common/error_word.h).
#pragma once

#include <cstdint>

namespace mok {

class DeviceErrorWord {
 public:
  DeviceErrorWord();  // host-mapped allocation, zeroed
  ~DeviceErrorWord();
  DeviceErrorWord(const DeviceErrorWord&) = delete;
  DeviceErrorWord& operator=(const DeviceErrorWord&) = delete;

  // Pointer kernels write to.
  unsigned long long* device() const { return device_; }
  // The raw word (valid once the kernels that may write it have completed).
  uint64_t peek() const;
  // Throws mok::Error naming the recorded problem (and clears the word), else returns.
  // `top_k` turns a flat routing index into "topk_idx[t,j]".
  void check(int64_t top_k = 1);
  void clear();

 private:
  unsigned long long* host_ = nullptr;
  unsigned long long* device_ = nullptr;
};

}  // namespace mok
