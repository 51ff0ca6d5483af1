"""Batching in the OpenAI-compatible server: concurrent requests answered by shared batched `generate` calls
(hf_raincheck.serve.batch / scheduler), equal to `RaincheckChat`; a bad request inside a batch fails only itself;
the fan-out streamer of a batched call; which requests share a call."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

openai = pytest.importorskip("openai")

sys.path.insert(0, os.path.dirname(__file__))

from serve_support import (  # noqa: E402
    ask_openai, chat_reference, data_url, gridqa_images, plain_answer, processor_messages, user,
)

from hf_raincheck import RaincheckChat, RaincheckConfig  # noqa: E402
from hf_raincheck.cache.batched import BatchedDeferredPrefillCache  # noqa: E402
from hf_raincheck.gridqa import has_default, load_default  # noqa: E402
from hf_raincheck.serve import DEFAULT_MODEL, RaincheckServer  # noqa: E402
from hf_raincheck.serve.pool import ConversationPool, cache_nbytes, cache_storages  # noqa: E402

CONFIG = RaincheckConfig(retention=0.3)
MAX_TOKENS = 16
WINDOW_MS = 10000  # the requests of a round are sent at once: the scheduler waits for all of them (`rounds`)

needs_model = pytest.mark.skipif(not has_default(), reason="the shipped GridQA checkpoint is missing")


@pytest.fixture(scope="module")
def reference():
    return load_default()


def ask(client, messages, **kwargs):
    return ask_openai(client, DEFAULT_MODEL, messages, MAX_TOKENS, **kwargs)


def stats(server) -> dict:
    with urllib.request.urlopen(server.base_url + "/raincheck/stats", timeout=10) as response:
        return json.loads(response.read())


def rounds(server, requests_per_round, send):
    """Runs each round's requests at once (threads released together; the scheduler collects exactly that many
    into one batch: its window is long, its max_batch_size the round's size); returns each round's results."""
    results = []
    for requests in requests_per_round:
        barrier = threading.Barrier(len(requests))
        server.scheduler.max_batch_size = len(requests)

        def go(request):
            barrier.wait()
            return send(request)

        with ThreadPoolExecutor(len(requests)) as pool:
            results.append(list(pool.map(go, requests)))
    return results


# ---------------------------------------------------------------------------------------------- concurrent chats
def dialogues():
    """Four conversations of three turns; the last one joins a round late (a new row next to continued ones);
    turn 3 brings a new image in two of them (rows with and without new images in one batch)."""
    images = gridqa_images(range(60, 66))
    return [
        [("what is in C3?", images[60]), ("what is in D4?", None), ("what is in B2?", images[64])],
        [("list row B.", images[61]), ("what is in A1?", None), ("how many red things are in column 3?", None)],
        [("what is in E5?", images[62]), ("list row C.", None), ("what is in F6?", images[65])],
        [None, ("what is in H8?", images[63]), ("what is in G7?", None)],
    ]


@needs_model
def test_concurrent_conversations_share_batched_calls_and_equal_raincheck_chat(reference):
    model, processor = reference
    chats = dialogues()
    expected = [chat_reference(model, processor, CONFIG, [t for t in turns if t is not None], MAX_TOKENS)
                for turns in chats]
    with RaincheckServer(raincheck_config=CONFIG, port=0, cache_budget_mb=256, batch_window_ms=WINDOW_MS) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        histories = [[] for _ in chats]

        def send(request):
            i, t = request
            text, image = chats[i][t]
            histories[i].append(user(text, data_url(image) if image is not None else None))
            answer, usage = ask(client, histories[i])
            histories[i].append({"role": "assistant", "content": answer})
            return i, answer, usage

        done = [[] for _ in chats]
        requests = [[(i, t) for i, turns in enumerate(chats) if turns[t] is not None] for t in range(3)]
        for results in rounds(srv, requests, send):
            for i, answer, usage in results:
                done[i].append((answer, usage))

        answers = [[a for a, _ in conv] for conv in done]
        assert answers == expected  # every conversation as RaincheckChat answers it alone, none crossed over
        usages = [[u.raincheck for _, u in conv] for conv in done]
        assert [[u["batch_size"] for u in conv] for conv in usages] == [[3, 4, 4]] * 3 + [[4, 4]]
        batches = stats(srv)["batches"]  # 11 requests in 3 calls
        assert batches == {"calls": 3, "rows": 11, "max_rows": 4, "sizes": {"3": 1, "4": 2}, "fallbacks": 0}
        for conv in usages:
            assert [u["conversation_cache"] for u in conv] == ["new"] + ["reused"] * (len(conv) - 1)
            for before, after in zip(conv, conv[1:]):  # each pending token restored once: between or in prefill
                assert after["previous_restored_after_answer"] + after["restored_in_prefill"] == \
                    before["pending_at_answer_end"]
        assert srv.scheduler.wait_idle(60)
        snapshot = srv.pool.snapshot()
        assert snapshot["conversations"] == 4 and snapshot["pending"] == 0
        # each conversation pooled in buffers of its own, of its slots rounded up to 256 (no row of a batch's
        # shared buffers, no buffer grown for a call), and no batch cache left alive: the pool's bytes are the
        # bytes its conversations keep alive
        pooled = [c.cache for c in srv.pool.conversations()]
        for cache in pooled:
            slots = -(-cache.length // 256) * 256
            for layer in cache.layers:
                if layer.is_initialized:
                    for tensor in (layer.keys, layer.values):
                        assert tensor.shape[2] == slots and tensor.untyped_storage().nbytes() == tensor.nbytes
            assert cache.filled.untyped_storage().nbytes() == slots
        union = {k: v for cache in pooled for k, v in cache_storages(cache).items()}
        assert snapshot["bytes"] == sum(union.values()) == sum(cache_nbytes(cache) for cache in pooled)
        gc.collect()
        ids = {id(cache) for cache in pooled}
        assert not [o for o in gc.get_objects()
                    if type(o) is BatchedDeferredPrefillCache and any(id(r) in ids for r in o.rows)]
        reported = sum(u["deferred"] for conv in usages for u in conv)
        assert snapshot["deferred"] == reported == (snapshot["restored_in_prefill"]
                                                    + snapshot["restored_during_decode"]
                                                    + snapshot["restored_after_answer"]) > 0
    assert not srv.scheduler.running


def ask_streamed(client, messages):
    return ask_openai(client, DEFAULT_MODEL, messages, MAX_TOKENS, stream=True)


@needs_model
def test_streamed_requests_in_batches(reference):
    """Streamed requests join batches: a `FanOutStreamer` hands each request its row's tokens, next to a
    request that is not streamed; every stream is RaincheckChat's answer."""
    from hf_raincheck.serve import batch

    assert batch.STREAM_IN_BATCHES
    model, processor = reference
    images = gridqa_images([80, 81, 82])
    chats = [[("what is in C3?", images[80]), ("what is in D4?", None)],
             [("list row B.", images[81]), ("what is in A1?", None)],
             [("what is in E5?", images[82]), ("list row C.", None)]]
    expected = [chat_reference(model, processor, CONFIG, turns, MAX_TOKENS) for turns in chats]
    with RaincheckServer(raincheck_config=CONFIG, port=0, cache_budget_mb=256, batch_window_ms=WINDOW_MS) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        histories = [[] for _ in chats]

        def send(request):
            i, t = request
            text, image = chats[i][t]
            histories[i].append(user(text, data_url(image) if image is not None else None))
            # conversation 2 is not streamed: streamed and plain rows in one batch
            answer, usage = (ask_streamed if i < 2 else ask)(client, histories[i])
            histories[i].append({"role": "assistant", "content": answer})
            return answer, usage

        results = rounds(srv, [[(i, t) for i in range(3)] for t in range(2)], send)
        assert [[r[i][0] for r in results] for i in range(3)] == expected
        sizes = [r[i][1].raincheck["batch_size"] for r in results for i in range(3)]
        assert sizes == [3] * 6 and stats(srv)["batches"]["fallbacks"] == 0
        assert [r[i][1].raincheck["conversation_cache"] for r in results for i in range(3)] == ["new"] * 3 + \
            ["reused"] * 3


