// Where the GPU layer's memory comes from: the workspace its layers share on a communicator
// (Config::share_workspace: buffers and symmetric windows by name), its own buffers and windows
// as the memory plan names them, and the saved state of several forwards alive at once
// (Config::saved_forwards > 1: microbatches, pipeline stages, activation checkpointing).
// Forward g uses slot g % N: its own schedule (the builder's tables), its copy of its published
// routing, the activation budget's gate/up rows and the shared expert's activations. The Impl
// members that the forward and the backward use are the active slot's; activating another swaps
// them with slots[i] (pointer swaps, the tensor maps into the buffers with them), so the kernels'
// code is the one-forward code. Everything else a backward needs is staged again (x, d_out) or
// transient (the workspace).
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "gemm/tensor_map.h"
#include "megakernel/layer_impl.h"
#include "mok/memory.hpp"

namespace mok {

std::shared_ptr<layer_detail::DeviceBuffer> layer_detail::Workspace::get(const std::string& name, size_t bytes) {
  const std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = entries_[name];
  if (std::shared_ptr<DeviceBuffer> b = e.buffer.lock(); b && e.bytes >= bytes) return b;
  auto b = std::make_shared<DeviceBuffer>(bytes, name.c_str());  // zeroed, as every buffer
  e = Entry{b, bytes};
  return b;
}

std::shared_ptr<layer_detail::SharedWindow> layer_detail::Workspace::window(comm::Communicator& comm,
                                                                          const std::string& name, size_t bytes) {
  const std::lock_guard<std::mutex> lock(mutex_);
  WindowEntry& e = windows_[name];
  if (std::shared_ptr<SharedWindow> w = e.window.lock(); w && e.bytes >= bytes) return w;
  auto w = std::make_shared<SharedWindow>(comm, comm.acquire_window(name, bytes));
  e = WindowEntry{w, bytes};
  return w;
}

int64_t layer_detail::Workspace::windows_reused(const MemoryPlan& plan) {
  const std::lock_guard<std::mutex> lock(mutex_);
  int64_t mask = 0;
  int bit = 0;
  for (const BufferBytes& b : plan.buffers) {
    if (!b.symmetric || !b.workspace) continue;
    const auto it = windows_.find(std::string("mok.workspace.") + b.name);
    if (it != windows_.end() && !it->second.window.expired() && it->second.bytes >= static_cast<size_t>(b.bytes))
      mask |= int64_t(1) << bit;
    ++bit;
  }
  return mask;
}

std::shared_ptr<layer_detail::Workspace> layer_detail::Workspace::of(const comm::Communicator& comm) {
  // One per communicator while any of its layers shares; keyed by address (a communicator
  // outlives its layers, so an expired entry is never another one's).
  static std::mutex mutex;
  static std::map<const comm::Communicator*, std::weak_ptr<Workspace>> registry;
  const std::lock_guard<std::mutex> lock(mutex);
  std::weak_ptr<Workspace>& slot = registry[&comm];
  std::shared_ptr<Workspace> w = slot.lock();
  if (!w) slot = w = std::make_shared<Workspace>();
  return w;
}

const comm::Window* Layer::Impl::acquire_window(const std::string& tag, const char* name) {
  const auto bytes = static_cast<size_t>(mem.bytes(name));
  for (const BufferBytes& b : mem.buffers) {
    if (b.name != name || !b.workspace) continue;
    shared_windows.push_back(workspace->window(comm, std::string("mok.workspace.") + name, bytes));
    return shared_windows.back()->window;
  }
  // "window.x" -> tag + ".x"
  return leases.acquire(comm, tag + std::string(name).substr(std::string("window").size()), bytes);
}

layer_detail::DeviceBuffer Layer::Impl::allocate(const char* name, const char* what) {
  const auto bytes = static_cast<size_t>(mem.bytes(name));
  for (const BufferBytes& b : mem.buffers)
    if (b.name == name && b.workspace) return DeviceBuffer::view(workspace->get(name, bytes));
  return DeviceBuffer(bytes, what);
}

void Layer::Impl::setup_saved_slots() {
  const int n = config.saved_forwards;
  if (n <= 1) return;
  slots.resize(static_cast<size_t>(n));
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  const int64_t rows = t_tiles * sched::kBlockM;
  const bool has_shared = Is > 0 && T > 0;
  saved_routing = DeviceBuffer(static_cast<size_t>(mem.bytes(slot_name("routing", 0, true))), "saved routing");
  for (int i = 1; i < n; ++i) {
    SavedSlot& s = slots[static_cast<size_t>(i)];
    s.schedule = std::make_unique<gpu::ScheduleBuilder>(shape, config, rank, tables.get<const int32_t* const>(), sms);
    s.routing = DeviceBuffer(static_cast<size_t>(mem.bytes(slot_name("routing", i, true))), "saved routing");
    // Maps of this slot's buffers (or the active ones' where it has none: never used then).
    s.gu_map = maps.gu;
    s.gus_out = maps.gus_out;
    s.hs_out = maps.hs_out;
    s.hs_in = maps.hs_in;
    if (saved_rows > 0) {
      s.gu_saved = allocate(slot_name("gu_saved", i).c_str(), "saved gate/up rows");
      s.gu_map = gemm::make_map_2d(s.gu_saved.p, u(saved_rows), u(2 * I), 64);
    }
    if (has_shared) {
      s.gu_s = DeviceBuffer(static_cast<size_t>(mem.bytes(slot_name("gu_s", i))), "gu_s");
      s.h_s = DeviceBuffer(static_cast<size_t>(mem.bytes(slot_name("h_s", i))), "h_s");
      s.gus_out = gemm::make_map_2d(s.gu_s.p, u(rows), u(2 * Is), 64);
      s.hs_out = gemm::make_map_2d(s.h_s.p, u(rows), u(Is), 64);
      s.hs_in = gemm::make_map_2d(s.h_s.p, u(rows), u(Is), 128);
    }
  }
}

void Layer::Impl::swap_slot(int i) {
  SavedSlot& s = slots[static_cast<size_t>(i)];
  std::swap(schedule, s.schedule);
  std::swap(gu_saved, s.gu_saved);
  std::swap(gu_s, s.gu_s);
  std::swap(h_s, s.h_s);
  std::swap(saved_routing, s.routing);
  std::swap(maps.gu, s.gu_map);
  std::swap(maps.gus_out, s.gus_out);
  std::swap(maps.hs_out, s.hs_out);
  std::swap(maps.hs_in, s.hs_in);
  std::swap(saved, s.saved);
  std::swap(active_generation, s.generation);
}

void Layer::Impl::refuse_capture_with_slots(cudaStream_t stream) const {
  if (slots.size() <= 1) return;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MOK_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  MOK_REQUIRE(capturing == cudaStreamCaptureStatusNone, "config.saved_forwards",
              "more than 1 cannot be captured in a CUDA graph (each call's slot is chosen on the host)");
}

void Layer::Impl::activate(int i) {
  if (i == active) return;
  swap_slot(active);  // the active state back into its slot (which held nothing)
  swap_slot(i);       // slot i's into the members (its slot now holds nothing)
  active = i;
}

}  // namespace mok
