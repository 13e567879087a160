"""The README's figures of the layer's parts and of the machine: the grouped GEMM engine (bf16 and
FP8), the communication layer, the routing schedule, the GPUs' own cuBLAS rate, and the reliability
runs. Each *_figures function takes the results files (readme_figures_common.Results) and returns
its figures, one string each; FIGURES in readme_figures.py puts them in the README's order.
"""
from readme_figures_common import HEADLINE, FigureError, case_name, count, nums, ordered, span


def gemm_figures(res):
    g = res["gemm-h200x1.json"]
    cases = [c for c in g.get("cases") if not str(c.get("form", "")).endswith("_fp8")]  # BF16 forms (FP8: its own figure)

    def pick(name, rows=512, routing="uniform"):
        for c in cases:
            if (c.get("name"), c.get("rows_per_expert"), c.get("routing")) == (name, rows, routing):
                return c
        raise FigureError("%s: no case %s, %d rows per expert, %s" % (g.name, name, rows, routing))

    fc1, fc2 = pick("dsv3-fc1"), pick("dsv3-fc2")
    fused = [c for c in cases if c.get("form") == "dgrad_swiglu" and "torch_dgrad_swiglu_tflops" in c]
    if not fused:
        raise FigureError("%s: no dgrad_swiglu case with torch_dgrad_swiglu_tflops" % g.name)
    ratios = [g.num("mok_tflops", within=c) / g.num("torch_dgrad_swiglu_tflops", within=c) for c in fused]
    return [
        "**Grouped GEMM engine** on one GPU, DeepSeek-V3 experts at 512 rows each (uniform): FC1 with the "
        "fused SwiGLU %.0f TF/s, FC2 %.0f TF/s (torch._grouped_mm %.0f / %.0f; bf16 peak %.0f TF/s measured "
        "in that run). Over all %s (forms %s; %s rows per expert) mok's rate is %s torch._grouped_mm's; "
        "FC2's dgrad fused with the SwiGLU backward is %s torch's grouped GEMM plus elementwise ops (%s). "
        "%s" % (
            g.num("mok_tflops", within=fc1), g.num("mok_tflops", within=fc2),
            g.num("torch_grouped_mm_tflops", within=fc1), g.num("torch_grouped_mm_tflops", within=fc2),
            g.num("peak_bf16_tflops"), count(len(cases), "case"),
            ", ".join(ordered(g.get("form", within=c) for c in cases)),
            span(nums(g, cases, "rows_per_expert"), lambda v: "%d" % v), span(nums(g, cases, "speedup")),
            span(ratios), count(len(fused), "case"), g.source())]


def comm_figures(res):
    c = res["comm-h200x2.json"]

    def run(mode, sms):
        for r in c.get("results"):
            if (r.get("mode"), r.get("method"), r.get("hidden"), r.get("comm_sms")) == (mode, "tma", 7168, sms):
                return r
        raise FigureError("%s: no result %s tma hidden=7168 comm_sms=%d" % (c.name, mode, sms))

    def handoff(mode):
        for r in c.get("signal_latency_detail"):
            if (r.get("mode"), r.get("ctas")) == (mode, 1):
                return r
        raise FigureError("%s: no signal_latency_detail entry %s with 1 CTA" % (c.name, mode))

    pull = [run("pull", s) for s in (8, 16)]
    push = [run("push", s) for s in (8, 16)]
    block = c.num("bytes_per_handoff", "payload_loaded_from_peer", within=handoff("pull")) / 1024
    checked = c.get("results") + c.get("results_bidirectional") + c.get("signal_latency_detail")
    wrong = sum(c.num("wrong_words", within=r) for r in checked)
    return [
        "**Communication layer** (TMA row copies between two GPUs' NCCL windows, H=7168): pull %s GB/s "
        "with 8 / 16 SMs = %s of the %.0f GB/s cudaMemcpyPeer ceiling; push %s GB/s; a %.0f KiB block "
        "handed over with a flag by one CTA in %.1f µs pulled, %.1f µs pushed; %s over %s. %s" % (
            " / ".join("%.0f" % c.num("GBps", within=r) for r in pull),
            " / ".join("%.0f%%" % (100 * c.num("fraction_of_ceiling", within=r)) for r in pull),
            c.num("copy_ceiling_GBps"), " / ".join("%.0f" % c.num("GBps", within=r) for r in push), block,
            c.num("us_per_handoff", within=handoff("pull")), c.num("us_per_handoff", within=handoff("push")),
            count(wrong, "wrong word"), count(len(checked), "checked configuration"), c.source())]


