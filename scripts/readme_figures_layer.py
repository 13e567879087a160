"""The README's figures of the whole MoE layer: forward, backward, training and memory (bf16), the
A/Bs of the main job's options, the PyTorch op, and the FP8 / MXFP8 layer. Each *_figures function
takes the results files (readme_figures_common.Results) and returns its figures, one string each;
FIGURES in readme_figures.py puts them in the README's order.
"""
from readme_figures_common import (HEADLINE, FigureError, case_name, count, model_name, nums, ordered, span, times,
                                   versus)

QWEN = [("qwen3-235b", 8192, "uniform"), ("qwen3-30b-a3b", 8192, "uniform")]
# The main job on one GPU, on whichever card ran it last (the README quotes the newest run).
ONE_GPU_MAIN_JOB = ("forward-h200x1.json", "forward-h100x1.json")


def bf16_cases(f):
    """A forward file's bf16 cases (FP8 ones, from mok_bench --precision fp8, carry "precision")."""
    return [c for c in f.get("cases") if c.get("precision", "bf16") == "bf16"]


def forward_figures(res):
    f = res["forward-h200x2.json"]
    cases = bf16_cases(f)
    h = f.case(*HEADLINE)
    peak = f.num("peak_bf16", "burst_tflops_max")
    models = ", ".join(model_name(m) for m in ordered(c.get("model") for c in cases))
    tokens = ", ".join(str(t) for t in sorted(set(c.get("T") for c in cases)))
    routings = ", ".join(ordered(c.get("routing") for c in cases))
    qwen = ", ".join("%s %s" % (model_name(q[0]), times(f.num("speedup", within=f.case(*q)))) for q in QWEN)
    # The unfused path (kept as baseline and fallback) in the same run, case by case.
    unfused = [f.num("ms", within=a) / f.num("mok_ms", within=f.case(a["model"], a["T"], a["routing"]))
               for a in f.get("ablation") if a.get("variant") == "unfused"]
    if not unfused:
        raise FigureError("%s: no 'unfused' variant in 'ablation'" % f.name)
    variants = [v for v in ordered(a.get("variant") for a in f.get("ablation")) if v != h.get("variant")]
    lines = [
        "**Forward** (the megakernel) vs the PyTorch+NCCL baseline in the same run: **%s** over all %s "
        "(%s; T = %s tokens per rank; %s routing). %s: **%.2f vs %.2f ms** (%s), %.0f TF/s per GPU = "
        "%.0f%% of the %.0f TF/s cuBLAS bf16 burst peak measured in that run. At T=%d %s: %s. "
        "Sampled outputs match the spec within a relative error of %.1e. %s" % (
            versus(nums(f, cases, "speedup")), count(len(cases), "case"), models, tokens, routings,
            case_name(*HEADLINE),
            f.num("mok_ms", within=h), f.num("baseline_ms", within=h), times(f.num("speedup", within=h)),
            f.num("mok_tflops", within=h), f.num("mok_pct_of_peak", within=h), peak, QWEN[0][1], QWEN[0][2],
            qwen, max(nums(f, cases, "check_rel_err")), f.source()),
        "**Forward, sustained** (back-to-back forwards at the power cap, both sides): **%s** over all %s; "
        "%s %s, %.0f TF/s = %.0f%% of cuBLAS's sustained %.0f TF/s. Under load the median SM clock "
        "was %s MHz (GPU %s), held down by the power cap in %s of the samples. %s" % (
            versus(nums(f, cases, "sustained_speedup")), count(len(cases), "case"), case_name(*HEADLINE),
            times(f.num("sustained_speedup", within=h)), f.num("mok_sustained_tflops", within=h),
            f.num("mok_sustained_pct_of_sustained_peak", within=h), f.num("peak_bf16", "sustained_tflops_max"),
            " / ".join("%.0f" % f.num("sm_clock_mhz_median", within=g) for g in f.get("gpu_samples")),
            " / ".join(str(f.get("gpu", within=g)) for g in f.get("gpu_samples")),
            " / ".join("%.0f%%" % (100 * f.num("power_capped_share", within=g)) for g in f.get("gpu_samples")),
            f.source()),
        "**Ablation** in the same run: vs the unfused path the megakernel is %s over all %s; %s "
        "(%s) and other comm-SM / minibatch settings, %s, each checked bitwise against the "
        "main variant. %s" % (
            versus(unfused), count(len(unfused), "case"), count(len(variants), "other variant"),
            ", ".join("`%s`" % v for v in variants), count(len(f.get("ablation")), "run"), f.source()),
        "**Backward** (unfused kernels) vs the baseline's backward: **%s** over all %s; %s: "
        "%.2f vs %.2f ms, %.0f TF/s per GPU. Sampled gradients match the spec within %.1e. %s" % (
            versus(nums(f, cases, "bwd_speedup")), count(len(cases), "case"), case_name(*HEADLINE),
            f.num("mok_bwd_ms", within=h), f.num("baseline_bwd_ms", within=h), f.num("mok_bwd_tflops", within=h),
            max(nums(f, cases, "bwd_check_rel_err")), f.source()),
    ]
    # Every baseline time above must be the baseline file's (forward_report.py joins the two).
    b = res["baseline-h200x2.json"]
    for c in cases:
        bc = b.case(c["model"], c["T"], c["routing"])
        for key in ("baseline_ms", "baseline_bwd_ms", "baseline_sustained_ms"):
            if key in c and c[key] != b.num(key, within=bc):
                raise FigureError("%s: %s %s is %r, but %s has %r: the forward results were not joined with "
                                  "this baseline (bench/forward_report.py)" % (
                                      f.name, case_name(c["model"], c["T"], c["routing"]), key, c[key],
                                      b.name, bc[key]))
    lines.append(
        "**Baseline**: torch %s, NCCL %s (`bench/baseline/`); its forward / backward match a dense fp32 "
        "computation within %.1e / %.1e (its self check). %s" % (
            b.get("torch"), b.get("nccl"), b.num("self_check_rel_err"), b.num("self_check_bwd_rel_err"),
            b.source()))
    return lines


