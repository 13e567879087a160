#!/usr/bin/env python3
"""Tests of scripts/readme_figures.py on small synthetic results files (ctest
readme_figures_selftest, label cpu): the figures taken from each file, the wording when mok is
slower, errors that name the file and the key, the write / --check cycle, and figures typed by
hand outside the generated block."""
import copy
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import readme_figures as rf  # noqa: E402

META2 = {"device": "NVIDIA H200", "gpus": 2, "date": "2026-11-30T08:39:53Z", "commit": "45ca2101234"}


def fwd_case(model, T, routing, mok_ms, base_ms, bwd=(2.0, 3.0)):
    return {"model": model, "T": T, "routing": routing, "variant": "megakernel", "mok_ms": mok_ms,
            "mok_tflops": 400.0, "check_rel_err": 1e-3, "baseline_ms": base_ms, "speedup": base_ms / mok_ms,
            "mok_bwd_ms": bwd[0], "baseline_bwd_ms": bwd[1], "bwd_speedup": bwd[1] / bwd[0],
            "mok_bwd_tflops": 300.0, "bwd_check_rel_err": 2e-3, "baseline_sustained_ms": base_ms * 1.1,
            "sustained_speedup": 1.1 * base_ms / (mok_ms * 1.05), "mok_sustained_tflops": 380.0,
            "mok_pct_of_peak": 51.28, "mok_sustained_pct_of_sustained_peak": 56.7}


