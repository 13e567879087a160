"""bench/torch_step.py (the training-step benchmark of issue 21) on CPU tensors at a tiny shape:
it runs mok.MoE and the eager layer from the same weights, their outputs, gradients and losses
agree within bf16 rounding, torch.compile(fullgraph) works, and the results file has every field (measurements that
need a GPU are null on the CPU, never made up)."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load():
    spec = importlib.util.spec_from_file_location("torch_step", os.path.join(ROOT, "bench", "torch_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_step_on_cpu(tmp_path):
    out = tmp_path / "torch-cpu.json"
    load().main(["--device", "cpu", "--models", "tiny", "--tokens", "64", "--layers", "1", "--steps", "2",
                 "--warmup", "1", "--out", str(out), "--commit", "test"])
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["commit"] == "test" and doc["torch"]
    (c,) = doc["cases"]
    for key in ("model", "T", "layers", "mok_step_ms", "eager_step_ms", "speedup", "loss_max_rel_diff",
                "mok_fwd_bwd_ms", "eager_fwd_bwd_ms", "mok_optimizer_ms", "eager_optimizer_ms", "fwd_bwd_speedup",
                "out_rel_diff", "grad_max_rel_diff", "compile_ok", "compile_error", "graph_ok", "op_ms",
                "op_overhead_pct", "op_synced_ms", "op_synced_overhead_pct"):
        assert key in c, key
    assert c["mok_step_ms"] > 0 and c["eager_step_ms"] > 0 and c["mok_fwd_bwd_ms"] > 0
    assert c["loss_max_rel_diff"] < 5e-2, c["loss_max_rel_diff"]
    # one step from the same weights: the outputs and every parameter's gradient agree to bf16 rounding
    assert 0 < c["out_rel_diff"] < 2e-2 or c["out_rel_diff"] == 0, c["out_rel_diff"]
    assert c["grad_max_rel_diff"] < 5e-2, c["grad_max_rel_diff"]
    assert c["compile_ok"] is True, c["compile_error"]
    assert c["graph_ok"] is None and c["op_ms"] is None and c["op_overhead_pct"] is None
    assert c["op_synced_ms"] is None and c["op_synced_overhead_pct"] is None and "op_method" in doc
