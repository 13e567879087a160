"""mok.MoE / mok.moe on CPU tensors (the CPU reference engine) against an eager PyTorch MoE in
float64: the output and every gradient; named argument errors; several forwards alive before
their backwards, activation checkpointing, the op's registrations (opcheck) and torch.compile."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import mok

H, I, E, K, IS, T = 128, 64, 8, 3, 64, 40


def eager_moe(x, idx, w, wg, wu, wd, sg=None, su=None, sd=None):
    """The layer's math, written out (the baseline's): float64 in, float64 out, autograd-able."""
    def ffn(v, g, u, d):
        return (F.silu(v @ g.T) * (v @ u.T)) @ d.T
    out = ffn(x, sg, su, sd) if sg is not None else torch.zeros_like(x)
    for j in range(idx.shape[1]):
        for e in range(wg.shape[0]):
            rows = (idx[:, j] == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, w[rows, j, None] * ffn(x[rows], wg[e], wu[e], wd[e]))
    return out


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(seed, idx_dtype=torch.int32, empty=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    w, idx = torch.topk(torch.softmax(logits, -1), K, -1)
    idx = idx.to(idx_dtype)
    if empty:  # some empty slots, one token with none at all
        idx[::5, K - 1] = -1
        idx[7, :] = -1
    return x, idx, w.float()


@pytest.mark.parametrize("shared", [0, IS])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_forward_and_every_gradient_match_eager_fp64(shared, idx_dtype):
    torch.manual_seed(0)
    m = mok.MoE(H, I, E, K, shared, init_std=0.1)
    x, idx, w = make_inputs(1, idx_dtype)
    x.requires_grad_()
    w.requires_grad_()
    out = m(x, idx, w)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out.backward(d_out)
    params = [m.w_gate, m.w_up, m.w_down] + ([m.ws_gate, m.ws_up, m.ws_down] if shared else [])
    ref_in = [t.detach().double().requires_grad_() for t in [x, w] + params]
    ref = eager_moe(ref_in[0], idx.long(), ref_in[1], *ref_in[2:])
    ref.backward(d_out.double())
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    assert rel(out, ref) < 1e-2, rel(out, ref)
    assert torch.all(out[7] == (0 if not shared else out[7]))  # a token with no routed slot
    names = ["d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_ws_gate", "d_ws_up", "d_ws_down"]
    for name, got, want in zip(names, [x.grad, w.grad] + [p.grad for p in params], ref_in):
        assert got is not None and torch.isfinite(got.float()).all(), name
        assert rel(got, want.grad) < 2e-2, (name, rel(got, want.grad))
    # Empty slots get no router-weight gradient.
    assert torch.all(w.grad[idx < 0] == 0)


def test_argument_errors_are_named():
    m = mok.MoE(H, I, E, K)
    x, idx, w = make_inputs(3, empty=False)
    bad = idx.clone()
    bad[5, 1] = E
    with pytest.raises(mok.Error, match=r"topk_idx\[5,1\]"):
        m(x, bad, w)
    bad64 = idx.to(torch.int64)
    bad64[2, 0] = 1 << 32
    with pytest.raises(mok.Error, match=r"topk_idx\[2,0\]"):
        m(x, bad64, w)
    for value in (float("nan"), float("inf"), -0.5):
        badw = w.clone()
        badw[4, 2] = value
        with pytest.raises(mok.Error, match=r"topk_w\[4,2\]"):
            m(x, idx, badw)
    with pytest.raises(mok.Error, match="'x'"):
        m(x.float(), idx, w)
    with pytest.raises(mok.Error, match="topk_w"):
        m(x, idx, w[:, :2])
    with pytest.raises(TypeError, match="unknown config knob"):
        mok.MoE(H, I, E, K, fwd_comm_smz=8)
    with pytest.raises(ValueError, match="'hidden'"):
        mok.MoE(100, I, E, K)
    with pytest.raises(ValueError, match="'top_k'"):
        mok.MoE(H, I, E, E + 1)


def grads_of(m, steps):
    """Gradients after the given (x, idx, w) steps: all forwards first, backwards in reverse."""
    m.zero_grad()
    outs = [m(x, idx, w) for x, idx, w in steps]
    for o in reversed(outs):
        o.float().square().sum().backward()
    return [p.grad.clone() for p in m.parameters()]


def test_microbatches_alive_at_once_and_checkpointing():
    torch.manual_seed(4)
    m = mok.MoE(H, I, E, K, IS, init_std=0.1)
    steps = [make_inputs(10 + s) for s in range(3)]
    together = grads_of(m, steps)
    one_by_one = [torch.zeros_like(g) for g in together]
    for s in steps:
        for acc, g in zip(one_by_one, grads_of(m, [s])):
            acc += g.float()
    for a, b in zip(together, one_by_one):
        assert rel(a, b) < 1e-2
    m.zero_grad()
    x, idx, w = steps[0]
    x = x.clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(m, x, idx, w, use_reentrant=False).float().square().sum().backward()
    ck = [p.grad.clone() for p in m.parameters()]
    plain = grads_of(m, [steps[0]])
    for a, b in zip(ck, plain):
        assert torch.equal(a, b)  # recomputation gives the same bits


def test_op_registrations_pass_opcheck():
    torch.manual_seed(5)
    m = mok.MoE(H, I, E, K, IS)
    x, idx, w = make_inputs(6)
    args = (x.requires_grad_(), idx, w.requires_grad_(), m.w_gate, m.w_up, m.w_down, m.ws_gate, m.ws_up, m.ws_down)
    torch.library.opcheck(torch.ops.mok.moe_forward.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compile_fullgraph_traces_a_block():
    torch.manual_seed(7)
    m = mok.MoE(H, I, E, K, IS)
    router = torch.nn.Linear(H, E, dtype=torch.bfloat16)

    def block(x):
        idx, w = mok.route(router(x), K)
        return x + m(x, idx, w)

    x = make_inputs(8)[0]
    eager = block(x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(eager, compiled)


def test_module_repr_names_the_shape_and_footprint():
    r = repr(mok.MoE(H, I, E, K, IS))
    assert "hidden=128" in r and "ep_size=1" in r and "MiB" in r


def test_memory_plan_is_the_planners():
    m = mok.MoE(2048, 768, 128, 8, share_workspace=False, workspace_budget_bytes=0)  # Qwen3-30B-A3B, EP 1, resident
    plan = m.memory_plan(8192)
    assert plan["total"] == sum(v for k, v in plan.items() if k not in ("total", "saved", "workspace"))
    assert 1.6e9 < plan["total"] < 1.8e9, plan["total"]  # 1.72 GB (tests/cpu/test_memory_plan.cpp)
    assert plan["gu"] > 0 and plan["window.combine"] == 8192 * 8 * 2048 * 2 and plan["workspace"] == 0
    with pytest.raises(mok.Error, match="top_k"):  # the planner refuses what the layer would
        mok._cpu.plan_memory(64, 2048, 768, 8, 9)
    # The knobs reach the planner: a ring below the worst case (the backward over windows) keeps
    # the activation budget's gate/up rows (4I bytes each), none with full recompute; the shared
    # workspace is marked; an unknown knob is named.
    mb = 2048 * 16  # a multiple of every minibatch the planner may choose here (128-row tiles)
    windows = mok.MoE(2048, 768, 128, 8, macrobatch_tokens=mb, activation_budget_bytes=4 * 768 * 1024 * 10,
                      share_workspace=True).memory_plan(8192)
    assert windows["gu_saved"] == 10 * 1024 * 4 * 768 and windows["workspace"] > 0
    assert windows["total"] < plan["total"]
    recompute = mok.MoE(2048, 768, 128, 8, macrobatch_tokens=mb, activation_budget_bytes=0,
                        share_workspace=False).memory_plan(8192)
    assert "gu_saved" not in recompute and recompute["workspace"] == 0
    # The training mode in one knob: the ring that fits a 2 GB shared workspace.
    training = mok.MoE(2048, 768, 128, 8).memory_plan(8192)  # the default: the training mode
    assert 0 < training["workspace"] <= 2 * 10**9 and training["gu_saved"] > 0
    assert training["total"] - training["workspace"] < plan["total"] / 4
    with pytest.raises(mok.Error, match="no_such_knob"):
        mok._cpu.plan_memory(64, 2048, 768, 128, 8, config={"no_such_knob": "1"})


def test_training_example_matches_the_eager_model():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_moe.py"
    spec = importlib.util.spec_from_file_location("train_moe", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    mok_losses, eager_losses, diff = example.main(["--steps", "3", "--tokens", "64", "--layers", "2"])
    assert len(mok_losses) == 3 and all(torch.isfinite(torch.tensor(mok_losses)))
    assert diff < 2e-2, (mok_losses, eager_losses)
