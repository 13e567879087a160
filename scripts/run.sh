#!/usr/bin/env bash
# Builds mok and runs the main job: the MoE layer benchmark (CPU reference engine on simulated
# ranks when no GPU is visible). Arguments go to mok_bench (see mok_bench --help).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mok_ensure_deps
mok_build --target mok_bench
exec "$MOK_BUILD/bench/mok_bench" "$@"
