"""Summary of a harness run: passed / failed / skipped per upstream file, skips per reason,
failures per known-difference category (with one representative test id each).

    python summarize.py RESULTS.xml [SDIST_TESTS_ROOT]

RESULTS.xml is pytest's --junitxml output. A failure that matches no category is "new".
"""
from __future__ import annotations

import collections
import os
import re
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import skips  # noqa: E402

# The differences between hopper_moe and vLLM found before this harness existed (issue 27):
# (key, description, node id regex, failure message regex). First match wins.
CATEGORIES = [
    ("1-cutlass-fp16-out", "cutlass_moe_mm rejects fp16 outputs",
     r"test_cutlass_moe\.py", r"(?i)(half|float16|fp16|bfloat16 out|out_tensors.*dtype)"),
    ("2-topk-nonfinite", "topk_softmax/topk_sigmoid: NaN/±Inf logits give NaN weights",
     r"test_fused_topk\.py::test_fused_topk\w*nan_inf", r""),
    ("3-grouped-topk", "grouped_topk: bf16 sigmoid rounding, score x bias dtype pairs, "
     "non-finite scores", r"test_grouped_topk\.py", r""),
    ("4-silu-ulp", "silu_and_mul / silu_and_mul_quant differ by up to 1 ulp (bit-exact tests)",
     r"(test_activation\.py|test_fused_quant_activation\.py)", r""),
    ("5-align-scatter-idx", "moe_align_block_size: scatter_idx meaning differs",
     r"test_moe_align_block_size\.py", r"(?i)scatter|sorted|mismatch|assert"),
    ("6-moe-sum-strided", "moe_sum rejects strided hidden dims",
     r"test_moe\.py::test_moe_sum", r"(?i)(stride|contiguous)"),
    ("7-dyn-fp8-T1-scale", "dynamic_scaled_fp8_quant rejects a [T,1] scale",
     r"test_fp8_quant", r"(?i)scale"),
    ("9-global-num-experts", "fused_experts: global_num_experts < w1.size(0) rejected",
     r"", r"global_num_experts"),
    ("10-sm90-H-mod-8", "sm90 backend rejects H % 8 != 0", r"", r"(?i)(% ?8|multiple of 8)"),
]


def categorize(nodeid: str, message: str) -> str:
    for key, _, node_re, msg_re in CATEGORIES:
        if node_re and not re.search(node_re, nodeid):
            continue
        if msg_re and not re.search(msg_re, message):
            continue
        return key
    return "new"


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
    print("\nfailures (and errors) per difference category:")
    descr = {key: d for key, d, _, _ in CATEGORIES}
    descr["new"] = "not among the known differences"
    for key, entry in sorted(cats.items()):
        print(f"  {key:22} {entry['count']:5}  {descr[key]}")
        print(f"  {'':22} e.g. {entry['example']}")
        if key == "new" or entry["message"]:
            print(f"  {'':22}      {entry['message']!r}")
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
