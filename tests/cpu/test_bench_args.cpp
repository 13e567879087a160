// mok_bench's command line (bench/bench_args.h): numbers parse strictly, every bad value is an
// error naming its option and constraint, and options of the mode that does not run give notes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <regex>
#include <string>
#include <vector>

#include "bench_args.h"
#include "mok/errors.hpp"
#include "mok_bench_usage.h"

namespace {

using mok::bench::BenchArgs;
using mok::bench::mode_notes;
using mok::bench::parse_bench_args;
using mok::bench::parse_number;

// Runs fn, expects a mok::Error whose argument is `option` and whose message contains `needle`.
template <typename Fn>
void expect_error(Fn fn, const std::string& option, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error about " << option;
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.kind(), mok::ErrorKind::InvalidArgument) << e.what();
    EXPECT_EQ(e.argument(), option) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

void expect_bad_args(const std::vector<std::string>& args, const std::string& option, const std::string& needle) {
  expect_error([&] { (void)parse_bench_args(args); }, option, needle);
}

}  // namespace

TEST(BenchParseNumber, AcceptsWholeInRange) {
  EXPECT_EQ(parse_number("--x", "0", 0, 10), 0);
  EXPECT_EQ(parse_number("--x", "10", 0, 10), 10);
  EXPECT_EQ(parse_number<int64_t>("--x", "1048576", 1, int64_t{1} << 20), int64_t{1} << 20);
  EXPECT_EQ(parse_number("--x", "2.5", 0.0, 600.0), 2.5);
  EXPECT_EQ(parse_number("--x", "4", 0.0, 600.0), 4.0);
}

TEST(BenchParseNumber, RejectsPartialOrMalformed) {
  for (const char* text : {"", "abc", "12x", "2.5", " 3", "3 ", "+3", "0x10", "1e3", "--"}) {
    expect_error([&] { (void)parse_number("--x", text, 0, 100000); }, "--x", "must be a whole number in [0, 100000]");
  }
  for (const char* text : {"", "abc", "1.5s", "nan", "inf", "-inf", " 1"}) {
    expect_error([&] { (void)parse_number("--s", text, 0.0, 600.0); }, "--s", "must be a number in [0, 600]");
  }
}

TEST(BenchParseNumber, RejectsOutOfRange) {
  expect_error([] { (void)parse_number("--x", "-1", 0, 10); }, "--x", "got '-1'");
  expect_error([] { (void)parse_number("--x", "11", 0, 10); }, "--x", "in [0, 10]");
  // Beyond the type itself (from_chars reports result_out_of_range).
  expect_error([] { (void)parse_number("--x", "99999999999999999999", 0, 10); }, "--x", "in [0, 10]");
  expect_error([] { (void)parse_number("--s", "600.5", 0.0, 600.0); }, "--s", "got '600.5'");
}

TEST(BenchArgs, Defaults) {
  const BenchArgs a = parse_bench_args({});
  const mok::bench::GpuBenchOptions d;
  EXPECT_FALSE(a.help);
  EXPECT_FALSE(a.force_cpu);
  EXPECT_STREQ(a.cpu.preset->name, "medium");
  EXPECT_EQ(a.cpu.ranks, a.cpu.preset->world);
  EXPECT_EQ(a.cpu.reps, 3);
  EXPECT_EQ(a.gpu.models, d.models);
  EXPECT_EQ(a.gpu.tokens, d.tokens);
  EXPECT_EQ(a.gpu.iters, d.iters);
  EXPECT_EQ(a.gpu.sustain_s, d.sustain_s);
  EXPECT_TRUE(a.given.empty());
}

