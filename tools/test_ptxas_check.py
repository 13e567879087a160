#!/usr/bin/env python3
"""Self-test of ptxas_check.py: it must fail on spills, stack frames, missing reports,
non-sm_90a code and serialised or waited-for wgmmas, and pass a clean report (so the CI gate
cannot pass vacuously)."""
import pathlib
import subprocess
import sys
import tempfile

CHECK = pathlib.Path(__file__).with_name("ptxas_check.py")

CLEAN = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]
"""
SERIAL = ("ptxas info    : ({}) Potential Performance Loss: wgmma.mma_async instructions are serialized "
          "due to {} in the function '_Z6kernelPf'\n")
INJECTED = ("ptxas info    : (C7517) warpgroup.wait is injected in around line 12 by compiler to allow use of "
            "registers defined by GMMA in function '_Z6kernelPf'\n")


def run(log_text, with_log=True, allow=""):
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        (d / "k.cu.o").write_bytes(b"")
        if with_log:
            (d / "k.cu.o.ptxas.log").write_text(log_text)
        (d / "allow.txt").write_text(allow)
        r = subprocess.run([sys.executable, str(CHECK), "--build-dir", str(d), "--allow",
                            str(d / "allow.txt")], capture_output=True, text=True)
        return r.returncode


cases = [
    ("clean report passes", run(CLEAN), 0),
    ("spill stores fail", run(CLEAN.replace("0 bytes spill stores", "8 bytes spill stores")), 1),
    ("spill loads fail", run(CLEAN.replace("0 bytes spill loads", "8 bytes spill loads")), 1),
    ("stack frame fails", run(CLEAN.replace("0 bytes stack frame", "16 bytes stack frame")), 1),
    ("allowed stack frame passes",
     run(CLEAN.replace("0 bytes stack frame", "16 bytes stack frame"), allow="kernel\n"), 0),
    ("missing report fails", run(CLEAN, with_log=False), 1),
    ("sm_90 (not sm_90a) fails", run(CLEAN.replace("'sm_90a'", "'sm_90'")), 1),
    ("report without kernels fails", run("ptxas info    : 0 bytes gmem\n"), 1),
    ("serialised wgmmas fail (C7515)", run(CLEAN + SERIAL.format("C7515", "non wgmma instructions defining "
                                                               "accumulator registers of a wgmma")), 1),
    ("serialised wgmmas fail (C7518)", run(CLEAN + SERIAL.format("C7518", "program dependence on compiler-"
                                                               "inserted WG.DP in divergent path")), 1),
    ("an injected wgmma wait fails (C7517)", run(CLEAN + INJECTED), 1),
    ("an injected wgmma arrive fails (C7519)",
     run(CLEAN + INJECTED.replace("C7517", "C7519").replace("wait", "arrive")), 1),
    ("another C75xx remark passes", run(CLEAN + "ptxas info    : (C7508) Potential Performance Loss: setmaxnreg "
                                        "is used in function '_Z6kernelPf'\n"), 0),
]
bad = [name for name, got, want in cases if got != want]
for name, got, want in cases:
    print(f"{'ok ' if got == want else 'BAD'} {name}: exit {got}, expected {want}")
sys.exit(1 if bad else 0)
