"""mok.MoE on CUDA tensors (the GPU layer, mok._cuda) against the CPU reference engine (mok._cpu)
on the same weights and inputs: forward and every gradient; weights changed in place by an
optimizer are read by the next call, and weights moved to new tensors are re-bound; bad routing is
named by check(); a backward of an earlier forward is refused by name, unless the layer holds
several forwards (saved_forwards); precision="fp8": the forward on both paths and training on the
unfused one (fp8's default) against the CPU's FP8 recipe, and on the megakernel over windows of the
ring bitwise the unfused path's gradients. Skipped without a GPU or without mok._cuda."""

import pytest
import torch

import mok

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

H, I, E, K, IS, T = 256, 128, 8, 2, 128, 256


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), K, -1)
    idx = idx.to(torch.int32)
    idx[::7, 1] = -1
    return x.to(device), idx.to(device), w.float().to(device)


def step(m, x, idx, w, d_out):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    m.zero_grad()
    out = m(x, idx, w)
    out.backward(d_out)
    return [out, x.grad, w.grad] + [p.grad for p in m.parameters()]


def test_gpu_layer_matches_the_cpu_reference():
    pytest.importorskip("mok._cuda")
    torch.manual_seed(0)
    cpu = mok.MoE(H, I, E, K, IS, init_std=0.05)
    gpu = mok.MoE(H, I, E, K, IS).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x, idx, w = inputs(1, "cpu")
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = step(cpu, x, idx, w, d_out)
    got = step(gpu, x.cuda(), idx.cuda(), w.cuda(), d_out.cuda())
    torch.cuda.synchronize()
    gpu.check()
    names = ["out", "d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_ws_gate", "d_ws_up", "d_ws_down"]
    for name, a, b in zip(names, got, want):
        assert a is not None and a.is_cuda, name
        assert rel(a, b) < 1e-2, (name, rel(a, b))
    # Weights changed in place (an optimizer step) are read by the next call, as on the CPU.
    for m in (cpu, gpu):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.5)
    x2, idx2, w2 = inputs(3, "cpu")
    a = gpu(x2.cuda(), idx2.cuda(), w2.cuda())
    b = cpu(x2, idx2, w2)
    assert rel(a, b) < 1e-2
    # Weights moved to new storage (load_state_dict(assign=True)): the same GPU layer, re-bound.
    torch.manual_seed(5)
    other = mok.MoE(H, I, E, K, IS, init_std=0.05)
    cpu.load_state_dict(other.state_dict())
    gpu.load_state_dict({k: v.cuda() for k, v in other.state_dict().items()}, assign=True)
    layers = dict(gpu._gpu)
    a = gpu(x2.cuda(), idx2.cuda(), w2.cuda())
    assert gpu._gpu == layers, "the GPU layer was rebuilt instead of re-bound"
    assert rel(a, cpu(x2, idx2, w2)) < 1e-2


def test_gpu_bad_routing_is_named_by_check():
    pytest.importorskip("mok._cuda")
    m = mok.MoE(H, I, E, K).cuda()
    x, idx, w = inputs(4, "cuda")
    idx[9, 1] = E + 3
    with torch.no_grad():
        m(x, idx, w)
    torch.cuda.synchronize()
    with pytest.raises(mok.Error, match=r"topk_idx\[9,1\]"):
        m.check()


def test_gpu_backward_of_an_earlier_forward_is_refused():
    pytest.importorskip("mok._cuda")
    m = mok.MoE(H, I, E, K).cuda()
    x, idx, w = inputs(5, "cuda")
    first = m(x.clone().requires_grad_(), idx, w)
    second = m(x.clone().requires_grad_(), idx, w)
    second.float().sum().backward()  # its own: accepted
    with pytest.raises(mok.Error, match=r"backward\.forward_id"):  # saved_forwards = 1: the last one only
        first.float().sum().backward()


