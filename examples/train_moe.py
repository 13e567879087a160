"""Trains a small stack of MoE blocks on synthetic data twice — with mok.MoE and with the same
model using an eager PyTorch MoE layer (the baseline's math) — from the same initial weights, and
prints both loss curves, their largest relative difference and tokens/s.

Each block: x + MoE(RMSNorm(x)) with a linear + softmax top-k router. On CPU tensors mok runs its
CPU reference engine (the spec), so this runs anywhere; sizes are small by default.

    python examples/train_moe.py --steps 5 --tokens 256
    python examples/train_moe.py --device cuda                        # the GPU layer, EP 1
    torchrun --nproc-per-node 8 examples/train_moe.py --experts 64    # EP 8: one rank per GPU

Under torchrun (WORLD_SIZE > 1) the ranks form one EP group: each rank's mok.MoE holds E / W of
the experts and its own batch of tokens, while the eager model holds every expert on every rank.
Both train data-parallel over the group: the gradients of what every rank holds a copy of (the
norms, the routers, the shared expert; in the eager model the experts too) are summed over the
ranks before each step, and mok's routed experts' gradients already hold every rank's tokens. So
the two models train the same weights from the same start, rank by rank.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F

import mok


class EagerMoE(torch.nn.Module):
    """The layer written out in PyTorch ops, with mok.MoE's parameters (copied in)."""

    def __init__(self, ref: mok.MoE):
        super().__init__()
        for name, p in ref.named_parameters():
            self.register_parameter(name, torch.nn.Parameter(p.detach().clone()))
        self.shared = ref.shared_intermediate > 0

    def forward(self, x, topk_idx, topk_w):
        def ffn(v, g, u, d):
            return (F.silu(v @ g.T) * (v @ u.T)) @ d.T
        out = ffn(x, self.ws_gate, self.ws_up, self.ws_down) if self.shared else torch.zeros_like(x)
        for j in range(topk_idx.shape[1]):
            for e in range(self.w_gate.shape[0]):
                rows = (topk_idx[:, j] == e).nonzero().flatten()
                if rows.numel():
                    y = ffn(x[rows], self.w_gate[e], self.w_up[e], self.w_down[e])
                    out = out.index_add(0, rows, (topk_w[rows, j, None] * y.float()).to(x.dtype))
        return out


class Block(torch.nn.Module):
    def __init__(self, moe: torch.nn.Module, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, dtype=torch.bfloat16)
        self.router = torch.nn.Linear(hidden, experts, bias=False, dtype=torch.bfloat16)
        self.moe, self.top_k = moe, top_k

    def forward(self, x):
        h = self.norm(x)
        idx, w = mok.route(self.router(h), self.top_k)
        return x + self.moe(h, idx, w)


def ep_group():
    """(group, rank, world): torchrun's ranks as one EP group (NCCL, one GPU each), or (None, 0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None, 0, 1
    import torch.distributed as dist
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
    return dist.group.WORLD, dist.get_rank(), world


def build(args, eager: bool, group=None, rank: int = 0, world: int = 1):
    """The model from seed 0, the same on every rank and for both kinds: each layer's experts made
    in full on the CPU, mok's rank taking its E / world of them."""
    torch.manual_seed(0)
    blocks = []
    el = args.experts // world
    for _ in range(args.layers):
        full = mok.MoE(args.hidden, args.intermediate, args.experts, args.top_k, args.shared, init_std=0.05)
        if eager:
            moe = EagerMoE(full)
        elif world == 1 and args.device == "cpu":
            moe = full
        else:
            moe = mok.MoE(args.hidden, args.intermediate, args.experts, args.top_k, args.shared, group=group,
                          device=args.device)
            with torch.no_grad():
                for name, p in moe.named_parameters():
                    src = getattr(full, name)
                    p.copy_(src[rank * el:(rank + 1) * el] if name in ("w_gate", "w_up", "w_down") else src)
        blocks.append(Block(moe, args.hidden, args.experts, args.top_k))
    return torch.nn.Sequential(*blocks).to(args.device)


def sum_gradients(model, group, routed_too: bool):
    """Data parallelism over the EP group: the gradients of the weights every rank holds a copy of
    summed over the ranks (mok's routed experts' are complete already: routed_too False)."""
    if group is None:
        return
    import torch.distributed as dist
    for name, p in model.named_parameters():
        if p.grad is not None and (routed_too or name.rsplit(".", 1)[-1] not in ("w_gate", "w_up", "w_down")):
            dist.all_reduce(p.grad, group=group)


def train(model, data, steps, lr, group=None, routed_too=False):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        x, target = data[step % len(data)]
        loss = F.mse_loss(model(x).float(), target)
        opt.zero_grad()
        loss.backward()
        sum_gradients(model, group, routed_too)
        opt.step()
        losses.append(loss.item())
    if data[0][0].is_cuda:
        torch.cuda.synchronize()
    return losses, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--shared", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank and step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: cuda, each rank's GPU)")
    p.add_argument("--check", type=float, default=0.0,
                   help="exit with status 1 when the largest relative loss difference exceeds this (0: never)")
    args = p.parse_args(argv)
    group, rank, world = ep_group()
    if world > 1:
        args.device = "cuda"
        if args.experts % world:
            p.error(f"--experts ({args.experts}) must be divisible by the number of ranks ({world})")
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens
    data = [(torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16).to(args.device),
             torch.randn(args.tokens, args.hidden, generator=g).to(args.device)) for _ in range(4)]
    mok_model = build(args, eager=False, group=group, rank=rank, world=world)
    eager_model = build(args, eager=True, group=group, rank=rank, world=world)
    mok_losses, mok_s = train(mok_model, data, args.steps, args.lr, group)
    eager_losses, eager_s = train(eager_model, data, args.steps, args.lr, group, routed_too=True)
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mok_losses, eager_losses))
    if group is not None:  # the largest over the ranks
        import torch.distributed as dist
        t = torch.tensor([diff], device=args.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        diff = t.item()
    n = args.tokens * args.steps * world
    if rank == 0:
        for s, (a, b) in enumerate(zip(mok_losses, eager_losses)):
            print(f"step {s}: loss mok {a:.6f}  eager {b:.6f}" + (" (rank 0)" if world > 1 else ""))
        where = f"{args.device}, EP {world}" if world > 1 else args.device
        print(f"tokens/s: mok {n / mok_s:.0f}, eager {n / eager_s:.0f} (device: {where})")
        print(f"largest relative loss difference: {diff:.2e}" + (" (over the ranks)" if world > 1 else ""))
    failed = args.check > 0 and not diff <= args.check
    if failed and rank == 0:
        print(f"FAIL: the losses differ by more than {args.check:.1e}")
    if group is not None:
        del mok_model  # mok's layers before the group
        import torch.distributed as dist
        dist.destroy_process_group()
    if failed:
        raise SystemExit(1)
    return mok_losses, eager_losses, diff


if __name__ == "__main__":
    main()
