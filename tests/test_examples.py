"""The example scripts run as users run them (a subprocess each): exit 0 and the expected output."""

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


def test_chat_example_runs_the_shipped_model_by_default():
    """No arguments: the shipped GridQA Qwen3-VL on a held-out demo dialogue, Full and Raincheck side by side."""
    out = run_example("chat.py")
    assert "model: Qwen3VLForConditionalGeneration" in out, out
    # turn 1 lists a column (40 answer tokens under Full): 44 of 64 visual tokens deferred, all restored in the
    # Raincheck answer's decode steps
    assert re.search(r"\[turn 1\] full       TTFT [\d.]+ ms, 40 tokens \| deferred 0,", out), out
    assert re.search(r"\[turn 1\] raincheck  TTFT [\d.]+ ms, \d+ tokens \| deferred 44, restored: folded into "
                     r"this prefill 0, in decode steps 44, after the answer 0", out), out
    # the trained model reads the image: under Full prefill its column listing is right
    assert re.search(r"^\[turn 1\] full     : A2 orange triangle, .* \[right\]$", out, re.M), out
    # MMTok's 30% prefill holds only 3 of the column's 8 cells; restoration from the first decode step on
    # (--guard-tokens 0) brings the others before the listing reaches them: the first answer is right too
    assert re.search(r"^turn 1 selection \(mmtok, retention 0.3\): 20 of 64 visual tokens prefilled first; of the 8 "
                     r"cells the question asks about \(A2..H2\) 3 kept: A2, B2, G2$", out, re.M), out
    assert re.search(r"^\[turn 1\] raincheck: A2 orange triangle, .* \[right\]$", out, re.M), out
    assert re.search(r"^full: 3/3 right, raincheck: 3/3 right$", out, re.M), out


def test_chat_example_tiny_random():
    out = run_example("chat.py", "--tiny-random", "--max-new-tokens", "12", "--chunk-size", "4", "--guard-tokens", "2")
    assert re.search(r"\[turn 1\] raincheck  TTFT [\d.]+ ms, 12 tokens \| deferred 44, restored: folded into this "
                     r"prefill 0, in decode steps 36, after the answer \d+", out), out
    assert "[turn 2] user: And what is at the bottom right?" in out


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



def test_batch_example_runs_the_shipped_model():
    """Two GridQA conversations answered together: one generate call per turn for both rows, every answer right
    under Full and Raincheck, each row's deferred tokens restored while it decodes."""
    out = run_example("batch.py", "--dialogues", "2")
    assert re.search(r"^full: turn 1: one call for 2 rows, [\d.]+ s, turn 2: one call for 2 rows", out, re.M), out
    assert re.search(r"^raincheck: turn 1: one call for 2 rows", out, re.M), out
    for i in (1, 2):
        assert re.search(rf"\[conversation {i}, turn 1\] raincheck deferred 44, restored: folded into this prefill 0, "
                         r"in decode steps 44, after the answer 0", out), out
    assert re.search(r"^full: (\d+)/\1 right, raincheck: (\d+)/\2 right$", out, re.M), out