@pytest.mark.parametrize("budget", [-1, 0])
def test_gpu_microbatches_alive_at_once(budget):
    """saved_forwards = 3 with a ring below the worst case (the backward over windows; the gate/up
    rows saved, or recomputed with a budget of 0): three forwards run before their backwards, which
    run in reverse order, and each microbatch's output and gradients are bitwise those of running it
    alone; a fourth forward takes the first one's slot, whose backward is then refused by name."""
    pytest.importorskip("mok._cuda")
    # worst case here: 1408 rows
    cfg = dict(minibatch_tokens=128, macrobatch_tokens=256, activation_budget_bytes=budget)
    torch.manual_seed(3)
    alone = mok.MoE(H, I, E, K, IS, **cfg).cuda()
    many = mok.MoE(H, I, E, K, IS, saved_forwards=3, **cfg).cuda()
    many.load_state_dict(alone.state_dict())
    batches = [inputs(20 + i, "cuda") for i in range(4)]
    d_outs = [torch.randn(T, H, device="cuda").bfloat16() for _ in range(3)]
    want = [[t.clone() for t in step(alone, x, idx, w, d)] for (x, idx, w), d in zip(batches, d_outs)]
    xs = [b[0].clone().requires_grad_() for b in batches]
    ws = [b[2].clone().requires_grad_() for b in batches]
    outs = [many(xs[i], batches[i][1], ws[i]) for i in range(3)]
    for i in reversed(range(3)):
        many.zero_grad(set_to_none=True)
        outs[i].backward(d_outs[i])
        got = [outs[i], xs[i].grad, ws[i].grad] + [p.grad for p in many.parameters()]
        for j, (a, b) in enumerate(zip(got, want[i])):
            assert torch.equal(a, b), (i, j, rel(a, b))
    outs = [many(xs[i], batches[i][1], ws[i]) for i in range(4)]  # the fourth reuses the first's slot
    outs[3].float().sum().backward()
    with pytest.raises(mok.Error, match=r"backward\.forward_id"):
        outs[0].float().sum().backward()


def test_gpu_config_knobs_reach_the_layer():
    """mok.MoE's keyword arguments configure the GPU layer (mok::Config by name): the unfused path
    gives the megakernel's bits; a bad value is named."""
    pytest.importorskip("mok._cuda")
    torch.manual_seed(9)
    base = mok.MoE(H, I, E, K, IS).cuda()
    unfused = mok.MoE(H, I, E, K, IS, forward_path="unfused").cuda()
    unfused.load_state_dict(base.state_dict())
    x, idx, w = inputs(10, "cuda")
    with torch.no_grad():
        assert torch.equal(base(x, idx, w), unfused(x, idx, w))
    bad = mok.MoE(H, I, E, K, forward_path="fused").cuda()
    with pytest.raises(mok.Error, match=r"config\.forward_path"):
        with torch.no_grad():
            bad(x, idx, w)


@pytest.mark.parametrize("precision,forward_path", [("fp8", None), ("fp8", "megakernel"), ("mxfp8", None),
                                                    ("mxfp8", "megakernel")])