def one_gpu_figures(res):
    """The main job on one GPU: the full models (EP 1) and the per-rank slices of EP 8."""
    f = res.newest(*ONE_GPU_MAIN_JOB)
    cases = bf16_cases(f)
    full = [c for c in cases if "slice_of_ep" not in c]
    slices = [c for c in cases if "slice_of_ep" in c]
    if not full or not slices:
        raise FigureError("%s: needs full-model cases and EP-8 slices (slice_of_ep)" % f.name)

    def both(c):  # forward + backward of mok against the baseline's
        return (f.num("baseline_ms", within=c) + f.num("baseline_bwd_ms", within=c)) / (
            f.num("mok_ms", within=c) + f.num("mok_bwd_ms", within=c))

    h = f.case(*HEADLINE)
    hs = f.case(HEADLINE[0] + "/ep8", HEADLINE[1], HEADLINE[2])
    return [
        "**One GPU** (the main job): the full models (EP 1) forward **%s** and forward + backward %s "
        "the baseline over %s; the per-rank slices of EP 8 (each GPU computing what one rank of an "
        "8-GPU node does: E/8 experts, the same T) forward %s, forward + backward %s over %s. %s: "
        "forward %.2f ms = %.0f TF/s, backward %.2f ms = %.0f TF/s; its EP-8 slice: %.2f ms = %.0f TF/s "
        "and %.2f ms = %.0f TF/s (%.0f%% / %.0f%% of the %.0f TF/s burst peak of that run). %s" % (
            versus(nums(f, full, "speedup")), span([both(c) for c in full]), count(len(full), "case"),
            span(nums(f, slices, "speedup")), span([both(c) for c in slices]), count(len(slices), "case"),
            case_name(*HEADLINE), f.num("mok_ms", within=h), f.num("mok_tflops", within=h),
            f.num("mok_bwd_ms", within=h), f.num("mok_bwd_tflops", within=h), f.num("mok_ms", within=hs),
            f.num("mok_tflops", within=hs), f.num("mok_bwd_ms", within=hs), f.num("mok_bwd_tflops", within=hs),
            f.num("mok_pct_of_peak", within=hs), f.num("mok_bwd_pct_of_peak", within=hs),
            f.num("peak_bf16", "burst_tflops_max"), f.source())]


