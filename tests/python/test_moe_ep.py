"""mok.MoE over an EP group of two processes (torch.distributed: gloo on CPU, NCCL on CUDA), one GPU
each: every rank holds half of the experts, and its output and gradients are checked against the
CPU reference engine holding every expert over every rank's tokens at once; the shared expert's
gradients (a partial over each rank's tokens) summed over the group; a second step bitwise equal
to the first; both ways of making mok's communicator (its own over the group, the group's NCCL
one). Needs two GPUs: skipped otherwise (the 2-GPU issue runs it)."""

import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 GPUs")

H, I, E, K, IS, T, W = 256, 128, 8, 2, 128, 256, 2
NAMES = ["out", "d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_ws_gate", "d_ws_up", "d_ws_down"]


def rank_inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), K, -1)
    idx = idx.to(torch.int32)
    idx[::7, 1] = -1
    d_out = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x, idx, w.float(), d_out


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _rank_main(rank, store, nccl_comm, result):
    import gc

    import torch.distributed as dist

    import mok
    m = None
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{store}", rank=rank, world_size=W,
                            device_id=torch.device("cuda", rank))
    try:
        torch.manual_seed(0)
        full = mok.MoE(H, I, E, K, IS, init_std=0.05)  # the same on every rank: the reference's weights
        el = E // W
        mine = slice(rank * el, (rank + 1) * el)
        m = mok.MoE(H, I, E, K, IS, device="cuda", group=dist.group.WORLD, nccl_comm=nccl_comm)
        with torch.no_grad():
            for name in ("w_gate", "w_up", "w_down"):
                getattr(m, name).copy_(getattr(full, name)[mine])
            for name in ("ws_gate", "ws_up", "ws_down"):
                getattr(m, name).copy_(getattr(full, name))
        every = [rank_inputs(r) for r in range(W)]
        x, idx, w, d_out = (t.cuda() for t in every[rank])
        steps = []
        for _ in range(2):
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            m.zero_grad(set_to_none=True)
            out = m(xr, idx, wr)
            out.backward(d_out)
            torch.cuda.synchronize()
            m.check()
            shared = [p.grad.clone() for p in (m.ws_gate, m.ws_up, m.ws_down)]
            for s in shared:
                dist.all_reduce(s)  # the shared expert's partials over the group
            steps.append([out, xr.grad, wr.grad, m.w_gate.grad, m.w_up.grad, m.w_down.grad] + shared)
        # The reference: every expert over every rank's tokens in one call (the CPU engine).
        xa = torch.cat([e[0] for e in every]).requires_grad_()
        wa = torch.cat([e[2] for e in every]).requires_grad_()
        ref = full(xa, torch.cat([e[1] for e in every]), wa)
        ref.backward(torch.cat([e[3] for e in every]))
        rows = slice(rank * T, (rank + 1) * T)
        want = [ref[rows], xa.grad[rows], wa.grad[rows], full.w_gate.grad[mine], full.w_up.grad[mine],
                full.w_down.grad[mine], full.ws_gate.grad, full.ws_up.grad, full.ws_down.grad]
        errors = {n: rel(a, b) for n, a, b in zip(NAMES, steps[0], want)}
        same = all(torch.equal(a, b) for a, b in zip(steps[0], steps[1]))
        torch.save({"errors": errors, "bitwise_second_step": same, "ep_size": m.ep_size}, f"{result}.{rank}")
    finally:
        m = None  # mok's layer and communicator before the group (nccl_comm="group": the group's NCCL one)
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.parametrize("nccl_comm", ["own", "group"])
def test_two_ranks_match_the_reference_with_every_expert(nccl_comm):
    pytest.importorskip("mok._cuda")
    tmp = tempfile.mkdtemp(prefix="mok-ep-")
    store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result")
    ctx = mp.start_processes(_rank_main, args=(store, nccl_comm, result), nprocs=W, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 600
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish within 600 s")
    for rank in range(W):
        r = torch.load(f"{result}.{rank}")
        assert r["ep_size"] == W
        assert r["bitwise_second_step"], rank
        for name, err in r["errors"].items():
            assert err < 1e-2, (rank, name, err)