def test_fp8_forward_matches_the_cpu_fp8_recipe_and_follows_weight_updates(precision, forward_path):
    """The FP8 forward (recipe 1, and MXFP8 against the CPU reference's MX spec) on the recipes'
    default path (unfused, which trains) and on the FP8 megakernels (forward only: a call needing a
    gradient is refused, naming the knob)."""
    pytest.importorskip("mok._cuda")
    H8, I8 = 512, 256  # the FP8 megakernel pulls x in 512-channel units (H % 512), I % 128
    torch.manual_seed(5)
    knobs = {} if forward_path is None else {"forward_path": forward_path}
    cpu = mok.MoE(H8, I8, E, K, init_std=0.05, precision=precision)
    gpu = mok.MoE(H8, I8, E, K, precision=precision, **knobs).cuda()
    assert gpu._layer_knobs()["forward_path"] == (forward_path or "unfused")
    gpu.load_state_dict(cpu.state_dict())  # copies in place: the layer's FP8 codes must follow
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, H8, generator=g).to(torch.bfloat16)
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), K, -1)
    idx, w = idx.to(torch.int32), w.float()
    idx[::7, 1] = -1
    outs = []
    for scale in (None, 1.5):
        if scale is not None:  # an in-place update (the tensors' versions change, not their storage)
            with torch.no_grad():
                for m in (cpu, gpu):
                    for p in m.parameters():
                        p.mul_(scale)
        with torch.no_grad():
            want = cpu(x, idx, w)
            got = gpu(x.cuda(), idx.cuda(), w.cuda())
            again = gpu(x.cuda(), idx.cuda(), w.cuda())
        torch.cuda.synchronize()
        gpu.check()
        assert torch.equal(got, again)
        assert rel(got, want) < 1e-2, rel(got, want)  # the GPU's FP8 forward vs the CPU's recipe
        outs.append(got)
    assert rel(outs[1], outs[0]) > 0.1  # the update reached the GPU layer's codes
    if forward_path == "megakernel":
        refused = "forward only on this GPU layer: its forward_path is 'megakernel'"
        with pytest.raises(NotImplementedError, match=refused):
            gpu(x.cuda(), idx.cuda(), w.cuda())  # the Parameters need gradients
    else:  # the default path trains (test_fp8_trains_on_cuda_tensors_like_the_cpu_fp8_recipe checks the values)
        gpu(x.cuda(), idx.cuda(), w.cuda()).float().sum().backward()
        torch.cuda.synchronize()
        gpu.check()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpu.parameters())


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_fp8_trains_on_cuda_tensors_like_the_cpu_fp8_recipe(precision):
    """mok.MoE(precision="fp8" / "mxfp8") trains on CUDA tensors (the GPU layer's FP8 backward,
    after the unfused forward: the default path): the output and every gradient against the same
    weights on CPU tensors (the reference engine's recipe) within 3e-2 relative L2 (the GPU and CPU
    recipes differ in accumulation order; MXFP8 also by the GPU's re-blocking), and two forward +
    backward steps give the same bits."""
    pytest.importorskip("mok._cuda")
    H8, I8, T8 = 256, 128, 300  # FP8: H and I whole 128-blocks; T not a multiple of 128
    torch.manual_seed(11)
    cpu = mok.MoE(H8, I8, E, K, init_std=0.05, precision=precision)
    gpu = mok.MoE(H8, I8, E, K, precision=precision).cuda()
    gpu.load_state_dict(cpu.state_dict())
    g = torch.Generator().manual_seed(12)
    x = torch.randn(T8, H8, generator=g).to(torch.bfloat16)
    w, idx = torch.topk(torch.softmax(torch.randn(T8, E, generator=g), -1), K, -1)
    idx, w = idx.to(torch.int32), w.float()
    idx[::7, 1] = -1
    d_out = torch.randn(T8, H8, generator=g).to(torch.bfloat16)
    want = step(cpu, x, idx, w, d_out)
    got = [t.clone() for t in step(gpu, x.cuda(), idx.cuda(), w.cuda(), d_out.cuda())]
    again = [t.clone() for t in step(gpu, x.cuda(), idx.cuda(), w.cuda(), d_out.cuda())]
    torch.cuda.synchronize()
    gpu.check()
    names = ["out", "d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"]
    assert len(got) == len(names) == len(want)
    errs = {}
    for name, a, b, ref in zip(names, got, again, want):
        assert a.is_cuda and a.shape == ref.shape and a.dtype == ref.dtype, name
        assert torch.equal(a, b), name  # deterministic: two backwards, the same bits
        errs[name] = rel(a, ref)
        print(f"[{precision} gpu training] {name}: rel err vs the CPU's recipe {errs[name]:.2e}")
    for name, err in errs.items():
        assert err < 3e-2, (name, err)



@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_fp8_megakernel_over_windows_trains_like_the_unfused_path(precision):
    """forward_path="megakernel" with a ring below the worst case trains in FP8 (the backward over
    windows of the ring; its memory plan has the FP8 backward's buffers): the output within the
    FP8 forward's spread of the unfused path's, and every gradient bitwise the unfused path's (the
    C++ test LayerFp8BackwardWindows: the same sums in the same order), twice."""
    pytest.importorskip("mok._cuda")
    H8, I8, T8 = 512, 256, 700  # the FP8 megakernel: H % 512
    torch.manual_seed(13)
    unfused = mok.MoE(H8, I8, E, K, init_std=0.05, precision=precision).cuda()
    windows = mok.MoE(H8, I8, E, K, precision=precision, forward_path="megakernel", minibatch_tokens=128,
                      macrobatch_tokens=256).cuda()
    windows.load_state_dict(unfused.state_dict())
    assert "fp8_bwd_rows" in windows.memory_plan(T8)
    g = torch.Generator().manual_seed(14)
    x = torch.randn(T8, H8, generator=g).to(torch.bfloat16).cuda()
    w, idx = torch.topk(torch.softmax(torch.randn(T8, E, generator=g), -1), K, -1)
    idx, w = idx.to(torch.int32).cuda(), w.float().cuda()
    d_out = torch.randn(T8, H8, generator=g).to(torch.bfloat16).cuda()
    want = [t.clone() for t in step(unfused, x, idx, w, d_out)]
    for _ in range(2):
        got = [t.clone() for t in step(windows, x, idx, w, d_out)]
        torch.cuda.synchronize()
        windows.check()
        assert rel(got[0], want[0]) < 1e-2  # the megakernel's FP8 forward: another summation order
        for name, a, b in zip(["d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"], got[1:], want[1:]):
            assert torch.equal(a, b), name