def memory_figures(res):
    m = res["memory-h200x1.json"]
    cases = m.get("cases")

    def pick(model, ep, mode):
        for c in cases:
            if (c.get("model"), c.get("ep"), c.get("T"), c.get("routing"), c.get("mode", "resident")) == \
                    (model, ep, 8192, "uniform", mode):
                return c
        raise FigureError("%s: no case %s EP %d T=8192 uniform %s" % (m.name, model, ep, mode))

    def layer_gb(c):
        return (m.num("persistent_bytes_per_layer", within=c) + m.num("saved_bytes_per_forward", within=c)) / 1e9

    def layers_gb(c, n=58):
        return (layer_gb(c) * 1e9 * n + m.num("workspace_bytes", within=c)) / 1e9

    d1 = pick("dsv3", 1, "resident")
    # The training default at EP 1, where its measurement holds everything the plan counts (the
    # symmetric windows new, not an earlier layer's from the pool).
    trained = ""
    s1 = [c for c in cases if (c.get("model"), c.get("ep"), c.get("T"), c.get("routing"), c.get("mode")) ==
          ("dsv3", 1, 8192, "uniform", "saved") and c.get("measured_bytes") is not None and
          c.get("measured_windows") == "new"]
    if s1:
        trained = " (the training default, the layer with the workspace: %.2f GB, measured %.2f GB)" % (
            layer_gb(s1[0]) + m.num("workspace_bytes", within=s1[0]) / 1e9, m.num("measured_bytes", within=s1[0]) / 1e9)
    models = ("dsv3", "qwen3-235b", "qwen3-30b-a3b")
    saved = [pick(x, 8, "saved") for x in models]
    recompute = [pick(x, 8, "recompute") for x in models]
    base = m.num("baseline_saved_bytes", within=d1) / 1e9
    workspace = max(m.num("workspace_bytes", within=c) for c in saved) / 1e9
    ok = sum(1 for c in saved + recompute if m.get("backward_ok", within=c) is True)
    return [
        "**Memory per layer** (the planner, `mok::plan_memory`, which the layer allocates by; T = 8192): "
        "DeepSeek-V3 EP 1 with every routed row resident (`workspace_budget_bytes = 0`) %.1f GB, measured %.1f GB "
        "on one GPU; with the layers sharing one workspace (at most %.2f GB per GPU) and the backward over windows of "
        "the ring, at EP 8 %s GB per layer for DeepSeek-V3 / Qwen3-235B / Qwen3-30B-A3B with the gate/up rows "
        "saved, %s MB with full recompute: 58 DeepSeek-V3 layers hold %.1f GB (saved) or %.1f GB (recompute) "
        "per GPU, where the PyTorch baseline keeps %.1f GB per layer for its backward (at EP 1); the megakernel "
        "backward runs in %d of the %d EP-8 cases; DeepSeek-V3 EP 1 in the training mode%s. %s" % (
            layer_gb(d1), m.num("measured_bytes", within=d1) / 1e9, workspace,
            " / ".join("%.2f" % layer_gb(c) for c in saved), " / ".join("%.0f" % (layer_gb(c) * 1e3) for c in recompute),
            layers_gb(saved[0]), layers_gb(recompute[0]), base, ok, len(saved + recompute),
            trained or " (not measured in this file)", m.source())]


