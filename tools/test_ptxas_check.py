#!/usr/bin/env python3
"""Self-test of ptxas_check.py: it must fail on spills, stack frames, missing reports and
non-sm_90a code, and pass a clean report (so the CI gate cannot pass vacuously)."""
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
]
bad = [name for name, got, want in cases if got != want]
for name, got, want in cases:
    print(f"{'ok ' if got == want else 'BAD'} {name}: exit {got}, expected {want}")
sys.exit(1 if bad else 0)