@needs_model
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_requests_with_different_max_tokens_share_a_call_and_continue(reference, stream):
    """Two requests that differ only in max_tokens run as ONE batched call (the largest limit; each row stopped at
    its own): each answer has exactly its own tokens, each cache holds exactly its conversation (the server checks
    it when the row finishes), and turn 2 of each (again with different limits, in one call) continues
    correctly: every answer equals RaincheckChat's with the same per-turn max_new_tokens."""
    model, processor = reference
    images = gridqa_images([70, 71])
    # (text, image, max_tokens): turn 1 both cut short (3 / 7 tokens); turn 2: one ends by itself, one cut at 2
    chats = [[("list row B.", images[70], 3), ("what is in A1?", None, 16)],
             [("list row C. list row D.", images[71], 7), ("list row E.", None, 2)]]
    expected = []
    for turns in chats:
        with RaincheckChat(model, processor, CONFIG, do_sample=False) as chat:
            expected.append([chat.ask(text, images=image, max_new_tokens=n) for text, image, n in turns])
    with RaincheckServer(raincheck_config=CONFIG, port=0, cache_budget_mb=256, batch_window_ms=WINDOW_MS) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        histories = [[] for _ in chats]

        def send(request):
            i, t = request
            text, image, limit = chats[i][t]
            histories[i].append(user(text, data_url(image) if image is not None else None))
            answer, usage = ask_openai(client, DEFAULT_MODEL, histories[i], limit, stream=stream)
            histories[i].append({"role": "assistant", "content": answer})
            return answer, usage

        results = rounds(srv, [[(i, t) for i in range(2)] for t in range(2)], send)
        assert [[r[i][0] for r in results] for i in range(2)] == expected
        tokens = [[r[i][1].completion_tokens for r in results] for i in range(2)]
        assert tokens[0][0] == 3 and tokens[1][0] == 7 and tokens[1][1] == 2  # cut at their own limits
        assert 0 < tokens[0][1] < 16  # this one ended by itself, in the call that ran on to 16
        assert [r[i][1].raincheck["batch_size"] for r in results for i in range(2)] == [2] * 4
        assert stats(srv)["batches"] == {"calls": 2, "rows": 4, "max_rows": 2, "sizes": {"2": 2}, "fallbacks": 0}
        assert [r[i][1].raincheck["conversation_cache"] for r in results for i in range(2)] == \
            ["new", "new", "reused", "reused"]
        assert srv.scheduler.wait_idle(60)
        for conv in srv.pool.conversations():  # each cache: its whole conversation, the last answer included
            assert conv.cache.token_ids == conv.sequences[0].tolist()[:len(conv.cache.token_ids)]
            assert conv.sequences.shape[1] - len(conv.cache.token_ids) <= 1


