"""The OpenAI-compatible server (hf_raincheck.serve) on the shipped GridQA model: the real `openai` client on
localhost, answers against `RaincheckChat` / plain `generate`, cache reuse, restoration between requests,
eviction, and the bad-request matrix."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

sys.path.insert(0, os.path.dirname(__file__))

from serve_support import chat_reference, data_url, gridqa_images, plain_answer, processor_messages, user  # noqa: E402

from hf_raincheck import RaincheckConfig  # noqa: E402
from hf_raincheck.gridqa import has_default, load_default, make_dialogue  # noqa: E402
from hf_raincheck.serve import DEFAULT_MODEL, RaincheckServer  # noqa: E402

pytestmark = pytest.mark.skipif(not has_default(), reason="the shipped GridQA checkpoint is missing")

CONFIG = RaincheckConfig(retention=0.3)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference():
    """A second copy of the shipped model for the references (the server's model runs on its own thread)."""
    return load_default()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve_images")


@pytest.fixture(scope="module")
def server(image_dir):
    srv = RaincheckServer(raincheck_config=CONFIG, port=0, image_dirs=[str(image_dir)], cache_budget_mb=256).start()
    yield srv
    srv.stop()
    assert not srv.scheduler.running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def ask(client, messages, stream=False, **kwargs):
    """One request; returns (answer, usage)."""
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs.setdefault("temperature", 0)
    if not stream:
        response = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, **kwargs)
        return response.choices[0].message.content, response.usage
    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    assert finish in ("stop", "length")
    return "".join(pieces), usage


def test_multi_turn_chat_with_images_equals_raincheck_chat(server, client, reference, image_dir):
    """Three turns (an image as a data: URL, a second image as a local file, text only), streamed and not."""
    images = gridqa_images([0, 1])
    path = image_dir / "grid1.png"
    images[1].save(path)
    dialogue = make_dialogue(0)
    questions = [dialogue.turns[0].question, "what is in B2?", dialogue.turns[2].question]
    model, processor = reference
    expected = chat_reference(model, processor, CONFIG,
                              [(questions[0], images[0]), (questions[1], images[1]), (questions[2], None)], MAX_TOKENS)

    messages = [user(questions[0], data_url(images[0]))]
    answer1, usage1 = ask(client, messages)
    messages += [{"role": "assistant", "content": answer1}, user(questions[1], str(path))]
    answer2, usage2 = ask(client, messages, stream=True)
    messages += [{"role": "assistant", "content": answer2}, user(questions[2])]
    answer3, usage3 = ask(client, messages, stream=True)

    assert [answer1, answer2, answer3] == expected
    assert usage1.raincheck["conversation_cache"] == "new" and usage1.raincheck["deferred"] > 0
    assert usage2.raincheck["conversation_cache"] == "reused" and usage2.raincheck["deferred"] > 0
    assert usage3.raincheck["conversation_cache"] == "reused" and usage3.raincheck["deferred"] == 0
    assert usage2.prompt_tokens_details.cached_tokens == usage1.prompt_tokens + usage1.completion_tokens - 1
    assert usage1.total_tokens == usage1.prompt_tokens + usage1.completion_tokens


def test_turn_two_feeds_only_the_new_tokens_and_restores_between_requests(server, client):
    image = make_dialogue(2).image()
    messages = [user("what is in A1?", data_url(image, "JPEG"))]
    # 4 new tokens: the answer ends before the guard steps, so every deferred token is still pending
    answer1, usage1 = ask(client, messages, max_tokens=4)
    pending = usage1.raincheck["pending_at_answer_end"]
    assert pending == usage1.raincheck["deferred"] > 0
    assert server.scheduler.wait_idle(60)  # the server restores them while no request waits
    (conv,) = [c for c in server.pool.conversations() if c.key[0][1][-1] == ("text", "what is in A1?")]
    cache = conv.cache
    assert cache.pending == 0 and cache.stats.after_answer == pending
    assert cache.length == usage1.prompt_tokens + usage1.completion_tokens - 1  # the last token is not fed yet

    messages += [{"role": "assistant", "content": answer1}, user("what is in H8?")]
    _, usage2 = ask(client, messages)
    assert usage2.raincheck["conversation_cache"] == "reused"
    assert usage2.raincheck["previous_restored_after_answer"] == pending
    assert usage2.raincheck["restored_in_prefill"] == 0
    assert usage2.prompt_tokens_details.cached_tokens == usage1.prompt_tokens + usage1.completion_tokens - 1
    # the same cache object went on: two generate calls on it, the second fed only the new tokens
    assert len(cache.turn_stats) == 2
    assert cache.length == usage2.prompt_tokens + usage2.completion_tokens - 1
    fed = cache.length - (usage1.prompt_tokens + usage1.completion_tokens - 1)
    assert fed == usage2.prompt_tokens - usage2.prompt_tokens_details.cached_tokens + usage2.completion_tokens - 1


