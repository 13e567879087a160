#!/usr/bin/env python3
"""A training step of a stack of MoE blocks with mok.MoE against the same model with an eager
PyTorch MoE layer (issue 21's torch-<gpu>x<n>.json): forward + backward + an SGD step, median of
--steps after --warmup, also split into forward + backward and the optimizer (which touches every
weight and is the same for both); the outputs and gradients of one step from the same weights and
the losses of both over the steps (largest relative differences); whether
torch.compile(fullgraph=True) and a CUDA graph of the step work with mok; and, given mok_bench's
results (--mok-json), the op's overhead against mok_bench's C++ time of the same layer.

Each block is x + MoE(RMSNorm(x)) with a linear + softmax top-k router (examples/train_moe.py).
The eager layer on CUDA is the PyTorch baseline's math on one rank (bench/baseline/: rows sorted
by expert, torch._grouped_mm for the GEMMs, its backward written out the same way); on CPU (the
smoke test: --device cpu) a per-expert loop. One rank (EP 1).

usage: torch_step.py --out FILE [--models qwen3-30b-a3b,qwen3-235b] [--tokens 8192] [--layers 2]
                     [--steps 20] [--warmup 3] [--device cuda|cpu] [--mok-json FILE] [--commit C]
"""
import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import mok

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_moe import Block, EagerMoE  # noqa: E402  (the example's block and loop layer)