@needs_model
def test_a_streamed_request_cancelled_inside_a_batch_drops_only_its_conversation(reference, monkeypatch):
    """A client that goes away mid-stream (its streamer cancelled at its third token) while batched with
    another request: the other request's answer is RaincheckChat's, only the cancelled conversation is dropped."""
    import httpx

    from hf_raincheck.serve import handler

    class HangsUp(handler.TextQueueStreamer):  # what the handler does when the client disconnects, at a set token
        def put(self, value):
            if not self._prompt_seen:
                self.hangs_up = "hang up" in self._backend.decode(value.reshape(-1).tolist())
            elif self.hangs_up and self.total_tokens == 2:
                self.cancel()
            super().put(value)

    monkeypatch.setattr(handler, "TextQueueStreamer", HangsUp)
    model, processor = reference
    image = gridqa_images([90])[90]
    expected = chat_reference(model, processor, CONFIG, [("list row B.", image)], MAX_TOKENS)[0]
    with RaincheckServer(raincheck_config=CONFIG, port=0, cache_budget_mb=256, batch_window_ms=WINDOW_MS) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        kept = [user("list row B.", data_url(image))]
        leaving = {"model": DEFAULT_MODEL, "messages": [user("please hang up. list row C.", data_url(image))],
                   "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}

        def hang_up():
            pieces = []
            try:
                with httpx.Client(timeout=120) as http:
                    with http.stream("POST", srv.base_url + "/chat/completions", json=leaving) as response:
                        pieces = [line for line in response.iter_lines() if '"content"' in line]
            except httpx.HTTPError:  # the stream is cut off: the server dropped the request
                pass
            return pieces

        (answer, usage), pieces = rounds(srv, [["kept", "leaving"]],
                                         lambda r: ask_streamed(client, kept) if r == "kept" else hang_up())[0]
        assert answer == expected and usage.raincheck["batch_size"] == 2
        assert len(pieces) == 2  # its stream ended at the cancellation, after two of its 16 tokens
        assert srv.scheduler.wait_idle(60)
        (conv,) = srv.pool.conversations()  # the cancelled conversation was not kept
        assert ("text", "list row B.") in conv.key[0][1] and conv.turns == 1
        kept += [{"role": "assistant", "content": answer}, user("what is in A1?")]
        ((_, usage),) = rounds(srv, [[kept]], lambda m: ask(client, m))[0]  # (alone: no wait for a batch)
        assert usage.raincheck["conversation_cache"] == "reused"


# ---------------------------------------------------------------------------------------------- a bad row
POISON = "please explode"


def _post(server, body):
    request = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@needs_model
@pytest.mark.parametrize("advance", [False, True], ids=["fails-before-any-row", "fails-after-the-rows-ran"])
def test_a_bad_request_in_a_batch_fails_only_itself(reference, monkeypatch, advance):
    """A generate call that raises for a batch holding a poisoned row: the batch's other requests are answered
    (run again one at a time), the poisoned one gets a 500, and the other conversations go on. With ``advance``
    the failing call first ran every row (their caches advanced): those requests start new conversations."""
    model, processor = reference
    urls, images = {}, gridqa_images([70, 71])
    for i in (70, 71):
        urls[data_url(images[i])] = images[i]
    url_a, url_b = list(urls)
    with RaincheckServer(raincheck_config=CONFIG, port=0, cache_budget_mb=256, batch_window_ms=WINDOW_MS) as srv:
        served = srv.model
        real_generate = served.generate
        calls, inside = [], []
        failed_calls, held_during_fallback = [], []  # weak refs to a tensor of each failed call's frame

        def generate(*args, **kwargs):
            if inside:  # a call made by the batched generate itself (its rows, one after another)
                return real_generate(*args, **kwargs)
            ids = kwargs["input_ids"]
            poisoned = any(POISON in processor.tokenizer.decode(row) for row in ids)
            calls.append((ids.shape[0], poisoned))
            if failed_calls and ids.shape[0] == 1:  # a rerun: nothing of the failed batched call may be held
                gc.collect()
                held_during_fallback.append(failed_calls[0]() is not None)
            if poisoned and advance and ids.shape[0] > 1:
                inside.append(True)
                try:
                    real_generate(*args, **kwargs)  # every row runs: the continued caches advance
                finally:
                    inside.clear()
            if poisoned:
                its_tensors = torch.zeros(8)  # stands for what a failed call's frames hold (KV, activations)
                failed_calls.append(weakref.ref(its_tensors))
                raise RuntimeError("poisoned row")
            inside.append(True)
            try:
                return real_generate(*args, **kwargs)
            finally:
                inside.clear()

        monkeypatch.setattr(served, "generate", generate)
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        a, b = [user("what is in C3?", url_a)], [user("list row B.", url_b)]
        ((answer_a, _), (answer_b, _)) = rounds(srv, [[a, b]], lambda m: ask(client, m))[0]
        a += [{"role": "assistant", "content": answer_a}, user("what is in D4?")]
        b += [{"role": "assistant", "content": answer_b}, user("what is in A1?")]
        poison = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": POISON}], "max_tokens": MAX_TOKENS,
                  "temperature": 0}
        before = stats(srv)["batches"]
        results = rounds(srv, [[("a", a), ("b", b), ("poison", poison)]],
                         lambda r: _post(srv, r[1]) if r[0] == "poison" else ask(client, r[1]))[0]
        (answer_a2, usage_a2), (answer_b2, usage_b2), (status, body) = results
        assert status == 500 and "poisoned row" in body["error"]["message"]
        # the failed calls' frames were let go: before the reruns, and once the failed request was answered
        assert held_during_fallback and not any(held_during_fallback)
        gc.collect()
        assert len(failed_calls) == 2 and all(ref() is None for ref in failed_calls)
        after = stats(srv)["batches"]
        assert after["fallbacks"] == before["fallbacks"] + 1
        assert any(rows == 3 and poisoned for rows, poisoned in calls)  # the three requests shared a call
        assert usage_a2.raincheck["batch_size"] == usage_b2.raincheck["batch_size"] == 1  # then ran alone
        for messages, answer, usage in ((a, answer_a2, usage_a2), (b, answer_b2, usage_b2)):
            if advance:  # its cache was advanced by the failed call: the whole chat on a new cache
                assert usage.raincheck["conversation_cache"] == "new"
                expected, _ = plain_answer(model, processor, processor_messages(messages, urls), MAX_TOKENS,
                                           raincheck_config=CONFIG)
            else:
                assert usage.raincheck["conversation_cache"] == "reused"
                turns = [(messages[0]["content"][1]["text"], urls[messages[0]["content"][0]["image_url"]["url"]]),
                         (messages[2]["content"][0]["text"], None)]
                expected = chat_reference(model, processor, CONFIG, turns, MAX_TOKENS)[1]
            assert answer == expected
        # both conversations go on from their pooled caches; no cache was left in a half state
        for messages, answer in ((a, answer_a2), (b, answer_b2)):
            messages += [{"role": "assistant", "content": answer}, user("what is in E5?")]
        (_, usage_a3), (_, usage_b3) = rounds(srv, [[a, b]], lambda m: ask(client, m))[0]
        assert usage_a3.raincheck["conversation_cache"] == usage_b3.raincheck["conversation_cache"] == "reused"
        assert srv.scheduler.wait_idle(60)
        snapshot = srv.pool.snapshot()
        assert snapshot["pending"] == 0 and snapshot["conversations"] == 2
        assert snapshot["deferred"] == (snapshot["restored_in_prefill"] + snapshot["restored_during_decode"]
                                        + snapshot["restored_after_answer"])
    assert not srv.scheduler.running