def test_fuse_wgrad_accumulation_on_cuda_adds_the_fp32_sums():
    """fuse_wgrad_accumulation on the GPU layer (mok::GradRefs::accumulate): the weights' fp32
    main_grad after one backward rounds to the plain module's bf16 gradients bit for bit (the same
    tiles, only the final rounding gone), a second microbatch of the same inputs doubles it exactly,
    .grad stays None, and d_x, d_topk_w and the shared expert's gradients are the plain module's."""
    pytest.importorskip("mok._cuda")
    torch.manual_seed(6)
    plain = mok.MoE(H, I, E, K, IS, device="cuda", init_std=0.05)
    fused = mok.MoE(H, I, E, K, IS, device="cuda", init_std=0.05, fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    x, idx, w = inputs(61, "cuda")
    d_out = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    want = step(plain, x, idx, w, d_out)
    first = None
    for rep in range(2):
        got = step(fused, x, idx, w, d_out)
        for a, b in zip(want[:3], got[:3]):
            assert torch.equal(a, b)
        for p in (fused.w_gate, fused.w_up, fused.w_down):
            assert p.grad is None
        for a, b in zip(want[6:], got[6:]):  # the shared expert's
            assert torch.equal(a, b)
        mg = [p.main_grad.clone() for p in (fused.w_gate, fused.w_up, fused.w_down)]
        if rep == 0:
            for g, ref in zip(mg, want[3:6]):
                assert torch.equal(g.to(torch.bfloat16), ref)
            first = mg
        else:
            for g, f in zip(mg, first):
                assert torch.equal(g, f + f)
    plain.check()
    fused.check()


def _mok_device_bytes() -> int:
    """Device memory in use outside PyTorch's caching allocator (mok's buffers, windows and NCCL's)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def test_modules_share_one_communicator_and_its_workspace():
    """Eight layers alive at once (Qwen3-30B-A3B's dims with 32 experts, T = 8192, the default
    training memory model): forward all, then backward. Every mok.MoE on one GPU uses one
    communicator, so the layers share one workspace: the seven layers after the first add their
    own buffers only (the planner's total less its workspace, within 2%), not a workspace each."""
    pytest.importorskip("mok._cuda")
    import gc
    from mok import _comm
    h, i, e, k, t, n = 2048, 768, 32, 8, 8192, 8
    g = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w, idx = torch.topk(torch.softmax(torch.randn(t, e, device="cuda", generator=g), -1), k, -1)
    idx, w = idx.int(), w.float()
    # One layer made, run forward + backward and deleted first, so that the baseline holds what a
    # process keeps once its first layer is gone (202 MiB on one H100 at 69a043e, with every layer
    # and the communicator freed: by elimination kernel code loaded at first launch and NCCL's own
    # state). The last check below then sees what the layers and their communicator hold and give
    # back, and `one` the communicator's share without those one-time costs.
    warm = mok.MoE(h, i, e, k, device="cuda")
    warm(x.clone().requires_grad_(), idx, w).float().sum().backward()
    del warm
    gc.collect()
    torch.cuda.empty_cache()
    comms_before = _comm.live_communicators()
    base = _mok_device_bytes()
    torch.manual_seed(11)
    mods = [mok.MoE(h, i, e, k, device="cuda") for _ in range(n)]
    xs = [x.clone().requires_grad_() for _ in range(n)]
    outs = [mods[0](xs[0], idx, w)]
    outs[0].float().sum().backward()
    one = _mok_device_bytes() - base  # the communicator, the workspace and one layer's own buffers
    outs += [m(xx, idx, w) for m, xx in zip(mods[1:], xs[1:])]
    torch.stack([o.float().sum() for o in outs[1:]]).sum().backward()  # the backwards, last layer first
    all_n = _mok_device_bytes() - base
    assert len({id(c) for m in mods for c in m._gpu_comms.values()}) == 1  # one communicator for all
    assert _comm.live_communicators() - comms_before <= 1
    plan = mods[0].memory_plan(t)
    own = plan["total"] - plan["workspace"]
    added = all_n - one
    print(f"[mok] {n} layers: first {one / 2**20:.1f} MiB (plan {plan['total'] / 2**20:.1f} MiB, of it workspace "
          f"{plan['workspace'] / 2**20:.1f}), each further {added / (n - 1) / 2**20:.1f} MiB (plan {own / 2**20:.1f} "
          f"MiB); all {all_n / 2**20:.1f} MiB vs {n * plan['total'] / 2**20:.1f} MiB with a workspace per layer")
    # 2% of the plan, and 8 MiB a layer for what allocation granularity adds (a window of a few KB
    # takes 2 MiB of ncclMemAlloc)
    assert abs(added - (n - 1) * own) <= (n - 1) * (0.02 * own + 8 * 2**20), (added, (n - 1) * own)
    assert all_n < 0.5 * n * plan["total"]  # far below a workspace per layer
    assert one >= plan["total"]
    for m in mods:
        m.check()
    del mods, outs, xs, m  # (the loop's name holds the last module, and through it the communicator)
    gc.collect()
    assert _comm.live_communicators() == comms_before  # the last layer's going frees the communicator
    assert _mok_device_bytes() - base < 64 * 2**20  # and its memory


@pytest.mark.parametrize("nccl_comm", ["own", "group"])
def test_group_of_one_rank_gives_the_bits_of_no_group(nccl_comm):
    """mok.MoE on a torch.distributed group (one rank here, NCCL): the communicator made over the
    group (its NCCL unique id broadcast over the group, or the group's own NCCL communicator)
    gives the output and gradients of the module without a group, bit for bit."""
    pytest.importorskip("mok._cuda")
    import gc
    from ep_util import world_of_one
    group = world_of_one()
    torch.manual_seed(13)
    plain = mok.MoE(H, I, E, K, IS, device="cuda", init_std=0.05)
    grouped = mok.MoE(H, I, E, K, IS, device="cuda", group=group, nccl_comm=nccl_comm)
    grouped.load_state_dict(plain.state_dict())
    x, idx, w = inputs(14, "cuda")
    d_out = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(15)).bfloat16()
    want = step(plain, x, idx, w, d_out)
    got = step(grouped, x, idx, w, d_out)
    torch.cuda.synchronize()
    grouped.check()
    for j, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), j
    del plain, grouped  # before the group (nccl_comm="group": its NCCL communicator is the group's)
    gc.collect()


def test_gpu_max_tokens_builds_one_layer_for_every_token_count():
    # Calls of 256, 200 and 64 tokens: one GPU layer on the capped module, three on the free one
    # (and a warning when a module builds layer MANY_LAYERS + 1); the capped calls give the free
    # ones' bits.
    pytest.importorskip("mok._cuda")
    torch.manual_seed(4)
    free = mok.MoE(H, I, E, K, IS).cuda()
    capped = mok.MoE(H, I, E, K, IS, max_tokens=T).cuda()
    capped.load_state_dict(free.state_dict())
    x, idx, w = inputs(5, "cuda")
    for n in (T, 200, 64):
        d_out = torch.randn(n, H, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16).cuda()
        a = step(free, x[:n], idx[:n], w[:n], d_out)
        b = step(capped, x[:n], idx[:n], w[:n], d_out)
        for u, v in zip(a, b):
            assert torch.equal(u, v)
    torch.cuda.synchronize()
    assert len(capped._gpu) == 1 and len(free._gpu) == 3
    with pytest.warns(UserWarning, match="max_tokens="):
        for n in range(8, 8 + 8 * mok.MoE.MANY_LAYERS, 8):
            free(x[:n], idx[:n], w[:n])
