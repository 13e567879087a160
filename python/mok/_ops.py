"""The layer as PyTorch custom ops: ``mok::moe_forward`` / ``mok::moe_backward``.

Registered with ``torch.library.custom_op`` (each with a fake implementation, so the ops trace
under ``torch.compile`` and run on meta tensors) and joined by ``register_autograd``: gradients
flow to x, topk_w (to the router) and every weight; topk_idx gets none.

CPU tensors run the CPU reference engine, whose backward recomputes what it needs from the saved
inputs: any number of forwards may be alive before their backwards (microbatches, activation
checkpointing). CUDA tensors run a GPU layer (mok._cuda) that a ``mok.MoE`` owns and names by the
``layer`` argument (a handle; 0 = none): its backward uses what the layer saved in the forward
whose number the forward op returned. The layer holds the saved state of its last
``saved_forwards`` forwards (a mok.MoE knob; 1 by default, more with a ring below the worst case):
the backward of an older forward is refused by name.

``precision`` "fp8" / "mxfp8" (a mok.MoE knob): the FP8 recipes (include/mok/reference.hpp).
Both train: on CPU tensors the reference engine runs the recipe's forward and backward; on CUDA
tensors the GPU layer does, when its forward runs on the unfused path (Config::forward_path
"unfused", mok.MoE's default for both). The FP8 megakernel (forward_path "megakernel") is forward
only: its forwards save nothing, and a call whose output would need a gradient raises
NotImplementedError (run it under torch.no_grad() / torch.inference_mode()); so does one on a
layer with backward_path "fused" (the backward's GEMM program is bf16 only). On CUDA tensors
mxfp8's MX codes are re-blocked onto the FP8 kernels. The GPU layer keeps the weights' FP8 codes
(made from the bf16 weights): it makes them again whenever a weight tensor changed, in place (its version counter)
or for another tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _cpu

Tensor = torch.Tensor
PRECISIONS = ("bf16", "fp8", "mxfp8")  # Config::precision's names (mok.MoE's precision knob)


def _cpu_threads() -> int:
    return max(1, torch.get_num_threads())


def _check_device(tensors: dict[str, Optional[Tensor]], device: torch.device) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"mok.moe: '{name}' is on {t.device}, x on {device}: all tensors must be on one device")


# GPU layers by handle (registered by mok.MoE, which owns them). Each numbers its forwards; a
# backward carries its forward's number (the forward op's second output).
_gpu_layers: dict[int, object] = {}
_gpu_weights: dict[int, tuple] = {}  # the weight addresses each GPU layer was last pointed at
_gpu_configs: dict[int, dict] = {}  # the config knobs (name -> text) each GPU layer was built with
_gpu_trains: dict[int, bool] = {}   # whether an FP8 GPU layer has a backward (its memory plan says)


def register_gpu_layer(layer, config: Optional[dict] = None, trains: Optional[bool] = None) -> int:
    """A handle for `layer`; `config`: the knobs it was built with (mok::Config's names, values as
    text; the C++ defaults for those absent), which say whether its FP8 forward can train; `trains`:
    whether its memory plan has the FP8 backward's buffers (None: decided by the knobs alone)."""
    handle = max(_gpu_layers, default=0) + 1
    _gpu_layers[handle] = layer
    _gpu_configs[handle] = dict(config or {})
    if trains is not None:
        _gpu_trains[handle] = bool(trains)
    return handle


def unregister_gpu_layer(handle: int) -> None:
    _gpu_layers.pop(handle, None)
    _gpu_weights.pop(handle, None)
    _gpu_configs.pop(handle, None)
    _gpu_trains.pop(handle, None)


def _fp8_forward_saves(handle: int) -> bool:
    """Whether the FP8 forward of GPU layer `handle` can save for a backward: on the unfused path,
    and on the megakernel when its ring is below the worst case (its backward then runs over windows
    of the ring; the layer's memory plan has the FP8 backward's buffers: register_gpu_layer's
    `trains`). The FP8 megakernel with a resident ring is forward only (mok::Layer::forward refuses
    save_for_backward there). Config::forward_path's default is the megakernel."""
    if handle in _gpu_trains:
        return _gpu_trains[handle]
    return _gpu_configs.get(handle, {}).get("forward_path", "megakernel") == "unfused"


def _fp8_training_refusal(handle: int) -> Optional[str]:
    """Why GPU layer `handle` (precision fp8 or mxfp8) cannot train, or None when it can: the checks of
    mok::Layer::backward ('config.forward_path', 'config.backward_path'), made before the call."""
    config = _gpu_configs.get(handle, {})
    if not _fp8_forward_saves(handle):
        return (f"its forward_path is '{config.get('forward_path', 'megakernel')}' with a ring that holds the worst "
                "case (the FP8 megakernel trains only over windows of a smaller ring: workspace_budget_bytes, "
                "macrobatch_tokens): build the mok.MoE with forward_path='unfused' (the FP8 recipes' default when "
                "forward_path is not set) or a ring below the worst case")
    if config.get("backward_path", "unfused") != "unfused":
        return (f"its backward_path is '{config['backward_path']}' (the backward's GEMM program is bf16 only): use "
                "backward_path='unfused' (the default)")
    return None