# ---------------------------------------------------------------------------------------------- fan-out streamer
class Recorder:
    def __init__(self, cancel_after: int | None = None):
        self.puts, self.ended, self.cancel_after = [], False, cancel_after

    def put(self, value):
        from hf_raincheck.serve.errors import GenerationCancelled

        if self.cancel_after is not None and len(self.puts) > self.cancel_after:
            raise GenerationCancelled()
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def test_fan_out_streamer_gives_each_row_its_batch_one_stream():
    from hf_raincheck.serve.streaming import FanOutStreamer

    eos, pad = {9}, 0
    rows = [Recorder(), None, Recorder(), Recorder()]
    streamer = FanOutStreamer(rows, eos, pad)
    streamer.put(torch.tensor([[0, 1, 2], [3, 4, 5], [0, 0, 6], [7, 7, 7]]))  # the prompt, [B, L]
    assert not streamer.started(0)  # nothing given before the row's first token
    # row 0 ends with eos, row 2 holds a real pad token mid-answer, row 3 stops (a stop string) and is padded
    steps = [[5, 1, 0, 4], [9, 1, 7, 0], [0, 1, 8, 0], [0, 1, 9, 0]]
    for step in steps:
        streamer.put(torch.tensor(step))
    streamer.end()
    assert streamer.started(0) and not streamer.started(1)
    assert rows[0].puts == [[[0, 1, 2]], [5], [9]]
    assert rows[2].puts == [[[0, 0, 6]], [0], [7], [8], [9]]
    assert rows[3].puts == [[[7, 7, 7]], [4]]  # the trailing padding is never given
    assert all(r.ended for r in rows if r is not None)