def synthetic():
    """Every results file the script reads, with the keys it reads (values chosen to be easy to spot)."""
    cases = [fwd_case("dsv3", 8192, "uniform", 10.0, 25.0), fwd_case("qwen3-235b", 8192, "uniform", 5.0, 15.0),
             fwd_case("qwen3-30b-a3b", 8192, "uniform", 2.0, 9.0)]
    base = {k: v for k, v in META2.items()}
    base.update({"torch": "2.11.0", "nccl": "2.28.9", "self_check_rel_err": 0.0031, "self_check_bwd_rel_err": 0.0042,
                 "cases": [{"model": c["model"], "T": c["T"], "routing": c["routing"], "baseline_ms": c["baseline_ms"],
                            "baseline_bwd_ms": c["baseline_bwd_ms"],
                            "baseline_sustained_ms": c["baseline_sustained_ms"]} for c in cases]})
    forward = dict(META2, peak_bf16={"burst_tflops_max": 780.0, "sustained_tflops_max": 670.0}, cases=cases,
                   ablation=[dict(model=c["model"], T=c["T"], routing=c["routing"], variant="unfused",
                                  ms=c["mok_ms"] * 1.5) for c in cases] +
                   [dict(model="dsv3", T=8192, routing="uniform", variant="megakernel-ring4", ms=10.1)],
                   gpu_samples=[{"gpu": 0, "sm_clock_mhz_median": 1440.0, "power_capped_share": 1.0},
                                {"gpu": 1, "sm_clock_mhz_median": 1695.0, "power_capped_share": 0.62}])
    gemm_case = {"form": "fc1", "rows_per_expert": 512, "routing": "uniform", "speedup": 1.01}
    gemm = dict(META2, gpus=1, peak_bf16_tflops=780.2, cases=[
        dict(gemm_case, name="dsv3-fc1", mok_tflops=752.8, torch_grouped_mm_tflops=744.1),
        dict(gemm_case, name="dsv3-fc2", form="fc2", mok_tflops=651.6, torch_grouped_mm_tflops=611.7, speedup=1.07),
        dict(gemm_case, name="dsv3-dgrad-fc2-swiglu", form="dgrad_swiglu", rows_per_expert=128, mok_tflops=400.0,
             torch_grouped_mm_tflops=380.0, torch_dgrad_swiglu_tflops=200.0, speedup=0.92)])
    comm = dict(META2, copy_ceiling_GBps=394.45, signal_latency_us={"pull": 4.45, "push": 5.02},
                results=[{"mode": m, "method": "tma", "hidden": 7168, "comm_sms": n, "GBps": g,
                          "fraction_of_ceiling": g / 394.45, "wrong_words": 0}
                         for m, n, g in [("pull", 8, 368.2), ("pull", 16, 374.2), ("push", 8, 340.2),
                                         ("push", 16, 349.1)]],
                results_bidirectional=[{"wrong_words": 0}],
                signal_latency_detail=[{"mode": m, "ctas": 1, "us_per_handoff": us, "wrong_words": 0,
                                        "bytes_per_handoff": {"payload_loaded_from_peer": 131072}}
                                       for m, us in [("pull", 4.45), ("push", 5.02)]])
    schedule = dict(META2, what="graph of the builder", cases=[
        {"model": "dsv3", "T": 8192, "routing": "uniform", "schedule_us": 42.7},
        {"model": "qwen3-235b", "T": 8192, "routing": "uniform", "schedule_us": 30.2}])
    sustained = {"device": "NVIDIA H200", "gpus": 2, "date": "2026-11-30", "cublas_bf16_8192_cubed": {
        "per_gpu": [{"burst_tflops": 789.6, "sustained_tflops_median": 670.9},
                    {"burst_tflops": 806.1, "sustained_tflops_median": 673.5}],
        "nvidia_smi": [{"sm_clock_mhz_median": 1485.0}, {"sm_clock_mhz_median": 1470.0}]}}
    reliability = dict(META2, gpus=1, determinism={"runs": 100, "bitwise": True}, cases=[
        {"name": "A.a", "passed": True}, {"name": "A.b", "passed": True},
        {"name": "B.two_gpus", "passed": False, "skipped": True}, {"name": "C.broken", "passed": False}],
        sanitize=[{"tool": "memcheck", "test": "fwd", "errors": 0}, {"tool": "racecheck", "test": "fwd", "errors": 2},
                  {"tool": "racecheck", "test": "bwd", "errors": -1}])
    one = [dict(c, model=m) for c in cases for m in (c["model"], c["model"] + "/ep8")]
    for c in one:
        if c["model"].endswith("/ep8"):
            c.update(slice_of_ep=8, mok_bwd_pct_of_peak=60.0)
    fp8_one = [dict(model=c["model"], T=c["T"], routing=c["routing"], precision="fp8", mok_ms=c["mok_ms"] / 1.25,
                    mok_tflops=500.0 + 200.0 * ("slice_of_ep" in c), check_rel_err=5e-3, x_bf16=1.25,
                    speedup=c["speedup"] * 1.25) for c in one]
    forward1 = dict(META2, gpus=1, peak_bf16={"burst_tflops_max": 780.0}, cases=one + fp8_one)
    fp8_ab = dict(META2, gpus=1, cases=[
        {"model": m, "T": 8192, "routing": "uniform", "fp8-megakernel": {"median": 1.0},
         "fp8-unfused": {"median": x}} for m, x in (("dsv3", 1.3), ("qwen3-235b", 1.2))])
    peak_fp8 = dict(META2, gpus=1, peak_fp8={"burst_tflops_max": 1250.0})
    mem_case = {"T": 8192, "routing": "uniform", "persistent_bytes_per_layer": 4.0e9, "saved_bytes_per_forward": 2.6e9,
                "baseline_saved_bytes": 2.7e9, "measured_bytes": 6.6e9, "backward_ok": True, "mode": "resident",
                "workspace_bytes": 0}
    training = {"saved": (1e3, 0.6e9, 1.9e9), "recompute": (1e3, 4e6, 1.9e9)}  # persistent, saved, workspace
    memory = dict(META2, gpus=1, cases=[dict(mem_case, model=m, ep=ep) for m in ("dsv3", "qwen3-235b", "qwen3-30b-a3b")
                                        for ep in (1, 8)] +
                  [dict(mem_case, model=m, ep=8, mode=mode, persistent_bytes_per_layer=v[0], saved_bytes_per_forward=v[1],
                        workspace_bytes=v[2], backward_ok=mode == "saved" or m != "qwen3-235b")
                   for m in ("dsv3", "qwen3-235b", "qwen3-30b-a3b") for mode, v in training.items()] +
                  [dict(mem_case, model="dsv3", ep=1, mode="saved", persistent_bytes_per_layer=0, saved_bytes_per_forward=0.8e9,
                        workspace_bytes=2.0e9, measured_bytes=2.81e9, measured_windows="new")])
    torch_case = {"T": 8192, "layers": 2, "compile_ok": True, "graph_ok": True}
    torch_step = dict(META2, gpus=1, cases=[
        dict(torch_case, model="qwen3-30b-a3b", mok_step_ms=14.4, eager_step_ms=30.0, speedup=30.0 / 14.4,
             op_overhead_pct=17.6),
        dict(torch_case, model="qwen3-235b", mok_step_ms=49.8, eager_step_ms=78.1, speedup=78.1 / 49.8,
             op_overhead_pct=18.1)])
    train_mem = {"share_workspace": True, "total_bytes": 2.8e9, "workspace_bytes": 2.0e9}
    training = dict(META2, gpus=1, cases=[
        dict(c, macrobatch_tokens=8192, memory=train_mem, bwd_speedup=c["baseline_bwd_ms"] / c["mok_bwd_ms"])
        for c in cases])
    program = dict(META2, gpus=1, field="mok_bwd_ms", variants=["unfused", "fused-merged"], cases=[
        {"model": m, "T": 8192, "routing": "uniform", "unfused": {"runs": [10.0], "median": 10.0},
         "fused-merged": {"runs": [r * 10.0], "median": r * 10.0, "over_unfused": r}}
        for m, r in (("dsv3", 1.04), ("qwen3-235b", 1.02))])
    hold = dict(META2, gpus=1, field="mok_bwd_ms", variants=["carry", "hold"], cases=[
        {"model": m, "T": 8192, "routing": "uniform", "carry": {"runs": [20.0], "median": 20.0},
         "hold": {"runs": [r * 20.0], "median": r * 20.0, "over_carry": r}}
        for m, r in (("dsv3", 0.98), ("dsv3/ep8", 0.99))])
    streams = dict(META2, gpus=1, field="mok_bwd_ms", variants=["one_stream", "side_stream"], cases=[
        {"model": m, "T": 8192, "routing": "uniform", "mode": mode, "one_stream": {"runs": [20.0], "median": 20.0},
         "side_stream": {"runs": [r * 20.0], "median": r * 20.0, "over_one_stream": r}}
        for m, mode, r in (("dsv3", "windows", 0.98), ("dsv3/ep8", "windows", 0.99), ("dsv3", "resident", 1.0))])
    fp8 = dict(META2, gpus=1, peak_fp8_tflops=1400.0, cases=[
        {"name": "dsv3-fc1_fp8", "form": "fc1_fp8", "precision": "fp8", "rows_per_expert": r, "routing": "uniform",
         "mok_tflops": 900.0 + r / 100, "x_bf16": 1.3 + r / 10000} for r in (128, 2048)])
    runtime = dict(META2, gpus=1, base_commit="c5c4276", cases=[
        {"model": m, "T": 8192, "routing": "uniform", "base_ms": 1.0, "new_ms": x, "new_over_base": x,
         "bitwise_same": True} for m, x in (("dsv3", 1.0), ("qwen3-30b-a3b", 1.028))])
    movers = dict(META2, gpus=1, runs=[
        {"cases": [{"model": "dsv3", "T": 8192, "routing": "uniform", "rounds": {"median": 1.0},
                    "free": {"median": 1.0, "over_base": 1.0}, "same_as_c5c4276": True}]},
        {"cases": [{"model": "qwen3-30b-a3b/ep8", "T": 8192, "routing": "zipf", "rounds": {"median": 2.0},
                    "free": {"median": 1.88, "over_rounds": 0.94}}]}])
    fp8_bwd = dict(META2, gpus=1, field="mok_bwd_ms", variants=["bf16", "fp8"], cases=[
        {"model": m, "T": 8192, "routing": "uniform", "bf16": {"runs": [b], "median": b},
         "fp8": {"runs": [f], "median": f, "over_bf16": f / b}}
        for m, b, f in (("dsv3/ep8", 20.0, 16.0), ("qwen3-30b-a3b/ep8", 2.0, 2.5))])
    mx_part = lambda ms: {"cases": [  # noqa: E731  (fp8 vs mxfp8 medians per case)
        {"model": m, "T": 8192, "routing": "uniform", "fp8": {"runs": [f], "median": f},
         "mxfp8": {"runs": [x], "median": x, "over_fp8": x / f}} for m, f, x in ms]}
    mxfp8 = dict(META2, gpus=1, forward=mx_part([("dsv3/ep8", 7.0, 7.07), ("qwen3-235b/ep8", 3.0, 3.18)]),
                 backward=mx_part([("dsv3/ep8", 17.0, 17.0)]))
    tr_part = lambda ms: {"cases": [  # noqa: E731  (FP8 training: unfused vs windows, per case)
        {"model": m, "T": 8192, "routing": "uniform", "unfused_resident": {"runs": [u], "median": u},
         "windows_saved": {"runs": [w], "median": w}} for m, u, w in ms]}
    fp8_train = dict(META2, gpus=1, forward=tr_part([("dsv3/ep8", 11.5, 7.5), ("qwen3-235b/ep8", 5.0, 3.0)]),
                     backward=tr_part([("dsv3/ep8", 17.0, 20.0), ("qwen3-235b/ep8", 7.5, 8.5)]))
    fp8_mem = dict(META2, cases=[
        {"model": "dsv3", "ep": 8, "T": 8192, "routing": "uniform", "mode": mode, "workspace_bytes": 3.4e9,
         "persistent_bytes_per_layer": 1.41e9, "saved_bytes_per_forward": saved}
        for mode, saved in (("saved", 0.64e9), ("recompute", 0.005e9))])
    return {"fp8-train-modes-h200x1.json": fp8_train, "memory-fp8-h200x1.json": fp8_mem, "mxfp8-h200x1.json": mxfp8, "fp8-layer-backward-h200x1.json": fp8_bwd, "fp8-forward-h200x1.json": fp8_ab, "peak-fp8-h200x1.json": peak_fp8, "gemm-fp8-h200x1.json": fp8, "runtime-ab-h100x1.json": runtime, "movers-rounds-ab-h100x1.json": movers, "backward-program-h200x1.json": program, "window-hold-ab-h200x1.json": hold, "backward-streams-ab-h200x1.json": streams, "training-h200x1.json": training, "forward-h200x2.json": forward, "baseline-h200x2.json": base, "gemm-h200x1.json": gemm,
            "comm-h200x2.json": comm, "schedule-h200x2.json": schedule, "sustained-h200x2.json": sustained,
            "reliability-h200x1.json": reliability, "forward-h200x1.json": forward1, "memory-h200x1.json": memory,
            "torch-h200x1.json": torch_step}