TEST(BenchArgs, ParsesEveryOption) {
  const BenchArgs a = parse_bench_args(
      {"--models", "qwen3-235b,dsv3", "--tokens", "64,4096", "--routings", "zipf,one-rank", "--iters", "25",
       "--warmup", "0", "--comm-sms", "12", "--minibatch", "2048", "--macrobatch", "32768", "--budget", "0", "--path", "unfused", "--clusters", "1", "--dispatch", "push", "--bwd-path", "fused",
       "--sustain", "1.5", "--no-ablation", "--no-backward", "--json", "out.json", "--preset", "tiny",
       "--ranks", "8", "--routing", "empty-slots", "--threads", "2", "--reps", "1", "--cpu"});
  EXPECT_EQ(a.gpu.models, (std::vector<std::string>{"qwen3-235b", "dsv3"}));
  EXPECT_EQ(a.gpu.tokens, (std::vector<int64_t>{64, 4096}));
  EXPECT_EQ(a.gpu.routings, (std::vector<mok::Routing>{mok::Routing::Zipf, mok::Routing::OneRank}));
  EXPECT_EQ(a.gpu.iters, 25);
  EXPECT_EQ(a.gpu.warmup, 0);
  EXPECT_EQ(a.gpu.comm_sms, 12);
  EXPECT_EQ(a.gpu.minibatch, 2048);
  EXPECT_EQ(a.gpu.macrobatch, 32768);
  EXPECT_EQ(a.gpu.budget_mb, 0);
  EXPECT_EQ(a.gpu.workspace_budget_mb, -1);
  EXPECT_EQ(parse_bench_args({"--workspace-budget", "2000"}).gpu.workspace_budget_mb, 2000);
  EXPECT_TRUE(a.gpu.variants.empty());  // every ablation variant
  EXPECT_EQ(parse_bench_args({"--variants", "megakernel-bwd-accumulate,megakernel-resident"}).gpu.variants,
            (std::vector<std::string>{"megakernel-bwd-accumulate", "megakernel-resident"}));
  EXPECT_EQ(a.gpu.path, mok::ForwardPath::Unfused);
  EXPECT_EQ(a.gpu.clusters, 1);
  EXPECT_EQ(a.gpu.dispatch, mok::DispatchPath::Push);
  EXPECT_EQ(a.gpu.backward_path, mok::BackwardPath::Fused);
  EXPECT_EQ(a.gpu.sustain_s, 1.5);
  EXPECT_FALSE(a.gpu.ablation);
  EXPECT_FALSE(a.gpu.backward);
  EXPECT_EQ(a.gpu.json, "out.json");
  EXPECT_EQ(a.cpu.json, "out.json");  // --json names the results file of either mode
  EXPECT_STREQ(a.cpu.preset->name, "tiny");
  EXPECT_EQ(a.cpu.ranks, 8);
  EXPECT_EQ(a.cpu.routing, mok::Routing::EmptySlots);
  EXPECT_EQ(a.cpu.threads, 2);
  EXPECT_EQ(a.cpu.reps, 1);
  EXPECT_TRUE(a.force_cpu);
}

// The examples of issue 17, item 5, one by one.
TEST(BenchArgs, RejectsBadValuesByName) {
  expect_bad_args({"--ranks", "0"}, "--ranks", "must be a whole number in [1, 4096]");
  expect_bad_args({"--ranks", "abc"}, "--ranks", "got 'abc'");
  expect_bad_args({"--threads", "-1"}, "--threads", "in [0, 1024] (0 = all cores)");
  expect_bad_args({"--reps", "2.5"}, "--reps", "got '2.5'");
  expect_bad_args({"--tokens", "-5"}, "--tokens", "must be a whole number in [1, 1048576] per rank");
  expect_bad_args({"--tokens", "12x"}, "--tokens", "got '12x'");
  expect_bad_args({"--tokens", "2048,,8192"}, "--tokens", "got ''");
  expect_bad_args({"--iters", "19"}, "--iters", "in [20, 100000]");
  expect_bad_args({"--comm-sms", "8.0"}, "--comm-sms", "got '8.0'");
  expect_bad_args({"--minibatch", "1000"}, "--minibatch", "got '1000'");
  expect_bad_args({"--macrobatch", "-1"}, "--macrobatch", "got '-1'");
  expect_bad_args({"--budget", "-2"}, "--budget", "got '-2'");
  expect_bad_args({"--workspace-budget", "-2"}, "--workspace-budget", "got '-2'");
  expect_bad_args({"--workspace-budget", "2000", "--macrobatch", "8192"}, "--workspace-budget", "not with --macrobatch");
  expect_bad_args({"--path", "unfused", "--workspace-budget", "2000"}, "--workspace-budget", "not with --path unfused");
  expect_bad_args({"--clusters", "2"}, "--clusters", "in [0, 1]");
  expect_bad_args({"--sustain", "-1"}, "--sustain", "in [0, 600] seconds");
  expect_bad_args({"--sustain", "4s"}, "--sustain", "got '4s'");
  expect_bad_args({"--variants", ""}, "--variants", "ablation variant names, got ''");
  expect_bad_args({"--variants", "megakernel-resident,"}, "--variants", "got 'megakernel-resident,'");
}