def test_fan_out_streamer_ends_each_row_at_its_own_limit():
    from hf_raincheck.serve.streaming import FanOutStreamer

    eos, pad = {9}, 0
    rows = [Recorder(), Recorder(), Recorder()]
    streamer = FanOutStreamer(rows, eos, pad, row_limits=[2, 4, 4])
    streamer.put(torch.tensor([[1, 1], [2, 2], [3, 3]]))
    # row 0: cut after 2 tokens (padding after); row 1: a real pad token as its last one; row 2: eos first
    for step in ([5, 6, 9], [5, 6, 0], [0, 0, 0], [0, 0, 0]):
        streamer.put(torch.tensor(step))
    streamer.end()
    assert rows[0].puts == [[[1, 1]], [5], [5]]
    assert rows[1].puts == [[[2, 2]], [6], [6], [0], [0]]  # padding at the limit was part of the answer
    assert rows[2].puts == [[[3, 3]], [9]]
    assert all(r.ended for r in rows)
    for bad in ([2, 4], [2, 0, 1], "4"):
        with pytest.raises(ValueError, match="row_limits must be None or one int >= 1 per row"):
            FanOutStreamer(rows, eos, pad, row_limits=bad)


def test_fan_out_streamer_cancels_one_row_and_aborts_when_all_are_cancelled():
    from hf_raincheck.serve.errors import GenerationCancelled

    from hf_raincheck.serve.streaming import FanOutStreamer

    rows = [Recorder(cancel_after=1), Recorder(), None]
    streamer = FanOutStreamer(rows, {9}, 0)
    streamer.put(torch.ones(3, 2, dtype=torch.long))
    for token in (4, 5, 6):
        streamer.put(torch.tensor([token, token, token]))
    streamer.end()
    assert streamer.cancelled == [True, False, False]
    assert rows[0].puts == [[[1, 1]], [4]] and not rows[0].ended
    assert rows[1].puts == [[[1, 1]], [4], [5], [6]] and rows[1].ended
    everyone = FanOutStreamer([Recorder(cancel_after=0), Recorder(cancel_after=0)], {9}, 0)
    everyone.put(torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(GenerationCancelled):
        everyone.put(torch.tensor([4, 4]))
    with pytest.raises(ValueError, match=r"prompt \[2, length\]"):
        FanOutStreamer([None, None], {9}, 0).put(torch.ones(3))


@needs_model
def test_text_queue_streamer_streams_the_answer_as_text(reference):
    """The request streamer: the prompt is not streamed, a character split over several tokens comes out whole,
    special tokens are skipped, the pieces join to the decoded answer, ``end`` queues None, and a cancelled stream
    raises `GenerationCancelled` at its next token."""
    import asyncio

    from hf_raincheck.serve.errors import GenerationCancelled
    from hf_raincheck.serve.streaming import TextQueueStreamer

    tokenizer = reference[1].tokenizer
    text = "a grid: 🙂 ∑ é"
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # a character split over tokens (the emoji: 4)
    loop = asyncio.new_event_loop()
    try:
        queue = asyncio.Queue()
        streamer = TextQueueStreamer(tokenizer, loop, queue)
        streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt
        for token in ids:
            streamer.put(torch.tensor([token]))
        streamer.end()
        loop.run_until_complete(asyncio.sleep(0))  # runs the queued puts
        pieces = []
        while not queue.empty():
            pieces.append(queue.get_nowait())
        assert pieces[-1] is None and "".join(pieces[:-1]) == text and streamer.total_tokens == len(ids)
        assert all("\ufffd" not in piece for piece in pieces[:-1])
        streamer.cancel()
        with pytest.raises(GenerationCancelled):
            streamer.put(torch.tensor([ids[0]]))
    finally:
        loop.close()
    with pytest.raises(ValueError, match="must be a fast tokenizer"):
        TextQueueStreamer(object(), None, None)


@needs_model
def test_fan_out_streamer_in_transformers_batched_generate(reference):
    """transformers' own batched generate drives the fan-out as the Raincheck engine will: every row's
    stream is its answer (the tokens `answer_length` keeps)."""
    from hf_raincheck.serve.streaming import FanOutStreamer
    from hf_raincheck.serve.turn import answer_length, eos_ids

    model, processor = reference
    texts = ["what is in C3?", "list row B. list row C. list row D.", "hi"]
    rows = [processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": t}]}],
                                          add_generation_prompt=True, tokenize=True, return_dict=True,
                                          return_tensors="pt") for t in texts]
    from hf_raincheck.conversation import batch_inputs

    gen = model.generation_config
    batch = batch_inputs(rows, gen.pad_token_id)
    recorders = [Recorder() for _ in texts]
    streamer = FanOutStreamer(recorders, eos_ids(gen), gen.pad_token_id)
    out = model.generate(**batch, max_new_tokens=12, do_sample=False, streamer=streamer)
    width = batch["input_ids"].shape[1]
    for i, recorder in enumerate(recorders):
        new = out[i, width:].tolist()
        answer = new[:answer_length(new, eos_ids(gen), gen.pad_token_id, 12)]
        assert recorder.puts[0] == [batch["input_ids"][i].tolist()]
        assert [p[0] for p in recorder.puts[1:]] == answer and recorder.ended


