#!/usr/bin/env bash
# DRAM and L2 bytes of one forward megakernel (Nsight Compute), against what a forward must move
# at least. The question it answers: are the experts' weights read from DRAM more than once (the
# tickets running at the same time share too few weight tiles for L2 to keep them), which would
# cost energy at the power cap (notes/forward.md, "Next").
#
# One GPU, EP 1: ncu serializes the process's kernels and replays the profiled one, so a 2-GPU
# megakernel would wait for its peer. DeepSeek-V3 with T = 16384 gives 512 rows per expert, the
# same tiles per expert as EP 2 at T = 8192 (with twice the experts).
#
# Usage (GPU machine, repo root, after a build into $MOK_BUILD, default build/device):
#   [PROFILE_VARIANTS="8 4 16 8c"] [PROFILE_TOKENS=16384] bench/profile_forward.sh
# A variant is a raster group size (MOK_MK_GROUP_M; 0 = the whole minibatch), with a "c" suffix
# for 2-CTA clusters (B multicast). For each it prints the kernel time, the SM clock, DRAM
# read / write GB, L2 GB and hit rate of the 4th forward's megakernel, then the minimum bytes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BENCH="${MOK_BUILD:-$ROOT/build/device}/bench/mok_bench"
[ -x "$BENCH" ] || { echo "profile_forward: $BENCH not built" >&2; exit 2; }
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)"
[ -n "$NCU" ] || { echo "profile_forward: ncu not found" >&2; exit 2; }
T="${PROFILE_TOKENS:-16384}"
METRICS=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__bytes_read.sum,dram__bytes_write.sum
METRICS=$METRICS,lts__t_bytes.sum,lts__t_sector_hit_rate.pct
printf "| variant | kernel ms | SM clock GHz | DRAM read GB | DRAM write GB | L2 GB | L2 hit %% |\n|---|---|---|---|---|---|---|\n"
for variant in ${PROFILE_VARIANTS:-8 4 16 8c}; do
  gm="${variant%c}"
  clusters=0
  [ "$gm" != "$variant" ] && clusters=1
  log="/tmp/profile_forward_$variant.csv"
  # ncu's kernel replay cannot relaunch a cooperative cluster kernel (LaunchFailed): cluster
  # variants rerun the whole application once per metric pass instead.
  replay="${PROFILE_REPLAY:-kernel}"
  [ "$clusters" = 1 ] && replay=application
  # The mok_bench run: the main variant only, 5 warm-up forwards; the 4th megakernel launch is
  # profiled (earlier ones warm the caches and the clocks as a benchmark would).
  CUDA_VISIBLE_DEVICES=0 MOK_MK_GROUP_M="$gm" timeout 300 "$NCU" --replay-mode "$replay" --clock-control none --csv --page raw --print-units base \
    --kernel-name regex:forward_megakernel --launch-skip 3 --launch-count 1 --metrics "$METRICS" \
    "$BENCH" --models dsv3 --tokens "$T" --routings uniform --no-ablation --sustain 0 --warmup 5 --iters 20 \
    --clusters "$clusters" >"$log" 2>&1
  rc=$?
  python3 - "$log" "$variant" "$rc" <<'PY'
import csv, sys
path, gm, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [r for r in csv.reader(open(path, errors="replace")) if len(r) > 5]
head = next((r for r in rows if "dram__bytes_read.sum" in r), None)
data = [r for r in rows if head and len(r) == len(head) and r is not head and r[0] != head[0]]
# ncu --csv --page raw: a header row, a units row, then one row per profiled kernel
units = data[0] if data else None
vals = data[1] if len(data) > 1 else None
def log_tail():
    tail = [l.rstrip() for l in open(path, errors="replace") if l.strip() and not l.startswith('"')][-6:]
    print("\n".join("    " + l[:200] for l in tail))
if not vals:
    print(f"| {gm} | no profile (rc {rc}; see {path}) | | | | | |")
    log_tail()
    sys.exit(0)
def get(name):
    i = head.index(name)
    v = float(vals[i].replace(",", ""))
    u = units[i].strip().lower()
    scale = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "nsecond": 1e-9, "usecond": 1e-6,
             "msecond": 1e-3, "second": 1, "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1, "hz": 1, "khz": 1e3, "mhz": 1e6, "ghz": 1e9, "%": 1,
             "cycle/second": 1, "cycle/nsecond": 1e9, "cycle/usecond": 1e6}.get(u, 1)
    return v * scale
print(f"| {gm} | {get('gpu__time_duration.sum') * 1e3:.3f} | {get('sm__cycles_elapsed.avg.per_second') / 1e9:.2f} "
      f"| {get('dram__bytes_read.sum') / 1e9:.2f} | {get('dram__bytes_write.sum') / 1e9:.2f} "
      f"| {get('lts__t_bytes.sum') / 1e9:.2f} | {get('lts__t_sector_hit_rate.pct'):.1f} |")
if get("dram__bytes_read.sum") != get("dram__bytes_read.sum"):  # nan: ncu collected no values
    log_tail()
PY
done
# What one forward of this shape must move through DRAM at least (EP 1, uniform routing).
python3 - "$T" <<'PY'
import sys
T, H, I, E, k = int(sys.argv[1]), 7168, 2048, 256, 8
rows = T * k
weights = E * 3 * H * I * 2
x = T * H * 2
ring = rows * H * 2          # routed rows written into the ring, read by FC1
h = rows * I * 2             # SwiGLU output written by FC1, read by FC2
gu = 2 * rows * I * 2        # gate/up pre-activations kept for backward
y = rows * H * 2             # FC2 output, read by the combine
print(f"\nminimum per forward (T={T}, DeepSeek-V3, EP 1): weights {weights / 1e9:.2f} GB read once; with x "
      f"read once and every intermediate through DRAM once (ring w+r, h w+r, gu w, y w+r, combine slots w): "
      f"read {(weights + x + ring + h + y) / 1e9:.2f} GB, write {(ring + h + gu + y + y) / 1e9:.2f} GB; "
      f"if the pull reads x once per route ({k * x / 1e9:.2f} GB, no L2 reuse): read {(weights + k * x + ring + h + y) / 1e9:.2f} GB")
PY
