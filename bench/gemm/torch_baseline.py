#!/usr/bin/env python3
"""PyTorch baseline for bench/gemm, run in the same device call as mok_gemm_bench.

Reads the cases mok_gemm_bench wrote (with their exact per-expert row counts), times
torch._grouped_mm on the same problems (same M/N/K, same groups, random bf16 data, buffer sets
rotated when one set would fit in L2; median of CUDA-event-timed launches after warm-up), and
torch.matmul 8192^3 in bf16 and torch._scaled_mm 8192^3 in FP8 as the cuBLAS dense peaks. Writes
a JSON with one entry per case.

  python3 bench/gemm/torch_baseline.py --cases mok.json --out torch.json
"""
import argparse
import json
import statistics

import torch


def time_ms(fn, reps, warm=3):
    """Median over batches of back-to-back launches between two CUDA events (Python dispatch
    overlaps the GPU, as in mok_gemm_bench), per launch."""
    for i in range(warm):
        fn(i)
    torch.cuda.synchronize()

    def batch(n, first):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fn(first + i)
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / n

    est = batch(3, 0)
    per = int(min(50, max(3, 2.0 / max(est, 1e-3))))
    nb = max(5, reps // per)
    return statistics.median(batch(per, b * per) for b in range(nb))


def peak_tflops():
    n = 8192
    a = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    b = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    ms = time_ms(lambda i: torch.matmul(a[i % 2], b[i % 2]), reps=30, warm=5)
    return 2.0 * n**3 / (ms * 1e-3) / 1e12, ms


def peak_fp8_tflops():
    """torch._scaled_mm 8192^3 on E4M3 operands (tensor-wise scales, bf16 out): cuBLAS's dense FP8
    rate in this run, the peak the FP8 forms are measured against. (0, 0) where it fails."""
    n = 8192
    try:
        a = [torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn) for _ in range(2)]
        b = [torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t() for _ in range(2)]  # column-major
        one = torch.ones((), device="cuda", dtype=torch.float32)
        ms = time_ms(lambda i: torch._scaled_mm(a[i % 2], b[i % 2], one, one, out_dtype=torch.bfloat16), reps=30, warm=5)
    except Exception as ex:  # noqa: BLE001 - reported, the rest still runs
        print(f"cuBLAS fp8 8192^3 failed: {ex}", flush=True)
        return 0.0, 0.0
    return 2.0 * n**3 / (ms * 1e-3) / 1e12, ms


def copy_tbps():
    """Device-to-device copy of 2 GiB, bytes read + written per second: the memory ceiling the
    roofline of bench/gemm/roofline.py uses (same run, same GPU)."""
    n = 1 << 30  # bf16 elements: 2 GiB per buffer
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda i: dst.copy_(src), reps=30, warm=3)
    del src, dst
    torch.cuda.empty_cache()
    return 2.0 * 2 * n / (ms * 1e-3) / 1e12


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(torch.bfloat16)


def build(case):
    """Returns (make_set, call) for one case: make_set() allocates one buffer set, call(set) runs
    torch._grouped_mm on it."""
    counts = case["counts"]
    E, M = len(counts), sum(counts)
    H, I = case["hidden"], case["inter"]
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    form, name = case["form"], case["name"]

    if form == "fc1":  # [M, H] x [E, 2I, H]^T
        def make():
            return rnd(M, H), rnd(E, 2 * I, H, scale=0.03)
        return make, lambda s: torch._grouped_mm(s[0], s[1].transpose(-2, -1), offs=offs), M
    if form == "fc2":  # [M, I] x [E, H, I]^T
        def make():
            return rnd(M, I), rnd(E, H, I, scale=0.03)
        return make, lambda s: torch._grouped_mm(s[0], s[1].transpose(-2, -1), offs=offs), M
    if form in ("fc1_fp8", "fc2_fp8", "dgrad_fp8", "dgrad_swiglu_fp8"):
        # [M, k] x [E, n, k]^T with E4M3 operands (fc1: k = H, n = 2I, the gate and up products, no
        # SwiGLU; fc2: k = I, n = H): torch's FP8 grouped GEMM takes row-wise scales (per row of a,
        # per output column of w), not mok's 1x128 / 128x128 blocks: the same FLOPs and operand
        # bytes, another scaling recipe (scales of 1 here).
        # (dgrad_fp8, dgrad_swiglu_fp8: the case's k and n, the plain product on a dgrad's shape)
        k, n = (H, 2 * I) if form == "fc1_fp8" else (I, H) if form == "fc2_fp8" else (case["k"], case["n"])
        def make():
            a = rnd(M, k).to(torch.float8_e4m3fn)
            w = rnd(E, n, k, scale=0.03).to(torch.float8_e4m3fn)
            return (a, w, torch.ones(M, device="cuda", dtype=torch.float32),
                    torch.ones(E, n, device="cuda", dtype=torch.float32))
        return make, lambda s: torch._scaled_grouped_mm(s[0], s[1].transpose(-2, -1), s[2], s[3], offs=offs,
                                                        out_dtype=torch.bfloat16), M
    if form in ("dgrad", "dgrad_fc1"):  # [M, k] x [E, k, n] (dgrad_fc1: mok reads the K blocks from w_gate and w_up)
        k, n = case["k"], case["n"]
        def make():
            return rnd(M, k), rnd(E, k, n, scale=0.03)
        return make, lambda s: torch._grouped_mm(s[0], s[1], offs=offs), M
    if form == "dgrad_swiglu":  # d_h = [M, H] x [E, H, I]; main() also times the SwiGLU backward
        def make():
            return rnd(M, H), rnd(E, H, I, scale=0.03), rnd(M, 2 * I)
        return make, lambda s: torch._grouped_mm(s[0], s[1], offs=offs), M
    if form == "wgrad":  # out[e] = a_e^T b_e: [m, M] x [M, n] grouped along M
        m, n = case["m"], case["n"]
        def make():
            return rnd(M, m), rnd(M, n)
        return make, lambda s: torch._grouped_mm(s[0].t(), s[1], offs=offs), M
    if form == "wgrad_fp8":  # the K-grouped (2d x 2d) FP8 product, torch's row-wise scales (per output row / column)
        m, n = case["m"], case["n"]
        def make():
            a = rnd(m, M).to(torch.float8_e4m3fn)  # [m, M]: K-major, as mok reads it
            b = rnd(n, M).to(torch.float8_e4m3fn)  # [n, M]: b^T, column-major [M, n]
            return (a, b, torch.ones(E * m, device="cuda", dtype=torch.float32),
                    torch.ones(E * n, device="cuda", dtype=torch.float32))
        return make, lambda s: torch._scaled_grouped_mm(s[0], s[1].t(), s[2], s[3], offs=offs,
                                                        out_dtype=torch.bfloat16), M
    raise ValueError(f"unknown form {form} ({name})")