def training_figures(res):
    """The main job in training mode (mok_bench --workspace-budget): shared workspace, backward over windows."""
    t = res["training-h200x1.json"]
    cases = [c for c in t.get("cases") if t.get("memory", "share_workspace", within=c) is True]
    if not cases:
        raise FigureError("%s: no case with a shared workspace (memory.share_workspace)" % t.name)

    def held_gb(c):  # what the layer holds besides the workspace all layers share
        return (t.num("memory", "total_bytes", within=c) - t.num("memory", "workspace_bytes", within=c)) / 1e9

    h = t.case(*HEADLINE)
    workspace = max(t.num("memory", "workspace_bytes", within=c) for c in cases) / 1e9
    return [
        "**Training mode** (the default config since a3b79a5) on one GPU (`mok_bench --workspace-budget 2000`: "
        "the layers share one workspace of at "
        "most %.2f GB per GPU, each model's ring the largest that fits it, the backward over windows of the ring "
        "with the gate/up rows saved): backward %s and forward %s (the baseline's time over mok's, %s); %s: backward %.1f ms vs the "
        "baseline's %.1f ms with a ring of %d rows, the layer holding %.2f GB besides the "
        "workspace (58 layers: %.1f GB). %s" % (
            workspace, span(nums(t, cases, "bwd_speedup")), span(nums(t, cases, "speedup")),
            count(len(cases), "case"), case_name(*HEADLINE), t.num("mok_bwd_ms", within=h),
            t.num("baseline_bwd_ms", within=h), int(t.num("macrobatch_tokens", within=h)), held_gb(h),
            (58 * held_gb(h) * 1e9 + t.num("memory", "workspace_bytes", within=h)) / 1e9,
            t.source())]


def torch_figures(res):
    """The PyTorch op in a training step (bench/torch_step.py)."""
    t = res["torch-h200x1.json"]
    cases = t.get("cases")
    if not cases:
        raise FigureError("%s: no cases" % t.name)
    names = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "qwen3-235b": "Qwen3-235B", "dsv3": "DeepSeek-V3"}
    parts = ["%s %.1f vs %.1f ms (%s)" % (names.get(t.get("model", within=c), t.get("model", within=c)),
                                           t.num("mok_step_ms", within=c), t.num("eager_step_ms", within=c),
                                           times(t.num("speedup", within=c))) for c in cases]
    layers = {t.num("layers", within=c) for c in cases}
    works = lambda key: all(t.get(key, within=c) is True for c in cases)  # noqa: E731
    overhead = [t.num("op_overhead_pct", within=c) for c in cases if t.get("op_overhead_pct", within=c) is not None]
    return [
        "**Training step** in PyTorch (`mok.MoE`, %s blocks of x + MoE(RMSNorm(x)), forward + backward + SGD, "
        "T = %d, against the same model with the eager `torch._grouped_mm` layer): %s; torch.compile "
        "(fullgraph) %s, a CUDA graph of the step %s%s. %s" % (
            "/".join(str(int(n)) for n in sorted(layers)), int(t.num("T", within=cases[0])), ", ".join(parts),
            "works" if works("compile_ok") else "FAILS", "works" if works("graph_ok") else "FAILS",
            "; the op's forward + backward time against the C++ layer's (mok_bench): %s" %
            span(overhead, fmt=lambda v: "%+.1f%%" % v) if overhead else "",
            t.source())]


def backward_program_figures(res):
    """The backward's GEMM program (Config::backward_path fused) against the unfused kernels, same run."""
    b = res["backward-program-h200x1.json"]
    variants = b.get("variants")
    cases = b.get("cases")
    ref = variants[0]
    parts = ["%s %s" % (v, span([b.num(v, "over_" + ref, within=c) for c in cases])) for v in variants[1:]]
    return [
        "**Backward GEMM program** (`Config::backward_path` fused: the backward's four GEMMs in one persistent "
        "kernel, bitwise the unfused backward; EP 1, every row resident, T = %d, %s): its time over the %s "
        "kernels' %s — slower so far, the unfused kernels stay the default (`notes/backward.md`). %s" % (
            int(b.num("T", within=cases[0])), " / ".join(str(b.get("model", within=c)) for c in cases), ref,
            "; ".join(parts), b.source())]


