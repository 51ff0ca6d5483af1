"""A bounded load test of ``python -m hf_raincheck.serve`` (the CLI, in a subprocess, the shipped GridQA model):
8 concurrent conversations x 4 turns with different images through the `openai` client; concurrent requests share
batched generate calls."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

sys.path.insert(0, os.path.dirname(__file__))

from serve_support import ask_openai, chat_reference, data_url, user  # noqa: E402

from hf_raincheck import RaincheckConfig  # noqa: E402
from hf_raincheck.gridqa import has_default, load_default, make_dialogue  # noqa: E402
from hf_raincheck.serve import DEFAULT_MODEL  # noqa: E402
from hf_raincheck.serve.app import free_port  # noqa: E402

pytestmark = pytest.mark.skipif(not has_default(), reason="the shipped GridQA checkpoint is missing")

CONVERSATIONS = 8
MAX_TOKENS = 16
BUDGET_MB = 16
TIME_BOUND_S = 180
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dialogue_turns(i: int):
    """Conversation i: its own grid in turn 1, another grid in turn 3 (questions about both)."""
    first, second = make_dialogue(20 + i), make_dialogue(40 + i)
    return [(first.turns[0].question, first.image()), ("what is in C3?", None),
            ("what is in D5?", second.image()), (first.turns[-1].question, None)]


def start_server(port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_raincheck.serve", "--port", str(port), "--cache-budget-mb", str(BUDGET_MB),
         "--retention", "0.3", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited ({process.returncode}):\n{process.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("the server did not answer /health within 120 s")


def stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/raincheck/stats", timeout=10) as response:
        return json.loads(response.read())


def converse(base_url: str, turns) -> list[tuple[str, object]]:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages, results = [], []
    for t, (text, image) in enumerate(turns):
        messages.append(user(text, data_url(image) if image is not None else None))
        answer, usage = ask_openai(client, DEFAULT_MODEL, messages, MAX_TOKENS, stream=bool(t % 2))  # odd: streamed
        results.append((answer, usage))
        messages.append({"role": "assistant", "content": answer})
    return results


def test_eight_concurrent_conversations_of_four_turns():
    model, processor = load_default()
    dialogues = [dialogue_turns(i) for i in range(CONVERSATIONS)]
    expected = [chat_reference(model, processor, RaincheckConfig(retention=0.3), turns, MAX_TOKENS)
                for turns in dialogues]
    assert len({tuple(answers) for answers in expected}) == CONVERSATIONS  # the conversations are told apart

    port = free_port()
    process = start_server(port)
    try:
        start = time.monotonic()
        with ThreadPoolExecutor(CONVERSATIONS) as pool:
            results = list(pool.map(lambda turns: converse(f"http://127.0.0.1:{port}/v1", turns), dialogues))
        elapsed = time.monotonic() - start
        assert elapsed < TIME_BOUND_S, f"32 requests took {elapsed:.0f} s"

        for i, (result, reference) in enumerate(zip(results, expected)):
            assert [answer for answer, _ in result] == reference, f"conversation {i}"  # no answer crosses over
            usages = [usage.raincheck for _, usage in result]
            assert [u["conversation_cache"] for u in usages] == ["new", "reused", "reused", "reused"]
            assert usages[0]["deferred"] > 0 and usages[2]["deferred"] > 0
            for before, after in zip(usages, usages[1:]):  # each pending token restored once, between or in prefill
                assert after["previous_restored_after_answer"] + after["restored_in_prefill"] == \
                    before["pending_at_answer_end"]

        deadline = time.monotonic() + 60  # the server restores what the last answers left, while idle
        while (snapshot := stats(port))["pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert snapshot["pending"] == 0
        assert snapshot["conversations"] == CONVERSATIONS and snapshot["evictions"] == 0
        assert snapshot["hits"] == 3 * CONVERSATIONS and snapshot["misses"] == CONVERSATIONS
        reported = sum(usage.raincheck["deferred"] for result in results for _, usage in result)
        assert snapshot["deferred"] == reported == (snapshot["restored_in_prefill"] + snapshot["restored_during_decode"]
                                                    + snapshot["restored_after_answer"])
        assert 0 < snapshot["peak_bytes"] <= snapshot["budget_bytes"] == BUDGET_MB * 1024 * 1024
        # concurrent requests shared generate calls (the default --max-batch-size / --batch-window-ms)
        batches = snapshot["batches"]
        assert batches["rows"] == 4 * CONVERSATIONS and batches["fallbacks"] == 0
        assert batches["max_rows"] >= 2 and batches["calls"] < 4 * CONVERSATIONS, batches
        assert max(usage.raincheck["batch_size"] for result in results for _, usage in result) >= 2
    finally:
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise AssertionError("the server did not stop within 30 s of SIGINT") from None
    assert process.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