# ---------------------------------------------------------------------------------------------- the pool
def test_the_pool_counts_a_shared_buffer_once_and_frees_it_with_its_last_holder():
    class Model:
        pass

    model, sequences = Model(), torch.zeros(1, 1, dtype=torch.long)
    shared = torch.zeros(1000, dtype=torch.uint8)  # a batched call's KV buffer, rows of it held by two caches
    caches = {"a": {"kv": shared[:500]}, "b": {"kv": shared[500:], "own": torch.zeros(100, dtype=torch.uint8)},
              "c": {"kv": torch.zeros(600, dtype=torch.uint8)}}
    assert cache_nbytes(caches["a"]) == 1000 and cache_nbytes(caches["b"]) == 1100
    pool = ConversationPool(1500)
    for name in ("a", "b"):
        assert pool.checkin(pool.new(model, (name,), caches[name], sequences)) == []
    assert pool.bytes == 1100  # not 2100
    conv_a = pool.checkout(model, ("a", "next"))
    assert pool.bytes == 1100  # b still holds the shared buffer
    pool.checkin(conv_a)
    evicted = pool.checkin(pool.new(model, ("c",), caches["c"], sequences))  # 1700 > 1500
    assert len(evicted) == 2 and pool.bytes == 600  # evicting a alone frees nothing; with b the buffer goes
    assert pool.peak_bytes == 1100 and pool.conversations()[0].cache is caches["c"]


