"""What the report generators' self-tests share (test_forward_report.py, test_reliability_report.py,
test_memory_report.py, test_ab_report.py): a test case with a temporary directory and a writer of input files."""
import json
import os
import tempfile
import unittest


class TempDirCase(unittest.TestCase):
    """self.tmp: a fresh directory per test; write(name, doc) puts a JSON document (or a raw
    string, for inputs that must not parse) there and returns its path."""

    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def write(self, name, doc):
        path = os.path.join(self.tmp, name)
        with open(path, "w") as f:
            f.write(doc if isinstance(doc, str) else json.dumps(doc))
        return path