MODELS = {  # name: (H, I, E, k), as mok_bench and the baseline
    "dsv3": (7168, 2048, 256, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b": (4096, 1536, 128, 8),
    "tiny": (128, 64, 8, 2),  # the CPU smoke test's
}


class _GroupedFFN(torch.autograd.Function):
    """sum_j w[t, j] * FFN_{idx[t, j]}(x[t]) over one rank's experts, as the baseline computes it."""

    @staticmethod
    def forward(ctx, x, idx, w, wg, wu, wd):
        T, k = idx.shape
        E = wg.shape[0]
        flat = idx.reshape(-1).long()
        keep = (flat >= 0).nonzero().flatten()
        order = keep[torch.argsort(flat[keep], stable=True)]
        e_rows = flat[order]
        offs = torch.cumsum(torch.bincount(e_rows, minlength=E), 0).to(torch.int32)
        xs = x[order // k]
        g = torch._grouped_mm(xs, wg.transpose(-2, -1), offs=offs)  # the weights as they are: no copy
        u = torch._grouped_mm(xs, wu.transpose(-2, -1), offs=offs)
        h = (F.silu(g.float()) * u.float()).bfloat16()
        y = torch._grouped_mm(h, wd.transpose(-2, -1), offs=offs)
        ws = w.reshape(-1)[order]
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, order // k, y.float() * ws[:, None])
        ctx.save_for_backward(x, order, offs, xs, g, u, h, y, ws, wg, wu, wd)
        ctx.k, ctx.shape_w = k, w.shape
        return out.bfloat16()

    @staticmethod
    def backward(ctx, d_out):
        x, order, offs, xs, g, u, h, y, ws, wg, wu, wd = ctx.saved_tensors
        k = ctx.k
        dr = d_out[order // k]  # each route's d_out row
        d_w = torch.zeros(ctx.shape_w[0] * k, dtype=torch.float32, device=x.device)
        d_w[order] = (dr.float() * y.float()).sum(1)
        dy = (dr.float() * ws[:, None]).bfloat16()
        dh = torch._grouped_mm(dy, wd, offs=offs).float()
        gf, uf = g.float(), u.float()
        dg = torch.ops.aten.silu_backward(dh * uf, gf).bfloat16()
        du = (dh * F.silu(gf)).bfloat16()
        dxs = torch._grouped_mm(dg, wg, offs=offs).float() + torch._grouped_mm(du, wu, offs=offs).float()
        d_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        d_x.index_add_(0, order // k, dxs)
        dwd = torch._grouped_mm(dy.t(), h, offs=offs)
        dwg = torch._grouped_mm(dg.t(), xs, offs=offs)
        dwu = torch._grouped_mm(du.t(), xs, offs=offs)
        return d_x.bfloat16(), None, d_w.view(ctx.shape_w), dwg, dwu, dwd


class GroupedMoE(EagerMoE):
    """The eager layer with mok.MoE's parameters: torch._grouped_mm on CUDA, the loop elsewhere."""

    def forward(self, x, topk_idx, topk_w):
        if not x.is_cuda:
            return super().forward(x, topk_idx, topk_w)
        out = _GroupedFFN.apply(x, topk_idx, topk_w, self.w_gate, self.w_up, self.w_down)
        if self.shared:
            out = out + (F.silu(x @ self.ws_gate.T) * (x @ self.ws_up.T)) @ self.ws_down.T
        return out


def build(model, layers, eager, device, seed):
    H, I, E, k = MODELS[model]
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        layer = mok.MoE(H, I, E, k, init_std=0.02)
        blocks.append(Block(GroupedMoE(layer) if eager else layer, H, E, k))
    return torch.nn.Sequential(*blocks).to(device)


def timed_steps(model, x, target, steps, warmup, device):
    """Per-step times (ms) of forward + backward + SGD step, of the forward + backward alone and of
    the optimizer alone, and the losses. Gradients are set to None between steps (PyTorch's
    default zero_grad): the backward writes them rather than adding to zeroed ones."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, fwd_bwd, optim, losses = [], [], [], []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        if device == "cuda":
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
        loss = F.mse_loss(model(x).float(), target)
        opt.zero_grad()
        loss.backward()
        if device == "cuda":
            ev[1].record()
        opt.step()
        if device == "cuda":
            ev[2].record()
            ev[2].synchronize()
            ms, fb = ev[0].elapsed_time(ev[2]), ev[0].elapsed_time(ev[1])
        else:
            ms = fb = (time.perf_counter() - t0) * 1e3
        losses.append(loss.item())
        if s >= warmup:
            times.append(ms)
            fwd_bwd.append(fb)
            optim.append(ms - fb)
    return times, fwd_bwd, optim, losses


def first_step_diff(mok_model, eager_model, x, target):
    """Largest relative L2 difference (||a - b|| / ||b||) between the two models' outputs and their
    parameters' gradients after one forward + backward from the same weights."""
    worst = {"out": 0.0, "grad": 0.0}
    outs = []
    for m in (mok_model, eager_model):
        m.zero_grad()
        y = m(x)
        F.mse_loss(y.float(), target).backward()
        outs.append(y.detach().float())
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    worst["out"] = rel(outs[0], outs[1])
    for (name, p), q in zip(mok_model.named_parameters(), eager_model.parameters()):
        if p.grad is not None and q.grad is not None:
            worst["grad"] = max(worst["grad"], rel(p.grad.float(), q.grad.float()))
    for m in (mok_model, eager_model):
        m.zero_grad()
    return worst


def try_compile(model, x, target, device):
    """(ok, error): a fullgraph torch.compile of the block stack gives the eager losses."""
    try:
        backend = "inductor" if device == "cuda" else "aot_eager"
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        a = F.mse_loss(compiled(x).float(), target)
        a.backward()
        b = F.mse_loss(model(x).float(), target)
        return bool(torch.allclose(a.detach(), b.detach(), rtol=1e-2)), None
    except Exception as e:  # reported, not raised: the JSON says what failed
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def try_graph(model, x, target):
    """(ok, error): forward + backward captured in one CUDA graph and replayed (CUDA only)."""
    try:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the graph (the layers' first calls allocate)
            for _ in range(2):
                F.mse_loss(model(x).float(), target).backward()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            loss = F.mse_loss(model(x).float(), target)
            loss.backward()
        g.replay()
        torch.cuda.synchronize()
        want = F.mse_loss(model(x).float(), target)
        return bool(torch.allclose(loss.detach(), want.detach(), rtol=1e-2)), None
    except Exception as e:
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def op_ms(model, x, steps, warmup):
    """One mok.MoE layer's forward + backward through the op, the median over CUDA events around
    each, its gradients set to None before each (so that autograd writes them: no accumulation
    pass, as in mok_bench). As mok_bench times the C++ layer, the iterations are enqueued back to
    back with one synchronization at the end, so the host's work (Python, autograd, the op's
    checks) overlaps the GPU's as in a training run; a host slower than the GPU shows as a larger
    time. Also returned: the same with a synchronization before each iteration (the host's latency
    to the first kernel inside every timing: what the first measurements of 2026-12 reported)."""
    layer = model[0].moe
    k = model[0].top_k
    idx, w = mok.route(model[0].router(x), k)
    d_out = torch.randn_like(x)

    def one():
        layer.zero_grad(set_to_none=True)
        layer(x.detach().requires_grad_(), idx, w.detach().requires_grad_()).backward(d_out)

    def timed(sync_each):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(warmup + steps)]
        torch.cuda.synchronize()
        for start, end in events:
            if sync_each:
                torch.cuda.synchronize()
            start.record()
            one()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events[warmup:])

    return timed(False), timed(True)


def cpp_ms(mok_json, model, T):
    """mok_bench's forward + backward of the same layer (EP 1, uniform), or None."""
    if not mok_json:
        return None
    with open(mok_json) as f:
        doc = json.load(f)
    if doc.get("ep", 1) != 1:
        return None  # another EP size: not the same layer
    for c in doc.get("cases", []):
        if (c.get("model"), c.get("T"), c.get("routing")) == (model, T, "uniform") and c.get("mok_bwd_ms"):
            return c["mok_ms"] + c["mok_bwd_ms"]
    return None


def run_case(a, model, T):
    H = MODELS[model][0]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(a.device)
    target = torch.randn(T, H, generator=g).to(a.device)
    mok_model = build(model, a.layers, False, a.device, 0)
    eager_model = build(model, a.layers, True, a.device, 0)
    eager_model.load_state_dict(copy.deepcopy(mok_model.state_dict()))
    diff = first_step_diff(mok_model, eager_model, x, target)
    mok_t, mok_fb, mok_opt, mok_loss = timed_steps(mok_model, x, target, a.steps, a.warmup, a.device)
    eager_t, eager_fb, eager_opt, eager_loss = timed_steps(eager_model, x, target, a.steps, a.warmup, a.device)
    med = statistics.median
    case = {"model": model, "T": T, "layers": a.layers, "mok_step_ms": med(mok_t), "eager_step_ms": med(eager_t),
            "mok_fwd_bwd_ms": med(mok_fb), "eager_fwd_bwd_ms": med(eager_fb),
            "mok_optimizer_ms": med(mok_opt), "eager_optimizer_ms": med(eager_opt),
            "out_rel_diff": diff["out"], "grad_max_rel_diff": diff["grad"],
            "loss_max_rel_diff": max(abs(p - q) / max(abs(q), 1e-12) for p, q in zip(mok_loss, eager_loss))}
    case["speedup"] = case["eager_step_ms"] / case["mok_step_ms"]
    case["fwd_bwd_speedup"] = case["eager_fwd_bwd_ms"] / case["mok_fwd_bwd_ms"]
    case["compile_ok"], case["compile_error"] = try_compile(mok_model, x, target, a.device)
    case["graph_ok"], case["graph_error"] = try_graph(mok_model, x, target) if a.device == "cuda" else (None, None)
    on_gpu = a.device == "cuda"
    timed = op_ms(mok_model, x, a.steps, a.warmup) if on_gpu else (None, None)
    case["op_ms"], case["op_synced_ms"] = timed
    ref = cpp_ms(a.mok_json, model, T)
    case["op_overhead_pct"] = 100.0 * (case["op_ms"] / ref - 1.0) if ref and case["op_ms"] else None
    case["op_synced_overhead_pct"] = (100.0 * (case["op_synced_ms"] / ref - 1.0)
                                      if ref and case["op_synced_ms"] else None)
    return case


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="qwen3-30b-a3b,qwen3-235b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--mok-json", help="mok_bench results of the same run (for the op's overhead)")
    p.add_argument("--commit", default=os.environ.get("MOK_COMMIT", "unknown"))
    a = p.parse_args(argv)
    for m in a.models.split(","):
        if m not in MODELS:
            p.error(f"--models: unknown model '{m}' (one of {', '.join(MODELS)})")
    if a.steps < 1 or a.warmup < 0 or a.layers < 1 or a.tokens < 1:
        p.error("--steps, --layers and --tokens must be >= 1 and --warmup >= 0")
    cases = []
    for m in a.models.split(","):
        c = run_case(a, m, a.tokens)
        overhead = "-" if c["op_overhead_pct"] is None else f"{c['op_overhead_pct']:.1f}%"
        print(f"[torch_step] {m} T={a.tokens} x{a.layers}: step mok {c['mok_step_ms']:.2f} ms, eager "
              f"{c['eager_step_ms']:.2f} ms ({c['speedup']:.2f}x); forward + backward {c['mok_fwd_bwd_ms']:.2f} vs "
              f"{c['eager_fwd_bwd_ms']:.2f} ms ({c['fwd_bwd_speedup']:.2f}x), optimizer {c['mok_optimizer_ms']:.2f} "
              f"/ {c['eager_optimizer_ms']:.2f} ms; out diff {c['out_rel_diff']:.1e}, grad diff "
              f"{c['grad_max_rel_diff']:.1e}, loss diff {c['loss_max_rel_diff']:.1e}; compile {c['compile_ok']}, "
              f"graph {c['graph_ok']}, op overhead {overhead}", flush=True)
        cases.append(c)
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    doc = {"device": device, "gpus": torch.cuda.device_count() if a.device == "cuda" else 0,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": a.commit, "torch": torch.__version__,
           "op_method": "op_ms: median of CUDA events around each forward + backward, enqueued back to back (as "
                        "mok_bench times the C++ layer); op_synced_ms: the same with a device sync before each",
           "cases": cases}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.out}")
    return doc


if __name__ == "__main__":
    main()
