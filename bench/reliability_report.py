#!/usr/bin/env python3
"""Assembles the reliability results file (bench/results/reliability-h200x1.json) from the reports
of one GPU run, and prints its tables.

usage: reliability_report.py --gtest-json FILE [--gtest-json FILE ...]
                             --sanitize-json FILE [--sanitize-json FILE ...] [--rerun-sanitize-json FILE ...]
                             [--device NAME] [--gpus N] [--commit SHA] [--date ISO] [--out PATH]

--gtest-json: gtest's --gtest_output=json:FILE of the reliability test binary (and of any other
  test binary whose cases belong in the file). Every test that ran becomes a case named like a
  gtest filter ("Suite.Test", "Prefix/Suite.Test/param"), passed when gtest ran it to completion
  without a failure. A skipped test (GTEST_SKIP, "result": "SKIPPED") is recorded as not passed
  with "skipped": true: a skip proves nothing. Disabled tests (status NOTRUN) are left out, as
  gtest leaves out tests a filter excludes. A test name in two inputs is an error (which verdict
  would count?).
--sanitize-json: the sanitize.json of scripts/sanitize.sh. Each run gives {tool, test, errors,
  seconds}. errors is the sanitizer's error count; -1 when the run gave no clean verdict without
  the tool counting an error (a timeout, a crash, a missing binary, a test failing under the tool,
  racecheck warnings): the results file must not read "0 errors" for a run that proved nothing.
  Several files (passes of sanitize.sh over one build, e.g. one per tool when a call's time is
  short) are joined in the order given; they must name the same device and commit, and a
  (tool, test) run in two of them is an error.
--rerun-sanitize-json: the sanitize.json of a later commit that ran some of the same (tool, test)
  pairs again (after a fix). Recorded beside the runs as "reruns": [{tool, test, errors, seconds,
  commit}], never in place of them (the runs keep the verdicts of the report's commit); every
  rerun must repeat a run of the sanitize JSONs, on the same device. Without it there is no
  "reruns" key.
Determinism: from the case Determinism.HundredForwardBackwardCallsAreBitwiseIdentical, whose
  RecordProperty("runs", N) and RecordProperty("bitwise", 0|1) gtest writes as extra keys of the
  test's entry (as strings). Without that case or those keys: runs 0, bitwise false.
Defaults: --device from the sanitize JSON, --gpus 1 (the runs use one GPU), --commit from
  `git rev-parse HEAD` (else the sanitize JSON's), --date now (UTC).

Any missing or malformed input stops the script with a message and exit status 1 before
anything is written; the output is written to a temporary file and renamed, never half written.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "reliability-h200x1.json")
DETERMINISM_CASE = "Determinism.HundredForwardBackwardCallsAreBitwiseIdentical"
# gtest's own keys of a test entry; everything else on it came from RecordProperty.
GTEST_TEST_KEYS = {"name", "file", "line", "status", "result", "timestamp", "time", "classname",
                   "failures", "skipped", "value_param", "type_param"}


class InputError(Exception):
    """An input that cannot be used: the message names the file and what is wrong."""


def load_json(path, what):
    if not os.path.isfile(path):
        raise InputError("%s %s does not exist" % (what, path))
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise InputError("%s %s is not readable JSON: %s" % (what, path, e))


def require(cond, path, why):
    if not cond:
        raise InputError("%s: %s" % (path, why))


def read_gtest(path):
    """[(case dict, properties dict)] of the tests that ran, in the file's order."""
    doc = load_json(path, "gtest JSON")
    require(isinstance(doc, dict) and isinstance(doc.get("testsuites"), list), path,
            "no list 'testsuites' (not gtest's --gtest_output=json format)")
    out = []
    for suite in doc["testsuites"]:
        require(isinstance(suite, dict) and isinstance(suite.get("name"), str) and
                isinstance(suite.get("testsuite"), list), path,
                "a test suite without a 'name' string and a 'testsuite' list")
        for test in suite["testsuite"]:
            require(isinstance(test, dict) and isinstance(test.get("name"), str) and
                    isinstance(test.get("status"), str), path,
                    "a test of suite %s without 'name' and 'status' strings" % suite["name"])
            name = "%s.%s" % (suite["name"], test["name"])
            if test["status"] == "NOTRUN":  # DISABLED_: not part of this run
                print("note: %s is disabled, left out" % name, file=sys.stderr)
                continue
            require(test["status"] == "RUN", path, "%s has status %r" % (name, test["status"]))
            failures = test.get("failures", [])
            require(isinstance(failures, list), path, "%s: 'failures' is not a list" % name)
            case = {"name": name, "passed": not failures}
            # A test that failed and then skipped counts as failed (gtest says so too).
            if test.get("result") == "SKIPPED" and not failures:
                case.update(passed=False, skipped=True)
            props = {k: v for k, v in test.items() if k not in GTEST_TEST_KEYS}
            out.append((case, props))
    return out


