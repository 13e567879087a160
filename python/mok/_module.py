"""``mok.MoE``: the layer as an ``nn.Module`` that owns this rank's expert weights."""

from __future__ import annotations


import warnings

import torch

from . import _comm
from ._cpu import Error
from ._fused_wgrad import FusedWgradMoE
from ._ops import PRECISIONS, moe, register_gpu_layer, unregister_gpu_layer

# The knobs of mok::Config (include/mok/config.hpp), by the same names. On CPU tensors only
# cpu_threads matters; the others configure the GPU layer and are kept for it.
CONFIG_KNOBS = ("forward_path", "combine", "dispatch", "backward_path", "fwd_clusters", "fwd_comm_sms", "bwd_comm_sms",
                "minibatch_tokens", "macrobatch_tokens", "activation_budget_bytes", "share_workspace", "workspace_budget_bytes",
                "saved_forwards", "fp8_keep_weight_codes_t",
                "precision",
                "wait_timeout_s", "cpu_threads")


class MoE(torch.nn.Module):
    """One rank's routed experts (and an optional shared expert) of an expert-parallel MoE layer.

    ``forward(x, topk_idx, topk_w)`` takes the router's choice (global expert ids, -1 = empty
    slot, and the weights) and returns ``shared(x) + sum_j topk_w[..., j] * FFN_{topk_idx[..., j]}(x)``;
    x is [..., H] (e.g. [B, S, H]; bf16, or fp32 / fp16 under a bf16 autocast) and the router's
    tensors [..., top_k] with x's leading dimensions (``topk_w`` in fp32, or bf16 / fp16, taken as
    fp32).
    The weights are Parameters: ``w_gate``, ``w_up`` [E_loc, I, H], ``w_down`` [E_loc, H, I] and, with
    ``shared_intermediate > 0``, ``ws_gate``, ``ws_up`` [Is, H], ``ws_down`` [H, Is], in ``dtype``
    (bf16, the layer's precision). ``group``: the EP process group (a torch.distributed
    ProcessGroup; None = one rank). With a group of W ranks each rank's module holds its E / W
    experts (rank r: experts [r E/W, (r+1) E/W)), every rank calls the module with the same token
    count T (pad with topk_idx = -1 rows, which cost no routed expert work; ``max_tokens`` does
    it) and ``topk_idx`` holds global expert ids; the routed weights' gradients are complete
    (every rank's tokens), the shared expert's cover this rank's tokens only (sum them over the
    group, as for any replicated weight).
    Calls are collective over the group: every rank runs the same modules in the same order. An
    EP group runs on CUDA tensors; CPU tensors run the reference engine on one rank (group None or
    of one rank). ``nccl_comm``: "own" (default: mok's own NCCL communicator over the group's
    ranks) or "group" (the group's NCCL communicator; see mok/_comm.py). Every module on one group
    and GPU shares one mok communicator, and so one workspace (the layers' transient buffers, up to
    ``workspace_budget_bytes``), whatever the number of layers. Config knobs are keyword arguments
    with the names of mok::Config (``CONFIG_KNOBS``). ``precision="fp8"`` (or "mxfp8"): the FP8
    recipe from these bf16 weights — it trains on CPU tensors (the reference engine) and on CUDA
    tensors (the GPU layer keeps the weights' codes and remakes them when a weight changes). fp8 and
    mxfp8 modules default to the unfused path, which trains: without a ``forward_path`` knob an fp8
    module's GPU layer (and its ``memory_plan``) gets ``forward_path="unfused"``.
    ``forward_path="megakernel"`` set explicitly is kept: it trains when its ring is below the worst
    case (the backward over windows; the memory plan then holds ``fp8_bwd_rows``), and is forward
    only with a resident ring, where a call whose output needs a gradient raises NotImplementedError
    (so does one with ``backward_path="fused"``, which is bf16 only).
    ``fuse_wgrad_accumulation=True`` (bf16, eager): the routed experts' weight gradients are added to
    each weight's fp32 ``main_grad`` (made as zeros when missing) instead of ``.grad``, as training
    stacks accumulate over microbatches (``mok/_fused_wgrad.py``).
    The GPU layer is built for a token count: one per distinct T a module is called with, each with
    its own buffers (a warning past ``MANY_LAYERS``). ``max_tokens=N`` runs every call of up to N
    tokens on one layer built for N (the call padded with rows of no route, the output cut back;
    the same bits as the unpadded call): the memory of a model whose token count varies (the last
    batch, evaluation, variable packing) stays that of one T. The padding costs no routed expert
    work, but the shared expert, the merge and autograd's saved x run at N rows. With an EP group
    and the same max_tokens on every rank, the ranks may call with different T (every rank still
    calls, 0 tokens included).
    """

    MANY_LAYERS = 4  # GPU layers (token counts) one module builds before it warns

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, shared_intermediate: int = 0, *,
                 group=None, device=None, dtype: torch.dtype = torch.bfloat16, init_std: float = 0.02,
                 fuse_wgrad_accumulation: bool = False, nccl_comm: str = "own", max_tokens: int | None = None,
                 **config):
        super().__init__()
        unknown = sorted(set(config) - set(CONFIG_KNOBS))
        if unknown:
            raise TypeError(f"mok.MoE: unknown config knob(s) {unknown}; known: {list(CONFIG_KNOBS)}")
        for name, value, step in (("hidden", hidden, 64), ("intermediate", intermediate, 64), ("experts", experts, 1),
                                  ("top_k", top_k, 1)):
            if not isinstance(value, int) or value < step or value % step:
                raise ValueError(f"mok.MoE: '{name}' must be a positive multiple of {step}, got {value!r}")
        if top_k > experts:
            raise ValueError(f"mok.MoE: 'top_k' must be <= experts ({experts}), got {top_k}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or
                                       max_tokens < 1):
            raise ValueError(f"mok.MoE: 'max_tokens' must be a positive int or None, got {max_tokens!r}")
        self.max_tokens = max_tokens
        if not isinstance(shared_intermediate, int) or shared_intermediate < 0:
            raise ValueError(f"mok.MoE: 'shared_intermediate' must be an int >= 0, got {shared_intermediate!r}")
        if config.get("precision", "bf16") not in PRECISIONS:
            raise ValueError(f"mok.MoE: 'precision' must be one of {PRECISIONS}, got {config['precision']!r}")
        if dtype != torch.bfloat16:
            raise ValueError(f"mok.MoE: 'dtype' must be torch.bfloat16 (the layer's precision), got {dtype}")
        if fuse_wgrad_accumulation and config.get("precision", "bf16") != "bf16":
            raise ValueError("mok.MoE: 'fuse_wgrad_accumulation' needs precision 'bf16' (the FP8 backward writes bf16 "
                             f"gradients), got precision {config['precision']!r}")
        if fuse_wgrad_accumulation and config.get("backward_path", "unfused") != "unfused":
            raise ValueError("mok.MoE: 'fuse_wgrad_accumulation' needs backward_path 'unfused' (the backward's GEMM "
                             f"program writes bf16 gradients), got {config['backward_path']!r}")
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        if nccl_comm not in _comm.NCCL_COMMS:
            raise ValueError(f"mok.MoE: 'nccl_comm' must be one of {_comm.NCCL_COMMS}, got {nccl_comm!r}")
        if group is not None and not (hasattr(group, "size") and hasattr(group, "rank")):
            raise TypeError(f"mok.MoE: 'group' must be a torch.distributed ProcessGroup or None, got {type(group)}")
        self.ep_size = 1 if group is None else int(group.size())
        self.ep_rank = 0 if group is None else int(group.rank())
        if group is not None and self.ep_rank < 0:
            raise ValueError("mok.MoE: this process is not a member of 'group' (its rank there is -1)")
        self.nccl_comm = nccl_comm
        if experts % self.ep_size:
            raise ValueError(f"mok.MoE: 'experts' ({experts}) must be divisible by the EP size ({self.ep_size})")
        self.hidden, self.intermediate, self.experts, self.top_k = hidden, intermediate, experts, top_k
        self.shared_intermediate = shared_intermediate
        self.group = group
        self.config = dict(config)
        e_loc = experts // self.ep_size

        def param(*shape):
            return torch.nn.Parameter(torch.randn(*shape, device=device, dtype=torch.float32).mul_(init_std).to(dtype))

        self.w_gate = param(e_loc, intermediate, hidden)
        self.w_up = param(e_loc, intermediate, hidden)
        self.w_down = param(e_loc, hidden, intermediate)
        if shared_intermediate > 0:
            self.ws_gate = param(shared_intermediate, hidden)
            self.ws_up = param(shared_intermediate, hidden)
            self.ws_down = param(hidden, shared_intermediate)
        else:
            self.ws_gate = self.ws_up = self.ws_down = None

        self._gpu = {}  # (device, T) -> handle of the GPU layer built for them (it reads the weights in place)
        self._gpu_comms = {}  # (device, T) -> the mok communicator that layer is on (shared by the group's modules)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """x [..., H], topk_idx and topk_w [..., top_k] with x's leading dimensions (e.g. [B, S, H]
        as a training stack holds its activations: the tokens are the flattened leading
        dimensions); returns [..., H]. The op below takes the flattened [T, H] form."""
        lead = tuple(x.shape[:-1])
        want = list(lead) + [self.top_k]
        if x.dim() < 1 or x.shape[-1] != self.hidden:
            raise Error(f"mok: invalid argument 'x': must be [..., H] with H = {self.hidden}, got {list(x.shape)}")
        for name, t in (("topk_idx", topk_idx), ("topk_w", topk_w)):
            if list(t.shape) != want:
                raise Error(f"mok: invalid argument '{name}': shape must be x's leading dimensions + [top_k] = "
                            f"{want}, got {list(t.shape)}")
        dev = x.device.type
        if x.dtype in (torch.float32, torch.float16) and torch.is_autocast_enabled(dev) and \
                torch.get_autocast_dtype(dev) == torch.bfloat16:
            # Under bf16 autocast activations may arrive in fp32 (a norm computed in fp32): the layer
            # runs in bf16, as a Linear would; autograd casts x's gradient back.
            x = x.to(torch.bfloat16)
        if topk_w.dtype in (torch.bfloat16, torch.float16):
            # A router in the model's dtype gives its weights in bf16 / fp16; the layer takes them in
            # fp32 (exact: a widening cast), and autograd casts their gradient back.
            topk_w = topk_w.float()
        T = x.numel() // self.hidden
        x, topk_idx, topk_w = x.reshape(T, self.hidden), topk_idx.reshape(T, self.top_k), topk_w.reshape(T, self.top_k)
        if self.max_tokens is not None and T != self.max_tokens:
            pad = self.max_tokens - T
            if pad < 0:
                raise Error(f"mok: invalid argument 'x': {T} tokens, more than the module's max_tokens = "
                            f"{self.max_tokens}")
            # Every call runs on the one layer built for max_tokens: the tokens padded with rows of
            # no route (topk_idx -1: no routed expert work, a zero routed output), the output cut
            # back to T. A token's result does not depend on the others', so the bits are the
            # unpadded call's.
            x = torch.cat([x, x.new_zeros(pad, self.hidden)])
            topk_idx = torch.cat([topk_idx, topk_idx.new_full((pad, self.top_k), -1)])
            topk_w = torch.cat([topk_w, topk_w.new_zeros(pad, self.top_k)])
        return self._forward_tokens(x, topk_idx, topk_w)[:T].reshape(*lead, self.hidden)

    def _forward_tokens(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """The layer over x [T, H], topk_idx and topk_w [T, top_k] (forward's checked, flattened and
        padded arguments)."""
        if self.config.get("cpu_threads"):
            torch.set_num_threads(int(self.config["cpu_threads"]))
        if not x.is_cuda and self.ep_size > 1:
            raise ValueError(f"mok.MoE: an EP group of {self.ep_size} ranks ('group') runs on CUDA tensors; CPU "
                             "tensors run the reference engine on one rank (group=None)")
        layer = self._gpu_layer(x) if x.is_cuda else 0
        if self.fuse_wgrad_accumulation and torch.is_grad_enabled() and any(
                w.requires_grad for w in (self.w_gate, self.w_up, self.w_down)):
            if torch.compiler.is_compiling():
                raise NotImplementedError("mok.MoE: fuse_wgrad_accumulation runs eager (the weights' main_grad is "
                                          "added to outside the graph); compile a module without it")
            return FusedWgradMoE.apply(x, topk_idx, topk_w, self.w_gate, self.w_up, self.w_down, self.ws_gate,
                                       self.ws_up, self.ws_down, layer)[0]
        return moe(x, topk_idx, topk_w, self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up, self.ws_down,
                   layer, str(self.config.get("precision", "bf16")))

    def _weights(self):
        return [self.w_gate, self.w_up, self.w_down] + (
            [self.ws_gate, self.ws_up, self.ws_down] if self.shared_intermediate else [])

    def _gpu_layer(self, x: torch.Tensor) -> int:
        """The GPU layer for x's device and token count (x [T, H], checked by forward; built on first
        use, collectively over the group: its buffers and windows, on the communicator every module
        of this group and device shares). It reads the weights where they are; when they move to new
        storage (``.to()``, ``load_state_dict(assign=True)``) the op re-binds it (``_bind_weights``)."""
        T = x.shape[0]
        weights = self._weights()
        for p in weights:
            if not p.is_cuda or p.device != x.device or not p.is_contiguous():
                raise ValueError(f"mok.MoE: the weights must be contiguous on {x.device} (move the module there)")
        key = (x.device.index, T)
        if key not in self._gpu:
            if len(self._gpu) == self.MANY_LAYERS and self.max_tokens is None:
                warnings.warn(
                    f"mok.MoE: one more GPU layer, for T = {T} (built so far for T = "
                    f"{sorted(t for (_, t) in self._gpu)}): each holds its own buffers, and every module of "
                    "the model does the same; pass max_tokens= to run every call on one layer (calls padded "
                    "with rows of no route)", stacklevel=2)
            _cuda = _import_cuda()
            knobs = self._layer_knobs()
            from . import _cpu
            wait_s = float(self.config.get("wait_timeout_s", _cpu.DEFAULT_WAIT_TIMEOUT_S))
            comm = _comm.communicator(_cuda, self.group, x.device.index, wait_s, self.nccl_comm)
            gl = _cuda.Layer(comm, T, self.hidden, self.intermediate, self.experts, self.top_k,
                             self.shared_intermediate, [p.data_ptr() for p in weights], knobs)
            # FP8: whether the layer has a backward (the FP8 megakernel over windows of a ring below
            # the worst case, or the unfused path): its plan holds the FP8 backward's buffers then.
            trains = None
            if knobs.get("precision") in ("fp8", "mxfp8"):
                trains = "fp8_bwd_rows" in self.memory_plan(T)
            self._gpu[key] = register_gpu_layer(gl, knobs, trains)
            self._gpu_comms[key] = comm  # (the layer keeps it alive too; kept here to be looked at)
        return self._gpu[key]

    def _layer_knobs(self) -> dict:
        """The config knobs as the GPU layer and the planner get them (name -> text): the module's,
        and with precision "fp8" / "mxfp8" forward_path "unfused" unless the module sets one (the
        FP8 megakernel trains only over windows of a ring below the worst case; FP8 modules default to
        the unfused path, which always trains)."""
        knobs = {name: _knob_text(value) for name, value in self.config.items()}
        if knobs.get("precision") in ("fp8", "mxfp8"):
            knobs.setdefault("forward_path", "unfused")
        return knobs

    def __del__(self):
        for handle in getattr(self, "_gpu", {}).values():
            unregister_gpu_layer(handle)

    def check(self) -> None:
        """Raises the GPU layers' pending device-side errors (synchronize first): bad routing,
        expired waits. CPU tensors raise at the call itself."""
        from ._ops import _gpu_layers
        for handle in self._gpu.values():
            _gpu_layers[handle].check()

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def main_grad_bytes(self) -> int:
        """With fuse_wgrad_accumulation: the fp32 main_grad of the routed weights that train (4 bytes
        per element, twice their bf16 bytes), per rank; 0 without."""
        if not self.fuse_wgrad_accumulation:
            return 0
        return sum(4 * w.numel() for w in (self.w_gate, self.w_up, self.w_down) if w.requires_grad)

    def memory_plan(self, tokens: int) -> dict:
        """The GPU layer's planned device memory for calls of `tokens` tokens per rank, weights and
        inputs not counted (mok::plan_memory, which the layer allocates by): {buffer: bytes} and
        the totals under "total", "saved" (what a backward reads of its forward) and "workspace"."""
        from . import _cpu
        knobs = self._layer_knobs()  # the GPU layer's (fp8: the unfused path unless set)
        rows = _cpu.plan_memory(int(tokens), self.hidden, self.intermediate, self.experts, self.top_k,
                                self.shared_intermediate, self.ep_size, knobs)
        plan = {name: nbytes for name, nbytes, _, _, _ in rows}
        plan["total"] = sum(r[1] for r in rows)
        plan["saved"] = sum(r[1] for r in rows if r[2] == "saved")
        plan["workspace"] = sum(r[1] for r in rows if r[4])
        return plan

    def extra_repr(self) -> str:
        shared = f", shared_intermediate={self.shared_intermediate}" if self.shared_intermediate else ""
        # The layer memory of the GPU layers built so far (one per token count).
        built = sorted({T for (_, T) in self._gpu})
        layer = "".join(f", layer memory at T={T}: {self.memory_plan(T)['total'] / 2**20:.1f} MiB" for T in built)
        # fuse_wgrad_accumulation: the routed weights' fp32 main_grad (made on the first backward if missing).
        fused = (f", fuse_wgrad_accumulation: main_grad {self.main_grad_bytes() / 2**20:.1f} MiB (fp32)"
                 if self.fuse_wgrad_accumulation else "")
        cap = f", max_tokens={self.max_tokens}" if self.max_tokens is not None else ""
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, experts={self.experts}, top_k={self.top_k}"
                f"{shared}, ep_size={self.ep_size}{cap}, weights={self.weight_bytes() / 2**20:.1f} MiB{fused}{layer}")


def _knob_text(value) -> str:
    """A config knob's value as the GPU layer parses it: bools as 0/1, the rest as written."""
    return str(int(value)) if isinstance(value, bool) else str(value)


def _version(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def _import_cuda():
    """mok._cuda, after checking that the NCCL this process loaded is the one mok was built
    against (device-API structures differ between NCCL versions)."""
    try:
        from . import _cuda
    except ImportError as e:
        raise ImportError("mok.MoE: CUDA tensors need mok._cuda, which this installation was built without "
                          "(pip install . with MOK_PYTHON_CUDA=ON, the default)") from e
    compiled, loaded = _cuda.nccl_versions()
    if compiled != loaded:
        raise ImportError(
            f"mok._cuda was compiled against NCCL {_version(compiled)}, but this process loaded NCCL "
            f"{_version(loaded)} (PyTorch's: torch.cuda.nccl.version() = {torch.cuda.nccl.version()}): rebuild mok in "
            "this environment (pip install --no-build-isolation .) so it compiles against the NCCL wheel torch uses")
    return _cuda


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain softmax top-k router over logits [..., E]: (topk_idx int32 [..., k], topk_w float32
    [..., k]), the shapes mok.MoE takes beside x [..., H]."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    return idx.to(torch.int32), w