def window_hold_figures(res):
    """The backward over windows: cut experts held over to the next window against carried in fp32."""
    h = res["window-hold-ab-h200x1.json"]
    variants = h.get("variants")
    cases = h.get("cases")
    ref, new = variants[0], variants[-1]
    ratios = [h.num(new, "over_" + ref, within=c) for c in cases]
    names = "; ".join("%s %.2f vs %.2f ms" % (case_name(h.get("model", within=c), h.num("T", within=c),
                                                        h.get("routing", within=c)),
                                              h.num(new, "median", within=c), h.num(ref, "median", within=c))
                      for c in cases)
    return [
        "**Held rows** (the training default's backward over windows: an expert cut by a window's end is held "
        "over whole into the next window, its rows kept in scratch the saved windows leave free, instead of "
        "carrying its fp32 weight-gradient sums; bitwise the same, same binary alternated): backward time "
        "%s the carry's over %s (%s). %s" % (span(ratios), count(len(cases), "case"), names, h.source())]


def side_stream_figures(res):
    """The bf16 backward's weight gradients on a side stream against one stream, over windows and resident."""
    b = res["backward-streams-ab-h200x1.json"]
    variants = b.get("variants")
    cases = b.get("cases")
    ref, new = variants[0], variants[-1]
    parts = []
    for mode in ordered(b.get("mode", within=c) for c in cases):
        of = [c for c in cases if b.get("mode", within=c) == mode]
        names = "; ".join("%s %.2f vs %.2f ms" % (case_name(b.get("model", within=c), b.num("T", within=c),
                                                            b.get("routing", within=c)),
                                                  b.num(new, "median", within=c), b.num(ref, "median", within=c))
                          for c in of)
        parts.append("%s %s over %s (%s)" % (mode, span([b.num(new, "over_" + ref, within=c) for c in of]),
                                             count(len(of), "case"), names))
    return [
        "**Weight gradients beside FC1's dgrad** (the backward's weight gradients, in FP8 dW_down, on a second stream "
        "forked after FC2's dgrad and joined before the pushes, so that each GEMM's last wave is filled by the "
        "next; bitwise the same, same binary alternated): backward time over one stream's: %s. %s" % (
            "; ".join(parts), b.source())]


def fp8_forward_figures(res):
    """The main job's FP8 pass (the FP8 megakernel) beside its bf16 cases, and the FP8 paths' A/B."""
    f = res.newest(*ONE_GPU_MAIN_JOB)
    cases = [c for c in f.get("cases") if c.get("precision") == "fp8"]
    if not cases:
        raise FigureError("%s: no FP8 cases (the main job's FP8 pass)" % f.name)

    h = f.case(*HEADLINE, precision="fp8")
    hs = f.case(HEADLINE[0] + "/ep8", HEADLINE[1], HEADLINE[2], precision="fp8")
    # The FP8 peak of the same run (the baseline measures it since ed31186), else the one measured
    # in a call of its own.
    same_run = isinstance(f.data.get("peak_fp8"), dict)
    p = f if same_run else res["peak-fp8-h200x1.json"]
    peak = p.num("peak_fp8", "burst_tflops_max")
    where = "in that run" if same_run else "in another call"
    ab = res["fp8-forward-h200x1.json"]
    unfused = [ab.num("fp8-unfused", "median", within=c) / ab.num("fp8-megakernel", "median", within=c)
               for c in ab.get("cases")]
    return [
        "**FP8 forward** (the FP8 megakernel: E4M3 operands with 1x128 activation and 128x128 weight "
        "scales, x quantized on the GPU before the pull) in the main job's run: "
        "**%s** the bf16 megakernel's rate over %s and against the baseline %s; %s: %.2f ms = %.0f TF/s, its EP-8 "
        "slice %.2f ms = %.0f TF/s (%.0f%% of cuBLAS's FP8 8192^3 %.0f TF/s, measured %s). "
        "Sampled outputs match the FP8 spec within %.1e. %s; the FP8 unfused path takes %s the FP8 "
        "megakernel's time over %s. %s%s" % (
            span(nums(f, cases, "x_bf16")), count(len(cases), "case"), versus(nums(f, cases, "speedup")),
            case_name(*HEADLINE), f.num("mok_ms", within=h), f.num("mok_tflops", within=h),
            f.num("mok_ms", within=hs), f.num("mok_tflops", within=hs),
            100.0 * f.num("mok_tflops", within=hs) / peak, peak, where, max(nums(f, cases, "check_rel_err")),
            f.source(), span(unfused), count(len(unfused), "case"), ab.source(),
            "" if same_run else "; " + p.source())]


