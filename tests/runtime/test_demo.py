"""`make demo` runs end to end (with fewer training steps): the model trains, a prefill, a
decode (MTP on) and a router start, the answers stream through the openai client and read as
the text the model was taught, and the demo reports TTFT, tokens/s and the acceptance it
measured; a second start finds the model cached."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from dserve.runtime.demo import DIALOGUES, ensure_model

pytestmark = pytest.mark.slow


def test_demo(tmp_path):
    model_dir, steps = str(tmp_path / "demo"), 80
    cmd = [sys.executable, "-m", "dserve.runtime.demo", "--model-dir", model_dir]
    cmd += ["--train-steps", str(steps), "--questions", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    question, answer = DIALOGUES[0]
    assert f"> {question}\n  {answer}\n" in out, out
    assert re.search(r"\[\d+ tokens, TTFT \d+ ms, \d+\.\d tokens/s\]", out), out
    figures = re.search(r"= (\d+\.\d) tokens/s on the CPU; speculative acceptance (\d\.\d\d)", out)
    assert figures and float(figures[1]) > 0, out
    assert float(figures[2]) > 1.5, "the trained draft's tokens are accepted"
    start = time.perf_counter()
    assert ensure_model(model_dir, steps) == model_dir
    assert time.perf_counter() - start < 1, "cached: not trained again"
