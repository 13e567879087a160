#!/usr/bin/env bash
# A/B of the GEMM forms on one GPU machine: a base build (from a source tarball, since the device
# copy of the tree has no .git) against this tree, mok_gemm_bench alternated ROUNDS times in one
# call, per case the median TF/s of each build (METHOD.md: A/B in one call, alternating binaries).
# On this machine, before the device call (the tarball travels in an ignored, carried folder):
#   git archive --format=tar <base-commit> > devrun/base.tar
# On the device (repo root), e.g. the FP8 weight gradients:
#   BASE_TAR=devrun/base.tar [ROUNDS=3] [FILTER=dsv3-wgrad-fc] [BENCH_ARGS="--reps 10"] \
#     bench/gemm/ab_device.sh
# A knob instead of a build: BENCH=<a built mok_gemm_bench> (e.g. devrun/bin/mok_gemm_bench from
# scripts/prebuilt.sh) runs that binary as both, the base with BASE_ARGS, the new with NEW_ARGS:
#   BENCH=devrun/bin/mok_gemm_bench BASE_ARGS="--cluster 0" NEW_ARGS="--cluster 1" \
#     FILTER=wgrad-fc bench/gemm/ab_device.sh
# and with BASE_BENCH=<another build's mok_gemm_bench> (e.g. copied aside before a rebuild) the two
# builds without building either.
# More builds in the same rounds: EXTRA_BENCHES="name=<path> ..." (each run after base and new, with
# NEW_ARGS; a column each, its ratio to the base).
# Writes $OUT/gemm-ab.json ({device, base, rounds, cases: [{case, rows_per_expert, base, new}]}, the
# TF/s of every run and their medians) and prints the table. The base's mok_gemm_bench must accept
# the same BENCH_ARGS (options added since the base are for the new build only: NEW_ARGS).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/gemm-ab-out}"
mkdir -p "$OUT"
t0=$(date +%s)
if [ -n "${BENCH:-}" ]; then
  base_bin="${BASE_BENCH:-$BENCH}" new_bin="$BENCH"
  for b in "$base_bin" "$new_bin"; do
    [ -x "$b" ] || { echo "ab_device: '$b' (BENCH / BASE_BENCH) is not an executable file" >&2; exit 2; }
  done
else
  [ -f "${BASE_TAR:-}" ] || { echo "ab_device: BASE_TAR (a git archive of the base commit) not found: '${BASE_TAR:-}'" >&2; exit 2; }
  gtest=()
  [ -f "$ROOT/.deps/googletest/CMakeLists.txt" ] && gtest=(-DMOK_GTEST_SOURCE="$ROOT/.deps/googletest")
  base_src=/tmp/mok-ab-base
  rm -rf "$base_src" && mkdir -p "$base_src" && tar xf "$BASE_TAR" -C "$base_src"
  jobs=$(( $(nproc) / 2 ))
  (cmake -S "$base_src" -B "$base_src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${gtest[@]}" >"$OUT/base_build.log" 2>&1 &&
    cmake --build "$base_src/build" -j "$jobs" --target mok_gemm_bench >>"$OUT/base_build.log" 2>&1) &
  cmake -S . -B build/gemm-ab -G Ninja -DCMAKE_BUILD_TYPE=Release "${gtest[@]}" >"$OUT/build.log" 2>&1 &&
    cmake --build build/gemm-ab -j "$jobs" --target mok_gemm_bench >>"$OUT/build.log" 2>&1
  wait
  for b in "$base_src/build" build/gemm-ab; do
    [ -x "$b/bench/gemm/mok_gemm_bench" ] || { echo "ab_device: $b did not build (see $OUT/*build.log)" >&2; exit 1; }
  done
  echo "builds: $(( $(date +%s) - t0 )) s"
  base_bin="$base_src/build/bench/gemm/mok_gemm_bench" new_bin=build/gemm-ab/bench/gemm/mok_gemm_bench
fi
read -r -a bench_args <<<"${BENCH_ARGS:---reps 10}"
read -r -a base_args <<<"${BASE_ARGS:-}"
read -r -a new_args <<<"${NEW_ARGS:-}"
for round in $(seq 1 "${ROUNDS:-3}"); do
  "$base_bin" --filter "${FILTER:-wgrad}" "${bench_args[@]}" "${base_args[@]}" \
    --out "$OUT/base_$round.json" >"$OUT/base_$round.txt" 2>&1 || echo "ab_device: base round $round failed" >&2
  "$new_bin" --filter "${FILTER:-wgrad}" "${bench_args[@]}" "${new_args[@]}" \
    --out "$OUT/new_$round.json" >"$OUT/new_$round.txt" 2>&1 || echo "ab_device: new round $round failed" >&2
  for x in ${EXTRA_BENCHES:-}; do
    "${x#*=}" --filter "${FILTER:-wgrad}" "${bench_args[@]}" "${new_args[@]}" \
      --out "$OUT/${x%%=*}_$round.json" >"$OUT/${x%%=*}_$round.txt" 2>&1 || echo "ab_device: ${x%%=*} round $round failed" >&2
  done
  echo "round $round: $(( $(date +%s) - t0 )) s"
done
for x in ${EXTRA_BENCHES:-}; do
  [[ "$x" == *=* && -x "${x#*=}" ]] || { echo "ab_device: EXTRA_BENCHES item '$x' is not name=<an executable>" >&2; exit 2; }
done
python3 - "$OUT" "${ROUNDS:-3}" ${EXTRA_BENCHES:-} <<'PY'
import collections, glob, json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
names = ["base", "new"] + [x.split("=", 1)[0] for x in sys.argv[3:]]
runs = collections.defaultdict(lambda: {v: [] for v in names})
device = None
for v in names:
    for f in sorted(glob.glob(f"{out}/{v}_*.json")):
        try:
            d = json.load(open(f))
        except (OSError, ValueError) as e:
            print(f"ab_device: {f}: {e}", file=sys.stderr)
            continue
        device = device or d.get("device")
        for c in d["cases"]:
            runs[(c["name"], c["routing"], c["rows_per_expert"])][v].append(c["mok_tflops"])
cases = []
others = names[1:]
print("| case | routing | rows | base TF/s | " + " | ".join(f"{v} TF/s | {v}/base" for v in others) + " |")
print("|---|---|---|---|" + "---|---|" * len(others))
fmt = lambda x: f"{x:.1f}" if x else "-"
for (name, routing, rows), r in sorted(runs.items()):
    med = {v: statistics.median(r[v]) if r[v] else None for v in r}
    ratio = {v: med[v] / med["base"] if med["base"] and med[v] else None for v in others}
    case = {"case": name, "routing": routing, "rows_per_expert": rows}
    for v in names:
        case[v] = {"tflops_runs": r[v], "median": med[v]}
    case.update({f"{v}_over_base": ratio[v] for v in others})
    cases.append(case)
    cols = " | ".join(f"{fmt(med[v])} | {f'{ratio[v]:.3f}' if ratio[v] else '-'}" for v in others)
    print(f"| {name} | {routing} | {rows} | {fmt(med['base'])} | {cols} |")
json.dump({"device": device, "rounds": rounds, "cases": cases}, open(f"{out}/gemm-ab.json", "w"), indent=1)
PY
