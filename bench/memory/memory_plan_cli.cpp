// mok_memory_plan: the GPU layer's planned device memory (mok::plan_memory, include/mok/memory.hpp)
// for the three benchmark models at T = 8192 tokens per rank and EP 1, 2 and 8, as JSON on stdout.
// It exists so that bench/results/memory-*.json (issue 19) can be written on any machine: the plan
// is what mok::Layer allocates, it needs no GPU, and EP 2 and 8 can be planned where only one GPU
// (or none) is present. bench/memory_report.py turns this output into the results file. Every case
// is rank 0 on the megakernel path, in three modes:
//   resident   mok::Config with workspace_budget_bytes = 0 and share_workspace off (the default
//              config is the training mode, the saved one below): the ring holds the worst case
//              of the routing (capped by 32-bit offsets), every buffer the layer's own;
//   saved      the workspace shared by the layers (Config::share_workspace) within a budget
//              (--workspace-budget, default 2 GB: mok::ring_for_workspace picks the ring), the
//              automatic activation budget: the backward runs over windows of the ring, reading
//              the saved gate/up rows;
//   recompute  the same with activation_budget_bytes = 0 (FC1 recomputed for every row).
// The planner sizes every buffer by the worst case or by a budget, so the numbers do not depend
// on the routing. `ring_rows` (rows of the forward's x ring) and `worst_case_rows` are printed.
// --precision fp8 | mxfp8 plans the FP8 layer (Config::precision): its megakernel trains in the
// saved and recompute modes (the backward over windows) and is forward only resident; without
// --workspace-budget its budget is mok::default_workspace_budget (2 GB plus the backward's
// per-call weight codes, which no ring makes smaller).
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
         ", \"backward_mode\": " + quoted(p.backward_mode()) +
         ", \"hold_rows\": " + std::to_string(p.hold_rows) + ", \"buffers\": [" + b +
         "], \"totals\": {\"total\": " + std::to_string(p.total()) +
         ", \"layer\": " + std::to_string(p.total(S::Layer)) + ", \"saved\": " + std::to_string(p.total(S::Saved)) +
         ", \"backward\": " + std::to_string(p.total(S::Backward)) +
         ", \"symmetric\": " + std::to_string(p.symmetric()) + ", \"workspace\": " + std::to_string(p.workspace()) +
         ", \"per_layer\": " + std::to_string(p.per_layer()) + "}";
}

int usage(int rc) {
  std::fprintf(rc ? stderr : stdout,
               "usage: mok_memory_plan [--sm-count N] [--workspace-budget MB] [--precision bf16|fp8|mxfp8]\n"
               "  JSON on stdout: mok::plan_memory for dsv3, qwen3-30b-a3b, qwen3-235b at T = %lld,\n"
               "  EP 1, 2 and 8, rank 0, modes resident (workspace_budget_bytes 0, no shared workspace), saved (the default mok::Config's training mode) and recompute\n"
               "  (the shared workspace within MB megabytes, default 2000, with the ring that fits it;\n"
               "  the automatic or no activation budget). --sm-count: the GPU's SMs (default 132).\n"
               "  --precision: the layer's (default bf16; fp8 / mxfp8 budget 2 GB plus the backward's\n"
               "  weight codes unless --workspace-budget is given).\n",
               static_cast<long long>(kTokens));
  return rc;
}

struct Mode {
  const char* name;
  bool windows;         // the shared workspace within --workspace-budget, and the ring that fits it
  int64_t budget;       // Config::activation_budget_bytes
};
constexpr Mode kModes[] = {{"resident", false, -1}, {"saved", true, -1}, {"recompute", true, 0}};

}  // namespace

int main(int argc, char** argv) {
  int sm_count = 132;
  int64_t budget_mb = 2000;
  bool budget_given = false;
  mok::Precision precision = mok::Precision::BF16;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) return usage(0);
    if (!std::strcmp(argv[i], "--precision") && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v == "bf16") precision = mok::Precision::BF16;
      else if (v == "fp8") precision = mok::Precision::FP8;
      else if (v == "mxfp8") precision = mok::Precision::MXFP8;
      else return usage(2);
      continue;
    }
    const bool sm = !std::strcmp(argv[i], "--sm-count"), budget = !std::strcmp(argv[i], "--workspace-budget");
    if ((sm || budget) && i + 1 < argc) {
      char* end = nullptr;
      const long long v = std::strtoll(argv[++i], &end, 10);
      if (*end != '\0' || v <= 0 || v > (1LL << 30)) return usage(2);
      if (sm) sm_count = static_cast<int>(v);
      if (budget) budget_mb = v, budget_given = true;
      continue;
    }
    return usage(2);
  }
  const mok::Config defaults;  // the megakernel path
  std::printf("{\"what\": \"mok::plan_memory, rank 0, modes resident / saved / recompute\", \"sm_count\": %d, "
              "\"workspace_budget_bytes\": %lld, \"precision\": \"%s\", \"forward_path\": \"%s\", \"dispatch\": \"%s\", "
              "\"cases\": [",
              sm_count, static_cast<long long>(budget_mb * 1000000), mok::to_string(precision),
              mok::to_string(defaults.forward_path), mok::to_string(defaults.dispatch));
  bool first = true;
  for (const Model& m : kModels) {
    for (int ep : kEps) {
      for (const Mode& mode : kModes) {
        const mok::LayerShape shape = mok::LayerShape::uniform(ep, kTokens, m.H, m.I, m.E, m.k);
        std::string body;
        // A shape the layer would refuse is reported, not fatal: the other cases still print.
        try {
          mok::Config config;
          config.precision = precision;
          config.activation_budget_bytes = mode.budget;
          if (!mode.windows) {  // (the resident mode is one setting away: mok_bench --workspace-budget 0)
            config.workspace_budget_bytes = 0;
            config.share_workspace = false;
          }
          if (mode.windows) {
            const int64_t budget =
                budget_given ? budget_mb * 1000000 : mok::default_workspace_budget(shape, config);
            config.macrobatch_tokens = mok::ring_for_workspace(shape, config, 0, sm_count, budget);
            config.share_workspace = true;
          }
          body = "\"macrobatch_tokens\": " + std::to_string(config.macrobatch_tokens) +
                 ", \"activation_budget_bytes\": " + std::to_string(config.activation_budget_bytes) +
                 ", \"share_workspace\": " + (config.share_workspace ? "true" : "false") + ", ";
          body += plan_json(mok::plan_memory(shape, config, 0, sm_count), shape);
        } catch (const std::exception& e) {
          body = "\"error\": " + quoted(e.what());
        }
        std::printf("%s\n  {\"model\": \"%s\", \"H\": %lld, \"I\": %lld, \"E\": %lld, \"k\": %lld, \"ep\": %d, "
                    "\"T\": %lld, \"mode\": \"%s\", %s}",
                    first ? "" : ",", m.name, static_cast<long long>(m.H), static_cast<long long>(m.I),
                    static_cast<long long>(m.E), static_cast<long long>(m.k), ep, static_cast<long long>(kTokens),
                    mode.name, body.c_str());
        first = false;
      }
    }
  }
  std::printf("\n]}\n");
  return 0;
}
