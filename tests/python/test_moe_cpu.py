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
    assert "hidden=128" in r and "ep_size=1" in r and "MiB" in r and "main_grad" not in r
    m = mok.MoE(H, I, E, K, IS, fuse_wgrad_accumulation=True)
    assert m.main_grad_bytes() == 4 * 3 * E * I * H
    assert f"main_grad {4 * 3 * E * I * H / 2**20:.1f} MiB (fp32)" in repr(m)


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


def test_fp8_keep_weight_codes_moves_the_backward_codes_out_of_the_workspace():
    # Config::fp8_keep_weight_codes_t through mok.MoE: the FP8 backward's weight codes become the
    # layer's own (made with the forward's), not the shared workspace's; refused by name without FP8.
    per_call = mok.MoE(2048, 768, 128, 8, precision="fp8").memory_plan(8192)
    kept = mok.MoE(2048, 768, 128, 8, precision="fp8", fp8_keep_weight_codes_t=True).memory_plan(8192)
    codes = kept["fp8_bwd_weights"]
    assert codes == per_call["fp8_bwd_weights"] >= 3 * 128 * 768 * 2048  # one byte per weight, plus scales
    assert kept["workspace"] == per_call["workspace"] - codes
    assert kept["total"] == per_call["total"]
    with pytest.raises(mok.Error, match="fp8_keep_weight_codes_t"):
        mok.MoE(2048, 768, 128, 8, fp8_keep_weight_codes_t=True).memory_plan(8192)


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