def fp8_backward_figures(res):
    """The GPU layer's FP8 backward against its bf16 backward, alternated in one call."""
    r = res["fp8-layer-backward-h200x1.json"]
    cases = r.get("cases")
    speed = [r.num("bf16", "median", within=c) / r.num("fp8", "median", within=c) for c in cases]
    slower = sum(1 for v in speed if v < 1)

    def name(c):  # "dsv3/ep8" -> "DeepSeek-V3 EP-8 slice"
        m = r.get("model", within=c)
        base, _, ep = m.partition("/")
        return model_name(base) + (" %s slice" % ep.upper().replace("EP", "EP-") if ep else "")
    each = "; ".join("%s %.2f vs %.2f ms" % (name(c), r.num("fp8", "median", within=c),
                                             r.num("bf16", "median", within=c)) for c in cases)
    kept = ""
    if "fp8-kept" in r.get("variants"):  # Config::fp8_keep_weight_codes_t
        ks = [r.num("bf16", "median", within=c) / r.num("fp8-kept", "median", within=c) for c in cases]
        kept = ("; with the weights' codes kept (`fp8_keep_weight_codes_t`: made once per weight update "
                "instead, which pays with several microbatches per update) %s%s") % (
            span(ks), ", slower in %d" % sum(1 for v in ks if v < 1) if any(v < 1 for v in ks) else "")
    return [
        "**FP8 backward** (the GPU layer's, unfused path, recipe 1: FP8 dgrads and weight gradients, "
        "the operands quantized per call; T=%d %s, alternated with the bf16 backward in one call): "
        "%s the bf16 backward's speed over %s%s (FP8 vs bf16: %s)%s. %s" % (
            r.num("T", within=cases[0]), r.get("routing", within=cases[0]), span(speed),
            count(len(cases), "case"), ", slower in %d" % slower if slower else "", each, kept, r.source())]


def fp8_training_figures(res):
    """FP8 training on the megakernel (its backward over windows of the ring) against the unfused
    path's (resident), and the FP8 layer's memory per layer at EP 8 (the planner)."""
    r = res["fp8-train-modes-h200x1.json"]
    m = res["memory-fp8-h200x1.json"]
    bwd, fwd = r.get("backward", "cases"), r.get("forward", "cases")

    def fb(variant, i):
        return r.num(variant, "median", within=fwd[i]) + r.num(variant, "median", within=bwd[i])

    def name(c):  # "dsv3/ep8" -> "DeepSeek-V3 EP-8 slice"
        base, _, ep = r.get("model", within=c).partition("/")
        return model_name(base) + (" %s slice" % ep.upper().replace("EP", "EP-") if ep else "")

    each = "; ".join("%s %.1f vs %.1f ms (backward %.2f vs %.2f ms)" % (
        name(c), fb("windows_saved", i), fb("unfused_resident", i), r.num("windows_saved", "median", within=c),
        r.num("unfused_resident", "median", within=c)) for i, c in enumerate(bwd))

    def pick(mode):
        for c in m.get("cases"):
            if (c.get("model"), c.get("ep"), c.get("routing"), c.get("mode")) == ("dsv3", 8, "uniform", mode):
                return c
        raise FigureError("%s: no case dsv3 EP 8 uniform %s" % (m.name, mode))
    sv, rc = pick("saved"), pick("recompute")
    gb = lambda c: (m.num("persistent_bytes_per_layer", within=c) + m.num("saved_bytes_per_forward", within=c)) / 1e9  # noqa: E731
    return [
        "**FP8 training on the megakernel** (the FP8 megakernel forward keeps the activation budget's gate/up "
        "rows, its backward runs over windows of the ring, bitwise the resident FP8 backward; T=%d %s): forward + "
        "backward against the unfused path's (resident) %s. %s; memory (the planner): DeepSeek-V3 EP 8 in FP8 "
        "%.2f GB per layer (%.2f GB with full recompute; of it the forward's weight codes %.2f GB) and a %.2f GB "
        "workspace shared by all layers. %s" % (
            r.num("T", within=bwd[0]), r.get("routing", within=bwd[0]), each, r.source(), gb(sv), gb(rc),
            m.num("persistent_bytes_per_layer", within=sv) / 1e9, m.num("workspace_bytes", within=sv) / 1e9,
            m.source())]


