// mok_bench's command line (see bench_args.h).
#include "bench_args.h"

#include <algorithm>
#include <string_view>

namespace mok::bench {

namespace {

enum class Mode { Both, Gpu, Cpu };

using Setter = void (*)(BenchArgs&, const std::string& option, const std::string& value);

// One row per option: the parser, the notes and the tests all read this table, so an option
// cannot be parsed without also being classified by mode.
struct Option {
  const char* name;
  bool takes_value;
  Mode mode;
  Setter set;
  const char* other = "";  // the other mode's counterpart, named in the note
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t b = 0;
  for (;;) {
    const size_t e = s.find(',', b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) return out;
    b = e + 1;
  }
}

// The library's routing names, with the error renamed from "routing" to the option given.
Routing parse_routing(const std::string& option, const std::string& value) {
  try {
    return routing_from_string(value);
  } catch (const Error& e) {
    throw Error(ErrorKind::InvalidArgument, option, e.constraint(), "got '" + value + "'");
  }
}

// `value` must be one of `names` (listed in the message).
void require_one_of(const std::string& option, const std::string& value, const std::vector<std::string>& names) {
  if (std::find(names.begin(), names.end(), value) != names.end()) return;
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
  throw Error(ErrorKind::InvalidArgument, option, "must be one of " + list, "got '" + value + "'");
}

// The models run_gpu_layer_bench knows: its default list runs every one of them.
const std::vector<std::string>& known_models() {
  static const std::vector<std::string> names = GpuBenchOptions{}.models;
  return names;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kCpuPresets) names.emplace_back(p.name);
  return names;
}

const Option kOptions[] = {
    {"--help", false, Mode::Both, [](BenchArgs& a, const std::string&, const std::string&) { a.help = true; }},
    {"-h", false, Mode::Both, [](BenchArgs& a, const std::string&, const std::string&) { a.help = true; }},
    {"--cpu", false, Mode::Both, [](BenchArgs& a, const std::string&, const std::string&) { a.force_cpu = true; }},
    // Both modes write their results file there (which mode runs is known only after parsing).
    {"--json", true, Mode::Both,
     [](BenchArgs& a, const std::string&, const std::string& v) { a.gpu.json = a.cpu.json = v; }},
    // GPU options.
    {"--models", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.models = split_list(v);
       for (const auto& m : a.gpu.models) require_one_of(o, m, known_models());
     }},
    {"--tokens", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.tokens.clear();
       for (const auto& t : split_list(v)) a.gpu.tokens.push_back(parse_number<int64_t>(o, t, 1, kMaxTokens, " per rank"));
     }},
    {"--routings", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.routings.clear();
       for (const auto& r : split_list(v)) a.gpu.routings.push_back(parse_routing(o, r));
     },
     "--routing"},
    {"--iters", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.iters = parse_number(o, v, kMinIters, kMaxIters);
     }},
    {"--warmup", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.warmup = parse_number(o, v, 0, kMaxIters);
     }},
    {"--comm-sms", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.comm_sms = parse_number(o, v, 0, kMaxCommSms, " (0 = chosen from the shape)");
     }},
    {"--minibatch", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.minibatch = parse_number<int64_t>(o, v, 0, kMaxTokens * 32, " routed rows (0 = chosen from the shape)");
       if (a.gpu.minibatch % 128 != 0)
         throw Error(ErrorKind::InvalidArgument, o, "must be a multiple of 128 (one M tile of routed rows)",
                     "got '" + v + "'");
     }},
    {"--macrobatch", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.macrobatch = parse_number<int64_t>(o, v, 0, kMaxTokens * 32, " routed rows (0 = the default ring)");
     }},
    {"--budget", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.budget_mb = parse_number<int64_t>(o, v, -1, int64_t(1) << 30, " MB (-1 = automatic, 0 = full recompute)");
     }},
    {"--workspace-budget", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.workspace_budget_mb = parse_number<int64_t>(o, v, -1, int64_t(1) << 30,
                                                          " MB (-1 = the library's default, 0 = off)");
     }},
    {"--path", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       require_one_of(o, v, {"megakernel", "unfused"});
       a.gpu.path = v == "megakernel" ? ForwardPath::Megakernel : ForwardPath::Unfused;
     }},
    {"--clusters", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) { a.gpu.clusters = parse_number(o, v, 0, 1); }},
    {"--dispatch", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       require_one_of(o, v, {"pull", "push"});
       a.gpu.dispatch = v == "pull" ? DispatchPath::Pull : DispatchPath::Push;
     }},
    {"--bwd-path", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       require_one_of(o, v, {"unfused", "fused"});
       a.gpu.backward_path = v == "unfused" ? BackwardPath::Unfused : BackwardPath::Fused;
     }},
    {"--precision", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       require_one_of(o, v, {"bf16", "fp8", "mxfp8"});
       a.gpu.precision = v == "bf16" ? Precision::BF16 : v == "fp8" ? Precision::FP8 : Precision::MXFP8;
     }},
    {"--sustain", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.sustain_s = parse_number(o, v, 0.0, kMaxSustainS, " seconds (0 = off)");
     }},
    {"--fp8-keep-weight-codes", false, Mode::Gpu,
     [](BenchArgs& a, const std::string&, const std::string&) { a.gpu.fp8_keep_weight_codes_t = true; }},
    {"--variants", true, Mode::Gpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.gpu.variants = split_list(v);
       for (const auto& n : a.gpu.variants)
         MOK_REQUIRE(!n.empty(), o, "a comma-separated list of ablation variant names, got '", v, "'");
     }},
    {"--no-ablation", false, Mode::Gpu, [](BenchArgs& a, const std::string&, const std::string&) { a.gpu.ablation = false; }},
    {"--no-backward", false, Mode::Gpu, [](BenchArgs& a, const std::string&, const std::string&) { a.gpu.backward = false; }},
    // CPU options.
    {"--preset", true, Mode::Cpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       require_one_of(o, v, preset_names());
       for (const auto& p : kCpuPresets)
         if (v == p.name) a.cpu.preset = &p;
     }},
    {"--ranks", true, Mode::Cpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) { a.cpu.ranks = parse_number(o, v, 1, kMaxRanks); }},
    {"--routing", true, Mode::Cpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) { a.cpu.routing = parse_routing(o, v); }, "--routings"},
    {"--threads", true, Mode::Cpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) {
       a.cpu.threads = parse_number(o, v, 0, kMaxThreads, " (0 = all cores)");
     }},
    {"--reps", true, Mode::Cpu,
     [](BenchArgs& a, const std::string& o, const std::string& v) { a.cpu.reps = parse_number(o, v, 1, kMaxReps); }},
};