def same_work(case, call, sets):
    """(key, fn(i)) timing torch doing what mok's fused form of this case does, or None: fc1 is the
    grouped GEMM then SwiGLU on its output; dgrad_swiglu the grouped GEMM then d_g and d_u from the
    forward's gate/up pre-activations (torch's natural layout: g and u as two halves; bf16
    elementwise ops, each rounding to bf16, so the same work, not the same bits)."""
    inter, n = case.get("inter"), len(sets)
    if case["form"] == "fc1":
        def fc1_swiglu(i):
            y = call(sets[i % n])
            return torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
        return "torch_fc1_swiglu", fc1_swiglu
    if case["form"] == "dgrad_swiglu":
        def dgrad_swiglu(i):
            s = sets[i % n]
            dh = call(s)
            g, u = s[2][:, :inter], s[2][:, inter:]
            sg = torch.sigmoid(g)
            return torch.cat([sg * (1 + g * (1 - sg)) * u * dh, g * sg * dh], dim=1)
        return "torch_dgrad_swiglu", dgrad_swiglu
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--only", help="NAME/ROUTING/ROWS: run this case alone (e.g. under ncu)")
    ap.add_argument("--no-peak", action="store_true")
    a = ap.parse_args()
    mok = json.load(open(a.cases))
    if a.only:
        mok["cases"] = [c for c in mok["cases"]
                        if f"{c['name']}/{c['routing']}/{c['rows_per_expert']}" == a.only]
    torch.manual_seed(0)
    peak, peak_ms = (0.0, 0.0) if a.no_peak else peak_tflops()
    print(f"cuBLAS bf16 8192^3: {peak:.1f} TFLOP/s ({peak_ms:.3f} ms)", flush=True)
    peak8, peak8_ms = (0.0, 0.0) if a.no_peak else peak_fp8_tflops()
    print(f"cuBLAS fp8 8192^3: {peak8:.1f} TFLOP/s ({peak8_ms:.3f} ms)", flush=True)
    copy = 0.0 if a.no_peak else copy_tbps()
    print(f"device copy: {copy:.2f} TB/s (read + write)", flush=True)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "peak_bf16_tflops": peak, "peak_fp8_tflops": peak8, "copy_tbps": copy, "cases": []}
    for case in mok["cases"]:
        entry = {k: case[k] for k in ("name", "form", "rows_per_expert", "routing")}
        try:
            make, call, _ = build(case)
            one = make()
            set_bytes = sum(t.numel() * t.element_size() for t in one)
            nsets = max(1, min(4, (256 << 20) // max(set_bytes, 1) + 1))
            sets = [one] + [make() for _ in range(nsets - 1)]
            ms = time_ms(lambda i: call(sets[i % nsets]), reps=a.reps)
            entry["torch_ms"] = ms
            entry["torch_tflops"] = case["flops"] / (ms * 1e-3) / 1e12
            same = same_work(case, call, sets)
            if same:
                # What mok's fused form does, done in torch: the product plus the activation.
                key, fn = same
                ms2 = time_ms(fn, reps=a.reps)
                entry[f"{key}_ms"] = ms2
                entry[f"{key}_tflops"] = case["flops"] / (ms2 * 1e-3) / 1e12
            del sets, one
        except Exception as ex:  # noqa: BLE001 - report and keep going
            entry["torch_error"] = f"{type(ex).__name__}: {ex}"[:300]
            print(f"{case['name']}: torch failed: {entry['torch_error']}", flush=True)
        torch.cuda.empty_cache()
        out["cases"].append(entry)
        t = entry.get("torch_tflops")
        t2 = entry.get("torch_dgrad_swiglu_tflops")
        print(f"{case['name']:<32} {case['form']:<12} {case['rows_per_expert']:>5} {case['routing']:<8} "
              f"mok {case['mok_tflops']:7.1f}  torch {t if t is None else round(t, 1)!s:>7}"
              + ("" if t2 is None else f"  torch + SwiGLU backward {t2:7.1f}"), flush=True)
    json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