def test_a_new_request_preempts_restoration_and_each_deferred_token_is_restored_once(reference, image_dir):
    config = RaincheckConfig(retention=0.3, completion_chunk_size=4)  # restoration in 4-token steps
    with RaincheckServer(raincheck_config=config, port=0, cache_budget_mb=256) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        images = gridqa_images([3, 4])
        first = [user("what is in C3?", data_url(images[3]))]
        answer, usage1 = ask(client, first, max_tokens=2)
        # at once: the restoration of the first conversation is preempted by the next requests
        ask(client, [user("what is in D4?", data_url(images[4]))], max_tokens=2)
        _, usage2 = ask(client, first + [{"role": "assistant", "content": answer}, user("what is in C4?")],
                        max_tokens=2)
        assert usage2.raincheck["conversation_cache"] == "reused"
        pending = usage1.raincheck["pending_at_answer_end"]
        assert pending > 0
        # exactly once: what was restored between the requests + what the prefill folded in = what was pending
        assert usage2.raincheck["previous_restored_after_answer"] + usage2.raincheck["restored_in_prefill"] == pending
        assert srv.scheduler.wait_idle(60)
        snapshot = srv.pool.snapshot()
        assert snapshot["pending"] == 0
        assert snapshot["deferred"] == (snapshot["restored_in_prefill"] + snapshot["restored_during_decode"]
                                        + snapshot["restored_after_answer"]) > 0


def image_urls(indices):
    """GridQA images of `indices` as data URLs: ({url: image}, [url per index])."""
    images = gridqa_images(indices)
    urls = {data_url(images[i]): images[i] for i in indices}
    return urls, list(urls)


def test_retention_one_answers_equal_plain_generate_on_the_whole_conversation(reference):
    config = RaincheckConfig(retention=1.0)
    model, processor = reference
    urls, (url5, url6) = image_urls([5, 6])
    with RaincheckServer(raincheck_config=config, port=0, cache_budget_mb=256) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        messages = [user("list row B.", url5)]
        for turn, follow_up in enumerate([user("what is in F6?", url6), user("how many red things are in column 3?"),
                                          None]):
            answer, usage = ask(client, messages, stream=turn % 2 == 1)
            expected, ids = plain_answer(model, processor, processor_messages(messages, urls), MAX_TOKENS)
            assert answer == expected, f"turn {turn + 1}"
            assert usage.prompt_tokens == ids.numel()  # the cached tokens are exactly the template's rendering
            assert usage.raincheck["deferred"] == 0
            if turn:
                assert usage.raincheck["conversation_cache"] == "reused"
            if follow_up is not None:
                messages += [{"role": "assistant", "content": answer}, follow_up]


def test_an_evicted_conversation_is_prefilled_again_correctly(reference):
    model, processor = reference
    urls, (url7, url8) = image_urls([7, 8])
    # about one conversation's cache (~1 MB) fits: the second conversation evicts the first
    with RaincheckServer(raincheck_config=CONFIG, port=0, cache_budget_mb=1.5) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        a = [user("what is in E5?", url7)]
        answer_a, _ = ask(client, a)
        ask(client, [user("what is in A8?", url8)])
        assert srv.pool.snapshot()["evictions"] >= 1
        a += [{"role": "assistant", "content": answer_a}, user("what is in E6?")]
        answer, usage = ask(client, a)
        assert usage.raincheck["conversation_cache"] == "new"
        expected, ids = plain_answer(model, processor, processor_messages(a, urls), MAX_TOKENS, raincheck_config=CONFIG)
        assert answer == expected and usage.prompt_tokens == ids.numel()
        snapshot = srv.pool.snapshot()
        assert snapshot["peak_bytes"] <= snapshot["budget_bytes"]