def fp8_round(v, block):
    """v [rows, cols] (float32) as its block-scaled E4M3 codes decode (the spec's recipe 1: per block
    s = amax / 448, 1 for an all-zero block; codes e4m3(v * (1 / s)), round to nearest even);
    block = (rows, cols) of a block."""
    r, c = v.shape
    b = v.reshape(r // block[0], block[0], c // block[1], block[1])
    amax = b.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (b * (1.0 / s)).to(torch.float8_e4m3fn)
    return (q.float() * s).reshape(r, c)


def eager_moe_fp8(x, idx, w, wg, wu, wd):
    """The FP8 forward's math in float32 with the spec's rounding points: x per 1x128, each weight
    matrix per 128x128, h per 1x128 before FC2; g, u, h and y rounded to bf16 as the layer does."""
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    xq = fp8_round(x.float(), (1, 128))
    out = torch.zeros_like(xq)
    for e in range(wg.shape[0]):
        g_, u_, d_ = (fp8_round(t.float(), (128, 128)) for t in (wg[e], wu[e], wd[e]))
        for j in range(idx.shape[1]):
            rows = (idx[:, j] == e).nonzero().flatten()
            if rows.numel():
                g, u = bf(xq[rows] @ g_.T), bf(xq[rows] @ u_.T)
                h = fp8_round(bf(F.silu(g) * u), (1, 128))
                out = out.index_add(0, rows, w[rows, j, None] * bf(h @ d_.T))
    return out


H8, I8, E8, K8 = 256, 128, 4, 2  # the FP8 tests' layer: H and I whole 128-blocks


def fp8_and_bf16_layers(T, seed):
    """An FP8 mok.MoE and a bf16 one with the same weights, x [T, H8] bf16, top-k routing (int32
    ids, float32 weights) and the generator that made them (for more inputs)."""
    torch.manual_seed(seed)
    m8 = mok.MoE(H8, I8, E8, K8, init_std=0.1, precision="fp8")
    mb = mok.MoE(H8, I8, E8, K8, init_std=0.1)
    mb.load_state_dict(m8.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H8, generator=g).to(torch.bfloat16)
    w, idx = torch.topk(torch.softmax(torch.randn(T, E8, generator=g), -1), K8, -1)
    return m8, mb, x, idx.to(torch.int32), w.float(), g


def test_fp8_forward_on_cpu_tensors_is_the_fp8_recipe():
    T8 = 24
    m8, mb, x, idx, w, _ = fp8_and_bf16_layers(T8, 3)
    idx[5, 1] = -1
    with torch.no_grad():
        out8, out16 = m8(x, idx, w), mb(x, idx, w)
        out8_again = m8(x, idx, w)
    want = eager_moe_fp8(x, idx.long(), w, m8.w_gate, m8.w_up, m8.w_down)
    err, err_bf16 = rel(out8, want), rel(out16, want)
    print(f"[fp8 cpu] rel err vs the float32 FP8 emulation {err:.2e}; the bf16 layer's output {err_bf16:.2e} from it")
    assert out8.dtype == torch.bfloat16 and torch.equal(out8, out8_again)
    assert err < 1e-2, err  # the recipe, to accumulation order and bf16 rounding boundaries
    assert err_bf16 > 2e-2, err_bf16  # ... and FP8 was applied (E4M3 costs ~6% on random data)
    # a bad precision is named at construction and at the functional op
    with pytest.raises(ValueError, match="'precision' must be"):
        mok.MoE(H8, I8, E8, K8, precision="fp16")
    with pytest.raises(ValueError, match="'precision' must be"):
        mok.moe(x, idx, w, m8.w_gate, m8.w_up, m8.w_down, precision="e5m2")
    # the planner's FP8 layer: the weights' codes and scales on top (its memory_plan)
    assert m8.memory_plan(T8)["fp8_weights"] == 3 * E8 * I8 * H8 + 3 * E8 * (I8 // 128) * (H8 // 128) * 4


def eager_moe_q_backward(x, idx, w, wg, wu, wd, dy, q):
    """A quantized recipe's backward in float32 with the spec's rounding points, written
    independently of the engine; q (FP8_RECIPE, MX_RECIPE) says how each GEMM reads its operands:
    q.rows(v) activation rows along K (x, d_out), q.weight(w) the forward's weight rows,
    q.down_dgrad(w_down) FC2's dgrad weights, q.fc1_dgrad(dg, du, w_gate, w_up) FC1's dgrad (the
    d_x rows, bf16), q.tokens(v) a weight gradient's operand blocked along the tokens (each
    expert's rows in token order). h is the bf16 h. Returns d_x, d_topk_w, d_w_gate, d_w_up, d_w_down."""
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    E, I, H = wg.shape
    xf, dyf = x.float(), dy.float()
    xq = q.rows(xf)
    dx, dw = torch.zeros_like(xf), torch.zeros(w.shape)
    dwg, dwu, dwd = torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I)
    for e in range(E):
        g_w, u_w = q.weight(wg[e].float()), q.weight(wu[e].float())
        rows, js = (idx == e).nonzero(as_tuple=True)  # token order (t, then j)
        if rows.numel() == 0:
            continue
        wr = w[rows, js]
        g, u = bf(xq[rows] @ g_w.T), bf(xq[rows] @ u_w.T)
        h = bf(F.silu(g) * u)
        gr = bf(q.rows(dyf[rows]) @ q.down_dgrad(wd[e].float()))
        dh = bf(wr[:, None] * gr)
        sg = torch.sigmoid(g)
        du = bf(g * sg * dh)
        dg = bf(sg * (1 + g * (1 - sg)) * u * dh)
        dx = dx.index_add(0, rows, q.fc1_dgrad(dg, du, wg[e].float(), wu[e].float()))
        dw[rows, js] = (gr * h).sum(1)
        hw = bf(wr[:, None] * h)
        dwd[e] = bf(q.tokens(dyf[rows]).T @ q.tokens(hw))
        dwg[e] = bf(q.tokens(dg).T @ q.tokens(xf[rows]))
        dwu[e] = bf(q.tokens(du).T @ q.tokens(xf[rows]))
    return dx, dw, dwg, dwu, dwd


def padded_blocks(v, n, round_fn):
    """v [rows, cols] rounded per n x 1 block down the rows, rows padded with zeros."""
    r = v.shape[0]
    return round_fn(torch.cat([v, torch.zeros((-r) % n, v.shape[1])]), (n, 1))[:r]


def pair_round(a, b, block):
    """a, b [n, m] quantized together in blocks of 64 rows of a then the same 64 rows of b (the
    packed gate/up order of FC1's dgrad)."""
    n, m = a.shape
    st = torch.cat([a.reshape(n // 64, 64, m), b.reshape(n // 64, 64, m)], 1).reshape(2 * n, m)
    st = fp8_round(st, block).reshape(n // 64, 128, m)
    return st[:, :64].reshape(n, m), st[:, 64:].reshape(n, m)


def _fp8_fc1_dgrad(dg, du, wg, wu):
    # [d_g d_u] per 1 x 128 of 64 gate + 64 up values of the same columns, against [W_gate; W_up]
    # in the same blocks (64 gate + 64 up rows x 128 columns per scale)
    gt, ut = pair_round(wg, wu, (128, 128))
    dgq, duq = pair_round(dg.T, du.T, (128, 1))
    return (dgq.T @ gt + duq.T @ ut).to(torch.bfloat16).float()


class FP8_RECIPE:  # recipe 1: 1 x 128 rows, 128 x 128 weights, 128 x 1 token blocks
    rows = staticmethod(lambda v: fp8_round(v, (1, 128)))
    weight = down_dgrad = staticmethod(lambda w: fp8_round(w, (128, 128)))
    fc1_dgrad = staticmethod(_fp8_fc1_dgrad)
    tokens = staticmethod(lambda v: padded_blocks(v, 128, fp8_round))


def mx_round(v, block):
    """v [rows, cols] (float32) as its MXFP8 codes decode (OCP MX, E4M3 elements): per block of 32
    (block = (1, 32) along rows or (32, 1) down columns) X = 2^(floor(log2 amax) - 8), clamped to
    [2^-127, 2^127] (an all-zero block: 2^-127); elements e4m3(v / X) clamped to +-448, round to
    nearest even."""
    r, c = v.shape
    b = v.reshape(r // block[0], block[0], c // block[1], block[1])
    amax = b.abs().amax(dim=(1, 3), keepdim=True)
    _, ex = torch.frexp(amax)  # amax = m 2^ex, m in [0.5, 1): floor(log2 amax) = ex - 1, exactly
    e = torch.where(amax > 0, ex.float() - 1 - 8, torch.full_like(amax, -127.0)).clamp(-127, 127)
    q = (b * torch.exp2(-e)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.float() * torch.exp2(e)).reshape(r, c)


class MX_RECIPE:  # recipe 2: MX blocks of 32 along each GEMM's K
    rows = weight = staticmethod(lambda v: mx_round(v, (1, 32)))
    down_dgrad = staticmethod(lambda w: mx_round(w, (32, 1)))  # W_down [H, I] along H
    fc1_dgrad = staticmethod(lambda dg, du, wg, wu: (mx_round(dg, (1, 32)) @ mx_round(wg, (32, 1)) +
                                                     mx_round(du, (1, 32)) @ mx_round(wu, (32, 1)))
                             .to(torch.bfloat16).float())
    tokens = staticmethod(lambda v: padded_blocks(v, 32, mx_round))


def module_grads(m, x0, idx, w0, dy):
    """[d_x, d_topk_w, d_w_gate, d_w_up, d_w_down] of one forward + backward of module m."""
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    m.zero_grad()
    m(x, idx, w).backward(dy)
    return [x.grad, w.grad, m.w_gate.grad, m.w_up.grad, m.w_down.grad]


def test_fp8_backward_on_cpu_tensors_is_the_fp8_recipe():
    """mok.MoE(precision="fp8") trains on CPU tensors: every gradient against the independent
    float32 emulation of recipe 1's backward, and FP8 visibly applied (the bf16 layer's gradients
    are further away); two backwards give the same bits."""
    T8 = 40
    m8, mb, x0, idx, w0, g = fp8_and_bf16_layers(T8, 5)
    dy = torch.randn(T8, H8, generator=g).to(torch.bfloat16)

    grads = lambda m: module_grads(m, x0, idx, w0, dy)  # noqa: E731

    got, again, base = grads(m8), grads(m8), grads(mb)
    want = eager_moe_q_backward(x0, idx.long(), w0, m8.w_gate.detach(), m8.w_up.detach(), m8.w_down.detach(), dy,
                                FP8_RECIPE)
    for name, a, b, c, ref in zip(("d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"), got, again, base, want):
        assert torch.equal(a, b), name  # deterministic
        err, err_bf16 = rel(a, ref), rel(c, ref)
        print(f"[fp8 cpu backward] {name}: rel err vs the float32 emulation {err:.2e}; the bf16 layer's {err_bf16:.2e}")
        assert err < 5e-3, (name, err)  # the recipe, to accumulation order and rounding boundaries
        assert err_bf16 > 2e-2, (name, err_bf16)  # ... and FP8 was applied


def test_mxfp8_trains_on_cpu_tensors():
    """mok.MoE(precision="mxfp8") trains on CPU tensors (recipe 2's backward in the reference engine):
    every gradient against the independent float32 emulation (eager_moe_q_backward with MX_RECIPE), two
    backwards the same bits, and MX visibly applied (the bf16 layer's gradients and fp8's are
    further away)."""
    T8 = 40
    m8, mb, x0, idx, w0, g = fp8_and_bf16_layers(T8, 7)
    mx = mok.MoE(H8, I8, E8, K8, init_std=0.1, precision="mxfp8")
    mx.load_state_dict(mb.state_dict())
    dy = torch.randn(T8, H8, generator=g).to(torch.bfloat16)

    grads = lambda m: module_grads(m, x0, idx, w0, dy)  # noqa: E731

    got, again, base, fp8 = grads(mx), grads(mx), grads(mb), grads(m8)
    want = eager_moe_q_backward(x0, idx.long(), w0, mx.w_gate.detach(), mx.w_up.detach(), mx.w_down.detach(), dy,
                                MX_RECIPE)
    for name, a, b, c, f, ref in zip(("d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"), got, again, base, fp8,
                                     want):
        assert torch.equal(a, b), name  # deterministic
        err, err_bf16, err_fp8 = rel(a, ref), rel(c, ref), rel(f, ref)
        print(f"[mxfp8 cpu backward] {name}: rel err vs the float32 emulation {err:.2e}; the bf16 layer's "
              f"{err_bf16:.2e}, fp8's {err_fp8:.2e}")
        assert err < 5e-3, (name, err)  # the recipe, to accumulation order and rounding boundaries
        assert err_bf16 > 2e-2 and err_fp8 > 2e-2, (name, err_bf16, err_fp8)  # ... and MX's blocks applied


def test_fp8_weight_codes_are_remade_when_a_weight_changes():
    """The GPU layer's FP8 codes are derived from the weights: the op's binding (mok._ops._bind_weights,
    host-side, so testable here with a stand-in layer) makes them again after an in-place update
    (the version counter), for new storage, and every call for tensors that track no version
    (made under inference_mode); bf16 re-binds for new storage only."""
    from mok import _ops

    class Layer:
        def __init__(self):
            self.calls = 0

        def set_weights(self, ptrs):
            self.calls += 1

    w = [torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4), None, None, None]
    for cached, want in ((True, [1, 1, 2, 3]), (False, [1, 1, 1, 2])):
        gl, handle = Layer(), 1000 + int(cached)
        seen = []
        _ops._bind_weights(gl, handle, w, cached)  # first call: bound
        seen.append(gl.calls)
        _ops._bind_weights(gl, handle, w, cached)  # nothing changed
        seen.append(gl.calls)
        w[1].mul_(2)  # in place: a new version, the same storage
        _ops._bind_weights(gl, handle, w, cached)
        seen.append(gl.calls)
        _ops._bind_weights(gl, handle, [w[0].clone()] + w[1:], cached)  # new storage
        seen.append(gl.calls)
        _ops.unregister_gpu_layer(handle)
        assert seen == want, (cached, seen)
    with torch.inference_mode():
        wi = [torch.randn(4, 4) for _ in range(3)] + [None] * 3
    gl = Layer()
    for _ in range(3):
        _ops._bind_weights(gl, 1002, wi, True)
    _ops.unregister_gpu_layer(1002)
    assert gl.calls == 3  # no version to compare: remade every call


def test_fp8_modules_default_to_the_unfused_path_which_trains():
    """The FP8 megakernel trains only over windows of a ring below the worst case: an fp8 mok.MoE's
    GPU layer (and its memory_plan) gets forward_path "unfused" unless the module sets one, and an
    explicit "megakernel" is kept. The op's checks (host-side, so testable here with stand-in
    layers): an fp8 forward saves for a backward on the unfused path and where the layer's plan has
    the FP8 backward (register_gpu_layer's `trains`, which mok.MoE takes from its memory plan), and a
    call needing a gradient on a megakernel with a resident ring (or backward_path "fused") fp8 layer
    is refused by NotImplementedError naming the knob, before the GPU layer is called."""
    from mok import _ops

    m8 = mok.MoE(H8, I8, E8, K8, precision="fp8")
    assert m8._layer_knobs() == {"precision": "fp8", "forward_path": "unfused"}
    assert "forward_path" not in m8.config  # the module's own knobs are left as given
    assert mok.MoE(H8, I8, E8, K8, precision="mxfp8")._layer_knobs() == {"precision": "mxfp8",
                                                                        "forward_path": "unfused"}
    mk = mok.MoE(512, I8, E8, K8, precision="fp8", forward_path="megakernel")
    assert mk._layer_knobs()["forward_path"] == "megakernel"
    assert "forward_path" not in mok.MoE(H8, I8, E8, K8)._layer_knobs()  # bf16: the C++ default (megakernel)
    # The planner sees the layer's knobs: the unfused FP8 layer plans what a backward reads, the
    # FP8 megakernel nothing (tests/cpu/test_memory_plan.cpp).
    plan = m8.memory_plan(64)
    assert plan["saved"] > 0 and plan["gu"] > 0 and plan["fp8_bwd_rows"] > 0 and plan["fp8_bwd_weights"] > 0
    plan_mk = mk.memory_plan(64)
    assert plan_mk["saved"] == 0 and "gu" not in plan_mk and "fp8_bwd_rows" not in plan_mk
    # A ring below the worst case: the FP8 megakernel's plan has its backward over windows.
    mk_windows = mok.MoE(512, I8, E8, K8, precision="fp8", forward_path="megakernel", minibatch_tokens=128,
                         macrobatch_tokens=256)
    plan_w = mk_windows.memory_plan(700)
    assert plan_w["fp8_bwd_rows"] > 0 and plan_w["bwd_carry"] > 0 and plan_w["gu_saved"] > 0

    class Cuda:  # a stand-in for x on a CUDA device: _setup_context reads is_cuda only before refusing
        is_cuda = True

    cases = {  # the GPU layer's knobs -> (its FP8 forward saves, the refusal names)
        "unfused": ({"precision": "fp8", "forward_path": "unfused"}, True, None),
        "megakernel": ({"precision": "fp8", "forward_path": "megakernel"}, False, "forward_path is 'megakernel'"),
        "default": ({"precision": "fp8"}, False, "forward_path is 'megakernel'"),  # Config's default path
        "fused backward": ({"precision": "fp8", "forward_path": "unfused", "backward_path": "fused"}, True,
                           "backward_path is 'fused'"),
    }
    # MXFP8 runs on the same runtime: the same answers, the refusal naming mxfp8
    cases.update({"mxfp8 " + name: (dict(knobs, precision="mxfp8"), saves, refusal)
                  for name, (knobs, saves, refusal) in list(cases.items())})
    # the megakernel over windows (its plan has the FP8 backward: mok.MoE passes trains=True)
    cases["megakernel windows"] = ({"precision": "fp8", "forward_path": "megakernel"}, True, None, True)
    cases["megakernel resident"] = ({"precision": "fp8", "forward_path": "megakernel"}, False,
                                    "forward_path is 'megakernel'", False)
    for name, case in cases.items():
        knobs, saves, refusal = case[:3]
        handle = _ops.register_gpu_layer(object(), knobs, case[3] if len(case) > 3 else None)
        try:
            assert _ops._fp8_forward_saves(handle) == saves, name
            why = _ops._fp8_training_refusal(handle)
            if refusal is None:
                assert why is None, (name, why)
            else:
                assert why is not None and refusal in why, (name, why)
                p = knobs["precision"]
                inputs = (Cuda(),) + (None,) * 8 + (handle, p)
                with pytest.raises(NotImplementedError, match=f"precision '{p}' is forward only on this GPU layer"):
                    _ops._setup_context(None, inputs, (None, None))
        finally:
            _ops.unregister_gpu_layer(handle)
        assert handle not in _ops._gpu_configs and handle not in _ops._gpu_trains


def test_fuse_wgrad_accumulation_adds_to_main_grad():
    """fuse_wgrad_accumulation: two microbatches' routed weight gradients land in the weights'
    fp32 main_grad (made on the first backward, then added to), their .grad stays None; d_x,
    d_topk_w and the shared expert's gradients are the plain module's; refusals by name."""
    torch.manual_seed(5)
    plain = mok.MoE(H, I, E, K, IS, init_std=0.1)
    fused = mok.MoE(H, I, E, K, IS, init_std=0.1, fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    want = [torch.zeros(p.shape, dtype=torch.float32) for p in (plain.w_gate, plain.w_up, plain.w_down)]
    for s in range(2):
        x, idx, w = make_inputs(30 + s)
        outs, gx, gw = [], [], []
        for m in (plain, fused):
            m.zero_grad()
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = m(xr, idx, wr)
            out.float().square().sum().backward()
            outs.append(out)
            gx.append(xr.grad)
            gw.append(wr.grad)
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(gx[0], gx[1]) and torch.equal(gw[0], gw[1])
        for acc, p in zip(want, (plain.w_gate, plain.w_up, plain.w_down)):
            acc += p.grad.float()
        for p in (fused.w_gate, fused.w_up, fused.w_down):
            assert p.grad is None and p.grad_added_to_main_grad
        for a, b in zip((plain.ws_gate, plain.ws_up, plain.ws_down), (fused.ws_gate, fused.ws_up, fused.ws_down)):
            assert torch.equal(a.grad, b.grad)
    for acc, p in zip(want, (fused.w_gate, fused.w_up, fused.w_down)):
        assert p.main_grad.dtype == torch.float32 and torch.equal(p.main_grad, acc)
    # A frozen weight gets no main_grad (and keeps the one it has); a gradient asked for x only
    # still adds to the others' (the convention's side effect).
    fused.w_down.requires_grad_(False)
    before = fused.w_down.main_grad.clone()
    x, idx, w = make_inputs(41)
    fused(x, idx, w.clone().requires_grad_()).float().square().sum().backward()
    assert torch.equal(fused.w_down.main_grad, before) and fused.w_down.grad is None
    fused.w_down.requires_grad_(True)
    fused.w_up.main_grad = torch.zeros(3)
    x, idx, w = make_inputs(40)
    with pytest.raises(ValueError, match="'w_up.main_grad' must be a contiguous float32"):
        fused(x, idx, w.clone().requires_grad_()).sum().backward()
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation' needs precision 'bf16'"):
        mok.MoE(H, I, E, K, fuse_wgrad_accumulation=True, precision="fp8")
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation' needs backward_path 'unfused'"):
        mok.MoE(H, I, E, K, fuse_wgrad_accumulation=True, backward_path="fused")


def test_ep_group_arguments_are_named():
    from ep_util import FakeGroup
    m = mok.MoE(H, I, E, K, IS, group=FakeGroup(2, 1))
    assert (m.ep_size, m.ep_rank) == (2, 1)
    assert tuple(m.w_gate.shape) == (E // 2, I, H) and tuple(m.w_down.shape) == (E // 2, H, I)
    assert "ep_size=2" in repr(m)
    assert m.memory_plan(64)["total"] > 0  # the planner at EP 2 (no GPU)
    x, idx, w = make_inputs(0)[:3]
    with pytest.raises(ValueError, match="'group'.*CUDA tensors"):
        m(x, idx, w)
    with pytest.raises(ValueError, match="'experts'.*divisible by the EP size"):
        mok.MoE(H, I, 6, K, group=FakeGroup(4, 0))
    with pytest.raises(ValueError, match="'nccl_comm'"):
        mok.MoE(H, I, E, K, nccl_comm="mine")
    with pytest.raises(TypeError, match="'group'"):
        mok.MoE(H, I, E, K, group=object())
    with pytest.raises(ValueError, match="not a member of 'group'"):
        mok.MoE(H, I, E, K, group=FakeGroup(2, -1))


def test_group_of_one_rank_is_the_module_without_group_on_cpu():
    # A real torch.distributed group of one rank (gloo): the module is the one-rank module.
    from ep_util import world_of_one
    group = world_of_one()
    torch.manual_seed(0)
    a = mok.MoE(H, I, E, K, IS, init_std=0.05)
    b = mok.MoE(H, I, E, K, IS, group=group)
    b.load_state_dict(a.state_dict())
    assert b.ep_size == 1 and b.ep_rank == 0
    x, idx, w = make_inputs(2)[:3]
    outs = []
    for m in (a, b):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = m(xr, idx, wr)
        out.float().square().sum().backward()
        outs.append([out, xr.grad, wr.grad] + [p.grad for p in m.parameters()])
    for u, v in zip(*outs):
        assert torch.equal(u, v)
