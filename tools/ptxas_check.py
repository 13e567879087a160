#!/usr/bin/env python3
"""Checks ptxas' resource reports of every CUDA translation unit in a build.

The build compiles each .cu through cmake/ptxas_log.sh, which stores `ptxas -v` output next to
the object file as <object>.ptxas.log. This script fails when
  * any kernel or device function spills registers (spill stores or loads > 0),
  * any kernel uses a stack frame and is not listed in the allow file,
  * ptxas serialised a kernel's wgmmas (C7515 / C7518 ..., "wgmma.mma_async instructions are
    serialized") or injected a wait or an arrive for them (C7517 / C7519, "warpgroup.wait is
    injected", "warpgroup.arrive is injected"): the tensor
    cores then wait for MMAs the code meant to overlap, a slowdown that no test notices,
  * a CUDA object has no report, or no report names an sm_90a entry function at all
    (so a broken launcher cannot make the check pass vacuously).
It prints one line per entry function: registers, stack, spills.
"""
import argparse
import pathlib
import re
import shutil
import subprocess
import sys

ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '(sm_[0-9a-z]+)'")
PROPS = re.compile(r"ptxas info\s*: Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
SERIAL = re.compile(r"\((C75\d\d)\)[^\n]*?"
                    r"(wgmma\.mma_async instructions are serialized|warpgroup\.(?:wait|arrive) is injected)"
                    r"[^\n]* in (?:the )?function '([^']+)'")


def parse(log: pathlib.Path):
    """Yields (function, arch, regs, stack, spill_st, spill_ld) for each function with properties."""
    arch_of, regs_of, current_entry, props_for = {}, {}, None, None
    rows = {}
    for line in log.read_text(errors="replace").splitlines():
        m = ENTRY.search(line)
        if m:
            current_entry = m.group(1)
            arch_of[current_entry] = m.group(2)
            continue
        m = PROPS.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = FRAME.search(line)
        if m and props_for:
            rows[props_for] = [int(m.group(1)), int(m.group(2)), int(m.group(3)), None]
            continue
        m = USED.search(line)
        if m and current_entry:
            regs_of[current_entry] = int(m.group(1))
    for fn, (stack, st, ld, _) in rows.items():
        yield fn, arch_of.get(fn), regs_of.get(fn), stack, st, ld


def demangle(names):
    """Readable names through c++filt when it exists (binutils); mangled names otherwise."""
    if not names or not shutil.which("c++filt"):
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    lines = out.splitlines()
    return dict(zip(names, lines)) if len(lines) == len(names) else {n: n for n in names}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--allow", required=True)
    a = ap.parse_args()
    build = pathlib.Path(a.build_dir)
    allow = [re.compile(l.strip()) for l in pathlib.Path(a.allow).read_text().splitlines()
             if l.strip() and not l.lstrip().startswith("#")]

    objects = sorted(p for p in build.rglob("*.cu.o") if "_googletest" not in p.parts)
    failures, entries = [], 0
    print(f"{'kernel':<90} {'arch':<7} {'regs':>4} {'stack':>5} {'spill st/ld':>11}")
    for obj in objects:
        log = obj.with_name(obj.name + ".ptxas.log")
        if not log.exists():
            failures.append(f"{obj}: no ptxas report (was it built through cmake/ptxas_log.sh?)")
            continue
        rows = list(parse(log))
        for m in SERIAL.finditer(log.read_text(errors="replace")):
            failures.append(f"{m.group(3)}: ptxas {m.group(1)}, {m.group(2)} ({log})")
        readable = demangle([r[0] for r in rows])
        for fn, arch, regs, stack, st, ld in rows:
            is_entry = arch is not None
            entries += is_entry
            full = readable[fn]
            name = full if len(full) <= 88 else full[:85] + "..."
            if is_entry:
                print(f"{name:<90} {arch:<7} {regs if regs is not None else '?':>4} {stack:>5} {st:>5}/{ld:<5}")
            if is_entry and arch != "sm_90a":
                failures.append(f"{fn}: compiled for {arch}, expected sm_90a ({log})")
            if st or ld:
                failures.append(f"{fn}: {st} bytes spill stores, {ld} bytes spill loads ({log})")
            if is_entry and stack and not any(p.search(fn) or p.search(full) for p in allow):
                failures.append(f"{fn}: {stack} bytes stack frame, not in {a.allow} ({log})")
    if not objects:
        failures.append(f"no CUDA objects found under {build}")
    elif entries == 0:
        failures.append("no sm_90a entry function found in any ptxas report")
    print(f"\n{len(objects)} CUDA objects, {entries} kernels checked")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
