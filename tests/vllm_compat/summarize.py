"""Summary of a harness run: passed / failed / skipped per upstream file, skips per reason,
failures per upstream test function (with one representative test id and message each).

    python summarize.py RESULTS.xml [SDIST_TESTS_ROOT]

RESULTS.xml is pytest's --junitxml output.
"""
from __future__ import annotations

import collections
import os
import re
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import skips  # noqa: E402

def categorize(nodeid: str, message: str) -> str:
    """A failure's group: its upstream test function (parameters dropped)."""
    return nodeid.split("[", 1)[0]


def _nodeid(case) -> str:
    cls = case.get("classname", "")
    path = cls.replace(".", "/") + ".py"
    return f"{path}::{case.get('name')}"


def main(xml_path: str, tests_root: str | None = None) -> int:
    root = ET.parse(xml_path).getroot()
    per_file = collections.OrderedDict()
    skip_reasons = collections.Counter()
    cats = collections.OrderedDict()
    for case in root.iter("testcase"):
        nodeid = _nodeid(case)
        file = nodeid.split("::")[0]
        counts = per_file.setdefault(file, collections.Counter())
        failure = case.find("failure")
        error = case.find("error")
        skipped = case.find("skipped")
        if failure is not None or error is not None:
            node = failure if failure is not None else error
            message = (node.get("message") or "") + "\n" + (node.text or "")[-4000:]
            counts["error" if failure is None else "failed"] += 1
            key = categorize(nodeid, message)
            entry = cats.setdefault(key, {"count": 0, "example": nodeid,
                                          "message": (node.get("message") or "")[:200]})
            entry["count"] += 1
        elif skipped is not None:
            counts["skipped"] += 1
            reason = (skipped.get("message") or "").strip()
            reason = re.sub(r"^Skipped: ", "", reason)
            skip_reasons[reason[:160]] += 1
        else:
            counts["passed"] += 1

    total = collections.Counter()
    print(f"{'upstream file':62} {'passed':>7} {'failed':>7} {'error':>6} {'skipped':>8}")
    for file, c in per_file.items():
        total.update(c)
        print(f"{file:62} {c['passed']:7} {c['failed']:7} {c['error']:6} {c['skipped']:8}")
    print(f"{'TOTAL':62} {total['passed']:7} {total['failed']:7} {total['error']:6} "
          f"{total['skipped']:8}")
    print("\nfailures (and errors) per upstream test:" + ("" if cats else " none"))
    for key, entry in sorted(cats.items()):
        print(f"  {entry['count']:5}  {key}")
        print(f"         e.g. {entry['example']}")
        print(f"              {entry['message']!r}")
    print("\nskipped, per reason:")
    for reason, n in skip_reasons.most_common():
        print(f"  {n:5}  {reason}")
    if tests_root:
        print("\nupstream files not run (tests/kernels/{moe,quantization,core}, tests/kernels/*.py):")
        by_reason = collections.defaultdict(list)
        for sub in ("moe", "quantization", "core", ""):
            base = os.path.join(tests_root, "tests", "kernels", sub)
            for name in sorted(os.listdir(base)):
                if not name.endswith(".py"):
                    continue
                rel = os.path.join("tests", "kernels", sub, name) if sub else \
                    os.path.join("tests", "kernels", name)
                reason = skips.not_run_reason(rel)
                if reason is not None and not name.startswith("__") and name != "conftest.py":
                    by_reason[reason].append(rel)
        for reason, files in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(files):4}  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
