#!/usr/bin/env bash
# The GEMM benchmarks' command lines (ctest gemm_bench_cli, label cpu): a bad number stops each with
# exit code 2 and a message naming the option, before it touches the GPU (so this runs on a
# machine without one). Usage: test_gemm_bench_cli.sh <mok_gemm_bench> <mok_read_ceiling> <mok_fp8_backward_bench>
set -uo pipefail
gemm="$1" ceiling="$2" fp8bwd="$3"
# shellcheck source=tests/cpu/cli_check.sh
source "$(dirname "${BASH_SOURCE[0]}")/cli_check.sh"
expect_refused "invalid argument '--reps' (got '0'): must be a whole number in [1, 100000]" "$gemm" --reps 0
expect_refused "invalid argument '--block-n' (got '2.5'): must be a whole number in [0, 256] (0, 128 or 256)" "$gemm" --block-n 2.5
expect_refused "invalid argument '--skew' (got '-2'): must be a whole number in [-1, 64]" "$gemm" --skew -2
expect_refused "invalid argument '--pdl' (got 'yes'): must be a whole number in [0, 1]" "$gemm" --pdl yes
expect_refused "usage:" "$gemm" --frobnicate
expect_refused "invalid argument '--reps' (got '2'): must be a whole number in [3, 100000]" "$ceiling" --reps 2
expect_refused "invalid argument '--gib' (got 'nan'): must be a number in [0.5, 64]" "$ceiling" --gib nan
expect_refused "invalid argument '--reps' (got 'abc'): must be a whole number in [1, 100000]" "$fp8bwd" --reps abc
expect_refused "usage:" "$fp8bwd" --out
finish "GEMM benchmark"
