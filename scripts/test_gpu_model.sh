#!/usr/bin/env bash
# scripts/common.sh's mok_gpu_model: the model word results files are named by (forward-<model>x<n>.json),
# from nvidia-smi's names of the cards mok runs on and a few others.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
fail=0
check() {
  local got
  got="$(mok_gpu_model "$1")"
  if [ "$got" != "$2" ]; then echo "mok_gpu_model '$1': got '$got', want '$2'"; fail=1; fi
}
check "NVIDIA H100 80GB HBM3" h100
check "NVIDIA H200" h200
check "NVIDIA H100 PCIe" h100
check "NVIDIA GH200 480GB" gh200
check "NVIDIA A100-SXM4-80GB" a100
check "NVIDIA GeForce RTX 4090" 4090
check "" gpu
[ "$fail" -eq 0 ] && echo "mok_gpu_model: 7 names as expected"
exit "$fail"
