// mok_memory_plan: the GPU layer's planned device memory (mok::plan_memory, include/mok/memory.hpp)
// for the three benchmark models at T = 8192 tokens per rank and EP 1, 2 and 8, as JSON on stdout.
// It exists so that bench/results/memory-*.json (issue 19) can be written on any machine: the plan
// is what mok::Layer allocates, it needs no GPU, and EP 2 and 8 can be planned where only one GPU
// (or none) is present. bench/memory_report.py turns this output into the results file. Every case
// is rank 0 with the default mok::Config (megakernel path); the planner sizes every buffer for the
// worst case of the routing, so the numbers do not depend on the routing. `ring_rows` (rows of the
// forward's x ring) and `worst_case_rows` are printed so the report can tell whether the backward
// can run on the megakernel path (it needs the ring to hold every routed row of the forward).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "mok/config.hpp"
#include "mok/memory.hpp"

namespace {

struct Model {
  const char* name;  // as mok_bench and the torch baseline name it, so the report can join them
  int64_t H, I, E, k;
};
constexpr Model kModels[] = {{"dsv3", 7168, 2048, 256, 8},
                             {"qwen3-30b-a3b", 2048, 768, 128, 8},
                             {"qwen3-235b", 4096, 1536, 128, 8}};
constexpr int kEps[] = {1, 2, 8};
constexpr int64_t kTokens = 8192;

// Buffer names are plain identifiers, but an error message may hold anything.
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
  }
  return out + "\"";
}

std::string plan_json(const mok::MemoryPlan& p, const mok::LayerShape& shape) {
  using S = mok::MemoryScope;
  std::string b;
  for (const mok::BufferBytes& buf : p.buffers)
    b += std::string(b.empty() ? "" : ", ") + "{\"name\": " + quoted(buf.name) + ", \"bytes\": " +
         std::to_string(buf.bytes) + ", \"scope\": " + quoted(mok::to_string(buf.scope)) +
         ", \"symmetric\": " + (buf.symmetric ? "true" : "false") + "}";
  // x_ring holds ring_rows rows of H bf16 values; absent on the unfused path (no ring: null).
  const std::string ring =
      p.has("x_ring") ? std::to_string(p.bytes("x_ring") / (2 * shape.hidden)) : std::string("null");
  return "\"worst_case_rows\": " + std::to_string(shape.worst_case_rows()) + ", \"ring_rows\": " + ring +
         ", \"buffers\": [" + b + "], \"totals\": {\"total\": " + std::to_string(p.total()) +
         ", \"layer\": " + std::to_string(p.total(S::Layer)) + ", \"saved\": " + std::to_string(p.total(S::Saved)) +
         ", \"backward\": " + std::to_string(p.total(S::Backward)) +
         ", \"symmetric\": " + std::to_string(p.symmetric()) + "}";
}

int usage(int rc) {
  std::fprintf(rc ? stderr : stdout,
               "usage: mok_memory_plan [--sm-count N]\n"
               "  JSON on stdout: mok::plan_memory for dsv3, qwen3-30b-a3b, qwen3-235b at T = %lld,\n"
               "  EP 1, 2 and 8, rank 0, the default mok::Config. --sm-count: the GPU's SMs (default 132).\n",
               static_cast<long long>(kTokens));
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  int sm_count = 132;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) return usage(0);
    if (!std::strcmp(argv[i], "--sm-count") && i + 1 < argc) {
      char* end = nullptr;
      sm_count = static_cast<int>(std::strtol(argv[++i], &end, 10));
      if (*end != '\0' || sm_count <= 0) return usage(2);
      continue;
    }
    return usage(2);
  }
  const mok::Config config;  // defaults: the megakernel path
  std::printf("{\"what\": \"mok::plan_memory, rank 0, default mok::Config\", \"sm_count\": %d, "
              "\"forward_path\": \"%s\", \"dispatch\": \"%s\", \"cases\": [",
              sm_count, mok::to_string(config.forward_path), mok::to_string(config.dispatch));
  bool first = true;
  for (const Model& m : kModels) {
    for (int ep : kEps) {
      const mok::LayerShape shape = mok::LayerShape::uniform(ep, kTokens, m.H, m.I, m.E, m.k);
      std::string body;
      // A shape the layer would refuse is reported, not fatal: the other cases still print.
      try {
        body = plan_json(mok::plan_memory(shape, config, 0, sm_count), shape);
      } catch (const std::exception& e) {
        body = "\"error\": " + quoted(e.what());
      }
      std::printf("%s\n  {\"model\": \"%s\", \"H\": %lld, \"I\": %lld, \"E\": %lld, \"k\": %lld, \"ep\": %d, "
                  "\"T\": %lld, %s}",
                  first ? "" : ",", m.name, static_cast<long long>(m.H), static_cast<long long>(m.I),
                  static_cast<long long>(m.E), static_cast<long long>(m.k), ep, static_cast<long long>(kTokens),
                  body.c_str());
      first = false;
    }
  }
  std::printf("\n]}\n");
  return 0;
}