README = """# project

## Status
Prose without figures, `code 2.5x` aside.

<!-- figures:begin -->
stale text
<!-- figures:end -->

Next: more prose.

## Other
Numbers here (3.5 ms) are not the script's business.
"""


class Fixture(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.results = os.path.join(self.tmp.name, "results")
        os.mkdir(self.results)
        self.readme = os.path.join(self.tmp.name, "README.md")
        self.write_results(synthetic())
        with open(self.readme, "w", encoding="utf-8") as f:
            f.write(README)

    def tearDown(self):
        self.tmp.cleanup()

    def write_results(self, files):
        for name, data in files.items():
            with open(os.path.join(self.results, name), "w") as f:
                json.dump(data, f)

    def block(self):
        return " ".join(rf.render(self.results)[0].split())  # wrapping undone

    def main(self, *args):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            rc = rf.main(["--results", self.results, "--readme", self.readme] + list(args))
        return rc, out.getvalue(), err.getvalue()

    def readme_text(self):
        with open(self.readme, encoding="utf-8") as f:
            return f.read()


class Figures(Fixture):
    def test_forward_figures_come_from_the_cases(self):
        b = self.block()
        self.assertIn("**2.50–4.50× faster** over all 3 cases", b)  # 25/10 .. 9/2
        self.assertIn("DeepSeek-V3 T=8192 uniform: **10.00 vs 25.00 ms** (2.50×), 400 TF/s per GPU = 51% of the "
                      "780 TF/s cuBLAS bf16 burst peak", b)
        self.assertIn("Qwen3-235B 3.00×, Qwen3-30B-A3B 4.50×", b)
        self.assertIn("vs the unfused path the megakernel is 1.50× faster over all 3 cases; 2 other variants "
                      "(`unfused`, `megakernel-ring4`) and other comm-SM / minibatch settings, 4 runs", b)
        self.assertIn("**1.50× faster** over all 3 cases; DeepSeek-V3 T=8192 uniform: 2.00 vs 3.00 ms", b)
        self.assertIn("1440 / 1695 MHz (GPU 0 / 1), held down by the power cap in 100% / 62%", b)

    def test_one_gpu_and_memory_figures_come_from_the_cases(self):
        b = " ".join(self.block().split())
        # forward + backward: (25 + 3) / (10 + 2) .. (9 + 3) / (2 + 2)
        self.assertIn("forward **2.50–4.50× faster** and forward + backward 2.33–3.00× the baseline over 3 cases", b)
        self.assertIn("DeepSeek-V3 EP 1 with every routed row resident (`workspace_budget_bytes = 0`) 6.6 GB, measured 6.6 GB", b)
        self.assertIn("DeepSeek-V3 EP 1 in the training mode (the training default, the layer with the workspace: 2.80 GB, "
                      "measured 2.81 GB).", b)
        # EP 8 training modes: 0.6 GB per layer saved, 4 MB recompute; 58 x 0.6 + 1.9 = 36.7 GB
        self.assertIn("at most 1.90 GB per GPU", b)
        self.assertIn("at EP 8 0.60 / 0.60 / 0.60 GB per layer", b)
        self.assertIn("4 / 4 / 4 MB with full recompute: 58 DeepSeek-V3 layers hold 36.7 GB (saved) or 2.1 GB", b)
        self.assertIn("the megakernel backward runs in 5 of the 6 EP-8 cases", b)

    def test_training_step_figure(self):
        b = " ".join(self.block().split())
        self.assertIn("Qwen3-30B-A3B 14.4 vs 30.0 ms (2.08×), Qwen3-235B 49.8 vs 78.1 ms (1.57×)", b)
        self.assertIn("torch.compile (fullgraph) works, a CUDA graph of the step works", b)
        self.assertIn("time against the C++ layer's (mok_bench): +17.6%–+18.1%", b)

    def test_training_mode_figure(self):
        b = " ".join(self.block().split())
        self.assertIn("backward 1.50× and forward 2.50–4.50× (the baseline's time over mok's, 3 cases)", b)
        self.assertIn("DeepSeek-V3 T=8192 uniform: backward 2.0 ms vs the baseline's 3.0 ms with a ring of 8192 rows, "
                      "the layer holding 0.80 GB besides the workspace (58 layers: 48.4 GB)", b)

    def test_window_hold_figure(self):
        b = " ".join(self.block().split())
        self.assertIn("backward time 0.98–0.99× the carry's over 2 cases (", b)
        self.assertIn("19.60 vs 20.00 ms", b)

    def test_movers_figure(self):
        b = " ".join(self.block().split())
        self.assertIn("forward time 0.94–1.00× the barrier's over 2 cases (Qwen3-30B-A3B EP-8 slice T=8192 zipf "
                      "0.94×); against c5c4276's build in the same rounds 1.00×, same bits.", b)

    def test_side_stream_figure(self):
        b = " ".join(self.block().split())
        self.assertIn("backward time over one stream's: windows 0.98–0.99× over 2 cases (DeepSeek-V3 T=8192 uniform "
                      "19.60 vs 20.00 ms; DeepSeek-V3 EP-8 slice T=8192 uniform 19.80 vs 20.00 ms); resident 1.00× "
                      "over 1 case (DeepSeek-V3 T=8192 uniform 20.00 vs 20.00 ms).", b)

    def test_backward_program_figure(self):
        b = " ".join(self.block().split())
        self.assertIn("T = 8192, dsv3 / qwen3-235b): its time over the unfused kernels' fused-merged 1.02–1.04×", b)

    def test_fp8_and_runtime_figures(self):
        b = " ".join(self.block().split())
        self.assertIn("2048 rows per expert, 920 TF/s (66% of cuBLAS's FP8 8192^3 1400 TF/s in that run; 1.50x", b)
        self.assertIn("Over all 2 cases (forms fc1_fp8; 128–2048 rows per expert) 1.31–1.50× mok's BF16 form", b)
        self.assertIn("outputs bitwise identical in 2 of 2 cases; time 1.00–1.03× the base's", b)
        # the FP8 forward: the FP8 cases of the one-GPU file only (its bf16 ones feed the figure above)
        self.assertIn("**1.25×** the bf16 megakernel's rate over 6 cases and against the baseline 3.12–5.62× faster", b)
        self.assertIn("its EP-8 slice 8.00 ms = 700 TF/s (56% of cuBLAS's FP8 8192^3 1250 TF/s", b)
        self.assertIn("the FP8 unfused path takes 1.20–1.30× the FP8 megakernel's time over 2 cases", b)
        self.assertIn("1250 TF/s, measured in another call", b)
        self.assertIn("peak-fp8-h200x1.json", b)
        # the FP8 backward: bf16 over fp8 time per case, a slower case counted, the names spelled out
        self.assertIn("0.80–1.25× the bf16 backward's speed over 2 cases, slower in 1 (FP8 vs bf16: DeepSeek-V3 "
                      "EP-8 slice 16.00 vs 20.00 ms; Qwen3-30B-A3B EP-8 slice 2.50 vs 2.00 ms)", b)
        # FP8 training: forward + backward of each path, the backward beside it, the planner's memory
        self.assertIn("DeepSeek-V3 EP-8 slice 27.5 vs 28.5 ms (backward 20.00 vs 17.00 ms); Qwen3-235B EP-8 slice "
                      "11.5 vs 12.5 ms (backward 8.50 vs 7.50 ms)", b)
        self.assertIn("DeepSeek-V3 EP 8 in FP8 2.05 GB per layer (1.42 GB with full recompute; of it the forward's "
                      "weight codes 1.41 GB) and a 3.40 GB workspace", b)
        # MXFP8: its time over FP8's, forward and backward, from the file's two parts
        self.assertIn("the forward megakernel takes 1.01–1.06× FP8's time over 2 cases, the unfused backward 1.00× "
                      "over 1 case", b)

    def test_fp8_forward_figure_takes_the_same_runs_peak_when_it_has_one(self):
        docs = synthetic()
        docs["forward-h200x1.json"]["peak_fp8"] = {"burst_tflops_max": 1400.0}
        del docs["peak-fp8-h200x1.json"]
        self.write_results(docs)
        os.remove(os.path.join(self.results, "peak-fp8-h200x1.json"))
        line = [l for l in rf.render(self.results)[0].split("\n- ") if l.startswith("**FP8 forward**")][0]
        line = " ".join(line.split())
        self.assertIn("(50% of cuBLAS's FP8 8192^3 1400 TF/s, measured in that run)", line)
        self.assertNotIn("peak-fp8-h200x1.json", line)

    def test_one_gpu_figures_quote_the_newest_main_job(self):
        """forward-h200x1.json and forward-h100x1.json: the run with the later date is quoted."""
        docs = synthetic()
        h100 = json.loads(json.dumps(docs["forward-h200x1.json"]))
        h100.update(device="NVIDIA H100 80GB HBM3", date="2026-12-07T23:06:34Z", commit="d726e33")
        self.write_results({"forward-h100x1.json": h100})

        def one_gpu_line():
            return [" ".join(l.split()) for l in rf.render(self.results)[0].split("\n- ")
                    if l.startswith("**One GPU**")][0]
        self.assertIn("[`forward-h100x1.json`](bench/results/forward-h100x1.json): 1× NVIDIA H100 80GB HBM3, commit "
                      "d726e33, 2026-12-07*", one_gpu_line())
        h100["date"] = "2026-11-01"  # older than the H200's run: that one is quoted
        self.write_results({"forward-h100x1.json": h100})
        self.assertIn("[`forward-h200x1.json`]", one_gpu_line())

    def test_every_line_names_its_results_file_and_run(self):
        lines = rf.render(self.results)[0].split("\n- ")[1:]
        self.assertEqual(len(lines), 24)
        for line in lines:
            self.assertRegex(" ".join(line.split()), r"\*\[`[a-z0-9-]+\.json`\]\(bench/results/[a-z0-9-]+\.json\): "
                                                     r"\d× NVIDIA H200, commit (45ca210|not recorded), 2026-11-30\*")

    def test_other_files(self):
        b = self.block()
        self.assertIn("FC1 with the fused SwiGLU 753 TF/s, FC2 652 TF/s (torch._grouped_mm 744 / 612", b)
        self.assertIn("Over all 3 cases (forms fc1, fc2, dgrad_swiglu; 128–512 rows per expert) mok's rate is "
                      "0.92–1.07× torch._grouped_mm's", b)
        self.assertIn("SwiGLU backward is 2.00× torch's grouped GEMM plus elementwise ops (1 case)", b)
        self.assertIn("pull 368 / 374 GB/s with 8 / 16 SMs = 93% / 95% of the 394 GB/s", b)
        self.assertIn("a 128 KiB block handed over with a flag by one CTA in 4.5 µs pulled, 5.0 µs pushed; "
                      "0 wrong words over 7 checked", b)
        self.assertIn("(graph of the builder): 30–43 µs over all 2 cases, DeepSeek-V3 T=8192 uniform 43 µs", b)
        self.assertIn("790 / 806 TF/s burst and 671 / 674 TF/s sustained", b)
        self.assertIn("2 of 4 tests pass, 1 skipped, 1 failed; 100 forward+backward calls bitwise identical", b)
        self.assertIn("1 of 3 runs clean (memcheck 1/1, racecheck 0/2); not clean: racecheck fwd (2 errors), "
                      "racecheck bwd (no verdict)", b)

    def test_a_slower_case_is_not_called_faster(self):
        files = synthetic()
        files["forward-h200x2.json"]["cases"][1]["speedup"] = 0.9
        self.write_results(files)
        self.assertIn("**0.90–4.50× the speed (slower in 1 of 3 cases)**", self.block())
        files["gemm-h200x1.json"]["cases"].pop()
        self.write_results(files)
        with self.assertRaisesRegex(rf.FigureError, "gemm-h200x1.json: no dgrad_swiglu case"):
            rf.render(self.results)

    def test_a_missing_key_names_the_file_and_the_key(self):
        files = synthetic()
        del files["forward-h200x2.json"]["peak_bf16"]["burst_tflops_max"]
        self.write_results(files)
        with self.assertRaisesRegex(rf.FigureError, r"forward-h200x2\.json: no key peak_bf16\.burst_tflops_max"):
            rf.render(self.results)

    def test_a_missing_case_is_named(self):
        files = synthetic()
        files["schedule-h200x2.json"]["cases"].pop(0)
        self.write_results(files)
        with self.assertRaisesRegex(rf.FigureError, r"schedule-h200x2\.json: no entry dsv3 T=8192 uniform"):
            rf.render(self.results)

    def test_baseline_times_must_be_the_baseline_files(self):
        files = synthetic()
        files["baseline-h200x2.json"]["cases"][0]["baseline_ms"] = 26.0
        self.write_results(files)
        with self.assertRaisesRegex(rf.FigureError, "not joined with this baseline"):
            rf.render(self.results)

    def test_the_committed_results_render(self):
        block, _ = rf.render(os.path.join(os.path.dirname(HERE), "bench", "results"))
        self.assertTrue(block.startswith(rf.BEGIN) and block.endswith(rf.END + "\n"))


class Cli(Fixture):
    def test_write_then_check_then_stale(self):
        rc, out, err = self.main("--check")
        self.assertEqual(rc, 1)
        self.assertIn("-stale text", out)
        self.assertIn("does not match the results files", err)
        self.assertIn("stale text", self.readme_text(), "--check must not write")
        self.assertEqual(self.main()[0], 0)
        text = self.readme_text()
        self.assertNotIn("stale text", text)
        self.assertTrue(text.startswith("# project\n\n## Status\n") and text.endswith("Numbers here (3.5 ms) are "
                                                                                     "not the script's business.\n"))
        self.assertEqual(self.main("--check"), (0, "", ""))
        files = synthetic()
        files["forward-h200x2.json"]["cases"][0]["mok_ms"] = 9.5
        self.write_results(files)
        rc, out, _ = self.main("--check")
        self.assertEqual(rc, 1)
        added = [l for l in out.splitlines() if l.startswith("+") and not l.startswith("+++")]
        self.assertTrue(any("**9.50 vs 25.00 ms**" in l for l in added), out)

    def test_a_figure_typed_into_the_section_fails_the_check(self):
        self.main()
        text = self.readme_text().replace("Next: more prose.", "Next: more prose, now 2.5× faster.")
        with open(self.readme, "w", encoding="utf-8") as f:
            f.write(text)
        rc, _, err = self.main("--check")
        self.assertEqual(rc, 1)
        line = self.readme_text().splitlines().index("Next: more prose, now 2.5× faster.") + 1
        self.assertIn("line %d: '2.5×'" % line, err)
        self.assertNotIn("3.5 ms", err)  # another section
        self.assertNotIn("code 2.5x", err)  # a code span

    def test_hand_typed_figure_patterns(self):
        for prose in ("11.62 vs 26.93 ms", "95% of", "~40 µs", "2.07–5.18×", "at 497 TF/s", "1.5e-3 apart"):
            text = README.replace("Next: more prose.", prose)
            self.assertTrue(rf.hand_typed_figures(text, "R"), prose)
        for prose in ("H200 GPUs, FP8, sm_90a, 2-CTA clusters, FC2 rows", "`Config::fwd_clusters` = 1"):
            text = README.replace("Next: more prose.", prose)
            self.assertEqual(rf.hand_typed_figures(text, "R"), [], prose)

    def test_markers_must_be_one_pair(self):
        for text in ("# no markers\n", README.replace("<!-- figures:end -->", ""),
                     README + "<!-- figures:begin -->\n<!-- figures:end -->\n"):
            with open(self.readme, "w", encoding="utf-8") as f:
                f.write(text)
            rc, _, err = self.main("--check")
            self.assertEqual(rc, 2)
            self.assertIn("needs exactly one '<!-- figures:begin ... -->' line", err)

    def test_unreadable_results_are_named(self):
        with open(os.path.join(self.results, "comm-h200x2.json"), "w") as f:
            f.write("{not json")
        rc, _, err = self.main("--check")
        self.assertEqual(rc, 2)
        self.assertIn("comm-h200x2.json: not JSON", err)
        os.remove(os.path.join(self.results, "comm-h200x2.json"))
        rc, _, err = self.main("--check")
        self.assertEqual(rc, 2)
        self.assertIn("comm-h200x2.json: cannot be read", err)

    def test_a_results_file_no_figure_quotes_is_noted(self):
        self.write_results({"forward-h100x8.json": copy.deepcopy(synthetic()["forward-h200x2.json"])})
        self.main()
        rc, _, err = self.main("--check")
        self.assertEqual(rc, 0)
        self.assertIn("note: forward-h100x8.json is quoted by no figure", err)

    def test_runs_as_a_script(self):
        self.main()
        p = subprocess.run([sys.executable, os.path.join(HERE, "readme_figures.py"), "--check", "--results",
                            self.results, "--readme", self.readme], capture_output=True, text=True)
        self.assertEqual((p.returncode, p.stdout, p.stderr), (0, "", ""))


if __name__ == "__main__":
    unittest.main(verbosity=2)
