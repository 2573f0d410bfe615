"""Shared test helpers.

DEVICES   ["cpu"] plus "cuda" when a GPU is present; parametrize device-generic tests over it.
gpu       marker for tests that need CUDA; they skip (not fail) on a machine without a GPU.
poison(t) fill an output with NaN (floating) or -7777 (integer) so unwritten elements show.
seeded(s) a torch.Generator seeded with s (CPU), for reproducible random inputs.

HOPPER_MOE_FAILURE_LOG=path appends each failure's report to `path` as soon as it happens, so
a run that is stopped before pytest's summary (a time limit) still says what failed and why.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on a machine without a GPU. Must be set before
    # any Triton kernel is defined, and before hopper_moe is imported: hopper_moe.settings reads
    # it once, at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hopper_moe  # noqa: E402,F401  (loads the ops)

HAS_CUDA = torch.cuda.is_available() and hopper_moe.built_with_cuda()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])

gpu = pytest.mark.gpu

# tests/vllm_compat holds the shim, skip table and summary of the run of vLLM's kernel tests
# (tools/vllm_kernel_tests.sh), not tests of this suite. No conftest.py of its own: under
# pytest-xdist a second module named `conftest` could be the one `from conftest import` finds.
collect_ignore = ["vllm_compat"]


if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest-xdist: share the cores between the workers (each CPU reference would otherwise
    # start one thread per core in every worker).
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def pytest_collection_modifyitems(config, items):
    # The long fuzz tests spread evenly through the first two thirds of the run: pytest-xdist
    # hands out tests in contiguous chunks, so adjacent fuzz tests would run one after another
    # on one worker, and a fuzz test handed out last would run alone at the end.
    fuzz = [item for item in items if "fuzz" in item.name]
    if fuzz:
        rest = iter([item for item in items if "fuzz" not in item.name])
        step = max(1, 2 * len(items) // (3 * len(fuzz)))
        ordered = []
        for item in fuzz:
            ordered.append(item)
            ordered.extend(itertools.islice(rest, step - 1))
        ordered.extend(rest)
        items[:] = ordered
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of hopper_moe")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    path = os.environ.get("HOPPER_MOE_FAILURE_LOG")
    if path and report.failed and not hasattr(report, "node"):  # not xdist's forwarded copy
        with open(path, "a") as f:
            f.write(f"=== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n"
                    f"{report.longreprtext}\n\n")


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` in place with a value no op writes by accident, and return it."""
    if t.dtype.is_floating_point:
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
        else:
            t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        info = torch.iinfo(t.dtype)  # -7777 where it fits, else the far end of the range
        t.fill_(-7777 if info.min <= -7777 else (info.min if info.min < 0 else info.max))
    return t


def seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
