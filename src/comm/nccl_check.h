// mok — turning NCCL failures into mok::Error (host code of the communication layer).
#pragma once

#include <nccl.h>

#include <string>

#include "mok/errors.hpp"

namespace mok::comm {

inline Error nccl_error(ncclResult_t r, ncclComm_t comm, const std::string& what) {
  const char* last = comm ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  return Error(ErrorKind::Runtime, what,
               detail::concat(ncclGetErrorString(r), (last && last[0]) ? ": " : "", last ? last : ""));
}

}  // namespace mok::comm

#define MOK_NCCL_CHECK(expr, nccl_comm_, what)                                                       \
  do {                                                                                         \
    const ncclResult_t mok_nccl_r_ = (expr);                                                   \
    if (mok_nccl_r_ != ncclSuccess) throw ::mok::comm::nccl_error(mok_nccl_r_, (nccl_comm_), (what)); \
  } while (0)
