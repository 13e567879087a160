"""Weight-gradient accumulation fused into the backward (``mok.MoE(fuse_wgrad_accumulation=True)``).

The convention of training stacks that accumulate gradients over microbatches in fp32 (Megatron's
gradient-accumulation fusion, Transformer Engine's ``fuse_wgrad_accumulation``): each routed
expert weight carries a ``main_grad`` (fp32, its shape, contiguous, on its device) and the backward
adds the weight's gradient to it instead of returning it; ``.grad`` stays None and the weight gets
``grad_added_to_main_grad = True``. A weight without ``main_grad`` gets one, zeros, on its first
backward (only a weight that requires grad; note that ``torch.autograd.grad(out, x)`` adds to them
too, as in the convention). On CUDA tensors the GPU layer adds the gradient's fp32 sums in its weight-gradient
epilogue (mok::GradRefs::accumulate: never rounded to bf16, each element once, deterministic); on
CPU tensors the reference engine's bf16 gradient is added (the CPU path is the specification's
rounding, within half a bf16 step of the GPU's). The shared expert's gradients, d_x and d_topk_w
are returned as usual.

Eager only: under torch.compile it raises (the op pair mok::moe_forward / mok::moe_backward is the
compiled path); once differentiable (no double backward). bf16 only (the GPU layer's FP8 backward
writes bf16 gradients).
"""

from __future__ import annotations

import torch

from . import _cpu
from ._ops import _check_device, _cpu_threads, _gpu_layer, gpu_backward, moe_forward

Tensor = torch.Tensor


def main_grad_of(w: Tensor, name: str) -> Tensor:
    """w.main_grad, made (zeros) when missing; checked: fp32, w's shape, contiguous, w's device."""
    g = getattr(w, "main_grad", None)
    if g is None:
        g = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        w.main_grad = g
    if g.dtype != torch.float32 or tuple(g.shape) != tuple(w.shape) or g.device != w.device or not g.is_contiguous():
        raise ValueError(f"mok.MoE(fuse_wgrad_accumulation=True): '{name}.main_grad' must be a contiguous float32 "
                         f"tensor of shape {tuple(w.shape)} on {w.device}, got {g.dtype} {tuple(g.shape)} on "
                         f"{g.device}{'' if g.is_contiguous() else ' (not contiguous)'}")
    return g


class FusedWgradMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer):
        out, generation = moe_forward(x, topk_idx, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer, "bf16")
        ctx.save_for_backward(x, topk_idx, topk_w, w_gate, w_up, w_down,
                              *([ws_gate, ws_up, ws_down] if ws_gate is not None else []), generation)
        ctx.shared = ws_gate is not None
        ctx.layer = layer
        ctx.mark_non_differentiable(generation)
        return out, generation

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, _d_generation):
        saved = list(ctx.saved_tensors)
        generation = saved.pop()
        x, topk_idx, topk_w, w_gate, w_up, w_down = saved[:6]
        ws = saved[6:9] if ctx.shared else [None, None, None]
        # Only the weights that need a gradient get (and are added to) a main_grad; the GPU layer
        # writes all three, so a frozen one's sums land in scratch.
        routed = ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down"))
        wants = [ctx.needs_input_grad[3 + i] for i in range(3)]
        mg = [main_grad_of(w, n) if want else torch.empty(w.shape, dtype=torch.float32, device=w.device)
              for (w, n), want in zip(routed, wants)]
        _check_device({"d_out": d_out}, x.device)
        c = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
        d_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        d_topk_w = torch.empty(topk_w.shape, dtype=topk_w.dtype, device=topk_w.device)
        d_ws = [torch.empty(w.shape, dtype=w.dtype, device=w.device) for w in ws if w is not None]
        if x.is_cuda:
            gpu_backward(_gpu_layer(ctx.layer, "the backward"), ctx.layer, d_out, x, topk_idx, topk_w,
                         (w_gate, w_up, w_down, *ws), [d_x, d_topk_w, *mg, *d_ws], generation, accumulate=True)
        else:
            d_w = [torch.empty(w.shape, dtype=w.dtype, device=w.device) for w in (w_gate, w_up, w_down)]
            _cpu.backward(c(x), c(topk_idx), c(topk_w), c(w_gate), c(w_up), c(w_down), *[c(w) for w in ws], c(d_out),
                          [d_x, d_topk_w, *d_w, *d_ws], threads=_cpu_threads(), precision="bf16")
            for g, d, want in zip(mg, d_w, wants):
                if want:
                    g.add_(d.float())
        for (w, _), want in zip(routed, wants):
            if want:
                w.grad_added_to_main_grad = True
        shared = d_ws if ctx.shared else [None, None, None]
        return d_x, None, d_topk_w, None, None, None, *shared, None
