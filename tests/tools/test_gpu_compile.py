"""The Triton kernels the CPU tests run in the interpreter also pass a GPU's front end
(`tests/tools/gpu_compile.py`): the interpreter accepts code an sm_90 compile refuses, such
as a function returning two shapes (session 23's extend kernels) or a dot narrower than 16.
The Gluon kernels, which no CPU test can run, compile whole for sm_90 (session 29: an int64
length the engine passes broke the MLA decode's compile on the GPU only), and none has its
wgmma serialized by ptxas (C7511: session 53's seesaw with loader warps, 2x slower for it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_pass_the_sm90_front_end():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.tools.gpu_compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert " 0 failed" in run.stdout