TEST(BenchArgs, RejectsUnknownNames) {
  expect_bad_args({"--models", "llama"}, "--models", "must be one of dsv3, qwen3-30b-a3b, qwen3-235b, dsv3/ep8");
  expect_bad_args({"--models", "dsv3,"}, "--models", "got ''");
  expect_bad_args({"--preset", "huge"}, "--preset", "must be one of tiny, small, medium");
  expect_bad_args({"--path", "fused"}, "--path", "must be one of megakernel, unfused");
  expect_bad_args({"--dispatch", "pul"}, "--dispatch", "must be one of pull, push");
  expect_bad_args({"--bwd-path", "megakernel"}, "--bwd-path", "must be one of unfused, fused");
  expect_bad_args({"--routing", "zipff"}, "--routing", "must be one of uniform, zipf");
  expect_bad_args({"--routings", "uniform,x"}, "--routings", "got 'x'");
  expect_bad_args({"--frobnicate"}, "--frobnicate", "unknown option");
  expect_bad_args({"medium"}, "medium", "unknown option");
}

TEST(BenchArgs, RejectsMissingValue) {
  expect_bad_args({"--ranks"}, "--ranks", "needs a value");
  expect_bad_args({"--cpu", "--json"}, "--json", "needs a value");
  // The next option is not swallowed as the value.
  expect_bad_args({"--ranks", "--cpu"}, "--ranks", "got the option '--cpu'");
}

TEST(BenchArgs, RanksMustDivideThePresetsExperts) {
  expect_bad_args({"--preset", "tiny", "--ranks", "3"}, "--ranks", "must divide the experts of preset tiny (E = 8)");
  expect_bad_args({"--ranks", "16", "--preset", "tiny"}, "--ranks", "got 16");  // order does not matter
  EXPECT_EQ(parse_bench_args({"--preset", "small", "--ranks", "16"}).cpu.ranks, 16);
  EXPECT_EQ(parse_bench_args({"--preset", "tiny"}).cpu.ranks, 2);
}

TEST(BenchArgs, HelpWinsOverEverythingElse) {
  EXPECT_TRUE(parse_bench_args({"--help"}).help);
  EXPECT_TRUE(parse_bench_args({"--ranks", "abc", "-h"}).help);
}

TEST(BenchArgs, NotesForTheModeThatDoesNotRun) {
  const BenchArgs a = parse_bench_args(
      {"--comm-sms", "8", "--ranks", "2", "--comm-sms", "16", "--routing", "zipf", "--routings", "zipf", "--cpu"});
  EXPECT_EQ(mode_notes(a, /*gpu_mode=*/false),
            (std::vector<std::string>{"note: --comm-sms applies on GPUs only; ignored in CPU mode",
                                      "note: --routings applies on GPUs only; ignored in CPU mode, which takes --routing"}));
  EXPECT_EQ(mode_notes(a, /*gpu_mode=*/true),
            (std::vector<std::string>{"note: --ranks applies in CPU mode only (--cpu); ignored on GPUs",
                                      "note: --routing applies in CPU mode only (--cpu); ignored on GPUs, which take --routings"}));
  EXPECT_TRUE(mode_notes(parse_bench_args({"--cpu", "--preset", "tiny", "--json", "x.json"}), false).empty());
  EXPECT_TRUE(mode_notes(parse_bench_args({"--iters", "30", "--no-ablation"}), true).empty());
}

// The usage text (also printed by scripts/run.sh --help) and the parser list the same options.
TEST(BenchArgs, UsageListsExactlyTheKnownOptions) {
  const std::string usage = kMokBenchUsage;
  const std::vector<std::string> known = mok::bench::bench_option_names();
  for (const auto& name : known) {
    EXPECT_TRUE(std::regex_search(usage, std::regex("(^|[^-\\w])" + name + "($|[^-\\w])"))) << name;
  }
  const std::regex option("--[a-z][a-z0-9-]*");
  for (auto it = std::sregex_iterator(usage.begin(), usage.end(), option); it != std::sregex_iterator(); ++it) {
    EXPECT_NE(std::find(known.begin(), known.end(), it->str()), known.end()) << it->str() << " is in the usage text";
  }
}
