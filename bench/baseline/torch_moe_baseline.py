#!/usr/bin/env python3
"""PyTorch + NCCL expert-parallel MoE baseline: all_to_all_single dispatch, torch._grouped_mm
expert FFN with SwiGLU, all_to_all_single combine, weighted sum at the source; and its backward
(router-weight gradient at the source, weighted d_out rows all_to_all'd to the experts, grouped
dgrads with the SwiGLU backward, grouped wgrads, d_x rows all_to_all'd back and summed), written
out explicitly as an EP training stack's autograd functions would run it.

This is what mok is measured against (same shapes, same routing, same run). It is written the
way an EP training stack without a fused kernel does it (torchtitan-style): split sizes are
exchanged and copied to the host (a real CPU sync in the loop), rows are sorted by expert and
padded per expert to a multiple of 16 for the grouped GEMM.

Run with torchrun, one process per GPU:
  torchrun --standalone --nproc-per-node=2 bench/baseline/torch_moe_baseline.py --out base.json
Timing: per iteration each rank times the forward with CUDA events; the iteration's time is the
slowest rank's; the reported figure is the median over >= 20 iterations after warm-up. The
backward (`baseline_bwd_ms`, unless --no-backward) the same way, each timed backward after an
untimed forward that saved what it needs.
With --sustain S, each case is also run for ~S seconds of back-to-back forwards (no barrier
between them; the count is fixed from the median above, so every rank runs the same number),
and `baseline_sustained_ms` is the slowest rank's mean time per forward over the second half: the
rate once the GPUs sit at their power cap (mok_bench --sustain measures mok the same way).
Memory: `saved_bytes` per case is what one forward with save=True keeps for the backward (the
largest rank's torch.cuda.memory_allocated growth; one untimed forward, bench/memory_report.py).

The measured bf16 peak (the "% of peak" the report quotes): before the MoE cases every rank
times cuBLAS dense bf16 8192^3 (torch.matmul) at the same time: `burst` = the median of 20
launches after 5 warm-up, and with --sustain S `sustained` = the mean over the second half of ~S
seconds of back-to-back launches (at the power cap). JSON `peak_bf16`: per-GPU figures and the
largest of each (the harder bar for mok's percentage). `peak_fp8` the same for cuBLAS FP8 8192^3
(E4M3 x E4M3, per-tensor scales, torch._scaled_mm), where the GPU has FP8 (sm_89+): the bar for
mok's FP8 forward.
"""
import argparse
import json
import math
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

MODELS = {  # name: (H, I, E, k)
    "dsv3": (7168, 2048, 256, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b": (4096, 1536, 128, 8),
}
ALIGN = 16


def model_shape(name, world):
    """(H, I, E, k, slice) of a model name as mok_bench takes it: "dsv3", or "dsv3/ep8" for the
    per-rank slice of EP 8 (E / 8 experts per GPU at the same tokens per GPU: E * world / 8 in all)."""
    base, _, sl = name.partition("/")
    if base not in MODELS:
        raise SystemExit(f"unknown model '{name}' (one of {', '.join(MODELS)}, optionally /epN)")
    H, I, E, k = MODELS[base]
    if not sl:
        return H, I, E, k, 0
    if not sl.startswith("ep") or not sl[2:].isdigit() or int(sl[2:]) < world or (E * world) % int(sl[2:]):
        raise SystemExit(f"model '{name}': the slice must be /epN with N >= {world} GPUs dividing E * GPUs")
    S = int(sl[2:])
    return H, I, E * world // S, k, S


def routing(T, E, k, kind, gen, device):
    if kind == "uniform":
        scores = torch.rand(T, E, generator=gen, device=device)
    elif kind == "zipf":  # popularity ~ 1/(e+1)^1.2, hot experts on rank 0 (as mok's workloads)
        pop = 1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32) ** 1.2
        g = -torch.log(-torch.log(torch.rand(T, E, generator=gen, device=device)))
        scores = torch.log(pop) + g  # Gumbel top-k = sampling without replacement ~ pop
    else:
        raise ValueError(kind)
    idx = scores.topk(k, dim=1).indices
    w = 0.05 + 0.95 * torch.rand(T, k, generator=gen, device=device)
    return idx, w.float()