def test_evicting_a_conversation_frees_its_cache():
    class Cache(dict):  # (a dict the pool measures, that a weak reference can follow)
        pass

    class Model:
        pass

    model, sequences = Model(), torch.zeros(1, 1, dtype=torch.long)
    pool = ConversationPool(1500)
    first = Cache(kv=torch.zeros(1000, dtype=torch.uint8))
    freed = weakref.ref(first)
    pool.checkin(pool.new(model, ("a",), first, sequences))
    del first
    assert pool.checkin(pool.new(model, ("b",), Cache(kv=torch.zeros(1000, dtype=torch.uint8)), sequences)) == [1]
    gc.collect()
    assert freed() is None and pool.bytes == 1000  # nothing keeps an evicted conversation's tensors alive


# ---------------------------------------------------------------------------------------------- grouping
def _turn(max_new_tokens=16, do_sample=False, seed=None, streamer=None, model="m", config=CONFIG):
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample)
    job = SimpleNamespace(model=model, processor="p", raincheck_config=config, generation_config=gen, seed=seed,
                          streamer=streamer)
    return SimpleNamespace(job=job)


def test_requests_share_a_call_only_with_equal_settings(monkeypatch):
    """Equal settings but for max_tokens share a call; sampling, seeds, streams (when not batched), models and,
    under the flash backend (rows one by one), max_tokens split them."""
    from hf_raincheck.serve import batch

    turns = [_turn(), _turn(max_new_tokens=8), _turn(), _turn(do_sample=True), _turn(do_sample=True, seed=3),
             _turn(do_sample=True, max_new_tokens=4), _turn(seed=3), _turn(streamer=object()), _turn(),
             _turn(model="other")]
    groups = batch.group_turns(turns, max_batch_size=3)
    index = {id(t): i for i, t in enumerate(turns)}
    assert [[index[id(t)] for t in g] for g in groups] == [[0, 1, 2], [3, 5], [4], [6, 7, 8], [9]]
    assert batch.batch_key(turns[4]) is None  # seeded sampling runs alone (its draws must not depend on a batch)
    monkeypatch.setattr(batch, "STREAM_IN_BATCHES", False)  # streamed requests alone
    groups = batch.group_turns(turns, max_batch_size=3)
    assert [[index[id(t)] for t in g] for g in groups] == [[0, 1, 2], [3, 5], [4], [6, 8], [7], [9]]
    flash = RaincheckConfig(attn_backend="flash")
    turns = [_turn(config=flash), _turn(max_new_tokens=8, config=flash), _turn(config=flash)]
    index = {id(t): i for i, t in enumerate(turns)}
    assert [[index[id(t)] for t in g] for g in batch.group_turns(turns, 3)] == [[0, 2], [1]]


