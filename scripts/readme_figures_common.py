"""What the figures of readme_figures.py share (readme_figures_layer.py, readme_figures_parts.py):
the results files, each read when a figure first asks for it, whose lookups name the file and the
key of anything missing (so that a broken results file says where), and the wording of numbers
(ranges, ratios, case counts), so that every figure words them alike.
Python 3 standard library only.
"""
import glob
import json
import os

MODEL_NAMES = {"dsv3": "DeepSeek-V3", "qwen3-30b-a3b": "Qwen3-30B-A3B", "qwen3-235b": "Qwen3-235B"}
HEADLINE = ("dsv3", 8192, "uniform")  # the case the README quotes in full


class FigureError(Exception):
    """A results file or README.md that cannot be used; the message names the file and what."""


class Doc:
    """One results file; get() names the file and the key path of anything missing."""

    def __init__(self, name, data):
        self.name, self.data = name, data

    def get(self, *path, within=None):
        node = self.data if within is None else within
        for i, key in enumerate(path):
            ok = (isinstance(node, dict) and key in node) or (
                isinstance(node, list) and isinstance(key, int) and -len(node) <= key < len(node))
            if not ok:
                raise FigureError("%s: no key %s" % (self.name, ".".join(str(k) for k in path[:i + 1])))
            node = node[key]
        return node

    def num(self, *path, within=None):
        v = self.get(*path, within=within)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise FigureError("%s: %s is %r, not a number" % (self.name, ".".join(map(str, path)), v))
        return v

    def case(self, model, T, routing, key="cases", precision="bf16"):
        for c in self.get(key):  # a forward file also holds FP8 cases ("precision")
            if (c.get("model"), c.get("T"), c.get("routing")) == (model, T, routing) and \
                    c.get("precision", "bf16") == precision:
                return c
        kind = "" if precision == "bf16" else precision + " "
        raise FigureError("%s: no %sentry %s T=%d %s in '%s'" % (self.name, kind, model, T, routing, key))

    def source(self):
        """Where a figure came from: the file and the run it records."""
        d = self.data
        gpus = "%s× " % d["gpus"] if isinstance(d.get("gpus"), int) else ""
        # A short hash, or with a suffix such as "+uncommitted" (a tree measured before its commit).
        c = str(d.get("commit") or "")
        commit = ("commit %s" % (c[:7] + c[c.index("+"):] if "+" in c else c[:7])) if c else "commit not recorded"
        return "*[`%s`](bench/results/%s): %s%s, %s, %s*" % (
            self.name, self.name, gpus, d.get("device", "device not recorded"), commit,
            str(d.get("date", "date not recorded"))[:10])


class Results:
    """The results directory; each file is read when a figure first asks for it."""

    def __init__(self, directory):
        self.directory, self.docs = directory, {}
        if not os.path.isdir(directory):
            raise FigureError("results directory %s does not exist" % directory)

    def __getitem__(self, name):
        if name not in self.docs:
            path = os.path.join(self.directory, name)
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except OSError as e:
                raise FigureError("%s: cannot be read (%s)" % (path, e.strerror or e))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise FigureError("%s: not JSON: %s" % (path, e))
            if not isinstance(data, dict):
                raise FigureError("%s: not a JSON object" % path)
            self.docs[name] = Doc(name, data)
        return self.docs[name]

    def newest(self, *names):
        """Of the results files named that exist (the same job measured on other cards, e.g.
        forward-h200x1.json and forward-h100x1.json), the one whose run is the latest by its date."""
        present = [n for n in names if os.path.isfile(os.path.join(self.directory, n))]
        if not present:
            raise FigureError("none of %s in %s" % (", ".join(names), self.directory))
        return max((self[n] for n in present), key=lambda d: str(d.data.get("date")))

    def unquoted(self):
        present = sorted(os.path.basename(p) for p in glob.glob(os.path.join(self.directory, "*.json")))
        return [n for n in present if n not in self.docs]


def times(v):
    return "%.2f×" % v


def span(values, fmt=times):
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else "%s–%s" % (fmt(lo).rstrip("×"), fmt(hi))


def count(n, word):
    return "%d %s%s" % (n, word, "" if n == 1 else "s")


def versus(values):
    """'2.01–5.21× faster' when every ratio (other time / mok's time) is at least 1, else the range
    as a speed ratio with the number of slower cases: the wording must not claim more than the data."""
    slower = sum(1 for v in values if v < 1)
    if not slower:
        return span(values) + " faster"
    return "%s the speed (slower in %d of %s)" % (span(values), slower, count(len(values), "case"))


def model_name(m):
    base, _, slice_ = m.partition("/")  # "dsv3/ep8": the per-rank slice of EP 8 on one GPU
    name = MODEL_NAMES.get(base, base)
    return "%s %s slice" % (name, slice_.upper().replace("EP", "EP-")) if slice_ else name


def case_name(model, T, routing):
    return "%s T=%d %s" % (model_name(model), T, routing)


def ordered(values):
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def nums(doc, entries, key):
    """entries[*][key], every one a number (named when missing); at least one entry."""
    if not entries:
        raise FigureError("%s: no entries to take %s from" % (doc.name, key))
    return [doc.num(key, within=e) for e in entries]