def schedule_figures(res):
    s = res["schedule-h200x2.json"]
    cases = s.get("cases")
    return [
        "**Routing schedule on the GPU** (%s): %s µs over all %s, %s %.0f µs. %s" % (
            s.get("what"), span(nums(s, cases, "schedule_us"), lambda v: "%.0f" % v),
            count(len(cases), "case"),
            case_name(*HEADLINE), s.num("schedule_us", within=s.case(*HEADLINE)), s.source())]


def sustained_figures(res):
    s = res["sustained-h200x2.json"]
    gpus = s.get("cublas_bf16_8192_cubed", "per_gpu")
    smi = s.get("cublas_bf16_8192_cubed", "nvidia_smi")
    return [
        "**The GPUs' own rate**: cuBLAS bf16 8192³ on each GPU alone runs at %s TF/s burst and %s TF/s "
        "sustained (seconds back to back, at the power cap, SM clock median %s MHz): the burst peaks above "
        "are not what a long run gets. %s" % (
            " / ".join("%.0f" % s.num("burst_tflops", within=g) for g in gpus),
            " / ".join("%.0f" % s.num("sustained_tflops_median", within=g) for g in gpus),
            " / ".join("%.0f" % s.num("sm_clock_mhz_median", within=g) for g in smi), s.source())]


def reliability_figures(res):
    r = res["reliability-h200x1.json"]
    cases = r.get("cases")
    passed = sum(1 for c in cases if r.get("passed", within=c) is True)
    skipped = sum(1 for c in cases if c.get("skipped") is True)
    runs = r.get("sanitize")
    tools = ordered(r.get("tool", within=x) for x in runs)
    per_tool = ", ".join("%s %d/%d" % (t, sum(1 for x in runs if x["tool"] == t and x.get("errors") == 0),
                                       sum(1 for x in runs if x["tool"] == t)) for t in tools)
    dirty = ["%s %s (%s)" % (x["tool"], x.get("test"), "no verdict" if x.get("errors") == -1 else
                             "%s errors" % x.get("errors")) for x in runs if x.get("errors") != 0]
    det = r.get("determinism")
    # Runs repeated at a later commit (after a fix): quoted beside the report commit's verdicts.
    reruns = r.data.get("reruns", [])
    rerun_text = "; re-run at a later commit: " + ", ".join(
        "%s %s %s at %s" % (x["tool"], x["test"], "clean" if x["errors"] == 0 else "%s errors" % x["errors"],
                            x["commit"]) for x in reruns) if reruns else ""
    return [
        "**Reliability** on one GPU: %d of %d tests pass, %d skipped, %d failed; %d forward+backward calls "
        "%s. compute-sanitizer: %d of %d runs clean (%s)%s%s%s. %s" % (
            passed, len(cases), skipped, len(cases) - passed - skipped, r.num("runs", within=det),
            "bitwise identical" if r.get("bitwise", within=det) is True else "NOT bitwise identical",
            len(runs) - len(dirty), len(runs), per_tool,
            "; not clean: " + ", ".join(dirty) if dirty else "", rerun_text,
            " (`notes/reliability.md`)" if dirty or reruns else "", r.source())]


def gemm_fp8_figures(res):
    """The block-scaled FP8 grouped forms against cuBLAS's FP8 rate and mok's BF16 form, same run."""
    g = res["gemm-fp8-h200x1.json"]
    cases = g.get("cases")
    fc1 = [c for c in cases if (c.get("name"), c.get("rows_per_expert")) == ("dsv3-fc1_fp8", 2048)]
    if not fc1:
        raise FigureError("%s: no case dsv3-fc1_fp8 at 2048 rows per expert" % g.name)
    c = fc1[0]
    return [
        "**FP8 grouped GEMM** (block-scaled E4M3: 1x128 activation and 128x128 weight scales, fp32 promotion "
        "every 128 of K) on one GPU: DeepSeek-V3 FC1 with SwiGLU and h written in FP8, 2048 rows per expert, "
        "%.0f TF/s (%.0f%% of cuBLAS's FP8 8192^3 %.0f TF/s in that run; %.2fx mok's BF16 FC1). Over all %s "
        "(forms %s; %s rows per expert) %s mok's BF16 form of the same case (`notes/fp8.md`). %s" % (
            g.num("mok_tflops", within=c), 100.0 * g.num("mok_tflops", within=c) / g.num("peak_fp8_tflops"),
            g.num("peak_fp8_tflops"), g.num("x_bf16", within=c), count(len(cases), "case"),
            ", ".join(ordered(g.get("form", within=x) for x in cases)),
            span(nums(g, cases, "rows_per_expert"), lambda v: "%d" % v), span(nums(g, cases, "x_bf16")),
            g.source())]
