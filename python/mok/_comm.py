"""One mok communicator per (EP group, GPU), shared by every mok.MoE on them.

mok's memory model (include/mok/memory.hpp) keeps the transient buffers of a layer — the ring of
routed rows, the staging windows — in one workspace per communicator, which every layer on that
communicator reuses in turn. A model's MoE layers must therefore share one communicator per GPU:
with one each, 58 DeepSeek-V3 layers would hold 58 workspaces. ``communicator()`` hands every
module the same ``mok._cuda.Communicator`` for the same group, device and wait bound, and forgets it
when the last module (the last GPU layer) holding it goes.

How a communicator is made (``nccl_comm``):

* ``"own"`` (the default): mok creates its own non-blocking NCCL communicator over the group's
  ranks. The group's first rank makes an NCCL unique id, which travels to the others over the group
  (``torch.distributed.broadcast_object_list``: any backend). mok owns it, so every host-side wait
  on it is bounded (CommOptions::bootstrap_timeout_s) and a failure can abort it.
* ``"group"``: mok uses the group's own NCCL communicator (``ProcessGroupNCCL._comm_ptr()``; one
  NCCL communicator fewer per GPU). torch makes it lazily, so a one-element all-reduce on the group
  comes first when it does not exist yet. mok does not own it: its windows are registered on it, its
  host waits are bounded only if torch made it non-blocking, and the mok.MoE modules must be deleted
  before the group is destroyed (``destroy_process_group``).

Without a group (``group=None``) the communicator is a one-rank one of its own per device (EP 1).
Creating a communicator is collective over the group: every rank builds its modules' GPU layers in
the same order, which a model does by running the same forward on every rank, from one thread. A
communicator lives while a module's GPU layer on it does, so delete modules on every rank at the
same point (``del model; gc.collect()``), or one rank makes a new communicator that its peers do not
(the peers' waits for it end after ``bootstrap_timeout_s`` with a named error). One that a failure
poisoned (an expired wait: failure is collective, every rank's is poisoned) is replaced.
"""

from __future__ import annotations

import threading
import weakref

import torch

NCCL_COMMS = ("own", "group")

_lock = threading.RLock()  # re-entrant: a weakref callback may run inside (garbage collection)
# key -> (weak reference to the mok._cuda.Communicator, the group). The group is held so that its id()
# is not reused by another group while the entry exists; the entry goes with the communicator.
_registry: dict[tuple, tuple] = {}


def communicator(cuda, group, device: int, wait_timeout_s: float, nccl_comm: str = "own"):
    """The mok._cuda.Communicator of `group` (None: one rank) on GPU `device` (collective when it
    is made: every rank of the group must ask for it in the same order). mok.MoE has checked its
    arguments (nccl_comm one of NCCL_COMMS, this process a member of the group)."""
    key = (None if group is None else id(group), int(device), float(wait_timeout_s), nccl_comm)
    with _lock:  # held while making one, so that two threads never make two (collective) communicators
        entry = _registry.get(key)
        comm = entry[0]() if entry is not None else None
        if comm is not None and not comm.poisoned:
            return comm
        comm = _make(cuda, group, int(device), float(wait_timeout_s), nccl_comm)
        _registry[key] = (weakref.ref(comm, lambda _ref, k=key: _forget(k, _ref)), group)
        return comm


def _forget(key, ref) -> None:
    with _lock:
        entry = _registry.get(key)
        if entry is not None and entry[0] is ref:
            del _registry[key]


def live_communicators() -> int:
    """How many communicators mok holds now (tests: one per group and device, however many modules)."""
    with _lock:
        return sum(1 for ref, _ in _registry.values() if ref() is not None)


def _make(cuda, group, device: int, wait_timeout_s: float, nccl_comm: str):
    if group is None:
        if nccl_comm != "own":
            raise ValueError("mok.MoE: nccl_comm='group' needs an EP process group (group=...), got group=None")
        return cuda.Communicator(device, 0, 1, cuda.unique_id(), wait_timeout_s)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("mok.MoE: 'group' needs torch.distributed initialized (init_process_group) in this process")
    rank, world = group.rank(), group.size()
    if nccl_comm == "group":
        comm = cuda.Communicator.adopt(_group_nccl_comm(group, device), wait_timeout_s)
        if comm.device != device:
            raise RuntimeError(f"mok.MoE: the group's NCCL communicator is on cuda:{comm.device}, the module's "
                               f"tensors on cuda:{device}")
        return comm
    # mok's own communicator: the group's first rank makes the id, the group carries it.
    payload = [cuda.unique_id() if rank == 0 else None]
    with torch.cuda.device(device):  # an NCCL group sends the object through this device
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    if not isinstance(payload[0], bytes):
        raise RuntimeError("mok.MoE: the NCCL unique id did not arrive over 'group' (got "
                           f"{type(payload[0]).__name__})")
    return cuda.Communicator(device, rank, world, payload[0], wait_timeout_s)


def _group_nccl_comm(group, device: int) -> int:
    """The address of `group`'s NCCL communicator on `device` (made by a one-element all-reduce if
    torch has not made it yet)."""
    import torch.distributed as dist

    dev = torch.device("cuda", device)
    try:
        backend = group._get_backend(dev)
    except RuntimeError as e:
        raise ValueError(f"mok.MoE: nccl_comm='group' needs an NCCL process group; this one has none for {dev} "
                         f"({e}); use nccl_comm='own'") from e
    if not hasattr(backend, "_comm_ptr"):
        raise ValueError(f"mok.MoE: nccl_comm='group' needs the group's NCCL communicator, which this torch's "
                         f"{type(backend).__name__} backend does not expose (_comm_ptr); use nccl_comm='own' (the "
                         "default), which works over any backend")
    with torch.cuda.device(dev):  # torch looks its communicator up by the current device
        ptr = backend._comm_ptr()
        if not ptr:
            dist.all_reduce(torch.zeros(1, device=dev), group=group)
            torch.cuda.synchronize(dev)
            ptr = backend._comm_ptr()
    if not ptr:
        raise RuntimeError(f"mok.MoE: the group's NCCL communicator on {dev} does not exist after a collective")
    return int(ptr)