def int_property(value, path, what):
    """RecordProperty values: gtest writes them as strings; accept ints as well."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InputError("%s: %s is %r, not an integer" % (path, what, value))


def read_cases(paths):
    cases, determinism, seen = [], {"runs": 0, "bitwise": False}, {}
    for path in paths:
        for case, props in read_gtest(path):
            if case["name"] in seen:
                raise InputError("%s: %s is also in %s" % (path, case["name"], seen[case["name"]]))
            seen[case["name"]] = path
            cases.append(case)
            if case["name"] == DETERMINISM_CASE:
                if "runs" in props:
                    determinism["runs"] = int_property(props["runs"], path, "property 'runs'")
                    require(determinism["runs"] >= 0, path, "property 'runs' is negative")
                if "bitwise" in props:
                    bitwise = int_property(props["bitwise"], path, "property 'bitwise'")
                    require(bitwise in (0, 1), path, "property 'bitwise' is %d, not 0 or 1" % bitwise)
                    determinism["bitwise"] = bitwise == 1
    if not cases:
        raise InputError("no test ran in %s" % ", ".join(paths))
    return cases, determinism


def read_sanitize(path):
    """(sanitize entries, the JSON's device, its commit)."""
    doc = load_json(path, "sanitize JSON")
    require(isinstance(doc, dict) and isinstance(doc.get("runs"), list), path, "no list 'runs'")
    require(not doc.get("dry_run"), path, "written by a dry run (MOK_SANITIZE_DRY_RUN=1): no results")
    require(doc["runs"], path, "no runs")
    entries = []
    for i, run in enumerate(doc["runs"]):
        require(isinstance(run, dict), path, "run %d is not an object" % i)
        for key in ("tool", "test"):
            require(isinstance(run.get(key), str) and run[key], path, "run %d has no '%s'" % (i, key))
        label = "run %d (%s %s)" % (i, run["tool"], run["test"])
        errors, seconds, clean = run.get("errors"), run.get("seconds"), run.get("clean")
        require(isinstance(errors, int) and not isinstance(errors, bool), path,
                "%s: 'errors' is %r, not an integer" % (label, errors))
        require(isinstance(seconds, (int, float)) and not isinstance(seconds, bool), path,
                "%s: 'seconds' is %r, not a number" % (label, seconds))
        require(isinstance(clean, bool), path, "%s: 'clean' is %r, not a boolean" % (label, clean))
        if not clean and errors == 0:
            errors = -1  # no error counted, but no clean verdict either (see the usage)
        entries.append({"tool": run["tool"], "test": run["test"], "errors": errors,
                        "seconds": float(seconds)})
    return entries, doc.get("device"), doc.get("commit")


def git_head():
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def read_sanitize_all(paths):
    """The runs of every sanitize JSON in order, and their one device and commit."""
    entries, device, commit, seen = [], None, None, {}
    for path in paths:
        runs, d, c = read_sanitize(path)
        for key, value, name in (("device", d, device), ("commit", c, commit)):
            if name is not None and value != name:
                raise InputError("%s: %s %r differs from the first sanitize JSON's %r"
                                 % (path, key, value, name))
        device, commit = d, c
        for run in runs:
            key = (run["tool"], run["test"])
            if key in seen:
                raise InputError("%s: run %s %s is also in %s" % (path, key[0], key[1], seen[key]))
            seen[key] = path
        entries += runs
    return entries, device, commit


def build(args):
    cases, determinism = read_cases(args.gtest_json)
    sanitize, san_device, san_commit = read_sanitize_all(args.sanitize_json)
    first = args.sanitize_json[0]
    device = args.device or san_device
    if not isinstance(device, str) or not device or device == "unknown":
        raise InputError("no device name: %s has none; pass --device" % first)
    commit = args.commit or git_head() or san_commit
    if not isinstance(commit, str) or not commit or commit == "unknown":
        raise InputError("no commit: not in a git checkout and %s has none; pass --commit"
                         % first)
    if (not args.commit and isinstance(san_commit, str) and san_commit not in ("", "unknown")
            and not (commit.startswith(san_commit) or san_commit.startswith(commit))):
        print("warning: the sanitizer runs were at commit %s, this checkout is at %s"
              % (san_commit, commit), file=sys.stderr)
    date = args.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    doc = {"device": device, "gpus": args.gpus, "date": date, "commit": commit,
           "cases": cases, "sanitize": sanitize, "determinism": determinism}
    if args.rerun_sanitize_json:
        doc["reruns"] = read_reruns(args.rerun_sanitize_json, sanitize, device)
    return doc


def read_reruns(paths, sanitize, device):
    """Runs of later commits repeating runs of the report's sanitize JSONs, with their commit."""
    ran = {(r["tool"], r["test"]) for r in sanitize}
    reruns = []
    for path in paths:
        runs, d, c = read_sanitize(path)
        if d != device:
            raise InputError("%s: device %r differs from the report's %r" % (path, d, device))
        if not isinstance(c, str) or not c or c == "unknown":
            raise InputError("%s: a rerun needs its commit" % path)
        for run in runs:
            if (run["tool"], run["test"]) not in ran:
                raise InputError("%s: rerun %s %s repeats no run of the sanitize JSONs"
                                 % (path, run["tool"], run["test"]))
            reruns.append(dict(run, commit=c))
    return reruns


def write_atomically(path, doc):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, ".%s.tmp" % os.path.basename(path))
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def print_tables(doc, out):
    print("%s x%d, commit %s, %s" % (doc["device"], doc["gpus"], doc["commit"], doc["date"]))
    width = max(len(c["name"]) for c in doc["cases"])
    print("\n%-*s  %s" % (width, "case", "verdict"))
    for c in doc["cases"]:
        verdict = "skipped" if c.get("skipped") else ("passed" if c["passed"] else "FAILED")
        print("%-*s  %s" % (width, c["name"], verdict))
    print("\n%-10s %-32s %10s %8s" % ("tool", "test", "errors", "seconds"))
    for s in doc["sanitize"]:
        errors = "no verdict" if s["errors"] < 0 else str(s["errors"])
        print("%-10s %-32s %10s %8.1f" % (s["tool"], s["test"], errors, s["seconds"]))
    d = doc["determinism"]
    passed = sum(c["passed"] for c in doc["cases"])
    clean = sum(s["errors"] == 0 for s in doc["sanitize"])
    print("\ndeterminism: %d runs, %s" % (d["runs"], "bitwise identical" if d["bitwise"]
                                          else "NOT shown bitwise identical"))
    print("%d/%d cases passed, %d/%d sanitizer runs clean -> %s"
          % (passed, len(doc["cases"]), clean, len(doc["sanitize"]), out))
    for r in doc.get("reruns", []):
        print("rerun at %s: %s %s, %d errors" % (r["commit"], r["tool"], r["test"], r["errors"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gtest-json", action="append", required=True, metavar="FILE")
    p.add_argument("--sanitize-json", action="append", required=True, metavar="FILE")
    p.add_argument("--rerun-sanitize-json", action="append", default=[], metavar="FILE")
    p.add_argument("--device")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--commit")
    p.add_argument("--date", help="ISO date (default: now, UTC)")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.gpus < 1:
        p.error("--gpus must be at least 1")
    try:
        doc = build(args)
    except InputError as e:
        print("reliability_report.py: %s (nothing written)" % e, file=sys.stderr)
        return 1
    write_atomically(args.out, doc)
    print_tables(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