def _gpu_layer(handle: int, what: str):
    if handle not in _gpu_layers:
        raise NotImplementedError(
            f"mok.moe: {what} on CUDA tensors needs the GPU layer of a mok.MoE module (use mok.MoE; the functional "
            "op runs CPU tensors only)")
    return _gpu_layers[handle]


def _bind_weights(gl, handle: int, weights, cached: bool = False) -> None:
    """Points the GPU layer at these weight tensors (contiguous, on its device) when they are not
    the ones it reads already: in bf16 the layer keeps no copy, so in-place updates need nothing,
    and other tensors (after .to(), load_state_dict(assign=True), a non-contiguous view copied here)
    are re-bound (host-side only). `cached` (FP8: the layer holds the weights' codes): an in-place
    update too (an optimizer step, load_state_dict, a .copy_() — the tensors' version counters)
    makes the codes again (one pass over the weights on the GPU, then a device sync)."""
    key = tuple(0 if w is None else (w.data_ptr(), _version_of(w) if cached else 0) for w in weights)
    if _gpu_weights.get(handle) != key:
        gl.set_weights([0 if w is None else w.data_ptr() for w in weights])
        _gpu_weights[handle] = key


def _version_of(w: Tensor):
    """w's version counter (bumped by every in-place write). A tensor made under
    torch.inference_mode() keeps none: then a new object, so the codes are made again every call
    (correct, at one quantization pass per call)."""
    try:
        return w._version
    except RuntimeError:
        return object()


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


@torch.library.custom_op("mok::moe_forward", mutates_args=())
def moe_forward(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                layer: int = 0, precision: str = "bf16") -> tuple[Tensor, Tensor]:
    """(out, generation): generation, a CPU int64 scalar, numbers this forward among the GPU layer's
    (0 on CPU tensors); the backward gets it as a tensor, so that a compiled graph checks the
    runtime value, not the one it was traced with."""
    _check_device({"topk_idx": topk_idx, "topk_w": topk_w, "w_gate": w_gate, "w_up": w_up,
                   "w_down": w_down, "ws_gate": ws_gate, "ws_up": ws_up, "ws_down": ws_down}, x.device)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    c = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
    if x.is_cuda:
        gl = _gpu_layer(layer, "the forward")
        xc, ic, wc = c(x), c(topk_idx), c(topk_w)
        stream = _stream(x)
        # Kept alive until the call is enqueued (a copied non-contiguous weight is a temporary).
        ws = [c(w) for w in (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)]
        bf16 = precision == "bf16"
        _bind_weights(gl, layer, ws, cached=not bf16)
        # Saved for a backward as in bf16 (every forward: the op does not know whether a gradient
        # will be asked for). FP8 saves where the layer trains (the unfused path, or the megakernel
        # over windows of a ring below the worst case); the FP8 megakernel with a resident ring is
        # forward only (the layer refuses to save there), and a call needing a gradient is refused
        # in _setup_context.
        save = bf16 or _fp8_forward_saves(layer)
        fid = gl.forward(xc.data_ptr(), ic.data_ptr(), ic.dtype == torch.int64, wc.data_ptr(), out.data_ptr(),
                         stream, save)
        del ws
        return out, torch.tensor(fid, dtype=torch.int64)
    _cpu.forward(c(x), c(topk_idx), c(topk_w), c(w_gate), c(w_up), c(w_down), c(ws_gate), c(ws_up), c(ws_down),
                 out, threads=_cpu_threads(), precision=precision)
    return out, torch.tensor(0, dtype=torch.int64)


@moe_forward.register_fake
def _(x, topk_idx, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer=0, precision="bf16"):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("mok::moe_backward", mutates_args=())
def moe_backward(d_out: Tensor, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor,
                 w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor],
                 ws_down: Optional[Tensor], generation: Tensor, layer: int = 0,
                 precision: str = "bf16") -> list[Tensor]:
    """[d_x, d_topk_w, d_w_gate, d_w_up, d_w_down] and, with a shared expert, its three.
    generation: the forward's (moe_forward's second output). precision: the forward's; "fp8" runs
    recipe 1's backward, "mxfp8" recipe 2's (CPU tensors: the reference engine; CUDA tensors: the
    GPU layer's, which knows its own precision, after an unfused forward)."""
    _check_device({"d_out": d_out, "w_gate": w_gate}, x.device)
    c = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
    grads = _grad_buffers(x, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    if x.is_cuda:
        gl = _gpu_layer(layer, "the backward")
        why = _fp8_training_refusal(layer) if precision != "bf16" else None
        if why:
            raise NotImplementedError(f"mok.moe: this {precision} GPU layer cannot run a backward: {why}")
        # As the forward bound them (FP8: the weights' versions too, so that an unchanged weight
        # does not make its codes again here).
        gpu_backward(gl, layer, d_out, x, topk_idx, topk_w, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down), grads,
                     generation, cached=precision != "bf16")
        return grads
    _cpu.backward(c(x), c(topk_idx), c(topk_w), c(w_gate), c(w_up), c(w_down), c(ws_gate), c(ws_up), c(ws_down),
                  c(d_out), grads, threads=_cpu_threads(), precision=precision)
    return grads


