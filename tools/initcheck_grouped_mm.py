"""Does PyTorch's bf16 ``torch._grouped_mm`` read memory that nobody wrote, for inputs that are
written in full? (The torch backend's GEMMs; initcheck reports reads inside it over the layer.)

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --show-backtrace no \
        --print-limit 30000 python tools/initcheck_grouped_mm.py > log 2>&1
    python tools/initcheck_grouped_mm.py --count log     # reports per case, and the threads

Each case runs one grouped GEMM between BEGIN / END markers, on inputs every element of which
was written: all groups non-empty, empty groups, one group, rows past the last offset, and the
offsets in a zero-filled buffer larger than needed (so a read past their end reads written
memory). If every case reports, the reads are the kernel's own setup, not hopper_moe's inputs.
"""
from __future__ import annotations

import sys

import torch

E, N, K = 8, 256, 128
CASES = [
    ("all_groups_full", [2, 4, 6, 8, 10, 12, 14, 16], 0),
    ("empty_groups", [0, 0, 0, 8, 8, 8, 16, 16], 0),
    ("one_group", [16] * 8, 0),
    ("rows_past_end", [2, 4, 6, 8, 10, 12, 14, 14], 0),
    ("all_groups_full_padded_offs", [2, 4, 6, 8, 10, 12, 14, 16], 56),
    ("empty_groups_padded_offs", [0, 0, 0, 8, 8, 8, 16, 16], 56),
]


def run_case(name: str, ends: list[int], pad: int) -> None:
    dev = "cuda"
    rows = 16
    a = torch.randn(rows, K, device=dev).to(torch.bfloat16)
    w = torch.randn(E, N, K, device=dev).to(torch.bfloat16)
    if pad:
        buf = torch.zeros(E + pad, dtype=torch.int32, device=dev)
        buf[:E] = torch.tensor(ends, dtype=torch.int32)
        offs = buf[:E]
    else:
        offs = torch.tensor(ends, dtype=torch.int32, device=dev)
    torch.cuda.synchronize()
    print(f"=== BEGIN {name} offs={ends} pad={pad}", flush=True)
    torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    torch.cuda.synchronize()
    print(f"=== END {name}", flush=True)


def count(path: str) -> None:
    """Reports per case (those compute-sanitizer printed) and the threads that made them."""
    case, reports, threads = None, {}, {}
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("=== BEGIN"):
                case = line.split()[2]
            elif line.startswith("=== END"):
                case = None
            elif case and "Uninitialized __global__ memory read" in line:
                reports[case] = reports.get(case, 0) + 1
            elif case and "by thread (" in line:
                threads.setdefault(case, set()).add(int(line.split("(")[1].split(",")[0]))
            elif "ERROR SUMMARY" in line or "skipped" in line:
                print(line.strip())
    for name, _, _ in CASES:
        t = sorted(threads.get(name, ()))
        where = f"threads {t[0]}..{t[-1]} ({len(t)} distinct)" if t else ""
        print(f"{name}: {reports.get(name, 0)} reports printed {where}")


def main() -> None:
    if sys.argv[1:2] == ["--count"]:
        if len(sys.argv) != 3:
            raise SystemExit("usage: initcheck_grouped_mm.py --count LOG")
        count(sys.argv[2])
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (and compute-sanitizer around it)")
    torch.manual_seed(0)
    for case in CASES:
        run_case(*case)
    print("done", torch.__version__, flush=True)


if __name__ == "__main__":
    main()
