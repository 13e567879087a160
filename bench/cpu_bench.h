// mok_bench's CPU mode (a machine without a GPU, or --cpu): the CPU reference engine (the
// executable spec) on W simulated ranks at a scaled-down model shape, timed, then checked against
// the naive fp64 model (src/reference/fp64_model.h), so that the run ends with a verdict instead
// of timings alone.
#pragma once

#include "bench_args.h"

namespace mok::bench {

// Prints the table and the verdict line ("verdict: PASS — ..." / "verdict: FAIL — ..."), writes
// o.json when it is set (device "cpu", run metadata, timings, the fp64 check, the verdict) and
// returns 0 on PASS, 1 on FAIL. Throws mok::Error on bad shapes or an unwritable results file.
int run_cpu_bench(const CpuBenchOptions& o, int threads);

}  // namespace mok::bench