const Option* find_option(const std::string& name) {
  for (const auto& o : kOptions)
    if (name == o.name) return &o;
  return nullptr;
}

}  // namespace

BenchArgs parse_bench_args(const std::vector<std::string>& args) {
  BenchArgs a;
  // --help anywhere prints the usage, whatever else is wrong (scripts/run.sh does the same).
  if (std::find_if(args.begin(), args.end(), [](const std::string& s) { return s == "--help" || s == "-h"; }) !=
      args.end()) {
    a.help = true;
    return a;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& name = args[i];
    const Option* o = find_option(name);
    if (o == nullptr) {
      throw Error(ErrorKind::InvalidArgument, name, "unknown option (--help lists the options)");
    }
    std::string value;
    if (o->takes_value) {
      // A following option is not taken as the value ("--ranks --cpu"); negative numbers are
      // values (and rejected by their range).
      if (i + 1 >= args.size()) throw Error(ErrorKind::InvalidArgument, name, "needs a value");
      if (std::string_view(args[i + 1]).starts_with("--")) {
        throw Error(ErrorKind::InvalidArgument, name, "needs a value", "got the option '" + args[i + 1] + "'");
      }
      value = args[++i];
    }
    o->set(a, name, value);
    if (std::find(a.given.begin(), a.given.end(), name) == a.given.end()) a.given.push_back(name);
  }
  // Checks across options, now that all are known.
  const CpuPreset& p = *a.cpu.preset;
  if (a.cpu.ranks == 0) a.cpu.ranks = p.world;
  MOK_REQUIRE(p.E % a.cpu.ranks == 0, "--ranks",
              "must divide the experts of preset ", p.name, " (E = ", p.E, "), got ", a.cpu.ranks);
  MOK_REQUIRE(a.gpu.workspace_budget_mb <= 0 || a.gpu.path == ForwardPath::Megakernel, "--workspace-budget",
              "sizes the megakernel's ring: not with --path unfused");
  MOK_REQUIRE(a.gpu.workspace_budget_mb <= 0 || a.gpu.macrobatch == 0, "--workspace-budget",
              "chooses the ring: not with --macrobatch");

  return a;
}

std::vector<std::string> mode_notes(const BenchArgs& args, bool gpu_mode) {
  std::vector<std::string> notes;
  for (const auto& name : args.given) {
    const Option& o = *find_option(name);
    std::string note;
    if (gpu_mode && o.mode == Mode::Cpu) {
      note = "note: " + name + " applies in CPU mode only (--cpu); ignored on GPUs";
      if (*o.other) note += std::string(", which take ") + o.other;
    } else if (!gpu_mode && o.mode == Mode::Gpu) {
      note = "note: " + name + " applies on GPUs only; ignored in CPU mode";
      if (*o.other) note += std::string(", which takes ") + o.other;
    }
    if (!note.empty()) notes.push_back(note);
  }
  return notes;
}

std::vector<std::string> bench_option_names() {
  std::vector<std::string> names;
  for (const auto& o : kOptions) names.emplace_back(o.name);
  return names;
}

}  // namespace mok::bench
