"""Process groups for the EP tests: a real torch.distributed group of one rank in this process
(so that the group path runs on one machine), and a stand-in with a size and a rank for the
argument checks."""

import os
import tempfile

import torch
import torch.distributed as dist


class FakeGroup:
    """size() and rank() of a ProcessGroup, nothing else (argument checks that need no peers)."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def world_of_one():
    """The default process group of this process as a world of one rank (initialized once: gloo for
    CPU tensors, and NCCL for CUDA ones where a GPU exists), over a file store."""
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="mok-pg-"), "store")
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)
    return dist.group.WORLD
