"""The layer as PyTorch custom ops: ``mok::moe_forward`` / ``mok::moe_backward``.

Registered with ``torch.library.custom_op`` (each with a fake implementation, so the ops trace
under ``torch.compile`` and run on meta tensors) and joined by ``register_autograd``: gradients
flow to x, topk_w (to the router) and every weight; topk_idx gets none. The backward recomputes
what it needs from the saved inputs, so any number of forwards may be alive before their
backwards (microbatches, activation checkpointing).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _cpu

Tensor = torch.Tensor


def _cpu_threads() -> int:
    return max(1, torch.get_num_threads())


def _check_device(tensors: dict[str, Optional[Tensor]]) -> None:
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cpu":
            raise NotImplementedError(
                f"mok.moe: '{name}' is on {t.device}: this build runs CPU tensors only (the CPU "
                "reference engine); the GPU megakernel path is not in the Python package yet")


@torch.library.custom_op("mok::moe_forward", mutates_args=())
def moe_forward(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor]) -> Tensor:
    _check_device({"x": x, "topk_idx": topk_idx, "topk_w": topk_w, "w_gate": w_gate, "w_up": w_up,
                   "w_down": w_down, "ws_gate": ws_gate, "ws_up": ws_up, "ws_down": ws_down})
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    c = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
    _cpu.forward(c(x), c(topk_idx), c(topk_w), c(w_gate), c(w_up), c(w_down), c(ws_gate), c(ws_up), c(ws_down),
                 out, threads=_cpu_threads())
    return out


@moe_forward.register_fake
def _(x, topk_idx, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("mok::moe_backward", mutates_args=())
def moe_backward(d_out: Tensor, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor,
                 w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor],
                 ws_down: Optional[Tensor]) -> list[Tensor]:
    """[d_x, d_topk_w, d_w_gate, d_w_up, d_w_down] and, with a shared expert, its three."""
    _check_device({"d_out": d_out, "x": x, "w_gate": w_gate})
    c = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
    grads = _grad_buffers(x, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    _cpu.backward(c(x), c(topk_idx), c(topk_w), c(w_gate), c(w_up), c(w_down), c(ws_gate), c(ws_up), c(ws_down),
                  c(d_out), grads, threads=_cpu_threads())
    return grads


def _grad_buffers(x, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down) -> list[Tensor]:
    like = [x, topk_w, w_gate, w_up, w_down] + ([ws_gate, ws_up, ws_down] if ws_gate is not None else [])
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like]


@moe_backward.register_fake
def _(d_out, x, topk_idx, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    return _grad_buffers(x, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*[t for t in inputs if t is not None])
    ctx.shared = inputs[6] is not None


def _backward(ctx, d_out):
    saved = list(ctx.saved_tensors)
    x, topk_idx, topk_w, w_gate, w_up, w_down = saved[:6]
    ws = saved[6:9] if ctx.shared else [None, None, None]
    g = moe_backward(d_out, x, topk_idx, topk_w, w_gate, w_up, w_down, *ws)
    shared = g[5:8] if ctx.shared else [None, None, None]
    return g[0], None, g[1], g[2], g[3], g[4], *shared


torch.library.register_autograd("mok::moe_forward", _backward, setup_context=_setup_context)


def moe(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
        ws_gate: Optional[Tensor] = None, ws_up: Optional[Tensor] = None,
        ws_down: Optional[Tensor] = None) -> Tensor:
    """The MoE layer on one rank: ``out[t] = shared(x[t]) + sum_j topk_w[t,j] FFN_{topk_idx[t,j]}(x[t])``.

    x [T, H] bf16; topk_idx [T, k] int32/int64 (global expert ids, -1 = empty slot); topk_w [T, k]
    float32, finite and >= 0; w_gate, w_up [E, I, H], w_down [E, H, I] bf16; the shared expert's
    ws_gate, ws_up [Is, H], ws_down [H, Is] bf16, or None. Returns out [T, H] bf16. Bad arguments
    raise mok.Error (a ValueError) naming the argument and the constraint, e.g. "topk_idx[3,1]".
    The rounding points are the C++ layer's (include/mok/reference.hpp).
    """
    return moe_forward(x, topk_idx, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
