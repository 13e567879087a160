"""Trains a small stack of MoE blocks on synthetic data twice — with mok.MoE and with the same
model using an eager PyTorch MoE layer (the baseline's math) — from the same initial weights, and
prints both loss curves, their largest relative difference and tokens/s.

Each block: x + MoE(RMSNorm(x)) with a linear + softmax top-k router. On CPU tensors mok runs its
CPU reference engine (the spec), so this runs anywhere; sizes are small by default.

    python examples/train_moe.py --steps 5 --tokens 256
"""

import argparse
import copy
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


def build(args, eager: bool, seed: int):
    torch.manual_seed(seed)
    blocks = []
    for _ in range(args.layers):
        layer = mok.MoE(args.hidden, args.intermediate, args.experts, args.top_k, args.shared, init_std=0.05)
        blocks.append(Block(EagerMoE(layer) if eager else layer, args.hidden, args.experts, args.top_k))
    return torch.nn.Sequential(*blocks)


def train(model, data, steps, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        x, target = data[step % len(data)]
        loss = F.mse_loss(model(x).float(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--shared", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16),
             torch.randn(args.tokens, args.hidden, generator=g)) for _ in range(4)]
    mok_model = build(args, eager=False, seed=0)
    eager_model = build(args, eager=True, seed=0)
    eager_model.load_state_dict(copy.deepcopy(mok_model.state_dict()))  # the same start
    mok_losses, mok_s = train(mok_model, data, args.steps, args.lr)
    eager_losses, eager_s = train(eager_model, data, args.steps, args.lr)
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mok_losses, eager_losses))
    for s, (a, b) in enumerate(zip(mok_losses, eager_losses)):
        print(f"step {s}: loss mok {a:.6f}  eager {b:.6f}")
    n = args.tokens * args.steps
    print(f"tokens/s: mok {n / mok_s:.0f}, eager {n / eager_s:.0f} (device: cpu)")
    print(f"largest relative loss difference: {diff:.2e}")
    return mok_losses, eager_losses, diff


if __name__ == "__main__":
    main()
