#!/usr/bin/env bash
# The Python package's tests (called by scripts/test.sh): `pip install .` into a virtual
# environment (build/venv; --system-site-packages, so a PyTorch already installed in the system
# Python is reused, e.g. on the GPU machines, which have no network), PyTorch, pytest and the
# build tools (scikit-build-core, nanobind) from PyPI where they are missing, then pytest over
# tests/python. MOK_VENV overrides the environment's path.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
venv="${MOK_VENV:-$MOK_ROOT/build/venv}"
if [ ! -x "$venv/bin/python" ]; then
  mok_log "creating the Python environment $venv"
  python3 -m venv --system-site-packages "$venv" || {
    mok_log "python3 -m venv failed: install the venv module (e.g. apt-get install python3-venv)"
    exit 1
  }
  # When python3 is itself a virtual environment (the GPU machines' PyTorch lives in one), its
  # packages are not the new environment's "system" ones: a .pth file in the new one adds them.
  if python3 -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)'; then
    parent="$(python3 -c 'import site; print("\n".join(site.getsitepackages()))')"
    child="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    printf '%s\n' "$parent" >"$child/mok-parent-environment.pth"
    mok_log "python3 is the virtual environment $(python3 -c 'import sys; print(sys.prefix)'): its packages are visible in $venv"
  fi
fi
py="$venv/bin/python"
missing=()
"$py" -c "import torch" 2>/dev/null || missing+=("torch>=2.6")
"$py" -c "import pytest" 2>/dev/null || missing+=(pytest numpy)
"$py" -c "import scikit_build_core" 2>/dev/null || missing+=("scikit-build-core>=0.10")
"$py" -c "import nanobind" 2>/dev/null || missing+=("nanobind>=2.4")
if [ ${#missing[@]} -gt 0 ]; then
  mok_log "installing into $venv: ${missing[*]}"
  "$py" -m pip install -q "${missing[@]}"
fi
# No build isolation: the build tools above are used (the GPU machines cannot fetch them). Without a
# GPU the GPU extension (minutes of compiling on a small machine) is left out.
cuda=ON
[ "$(mok_gpu_count)" -gt 0 ] || cuda=OFF
mok_log "pip install . (extensions: mok._cpu; mok._cuda: $cuda)"
"$py" -m pip install -q --no-build-isolation -C cmake.define.MOK_PYTHON_CUDA=$cuda "$MOK_ROOT"
(cd "$MOK_ROOT/build" && "$py" -c "import mok; print('[mok] import mok:', mok.__version__, mok.__file__)")
mok_log "running the Python tests (tests/python)"
"$py" -m pytest -q "$MOK_ROOT/tests/python"
# Several GPUs: the training example as one EP group of one process per GPU (torchrun), mok.MoE
# against the eager model with every expert; it prints the largest loss difference over the ranks.
gpus="$(mok_gpu_count)"
if [ "$gpus" -ge 2 ]; then
  n=$(( gpus > 8 ? 8 : gpus ))
  mok_log "the training example on an EP group of $n GPUs (torchrun)"
  (cd "$MOK_ROOT/build" && NCCL_NVLS_ENABLE=0 timeout 600 "$py" -m torch.distributed.run --standalone \
    --nproc-per-node "$n" "$MOK_ROOT/examples/train_moe.py" --experts $(( 4 * n )) --steps 5 --tokens 1024 --check 2e-2)
fi