# ---------------------------------------------------------------------------------------------- bad requests
def _post(server, body, path="/v1/chat/completions"):
    request = urllib.request.Request(server.base_url.removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _body(content, **extra):
    return {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def _text(text):
    return {"type": "text", "text": text}


def _image(url):
    return {"type": "image_url", "image_url": {"url": url}}


BAD_REQUESTS = {
    "malformed data URL": (_body([_image("data:image/png;base64"), _text("q")]), 400, "malformed data: URL"),
    "not base64": (_body([_image("data:image/png;base64,@@@"), _text("q")]), 400, "not valid base64"),
    "undecodable image": (_body([_image("data:image/png;base64,aGVsbG8gd29ybGQ="), _text("q")]), 400,
                          "cannot be decoded"),
    "not an image media type": (_body([_image("data:text/plain;base64,aGVsbG8="), _text("q")]), 400, "image/*"),
    "remote URL": (_body([_image("https://example.com/cat.png"), _text("q")]), 400, "not fetched"),
    "local path outside the image dirs": (_body([_image("/etc/hostname"), _text("q")]), 403, "--image-dir"),
    "missing local file": (None, 404, "not found"),
    "unsupported content type": (_body([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]), 400,
                                 "'input_audio' is not supported"),
    "prompt beyond the context": (_body("count: " + "a b " * 5000), 400, "beyond the model's context"),
    "max_tokens beyond the context": (_body("hi", max_tokens=100000), 400, "lower max_tokens"),
    "unknown model": ({**_body("hi"), "model": "someone/other-model"}, 400, "pinned"),
    "conflicting max tokens": (_body("hi", max_completion_tokens=8), 400, "conflict"),
    "generation_config and temperature": (_body("hi", generation_config='{"max_new_tokens": 4}', temperature=0.5,
                                                max_tokens=None), 400, "conflict"),
    "unknown generation setting": (_body("hi", generation_config='{"max_new_tokens": 4, "colour": "blue"}',
                                         max_tokens=None), 400, "['colour'] are not generation settings"),
    "generation_config not an object": (_body("hi", generation_config="[4]", max_tokens=None), 400, "got list"),
    "n > 1": (_body("hi", n=2), 400, "n=2"),
    "temperature out of range": (_body("hi", temperature=3), 400, "temperature"),
    "stream_options without stream": (_body("hi", stream_options={"include_usage": True}), 400, "stream_options"),
    "last message not from the user": ({"model": DEFAULT_MODEL, "messages": [{"role": "assistant", "content": "x"}]},
                                       400, "last message"),
    "unknown role": ({"model": DEFAULT_MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    "tools": (_body("hi", tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    "empty messages": ({"model": DEFAULT_MODEL, "messages": []}, 400, "non-empty"),
    "unknown field": (_body("hi", colour="blue"), 422, "colour"),
}


def test_bad_requests_get_a_clear_4xx_and_do_not_disturb_other_conversations(server, client, image_dir):
    # a conversation in the pool before the bad requests
    messages = [user("what is in B7?", data_url(make_dialogue(9).image()))]
    answer, _ = ask(client, messages)
    before = server.pool.snapshot()
    failures = []
    for name, (body, status, words) in BAD_REQUESTS.items():
        if body is None:
            body = _body([_image(str(image_dir / "missing.png")), _text("q")])
        body = {k: v for k, v in body.items() if v is not None}
        for stream in (False,) if name == "stream_options without stream" else (False, True):
            got, text = _post(server, {**body, "stream": stream} if stream else body)
            if got != status or words not in text:
                failures.append(f"{name} (stream={stream}): {got} {text[:300]}")
    assert not failures, "\n".join(failures)
    # the server is up, the earlier conversation's cache is intact and still reused
    with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/health", timeout=10) as response:
        assert response.status == 200
    assert server.pool.snapshot()["conversations"] == before["conversations"]
    messages += [{"role": "assistant", "content": answer}, user("what is in B8?")]
    _, usage = ask(client, messages)
    assert usage.raincheck["conversation_cache"] == "reused"


def test_a_failing_generation_is_reported_and_the_server_goes_on(server, client):
    # transformers accepts this generation_config, Raincheck's generate refuses it: a 500 for this request only
    body = _body("hi", generation_config=json.dumps({"max_new_tokens": 4, "prefill_chunk_size": 8}), max_tokens=None)
    body = {k: v for k, v in body.items() if v is not None}
    status, text = _post(server, body)
    assert status == 500 and "prefill_chunk_size" in text
    answer, usage = ask(client, [user("hello")])
    assert usage.completion_tokens > 0


def test_other_endpoints_and_stats(server, client):
    status, text = _post(server, {"model": DEFAULT_MODEL, "prompt": "hi"}, path="/v1/completions")
    assert status == 404 and "/v1/chat/completions" in text
    with urllib.request.urlopen(server.base_url + "/raincheck/stats", timeout=10) as response:
        stats = json.loads(response.read())
    assert {"conversations", "bytes", "budget_bytes", "hits", "misses", "evictions", "pending"} <= set(stats)
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL]
    with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    for path in ("/load_model", "/reset"):  # one model, loaded at start: transformers serve's loading routes refused
        status, text = _post(server, {"model": "other/model"}, path=path)
        assert status == 404 and "serves one model" in text, path


def test_command_line(capsys):
    from hf_raincheck.serve.cli import build_parser, console_main, raincheck_config_from_args

    with pytest.raises(SystemExit) as exit_info:
        console_main(["serve", "--help"])
    assert exit_info.value.code == 0 and "--retention" in capsys.readouterr().out
    assert console_main(["bogus"]) == 2 and "unknown command 'bogus'" in capsys.readouterr().err
    args = build_parser().parse_args(["some/model", "--retention", "0.5", "--pruning", "divprune",
                                      "--raincheck-config", '{"chunk_size": 15}'])
    config = raincheck_config_from_args(args)
    assert (args.model, config.retention, config.pruning, config.chunk_size) == ("some/model", 0.5, "divprune", 15)
    with pytest.raises(SystemExit):
        from hf_raincheck.serve.cli import main

        main(["--retention", "2"])  # an invalid config value: argparse error naming the field
    assert "retention" in capsys.readouterr().err


def test_sampling_parameters_stop_and_max_tokens(server, client):
    messages = [user("list row C.", data_url(make_dialogue(10).image()))]
    sampled = [ask(client, messages, temperature=1.0, top_p=0.9, seed=7, max_tokens=12)[0] for _ in range(2)]
    assert sampled[0] == sampled[1]  # the seed is applied on the model's thread, right before the request's generate
    response = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=3, temperature=0)
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 3
    full, _ = ask(client, messages, max_tokens=MAX_TOKENS)
    word = full.split()[1]
    stopped, _ = ask(client, messages, max_tokens=MAX_TOKENS, stop=[word])
    assert stopped.endswith(word) and len(stopped) < len(full) and full.startswith(stopped)


def test_a_client_that_goes_away_mid_stream_cancels_only_its_request(server, client):
    import httpx

    before = server.pool.snapshot()["conversations"]
    body = _body([_image(data_url(make_dialogue(11).image())), _text("list row D.")], max_tokens=200, stream=True,
                 temperature=0)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base_url + "/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if '"content"' in line:
                    break  # the first piece of the answer: hang up
    assert server.scheduler.wait_idle(60)
    assert server.pool.snapshot()["conversations"] == before  # the cancelled conversation was not kept
    answer, usage = ask(client, [user("hello again")])
    assert usage.completion_tokens > 0


def test_example_client(server, reference, capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import serve_client

    answers = serve_client.main(["--base-url", server.base_url, "--max-tokens", str(MAX_TOKENS)])
    dialogue = make_dialogue(0)
    model, processor = reference
    expected = chat_reference(model, processor, CONFIG,
                              [(turn.question, dialogue.image() if i == 0 else None)
                               for i, turn in enumerate(dialogue.turns)], MAX_TOKENS)
    assert answers == expected
    assert "from the conversation's cache (reused)" in capsys.readouterr().out


def test_command_line_refuses_a_model_without_raincheck_support(tmp_path, capsys):
    from hf_raincheck.serve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "no-such-model"), "--port", "0"])
    assert exit_info.value.code == 2 and "cannot serve" in capsys.readouterr().err


def test_a_16_bit_image_url_is_scaled_to_8_bit_not_clipped():
    """A 16-bit PNG sent as a data: URL decodes to the pixels of its 8-bit original (not an all-white image)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from hf_raincheck.serve.images import ImageLoader

    gray = make_dialogue(3).image().convert("L")
    wide = Image.fromarray((np.asarray(gray).astype(np.uint16) * 257))  # the same values on 16 bits
    buffer = io.BytesIO()
    wide.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    image, _ = ImageLoader().load(url, "messages[0].content[0]")
    assert np.array_equal(np.asarray(image), np.asarray(gray.convert("RGB")))


def test_the_image_loader_keeps_decoded_images_for_the_same_bytes_within_its_budget():
    from hf_raincheck.serve.images import ImageLoader

    images = gridqa_images([3, 4, 5])
    urls = {i: data_url(image) for i, image in images.items()}
    side = images[3].width * images[3].height * 3
    loader = ImageLoader(cache_mb=2.5 * side / (1024 * 1024))  # room for two decoded images
    first, digest = loader.load(urls[3], "m")
    again, digest_again = loader.load(urls[3], "m")
    assert again is first and digest_again == digest and loader.hits == 1
    jpeg = data_url(images[3], "JPEG")  # other bytes: decoded on their own (other pixels, another identity)
    assert loader.load(jpeg, "m")[0] is not first
    loader.load(urls[4], "m")  # the third image evicts the least recently used (the PNG of grid 3)
    assert loader.cached_images == 2
    fresh, digest_fresh = loader.load(urls[3], "m")
    assert fresh is not first and digest_fresh == digest and loader.hits == 1
    uncached = ImageLoader(cache_mb=0)
    assert uncached.load(urls[5], "m")[0] is not uncached.load(urls[5], "m")[0] and uncached.cached_images == 0
    with pytest.raises(ValueError, match="cache_mb must be a number >= 0"):
        ImageLoader(cache_mb=-1)


def test_a_model_object_in_memory_is_served_under_its_name(reference):
    """`RaincheckServer(model, processor=..., model_name=...)`: nothing loaded, the object itself served (with
    Raincheck enabled on it), its answers RaincheckChat's; other names are refused."""
    from hf_raincheck import disable_raincheck

    model, processor = load_default()  # its own instance: the server enables Raincheck on it
    try:
        image = gridqa_images([90])[90]
        expected = chat_reference(reference[0], reference[1], CONFIG, [("what is in C3?", image)], 12)
        with RaincheckServer(model, CONFIG, processor=processor, model_name="my/grid-model", port=0) as srv:
            assert srv.model is model and srv.model_name == "my/grid-model"
            client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
            answer = client.chat.completions.create(
                model="my/grid-model", messages=[user("what is in C3?", data_url(image))], max_tokens=12,
                temperature=0).choices[0].message.content
            assert [answer] == expected
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model=DEFAULT_MODEL, messages=[user("hi")], max_tokens=2)
    finally:
        disable_raincheck(model)


def test_a_model_saved_on_disk_is_loaded_as_transformers_serve_loads_it(reference, tmp_path):
    """A local path: the model and its processor loaded through the installed transformers serve's own loader (its
    device / dtype options), Raincheck enabled, its answers RaincheckChat's; the path is the model's name."""
    import torch

    import hf_raincheck.testing  # noqa: F401 - lets AutoProcessor build the Qwen3-VL processor without torchvision

    model, processor = load_default()
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    image = gridqa_images([90])[90]
    expected = chat_reference(reference[0], reference[1], CONFIG, [("what is in C3?", image)], 12)
    with RaincheckServer(str(tmp_path), CONFIG, port=0, device="cpu", dtype="float32") as srv:
        assert srv.model is not model and srv.model.dtype == torch.float32 and srv.model.device.type == "cpu"
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == [str(tmp_path)]
        answer = client.chat.completions.create(
            model=str(tmp_path), messages=[user("what is in C3?", data_url(image))], max_tokens=12,
            temperature=0).choices[0].message.content
        assert [answer] == expected


def test_a_model_object_needs_its_processor_and_a_name():
    model = load_default()[0]
    model.name_or_path = ""
    with pytest.raises(ValueError, match=r"needs its processor="):
        RaincheckServer(model, port=0)
    with pytest.raises(ValueError, match=r"needs a model_name without '@'"):
        RaincheckServer(model, processor=object(), port=0)
    with pytest.raises(ValueError, match=r"needs a model_name without '@'"):
        RaincheckServer(model, processor=object(), model_name="a@b", port=0)
    with pytest.raises(ValueError, match=r"processor and model_name are for a model object"):
        RaincheckServer(DEFAULT_MODEL, processor=object(), port=0)
