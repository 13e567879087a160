"""mok.MoE's inputs on CPU tensors: activations with leading dimensions ([B, S, H], as a training stack
holds them) are the flattened tokens; fp32 activations under a bf16 autocast and router weights in
bf16 are taken as the layer takes them; the router's tensors must match x's leading dimensions and
the module's top_k, with errors that name the argument on CPU as on CUDA (a model unit-tested on CPU
must not meet a new shape error on the GPU)."""

import pytest
import torch

import mok

H, I, E, K = 128, 64, 8, 2
B, S = 3, 5


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g).to(torch.bfloat16)
    w, idx = torch.topk(torch.softmax(torch.randn(B, S, E, generator=g), -1), K, -1)
    return x, idx.to(torch.int32), w.float()


def test_leading_dimensions_are_the_flattened_tokens():
    torch.manual_seed(0)
    m = mok.MoE(H, I, E, K, init_std=0.1)
    x, idx, w = inputs(1)
    d_out = torch.randn(B, S, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def run(xs, ids, ws, d):
        m.zero_grad()
        xs = xs.clone().requires_grad_()
        ws = ws.clone().requires_grad_()
        out = m(xs, ids, ws)
        out.backward(d)
        return out, xs.grad, ws.grad, [p.grad.clone() for p in m.parameters()]

    out3, dx3, dw3, grads3 = run(x, idx, w, d_out)
    out2, dx2, dw2, grads2 = run(x.reshape(-1, H), idx.reshape(-1, K), w.reshape(-1, K), d_out.reshape(-1, H))
    assert out3.shape == (B, S, H) and dx3.shape == (B, S, H) and dw3.shape == (B, S, K)
    assert torch.equal(out3.reshape(-1, H), out2)
    assert torch.equal(dx3.reshape(-1, H), dx2)
    assert torch.equal(dw3.reshape(-1, K), dw2)
    for a, b in zip(grads3, grads2):
        assert torch.equal(a, b)
    # One token on its own ([H], no leading dimension) is a batch of one.
    one = m(x[0, 0], idx[0, 0], w[0, 0])
    assert one.shape == (H,) and torch.equal(one, out2[0].detach())


def test_a_subclass_forward_runs_once_per_call():
    # The flattening and the padding must not go through forward again (a subclass's or a hook's).
    class Scaled(mok.MoE):
        def forward(self, x, topk_idx, topk_w):
            return 0.5 * super().forward(x, topk_idx, topk_w)

    torch.manual_seed(0)
    plain = mok.MoE(H, I, E, K, init_std=0.1)
    for kw in ({}, {"max_tokens": 20}):
        scaled = Scaled(H, I, E, K, **kw)
        scaled.load_state_dict(plain.state_dict())
        x, idx, w = inputs(2)
        assert torch.equal(scaled(x, idx, w), 0.5 * plain(x, idx, w))


def test_router_weights_in_bf16_are_taken_as_fp32():
    torch.manual_seed(0)
    m = mok.MoE(H, I, E, K, init_std=0.1)
    x, idx, w = inputs(4)
    w16 = w.to(torch.bfloat16).requires_grad_()
    out16 = m(x, idx, w16)
    w32 = w16.detach().float().requires_grad_()
    out32 = m(x, idx, w32)
    assert torch.equal(out16, out32)
    d_out = torch.randn(B, S, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out16.backward(d_out)
    out32.backward(d_out)
    assert w16.grad.dtype == torch.bfloat16 and torch.equal(w16.grad, w32.grad.to(torch.bfloat16))


def test_fp32_activations_under_bf16_autocast_run_in_bf16():
    torch.manual_seed(0)
    m = mok.MoE(H, I, E, K, init_std=0.1)
    x, idx, w = inputs(11)
    x32 = x.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x32, idx, w)
    x16 = x.clone().requires_grad_()
    want = m(x16, idx, w)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    d_out = torch.randn(B, S, H, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    out.backward(d_out)
    want.backward(d_out)
    assert x32.grad.dtype == torch.float32 and torch.equal(x32.grad, x16.grad.float())
    # Outside autocast an fp32 x is refused by name.
    with pytest.raises(mok.Error, match="'x'"):
        m(x.float(), idx, w)


def test_shape_errors_name_the_argument():
    m = mok.MoE(H, I, E, K)
    x, idx, w = inputs(3)
    with pytest.raises(mok.Error, match=r"'x': must be \[\.\.\., H\] with H = 128"):
        m(x[..., :64], idx, w)
    # A top_k other than the module's is refused on CPU as the GPU layer refuses it.
    with pytest.raises(mok.Error, match=r"'topk_idx': .*\[3, 5, 2\], got \[3, 5, 1\]"):
        m(x, idx[..., :1], w[..., :1])
    with pytest.raises(mok.Error, match=r"'topk_w': .*got \[15, 2\]"):
        m(x, idx, w.reshape(-1, K))
    with pytest.raises(mok.Error, match=r"'topk_idx': .*got \[3, 4, 2\]"):
        m(x, idx[:, :4], w)


def test_compile_fullgraph_traces_a_block_on_batch_and_sequence():
    # The shape a training stack's block has: [B, S, H] activations, a bf16 router.
    torch.manual_seed(7)
    m = mok.MoE(H, I, E, K)
    router = torch.nn.Linear(H, E, dtype=torch.bfloat16)

    def block(x):
        idx, w = mok.route(router(x), K)
        return x + m(x, idx, w.to(torch.bfloat16))

    x = inputs(8)[0]
    eager = block(x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    assert compiled.shape == (B, S, H) and torch.equal(eager, compiled)


def test_max_tokens_runs_every_call_padded_with_the_unpadded_bits():
    # One module per setting, the same weights: calls of 15 and 10 tokens (and [B, S] ones) on the
    # module capped at 24 tokens give the uncapped module's output and gradients, bit for bit.
    torch.manual_seed(3)
    free = mok.MoE(H, I, E, K, 64, init_std=0.1)
    capped = mok.MoE(H, I, E, K, 64, max_tokens=24)
    capped.load_state_dict(free.state_dict())
    assert "max_tokens=24" in repr(capped)
    x3, idx3, w3 = inputs(6)
    for x, idx, w in ((x3.reshape(-1, H), idx3.reshape(-1, K), w3.reshape(-1, K)),
                      (x3.reshape(-1, H)[:10], idx3.reshape(-1, K)[:10], w3.reshape(-1, K)[:10]),
                      (x3, idx3, w3)):
        d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        got = []
        for m in (free, capped):
            m.zero_grad()
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = m(xs, idx, ws)
            out.backward(d_out)
            got.append([out, xs.grad, ws.grad] + [p.grad for p in m.parameters()])
        assert got[1][0].shape == x.shape
        for a, b in zip(*got):
            assert torch.equal(a, b)


def test_max_tokens_is_checked():
    x, idx, w = inputs(9)
    m = mok.MoE(H, I, E, K, max_tokens=14)
    with pytest.raises(mok.Error, match=r"'x': 15 tokens, more than the module's max_tokens = 14"):
        m(x, idx, w)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="'max_tokens'"):
            mok.MoE(H, I, E, K, max_tokens=bad)