class EpMoE:
    def __init__(self, H, I, E, k, world, rank, device, gen):
        self.H, self.I, self.E, self.k, self.W, self.rank = H, I, E, k, world, rank
        self.E_loc = E // world
        s1, s2 = H ** -0.5, I ** -0.5
        # Weights in mok's layout: gate/up [E_loc, I, H] fused as [E_loc, 2I, H], down [E_loc, H, I].
        self.w13 = (torch.randn(self.E_loc, 2 * I, H, generator=gen, device=device) * s1).bfloat16()
        self.w2 = (torch.randn(self.E_loc, H, I, generator=gen, device=device) * s2).bfloat16()

    def experts(self, xs, local_e, save=False):
        """xs: rows received by this rank, local_e: their local expert. Returns FFN rows; with
        save, keeps what experts_backward needs."""
        order = torch.argsort(local_e, stable=True)
        counts = torch.bincount(local_e, minlength=self.E_loc)
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        ends = torch.cumsum(padded, 0)
        starts = ends - padded
        rank_in_expert = torch.arange(order.numel(), device=xs.device) - (torch.cumsum(counts, 0) - counts)[local_e[order]]
        dest = starts[local_e[order]] + rank_in_expert
        M = int(ends[-1].item()) if self.E_loc else 0
        buf = xs.new_zeros(M, self.H)
        buf[dest] = xs[order]
        offs = ends.to(torch.int32)
        gu = torch._grouped_mm(buf, self.w13.transpose(-2, -1), offs=offs)
        g, u = gu[:, : self.I], gu[:, self.I:]
        h = (F.silu(g.float()) * u.float()).bfloat16()
        y = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        out = torch.empty_like(xs)
        out[order] = y[dest]
        if save:
            self.ectx = {"order": order, "dest": dest, "offs": offs, "buf": buf, "g": g, "u": u, "h": h}
        return out

    def experts_backward(self, dyr):
        """dyr: weighted d_out rows of the received rows. Returns (their d_x rows, dW13, dW2)."""
        c = self.ectx
        order, dest, offs = c["order"], c["dest"], c["offs"]
        dy = dyr.new_zeros(c["buf"].shape[0], self.H)
        dy[dest] = dyr[order]
        dh = torch._grouped_mm(dy, self.w2, offs=offs).float()  # [M, I]: dy . W2 (untransposed)
        # The SwiGLU backward as eager autograd runs h = (silu(g) * u).bfloat16() in fp32: the fused
        # silu_backward for d_g, one product for d_u, both cast into d_gu's halves (no cat).
        g, u = c["g"].float(), c["u"].float()
        dgu = torch.empty(dh.shape[0], 2 * self.I, dtype=torch.bfloat16, device=dh.device)
        dgu[:, :self.I] = torch.ops.aten.silu_backward(dh * u, g)
        dgu[:, self.I:] = dh * F.silu(g)
        dx = torch._grouped_mm(dgu, self.w13, offs=offs)  # [M, H]
        dw2 = torch._grouped_mm(dy.t(), c["h"], offs=offs)  # [E_loc, H, I], K grouped over rows
        dw13 = torch._grouped_mm(dgu.t(), c["buf"], offs=offs)  # [E_loc, 2I, H]
        out = torch.empty_like(dyr)
        out[order] = dx[dest]
        return out, dw13, dw2

    def forward(self, x, idx, w, save=False):
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert = by destination rank
        dest_rank = flat // self.E_loc
        send_counts = torch.bincount(dest_rank, minlength=self.W)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_list, recv_list = send_counts.tolist(), recv_counts.tolist()  # host sync
        xs = x[order // k]
        es = (flat[order] % self.E_loc).to(torch.int32)
        xr = x.new_empty(sum(recv_list), self.H)
        er = es.new_empty(sum(recv_list))
        dist.all_to_all_single(xr, xs, recv_list, send_list)
        dist.all_to_all_single(er, es, recv_list, send_list)
        yr = self.experts(xr, er.long(), save)
        ys = torch.empty_like(xs)
        dist.all_to_all_single(ys, yr, send_list, recv_list)
        y = torch.empty(T * k, self.H, dtype=ys.dtype, device=ys.device)
        y[order] = ys
        if save:
            self.ctx = {"order": order, "send": send_list, "recv": recv_list, "y": y, "w": w}
        return (y.view(T, k, self.H).float() * w.unsqueeze(-1)).sum(1).bfloat16()

    def backward(self, d_out):
        """Gradients of the last forward(save=True): (d_x, d_topk_w, dW13, dW2)."""
        c = self.ctx
        T, k = c["w"].shape
        d_w = (c["y"].view(T, k, self.H).float() * d_out.float().unsqueeze(1)).sum(-1)
        dys = (c["w"].unsqueeze(-1) * d_out.float().unsqueeze(1)).bfloat16().view(T * k, self.H)[c["order"]]
        dyr = dys.new_empty(sum(c["recv"]), self.H)
        dist.all_to_all_single(dyr, dys, c["recv"], c["send"])
        dxr, dw13, dw2 = self.experts_backward(dyr)
        dxs = torch.empty_like(dys)
        dist.all_to_all_single(dxs, dxr, c["send"], c["recv"])
        dx = torch.empty_like(dys)
        dx[c["order"]] = dxs
        return dx.view(T, k, self.H).float().sum(1).bfloat16(), d_w, dw13, dw2


def gather_cat(t, world):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def backward_check(model, x, idx, w, d_out, world, rank):
    """The baseline's backward against fp32 autograd through a dense computation of the whole
    layer (every rank's tokens and weights gathered): the largest relative error of this rank's
    d_x, d_topk_w, dW13 and dW2."""
    d_x, d_w, dw13, dw2 = model.backward(d_out)
    E, k, I = model.E, model.k, model.I
    xa = gather_cat(x, world).float().requires_grad_()
    ia, da = gather_cat(idx, world), gather_cat(d_out, world).float()
    wa = gather_cat(w, world).requires_grad_()
    w13 = gather_cat(model.w13, world).float().requires_grad_()
    w2 = gather_cat(model.w2, world).float().requires_grad_()
    out = torch.zeros_like(xa)
    for e in range(E):
        m = ia == e
        if not m.any():
            continue
        t = m.any(1).nonzero().squeeze(1)
        gu = xa[t] @ w13[e].t()
        y = (F.silu(gu[:, :I]) * gu[:, I:]) @ w2[e].t()
        out = out.index_add(0, t, y * (wa * m).sum(1)[t].unsqueeze(1))
    gx, gw, g13, g2 = torch.autograd.grad((out * da).sum(), [xa, wa, w13, w2])
    T, el = x.shape[0], model.E_loc
    pairs = [(d_x, gx[rank * T:(rank + 1) * T]), (d_w, gw[rank * T:(rank + 1) * T]),
             (dw13, g13[rank * el:(rank + 1) * el]), (dw2, g2[rank * el:(rank + 1) * el])]
    return max(((a.float() - b).norm() / b.norm()).item() for a, b in pairs)


def self_check(world, rank, device):
    """Checks the baseline on a small shape against a dense fp32 computation of the whole layer
    (all weights and tokens gathered). Returns (||out - ref|| / ||ref|| for this rank's tokens,
    the backward's largest relative error (backward_check))."""
    H, I, E, k, T = 256, 128, 8 * world, 2, 64
    gen = torch.Generator(device=device).manual_seed(77 + rank)
    model = EpMoE(H, I, E, k, world, rank, device, gen)
    idx, w = routing(T, E, k, "uniform", gen, device)
    x = torch.randn(T, H, generator=gen, device=device).bfloat16()
    out = model.forward(x, idx, w, save=True)
    bwd = backward_check(model, x, idx, w, torch.randn(T, H, generator=gen, device=device).bfloat16(), world, rank)
    w13 = [torch.empty_like(model.w13) for _ in range(world)]
    w2 = [torch.empty_like(model.w2) for _ in range(world)]
    dist.all_gather(w13, model.w13)
    dist.all_gather(w2, model.w2)
    w13, w2 = torch.cat(w13).float(), torch.cat(w2).float()
    ref = torch.zeros(T, H, device=device)
    for e in range(E):
        m = (idx == e)
        if not m.any():
            continue
        t = m.any(1).nonzero().squeeze(1)
        gu = x[t].float() @ w13[e].t()
        h = F.silu(gu[:, :I]) * gu[:, I:]
        ref[t] += (h @ w2[e].t()) * (w * m).sum(1)[t].unsqueeze(1)
    return ((out.float() - ref).norm() / ref.norm()).item(), bwd


def slowest_median(fn, a, device, before=None):
    """Median over a.iters timed calls of fn() (after a.warmup), each the slowest rank's CUDA-event
    time; before() runs untimed ahead of each call (the forward that a timed backward needs)."""
    times = []
    for it in range(a.warmup + a.iters):
        if before is not None:
            before()
        dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        t = torch.tensor([e0.elapsed_time(e1)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if it >= a.warmup:
            times.append(t.item())
    times.sort()
    return times[len(times) // 2]


def saved_bytes(model, x, idx, w, device):
    """What a forward with save=True keeps alive for the backward (model.ctx and model.ectx), in
    bytes: torch.cuda.memory_allocated after it minus before, synchronised, on the rank that keeps
    the most (the routing decides how many rows each rank receives). Untimed; collective."""
    model.ctx = model.ectx = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    model.forward(x, idx, w, save=True)  # its output is dropped at once: only the saved tensors stay
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated(device) - before
    model.ctx = model.ectx = None
    t = torch.tensor([kept], device=device, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sustained_ms(model, x, idx, w, ms, a, device):
    """~a.sustain seconds of back-to-back forwards; each rank's mean time per forward over the
    second half, the slowest rank's (as mok_bench --sustain). `ms` is the max-reduced median of
    the timed iterations, equal on every rank, so every rank makes the same number of
    (collective) forward calls."""
    n = min(10**6, max(2 * a.iters, math.ceil(a.sustain * 1000.0 / max(ms, 1e-3))))
    mid, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    for i in range(n):
        if i == n // 2:
            mid.record()
        model.forward(x, idx, w)
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([mid.elapsed_time(end) / (n - n // 2)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def dense_peak(device, sustain_s, fp8=False, n=8192, warmup=5, iters=20):
    """This GPU's cuBLAS dense n^3 rate in TFLOP/s, bf16 (torch.matmul) or, with `fp8`, E4M3 x
    E4M3 with per-tensor fp32 scales and bf16 out (torch._scaled_mm: the ceiling FP8 forms are
    quoted against): (burst, sustained or None). Collective: every rank calls it, so the sustained
    launches (a count fixed from the slowest rank's burst time) run on all GPUs over the same seconds."""
    gen = torch.Generator(device=device).manual_seed(7)
    a = torch.randn(n, n, generator=gen, device=device).bfloat16()
    b = torch.randn(n, n, generator=gen, device=device).bfloat16()
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    if fp8:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt's FP8 wants
        one = torch.ones((), device=device, dtype=torch.float32)
        launch = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, out=c)
    else:
        launch = lambda: torch.matmul(a, b, out=c)
    flop = 2.0 * n ** 3
    for _ in range(warmup):
        launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        launch()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    times.sort()
    ms = times[len(times) // 2]
    burst = flop / (ms * 1e-3) / 1e12
    sustained = None
    if sustain_s > 0:
        slowest = torch.tensor([ms], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        count = min(10**6, max(2 * iters, math.ceil(sustain_s * 1000.0 / slowest.item())))
        dist.barrier()
        mid, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(count):
            if i == count // 2:
                mid.record()
            launch()
        end.record()
        end.synchronize()
        sustained = flop / (mid.elapsed_time(end) / (count - count // 2) * 1e-3) / 1e12
    del a, b, c, launch
    torch.cuda.empty_cache()
    return burst, sustained


def fp8_supported(device):
    """cuBLAS FP8 needs sm_89+ and a torch with _scaled_mm."""
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)


def peak_entry(world, device, sustain_s, fp8=False):
    """Every rank's dense peak (bf16, or FP8 with `fp8`), gathered: {burst_tflops: [...],
    sustained_tflops: [...] or None, ...}."""
    dist.barrier()
    burst, sustained = dense_peak(device, sustain_s, fp8)
    t = torch.tensor([burst, sustained if sustained is not None else -1.0], device=device, dtype=torch.float64)
    got = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(got, t)
    bursts = [g[0].item() for g in got]
    sustains = [g[1].item() for g in got]
    what = ("E4M3 x E4M3, fp32 per-tensor scales, bf16 out (torch._scaled_mm)" if fp8 else "bf16 (torch.matmul)")
    entry = {"method": f"cuBLAS dense {what} 8192^3 on every GPU at once; burst: median of 20 "
                       "after 5 warm-up; sustained: mean over the second half of the --sustain seconds",
             "burst_tflops": bursts, "burst_tflops_max": max(bursts)}
    if all(v > 0 for v in sustains):
        entry["sustained_tflops"] = sustains
        entry["sustained_tflops_max"] = max(sustains)
    return entry


def print_peak(name, peak):
    extra = (f", sustained {', '.join(f'{v:.0f}' for v in peak['sustained_tflops'])}"
             if "sustained_tflops" in peak else "")
    print(f"[baseline] {name} peak (cuBLAS 8192^3) TFLOP/s per GPU: burst "
          f"{', '.join(f'{v:.0f}' for v in peak['burst_tflops'])}{extra}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="baseline.json")
    ap.add_argument("--models", default=",".join(list(MODELS) + [m + "/ep8" for m in MODELS]))
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--routings", default="uniform,zipf")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sustain", type=float, default=0.0,
                    help="also ~S seconds of back-to-back forwards per case (0 = off)")
    ap.add_argument("--no-backward", action="store_true", help="time the forward only")
    a = ap.parse_args()
    if a.iters < 20 or a.sustain < 0:
        raise SystemExit(f"--iters must be >= 20 (got {a.iters}) and --sustain >= 0 (got {a.sustain})")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    rel, bwd_rel = self_check(world, rank, device)
    t = torch.tensor([rel, bwd_rel], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    rel, bwd_rel = t[0].item(), t[1].item()
    if rank == 0:
        print(f"[baseline] self-check vs dense fp32: rel err {rel:.2e} forward, {bwd_rel:.2e} backward", flush=True)
    if not (rel < 1e-2 and bwd_rel < 1e-2):
        raise SystemExit(f"baseline self-check failed: relative error {rel} forward, {bwd_rel} backward")
    peak = peak_entry(world, device, a.sustain)
    peak_fp8 = peak_entry(world, device, a.sustain, fp8=True) if fp8_supported(device) else None
    if rank == 0:
        print_peak("bf16", peak)
        if peak_fp8:
            print_peak("FP8", peak_fp8)
        else:
            print("[baseline] FP8 peak: not measured (needs sm_89+ and torch._scaled_mm)", flush=True)
    cases = []
    for name in a.models.split(","):
        H, I, E, k, slice_of = model_shape(name, world)
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        model = EpMoE(H, I, E, k, world, rank, device, gen)
        for T in map(int, a.tokens.split(",")):
            for kind in a.routings.split(","):
                if rank == 0:
                    print(f"[baseline] {name} T={T} {kind} ...", flush=True)
                idx, w = routing(T, E, k, kind, gen, device)
                x = torch.randn(T, H, generator=gen, device=device).bfloat16()
                ms = slowest_median(lambda: model.forward(x, idx, w), a, device)
                # Routed FLOPs of the slowest rank would need per-rank rows; report the
                # per-GPU average: 2 * T * k * 3 * H * I per rank.
                tflops = 2 * T * k * 3 * H * I / (ms * 1e-3) / 1e12
                case = {"model": name, "T": T, "routing": kind, "baseline_ms": ms,
                        **({"slice_of_ep": slice_of, "experts": E} if slice_of else {}),
                        "baseline_tflops": tflops, "ep": world}
                case["saved_bytes"] = saved_bytes(model, x, idx, w, device)
                if not a.no_backward:
                    d_out = torch.randn(T, H, generator=gen, device=device).bfloat16()
                    case["baseline_bwd_ms"] = slowest_median(lambda: model.backward(d_out), a, device,
                                                             before=lambda: model.forward(x, idx, w, save=True))
                    case["baseline_bwd_tflops"] = 2 * 2 * T * k * 3 * H * I / (case["baseline_bwd_ms"] * 1e-3) / 1e12
                    model.ctx = model.ectx = None
                if a.sustain > 0:
                    sus = sustained_ms(model, x, idx, w, ms, a, device)
                    case["baseline_sustained_ms"] = sus
                    case["baseline_sustained_tflops"] = 2 * T * k * 3 * H * I / (sus * 1e-3) / 1e12 if sus > 0 else None
                cases.append(case)
                if rank == 0:
                    extra = f", sustained {case['baseline_sustained_ms']:.3f} ms" if a.sustain > 0 else ""
                    if "baseline_bwd_ms" in case:
                        extra += f", backward {case['baseline_bwd_ms']:.3f} ms"
                    print(f"[baseline]   {ms:.3f} ms  {tflops:.0f} TFLOP/s per GPU{extra}", flush=True)
        del model
        torch.cuda.empty_cache()
    if rank == 0:
        meta = {"device": torch.cuda.get_device_name(0), "gpus": world,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "commit": os.environ.get("MOK_COMMIT", "unknown"),
                "what": "PyTorch+NCCL EP MoE forward: all_to_all_single + torch._grouped_mm + SwiGLU;"
                        " slowest rank per iteration, median of iterations; baseline_bwd_ms: its backward"
                        " (all_to_all_single + grouped dgrads and wgrads + SwiGLU backward), timed after an"
                        " untimed forward, same statistic, FLOPs twice the forward's",
                "self_check_rel_err": rel, "self_check_bwd_rel_err": bwd_rel, "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "peak_bf16": peak, **({"peak_fp8": peak_fp8} if peak_fp8 else {}), "cases": cases}
        with open(a.out, "w") as f:
            json.dump(meta, f, indent=1)
        print(f"wrote {a.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
