// mok — synthetic layer inputs for tests, the CPU main job and benchmarks.
//
// Deterministic for a given seed on every platform (own generator, no std:: distributions).
// Values are random, never zeros: zeros hide unwritten outputs and run faster than real data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mok/reference.hpp"

namespace mok {

enum class Routing {
  Uniform,     // each token picks k distinct experts uniformly
  Zipf,        // expert popularity ~ 1/(e+1)^1.2; low ids (rank 0) are hot
  OneExpert,   // every token routes one slot to expert 0
  OneRank,     // every token routes all it can to the experts of the last rank
  EmptySlots,  // uniform, with about 30% of slots empty (-1) and some all-empty tokens
};

const char* to_string(Routing r);
Routing routing_from_string(const std::string& s);  // throws mok::Error naming "routing"

struct Workload {
  LayerShape shape;
  std::vector<ref::RankInput> inputs;        // per rank
  ref::LayerWeights weights;                 // all experts + shared
  std::vector<std::vector<bf16>> d_out;      // per rank [T, H]
};

// `parts` selects what to generate: benchmarks at model shapes make weights on the GPU instead
// (tens of GB at DeepSeek-V3 shapes) and need no d_out for the forward pass.
enum WorkloadParts : unsigned { kWeights = 1, kGradOutput = 2, kAllParts = 3 };
Workload make_workload(const LayerShape& shape, Routing routing, uint64_t seed,
                       unsigned parts = kAllParts);

// Deterministic generator used by make_workload (splitmix64).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  int64_t below(int64_t n) { return static_cast<int64_t>(uniform() * static_cast<double>(n)); }
  // Approximately standard normal (Irwin–Hall with 4 terms, rescaled): cheap and portable.
  double normal() { return (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.7320508075688772; }

 private:
  uint64_t s_;
};

}  // namespace mok