def mxfp8_figures(res):
    """MXFP8 (recipe 2) on the GPU layer against FP8 (recipe 1), alternated in one call."""
    r = res["mxfp8-h200x1.json"]
    fwd, bwd = r.get("forward", "cases"), r.get("backward", "cases")
    ratio = lambda c: r.num("mxfp8", "median", within=c) / r.num("fp8", "median", within=c)  # noqa: E731
    return [
        "**MXFP8** (OCP MX: E4M3 with an E8M0 scale per 32 along K, quantized on the GPU and re-blocked "
        "to the power-of-two scales of FP8's blocks, so it runs on the FP8 kernels; forward and backward, "
        "EP-8 rank slices, T=%d %s): the forward megakernel takes %s FP8's time over %s, the unfused "
        "backward %s over %s (the GPU tests check both against the CPU reference's MX spec). %s" % (
            r.num("T", within=fwd[0]), r.get("routing", within=fwd[0]), span([ratio(c) for c in fwd]),
            count(len(fwd), "case"), span([ratio(c) for c in bwd]), count(len(bwd), "case"), r.source())]


def runtime_ab_figures(res):
    """The forward built from this tree against a base commit's build, same call (issue 18)."""
    # The newest run (one H100: the one-GPU kind lent then gave no H200); the H200 file keeps the
    # earlier runs and the base's output hashes the newer ones are compared with.
    r = res["runtime-ab-h100x1.json"]
    cases = r.get("cases")
    same = sum(1 for c in cases if r.get("bitwise_same", within=c) is True)
    return [
        "**Runtime A/B** (the main job's forward, every row resident, built from %s and from this tree, "
        "alternating): outputs bitwise identical in %d of %s; time %s the base's (the history in the file and "
        "in `runtime-ab-h200x1.json`: where the Qwen3-30B-A3B cost came from and what took it back). %s" % (
            r.get("base_commit"), same, count(len(cases), "case"), span(nums(r, cases, "new_over_base")),
            r.source())]


def movers_figures(res):
    """The forward comm CTAs with and without the round barrier (racecheck's), same call."""
    r = res["movers-rounds-ab-h100x1.json"]
    runs = r.get("runs")
    # The first run has c5c4276's build beside both settings, the second only the two settings.
    with_base, alone = r.get("cases", within=runs[0]), r.get("cases", within=runs[1])
    key = lambda c: (c["model"], c["T"], c["routing"])  # noqa: E731
    seen = {key(c) for c in with_base}
    cases = with_base + [c for c in alone if key(c) not in seen]  # a case of both runs: the first's
    ratio = lambda c: r.num("free", "median", within=c) / r.num("rounds", "median", within=c)  # noqa: E731
    over_rounds = [ratio(c) for c in cases]
    worst = min(cases, key=ratio)
    differ = sum(1 for c in with_base if r.get("same_as_c5c4276", within=c) is not True)
    bits = "same bits" if not differ else "bits differ in %d of %s" % (differ, count(len(with_base), "case"))
    return [
        "**Comm movers without the round barrier** (the forward's comm CTAs each move rows through their "
        "own buffers; the barrier between rounds is one racecheck can see and now runs only under it; "
        "EP 1, every row resident): forward time %s the barrier's over %s (%s %s); against c5c4276's "
        "build in the same rounds %s, %s. %s" % (
            span(over_rounds), count(len(cases), "case"), case_name(worst["model"], worst["T"], worst["routing"]),
            times(ratio(worst)), span([r.num("free", "over_base", within=c) for c in with_base]), bits,
            r.source())]
