"""The example scripts run as users run them (a subprocess each, ``--tiny-random``): exit 0 and the expected output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str, timeout: int = 300) -> str:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} exited with {done.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    return done.stdout


def test_chat_example():
    out = run_example("chat.py", "--tiny-random")
    assert re.search(r"\[turn 1\] TTFT [\d.]+ ms, TPOT [\d.]+ ms, 12 tokens \| deferred 44", out), out
    assert "[turn 2] assistant:" in out
    assert re.search(r"\[turn 1\] restored after its answer \(between turns\): \d+", out), out


def test_pipeline_example():
    out = run_example("pipeline.py", "--tiny-random", "--max-new-tokens", "8")
    for policy in ("full", "hard", "raincheck"):
        assert re.search(rf"^\[{policy}\] \d+ ms: '.+'$", out, re.M), out


def test_stream_example():
    out = run_example("stream.py", "--tiny-random")
    assert "[turn 1] deferred 44 | restored: folded into this prefill 0, during the answer 36 | pending when the " \
           "answer ended 8" in out, out
    assert "[turn 2] deferred 0" in out
    # turn 1's 8 pending tokens: the background worker restored them, or turn 2's prefill if it came first
    life = re.search(r"after the background worker: pending 0, .*during_prefill=(\d+), during_decode=36, "
                     r"after_answer=(\d+)\)", out)
    assert life and int(life[1]) + int(life[2]) == 8, out

