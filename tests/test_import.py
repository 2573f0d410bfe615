"""`import hopper_moe` stays light: it loads neither Triton nor torch._dynamo (about 2 s each
on a fresh interpreter); they load on first use."""
from __future__ import annotations

import os
import subprocess
import sys


def test_import_loads_neither_triton_nor_dynamo():
    code = ("import sys, hopper_moe; "
            "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))")
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
