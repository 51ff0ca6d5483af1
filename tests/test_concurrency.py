"""Concurrent sessions on one model, and `RaincheckChat.stream` at interpreter exit.

- Two `RaincheckChat` sessions on one model, each in its own thread, a few turns each: every selector (the ones
  that hook the vision tower's blocks, hiprune and visionzip, included) gives each session exactly the answers,
  the cache and the accounting of the same dialogue run alone.
- A process that exits while `RaincheckChat.stream` is generating exits cleanly (status 0, no "terminate called").
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from hf_raincheck import RaincheckChat, RaincheckConfig
from hf_raincheck.pruning import available_selectors
from hf_raincheck.testing import load_tiny_qwen3_vl, make_image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 120  # seconds; reached only if the code under test is broken
TURNS = (("What is in the picture?", 0), ("And in this one?", 1), ("Which one is brighter?", None))


def dialogue(seed: int) -> list[tuple[str, object]]:
    """One session's turns: a question and an image (or none) per turn, different for each session."""
    return [(text, None if image is None else make_image(10 * seed + image)) for text, image in TURNS]


def run_session(model, processor, config, turns) -> dict:
    with RaincheckChat(model, processor, config, max_new_tokens=4, min_new_tokens=4) as chat:
        answers = [chat.ask(text, images=image) for text, image in turns]
        assert chat.wait(TIMEOUT)
        cache = chat.cache
        return dict(
            answers=answers,
            token_ids=list(cache.token_ids),
            deferred=[s.deferred for s in chat.stats],
            during_decode=[s.restored_during_decode for s in chat.stats],
            plans=[(p.total_deferred, p.restored) for p in cache.plans],
            keys=[layer.keys[:, :, : cache.length].clone() for layer in cache.layers],
        )


@pytest.fixture(scope="module")
def vl(tiny_vl_path):
    return load_tiny_qwen3_vl(tiny_vl_path)


@pytest.mark.parametrize("selector", available_selectors())
def test_two_sessions_in_two_threads_equal_the_same_sessions_run_alone(vl, selector):
    model, processor = vl
    config = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=1, completion="blocking", pruning=selector)
    alone = [run_session(model, processor, config, dialogue(seed)) for seed in (1, 2)]

    for attempt in range(3):  # a few rounds: the threads' vision passes overlap in some of them
        results, errors = [None, None], []
        barrier = threading.Barrier(2)

        def session(index):
            try:
                barrier.wait(TIMEOUT)
                results[index] = run_session(model, processor, config, dialogue(index + 1))
            except BaseException as error:  # noqa: BLE001 - reported by the test thread
                errors.append(error)

        threads = [threading.Thread(target=session, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        assert not any(thread.is_alive() for thread in threads), "a session thread hangs"
        if errors:
            raise errors[0]
        for got, expected in zip(results, alone):
            assert got["answers"] == expected["answers"] and got["token_ids"] == expected["token_ids"]
            assert got["deferred"] == expected["deferred"] and got["during_decode"] == expected["during_decode"]
            assert got["plans"] == expected["plans"]
            for a, b in zip(got["keys"], expected["keys"]):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- interpreter exit while a stream generates
def test_exit_while_streaming_exits_cleanly(tiny_vl_path):
    script = textwrap.dedent(f"""
        from hf_raincheck import RaincheckChat, RaincheckConfig
        from hf_raincheck.testing import load_tiny_qwen3_vl, make_image

        model, processor = load_tiny_qwen3_vl({str(tiny_vl_path)!r})
        chat = RaincheckChat(model, processor, RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=1),
                             max_new_tokens=100000, min_new_tokens=100000)
        pieces = chat.stream("What is in the picture?", images=make_image(1))
        for _ in range(3):
            next(pieces)  # generating; the interpreter exits now, the stream still open
        print("exiting", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert "exiting" in done.stdout, done.stderr[-2000:]
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
