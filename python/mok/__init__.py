"""mok — expert-parallel Mixture-of-Experts layers for NVIDIA Hopper.

``mok.MoE`` is the layer as a PyTorch module (it owns this rank's expert weights) and
``mok.moe`` the functional op (registered with ``torch.library``: autograd, fake tensors,
``torch.compile``). CPU tensors run on the CPU reference engine, the layer's executable
specification (``mok._cpu``), so a model using ``mok.MoE`` can be developed and unit tested
without a GPU; CUDA tensors run on the GPU layer (``mok._cuda``: the megakernel forward and the
backward; one rank of an EP group, a torch.distributed ProcessGroup, per process).
PyTorch is needed for ``mok.moe`` / ``mok.MoE`` only: ``import mok`` works without it.
"""

from ._cpu import Error  # noqa: F401  (mok::Error: a ValueError naming the argument)

__version__ = "0.1.0"

try:
    import torch as _torch  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without PyTorch
    _torch = None

if _torch is not None:
    from ._ops import moe  # noqa: F401
    from ._module import CONFIG_KNOBS, MoE, route  # noqa: F401
else:  # pragma: no cover
    def _needs_torch(*_args, **_kwargs):
        raise ImportError("mok.moe and mok.MoE need PyTorch (pip install torch)")

    moe = MoE = _needs_torch