def test_row_token_limits():
    from hf_raincheck.serve.batch import RowTokenLimits

    limits = RowTokenLimits([1, 3, 2], prompt_width=4)
    assert limits(torch.zeros(3, 5, dtype=torch.long), None).tolist() == [True, False, False]
    assert limits(torch.zeros(3, 6, dtype=torch.long), None).tolist() == [True, False, True]
    assert limits(torch.zeros(3, 7, dtype=torch.long), None).tolist() == [True, True, True]
    with pytest.raises(ValueError, match="built for 3 rows, called with a batch of 1"):
        limits(torch.zeros(1, 7, dtype=torch.long), None)
    for bad, words in ((([], 4), "limits must be a non-empty list"), (([2, 0], 4), "limits must be"),
                       (([2], 0), "prompt_width must be an int >= 1")):
        with pytest.raises(ValueError, match=words):
            RowTokenLimits(*bad)


def test_answer_length():
    from hf_raincheck.serve.turn import answer_length

    assert answer_length([5, 6, 9, 0, 0], {9}, 0, 5) == 3  # up to the end-of-sequence token
    assert answer_length([5, 6, 7], {9}, 0, 3) == 3  # max_new_tokens
    assert answer_length([5, 0, 7, 0, 0], {9}, 0, 8) == 3  # a stop string, then the padding
    assert answer_length([5, 0, 7, 0, 0], {9}, 0, 5) == 5  # at max_new_tokens every token is the answer


def test_command_line_batching_options(capsys):
    from hf_raincheck.serve.cli import build_parser, main

    args = build_parser().parse_args(["--max-batch-size", "4", "--batch-window-ms", "20"])
    assert (args.max_batch_size, args.batch_window_ms) == (4, 20)
    for bad, words in ((["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
                       (["--batch-window-ms", "-1"], "--batch-window-ms must be in [0, 10000]"),
                       (["--image-cache-mb", "-1"], "--image-cache-mb must be >= 0")):
        with pytest.raises(SystemExit):
            main(bad)
        assert words in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
        RaincheckServer(port=0, max_batch_size=0)