def gpu_backward(gl, layer: int, d_out: Tensor, x: Tensor, topk_idx: Tensor, topk_w: Tensor, weights, grads,
                 generation: Tensor, cached: bool = False, accumulate: bool = False) -> None:
    """The GPU layer's backward into `grads` ([d_x, d_topk_w, the routed weights' three, the shared
    expert's]): weights bound as the forward bound them (`cached`: by version, FP8), and with
    `accumulate` the routed weights' fp32 gradients added to (mok::GradRefs::accumulate). The layer
    holds the saved state of its last saved_forwards forwards and names any other (mok.Error
    'backward.forward_id')."""
    c = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
    xc, ic, wc, dc = c(x), c(topk_idx), c(topk_w), c(d_out)
    ws = [c(w) for w in weights]  # kept alive until the call is enqueued (a copied weight is a temporary)
    _bind_weights(gl, layer, ws, cached=cached)
    gen = int(generation)  # a CPU scalar: no device sync
    gl.backward(xc.data_ptr(), ic.data_ptr(), ic.dtype == torch.int64, wc.data_ptr(), dc.data_ptr(),
                [g.data_ptr() for g in grads], _stream(x), gen, accumulate=accumulate)
    del ws


def _grad_buffers(x, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down) -> list[Tensor]:
    like = [x, topk_w, w_gate, w_up, w_down] + ([ws_gate, ws_up, ws_down] if ws_gate is not None else [])
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like]


@moe_backward.register_fake
def _(d_out, x, topk_idx, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, generation, layer=0,
      precision="bf16"):
    return _grad_buffers(x, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)


def _setup_context(ctx, inputs, output):
    # (Called only when the output needs a gradient.) FP8: recipe 1 has a backward on CPU tensors
    # (the reference engine) and on CUDA tensors (the GPU layer's, after an unfused forward or the
    # FP8 megakernel's over windows of the ring: one with a resident ring is forward only and saved
    # nothing); MXFP8 on CPU tensors (the reference's recipe 2, and on CUDA tensors the GPU
    # layer's, likewise).
    precision = inputs[10] if len(inputs) > 10 else "bf16"
    layer = inputs[9] if len(inputs) > 9 else 0
    if precision != "bf16" and inputs[0].is_cuda:
        why = _fp8_training_refusal(layer)
        if why:
            raise NotImplementedError(
                f"mok.moe: precision '{precision}' is forward only on this GPU layer: {why}; or call it under "
                "torch.no_grad() or torch.inference_mode(), or on tensors that need no gradient")
    ctx.save_for_backward(*[t for t in inputs[:9] if t is not None], output[1])
    ctx.shared = inputs[6] is not None
    ctx.layer = layer
    ctx.precision = precision


def _backward(ctx, d_out, _d_generation):
    saved = list(ctx.saved_tensors)
    generation = saved.pop()
    x, topk_idx, topk_w, w_gate, w_up, w_down = saved[:6]
    ws = saved[6:9] if ctx.shared else [None, None, None]
    g = moe_backward(d_out, x, topk_idx, topk_w, w_gate, w_up, w_down, *ws, generation, ctx.layer, ctx.precision)
    shared = g[5:8] if ctx.shared else [None, None, None]
    return g[0], None, g[1], g[2], g[3], g[4], *shared, None, None


torch.library.register_autograd("mok::moe_forward", _backward, setup_context=_setup_context)


def moe(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
        ws_gate: Optional[Tensor] = None, ws_up: Optional[Tensor] = None,
        ws_down: Optional[Tensor] = None, layer: int = 0, precision: str = "bf16") -> Tensor:
    """The MoE layer on one rank: ``out[t] = shared(x[t]) + sum_j topk_w[t,j] FFN_{topk_idx[t,j]}(x[t])``.

    x [T, H] bf16; topk_idx [T, k] int32/int64 (global expert ids, -1 = empty slot); topk_w [T, k]
    float32, finite and >= 0; w_gate, w_up [E, I, H], w_down [E, H, I] bf16; the shared expert's
    ws_gate, ws_up [Is, H], ws_down [H, Is] bf16, or None. Returns out [T, H] bf16. Bad arguments
    raise mok.Error (a ValueError) naming the argument and the constraint, e.g. "topk_idx[3,1]".
    The rounding points are the C++ layer's (include/mok/reference.hpp). ``layer``: the GPU layer
    of a mok.MoE for CUDA tensors (mok.MoE passes it; 0 on CPU). ``precision``: "bf16", or the FP8
    recipes "fp8" / "mxfp8" (both train on CPU tensors, and on CUDA tensors with a GPU layer whose
    forward_path is "unfused", mok.MoE's default for both; on CUDA tensors the layer's own
    precision, which mok.MoE passes).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"mok.moe: 'precision' must be one of {PRECISIONS}, got {precision!r}")
    return moe_forward(x, topk_idx, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer, precision)[0]
