"""Device memory of a stack of mok.MoE layers alive at once in one PyTorch process, measured
against mok's memory planner (mok::plan_memory, mok.MoE.memory_plan).

Per model: N layers (this rank's experts, T tokens, the default training memory model), a forward
through every layer, then the backwards (last layer first), then cudaMemGetInfo's used bytes less
PyTorch's reserved ones (the weights, inputs and gradients live in PyTorch's allocator; what is
left is mok's buffers and windows and NCCL's). Two modes, in one process:
  * shared    — every module on the GPU shares one mok communicator, so the layers share one
                workspace (the package's behaviour): planned N x (layer's own) + one workspace;
  * separate  — one communicator per module (made here by giving each module another
                wait_timeout_s), as every module got before the package shared them: planned N x
                (layer's own + a workspace).
The stack's forward + backward time (median of --iters after a warm-up) is recorded beside it.

    python bench/torch_layers_memory.py --out bench/results/torch-memory-h200x1.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys

import torch

MODELS = {  # hidden, intermediate, experts on this GPU, top-k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "dsv3/ep8": (7168, 2048, 32, 8),  # one rank's slice of DeepSeek-V3 at EP 8
    "qwen3-235b/ep8": (4096, 1536, 16, 8),
}


def mok_bytes() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def run_stack(mok, model: str, layers: int, tokens: int, mode: str, iters: int) -> dict:
    h, i, e, k = MODELS[model]
    gc.collect()
    torch.cuda.empty_cache()
    base = mok_bytes()
    torch.manual_seed(0)
    # separate: each module its own communicator (the registry keys on the wait bound too)
    mods = [mok.MoE(h, i, e, k, device="cuda", **({"wait_timeout_s": 5.0 + 0.001 * j} if mode == "separate" else {}))
            for j in range(layers)]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    w, idx = torch.topk(torch.softmax(torch.randn(tokens, e, device="cuda", generator=g), -1), k, -1)
    idx, w = idx.int(), w.float()

    def step():
        xs = [x.clone().requires_grad_() for _ in mods]
        outs = [m(xx, idx, w) for m, xx in zip(mods, xs)]
        torch.stack([o.float().sum() for o in outs]).sum().backward()
        return xs, outs

    kept = step()
    measured = mok_bytes() - base
    del kept
    times = []
    for it in range(iters + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        if it:
            times.append(start.elapsed_time(end))
    for m in mods:
        m.check()
    plan = mods[0].memory_plan(tokens)
    own = plan["total"] - plan["workspace"]
    planned = layers * own + plan["workspace"] if mode == "shared" else layers * plan["total"]
    weights = mods[0].weight_bytes()
    del mods
    gc.collect()
    times.sort()
    case = {"model": model, "ep": 1, "slice_of_ep": 8 if model.endswith("/ep8") else 1, "T": tokens,
            "layers": layers, "mode": mode, "measured_bytes": measured, "planned_bytes": planned,
            "measured_over_planned": measured / planned, "layer_own_bytes": own, "workspace_bytes": plan["workspace"],
            "weights_bytes_per_layer": weights, "stack_fwd_bwd_ms": times[len(times) // 2]}
    print(f"[mok] {model} x{layers} {mode:8s}: measured {measured / 2**30:7.2f} GiB, planned {planned / 2**30:7.2f} "
          f"GiB ({measured / planned:.3f}); forward+backward of the stack {case['stack_fwd_bwd_ms']:.2f} ms",
          flush=True)
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,dsv3/ep8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import mok
    cases = []
    for model in args.models.split(","):
        for mode in ("shared", "separate"):
            cases.append(run_stack(mok, model, args.layers, args.tokens, mode, args.iters))
    commit = os.environ.get("MOK_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                            capture_output=True, text=True).stdout.strip()
    result = {"device": torch.cuda.get_device_name(), "gpus": 1,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "commit": commit, "torch": torch.__version__,
              "what": "device memory of N mok.MoE layers alive in one PyTorch process (forward all, then backward), "
                      "cudaMemGetInfo's used bytes less PyTorch's reserved, against mok's planner",
              "cases": cases}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[mok] wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
