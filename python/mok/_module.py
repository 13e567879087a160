"""``mok.MoE``: the layer as an ``nn.Module`` that owns this rank's expert weights."""

from __future__ import annotations


import torch

from ._ops import moe

# The knobs of mok::Config (include/mok/config.hpp), by the same names. On CPU tensors only
# cpu_threads matters; the others configure the GPU layer and are kept for it.
CONFIG_KNOBS = ("forward_path", "combine", "dispatch", "fwd_clusters", "fwd_comm_sms", "bwd_comm_sms",
                "minibatch_tokens", "macrobatch_tokens", "precision", "wait_timeout_s", "cpu_threads")


class MoE(torch.nn.Module):
    """One rank's routed experts (and an optional shared expert) of an expert-parallel MoE layer.

    ``forward(x, topk_idx, topk_w)`` takes the router's choice (global expert ids, -1 = empty
    slot, and the weights) and returns ``shared(x) + sum_j topk_w[:, j] * FFN_{topk_idx[:, j]}(x)``.
    The weights are Parameters: ``w_gate``, ``w_up`` [E_loc, I, H], ``w_down`` [E_loc, H, I] and, with
    ``shared_intermediate > 0``, ``ws_gate``, ``ws_up`` [Is, H], ``ws_down`` [H, Is], in ``dtype``
    (bf16, the layer's precision). ``group``: the EP process group (None = one rank); this build
    runs one rank on CPU tensors (the CPU reference engine). Config knobs are keyword arguments
    with the names of mok::Config (``CONFIG_KNOBS``).
    """

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, shared_intermediate: int = 0, *,
                 group=None, device=None, dtype: torch.dtype = torch.bfloat16, init_std: float = 0.02,
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
        if not isinstance(shared_intermediate, int) or shared_intermediate < 0:
            raise ValueError(f"mok.MoE: 'shared_intermediate' must be an int >= 0, got {shared_intermediate!r}")
        if dtype != torch.bfloat16:
            raise ValueError(f"mok.MoE: 'dtype' must be torch.bfloat16 (the layer's precision), got {dtype}")
        self.ep_size = 1 if group is None else group.size()
        if self.ep_size != 1:
            raise NotImplementedError(
                f"mok.MoE: an EP group of {self.ep_size} ranks needs the GPU layer, which is not in the Python "
                "package yet; use group=None (one rank)")
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

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        if self.config.get("cpu_threads"):
            torch.set_num_threads(int(self.config["cpu_threads"]))
        return moe(x, topk_idx, topk_w, self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up, self.ws_down)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def extra_repr(self) -> str:
        shared = f", shared_intermediate={self.shared_intermediate}" if self.shared_intermediate else ""
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, experts={self.experts}, top_k={self.top_k}"
                f"{shared}, ep_size={self.ep_size}, weights={self.weight_bytes() / 2**20:.1f} MiB")


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain softmax top-k router: (topk_idx int32 [T, k], topk_w float32 [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    return idx.to(torch.int32), w

