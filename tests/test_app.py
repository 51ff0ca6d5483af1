"""The Gradio demo's handlers without a browser: input checks, two streamed turns, stop, video, sessions, overlay."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
import torch

gr = pytest.importorskip("gradio", reason="the demo needs gradio: pip install -e .[demo]")

from app_support import import_app, write_video  # noqa: E402
from hf_raincheck.generation.background import BackgroundCompletion  # noqa: E402
from hf_raincheck.testing import load_tiny_qwen3_vl, make_image, make_video  # noqa: E402

app = import_app()


@pytest.fixture(scope="module")
def uploads(tmp_path_factory):
    """Gradio's upload folder for these tests (``GRADIO_TEMP_DIR``), with a subfolder like Gradio's own."""
    root = tmp_path_factory.mktemp("gradio_uploads")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADIO_TEMP_DIR", str(root))
        folder = root / "0123abcd"
        folder.mkdir()
        yield folder


@pytest.fixture(scope="module")
def runtime(tiny_vl_path):
    model, processor = load_tiny_qwen3_vl(tiny_vl_path)  # its own copy: the demo changes the video processor
    return app.Runtime(model, processor, "tiny random Qwen3-VL", random_weights=True, default_max_new_tokens=24)


@pytest.fixture
def demo(runtime):
    d = app.RaincheckDemo(runtime)
    yield d
    for key in list(d.sessions._items):
        d.sessions.end(key)


def request(key="session-1"):
    return types.SimpleNamespace(session_hash=key)


def ask(demo, text, files=(), history=(), policy="Raincheck", retention=0.3, chunk=8, selector="mmtok", max_new=24,
        key="session-1"):
    """Runs one turn; returns every yielded output tuple."""
    message = {"text": text, "files": [str(f) for f in files]}
    return list(demo.respond(message, list(history), policy, retention, chunk, selector, max_new, request(key)))


def refused(demo, match, *args, **kwargs):
    with pytest.raises(gr.Error, match=match) as info:
        ask(demo, *args, **kwargs)
    assert "Traceback" not in str(info.value)
    return info.value


def test_inputs_are_checked_before_anything_runs(demo, uploads, tmp_path):
    image = uploads / "photo.png"
    make_image(1, (128, 128)).save(image)
    refused(demo, "The message is empty", "")
    refused(demo, "The message is empty", "   \n ")
    refused(demo, "Type a question", "", files=[image])
    refused(demo, "too long", "x" * (app.MAX_TEXT_CHARS + 1))
    # file types, by name and by content
    text = uploads / "notes.txt"
    text.write_text("hello")
    refused(demo, r"notes\.txt: unsupported file type '\.txt'", "What is it?", files=[text])
    fake = uploads / "fake.png"
    fake.write_bytes(b"not an image at all")
    refused(demo, r"fake\.png: cannot be read as an image", "What is it?", files=[fake])
    empty = uploads / "empty.jpg"
    empty.write_bytes(b"")
    refused(demo, r"empty\.jpg: the file is empty", "What is it?", files=[empty])
    broken = uploads / "broken.mp4"
    broken.write_bytes(b"\x00" * 1000)
    refused(demo, r"broken\.mp4: cannot be read as a video", "What happens?", files=[broken])
    # sizes and dimensions
    huge = uploads / "huge.png"
    make_image(2, (64, 64)).save(huge)
    with open(huge, "r+b") as f:
        f.truncate(app.MAX_IMAGE_BYTES + 1)
    refused(demo, r"huge\.png: 10\.0 MB is over the 10 MB limit for images", "What is it?", files=[huge])
    small = uploads / "small.png"
    make_image(3, (16, 64)).save(small)
    refused(demo, r"small\.png: image of 16x64 px is too small", "What is it?", files=[small])
    strip = uploads / "strip.png"
    make_image(4, (4000, 40)).save(strip)
    refused(demo, r"strip\.png: aspect ratio 100:1 is too extreme", "What is it?", files=[strip])
    refused(demo, "At most 4 images per message", "Compare them.", files=[image] * 5)
    # uploads only: a file outside Gradio's upload folder, or a path escaping it
    outside = tmp_path / "elsewhere.png"
    make_image(5, (64, 64)).save(outside)
    refused(demo, r"elsewhere\.png: not a file uploaded through this page", "What is it?", files=[outside])
    refused(demo, "not a file uploaded through this page", "What is it?", files=[uploads / ".." / ".." / "passwd"])
    refused(demo, "not a file uploaded through this page", "What is it?", files=["/etc/hostname"])
    # settings
    refused(demo, "Unknown policy", "What is it?", policy="Half")
    refused(demo, "Unknown selector", "What is it?", selector="nope")
    refused(demo, r"RaincheckConfig\.retention", "What is it?", retention=0.0)
    refused(demo, "Max new tokens must be between", "What is it?", max_new=0)
    assert len(demo.sessions) == 0  # nothing started


@pytest.fixture
def release():
    """An event that gates the background worker (see below); set at teardown, so a failing test frees it."""
    event = threading.Event()
    yield event
    event.set()


def test_two_streamed_turns_update_the_side_panel(demo, uploads, monkeypatch, release):
    image = uploads / "grid.png"
    make_image(7, (256, 256)).save(image)
    # hold the background worker until the answer's final panel is rendered (else, on a fast machine, that panel
    # can already show the restored tokens and the timer's refresh below has nothing new to show)
    chunk = BackgroundCompletion._chunk

    def gated_chunk(self, model, cache):
        assert release.wait(60), "the test never released the background worker"
        return chunk(self, model, cache)

    monkeypatch.setattr(BackgroundCompletion, "_chunk", gated_chunk)
    # chunks of 2 from the first step (the demo has no guard tokens): 17 steps restore 34 of the 44 deferred tokens
    # during the answer, the background worker the other 10
    outs = ask(demo, "What is in the top left corner?", files=[image], chunk=2, max_new=18)
    assert len(outs) >= 3  # the question, streamed pieces, the final panel
    box, history, stats, overlay, caption = outs[-1]
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert history[0]["content"][0] == {"path": str(image)} and history[0]["content"][-1].endswith("corner?")
    first = history[1]["content"]
    assert first.strip()
    pieces = [o[1][-1]["content"] for o in outs[1:-1]]
    assert len(pieces) >= 2 and pieces[-1] == first  # streamed: the answer grew over several yields
    assert "| 1 | Raincheck 0.3/2 mmtok |" in stats
    assert isinstance(overlay, app.Image.Image) and overlay.width > overlay.height
    assert caption.startswith("Turn 1") and "kept at first: 20" in caption  # 64 tokens, 0.3 -> 20 kept

    session = demo.sessions.get("session-1")
    s = session.chat.stats[0]
    assert s.deferred == 44 and s.new_tokens == 18 and s.restored_during_decode == 34  # steps 1..17 carry 2 each
    assert stats.splitlines()[2].endswith("| 34 | 0 |") and "Restoring the rest in the background" in stats
    # the timer's refresh: the panel follows the background worker, then skips while nothing changes
    assert demo.refresh(request()) == (gr.skip(), gr.skip(), gr.skip())  # still held: nothing new
    release.set()
    assert session.chat.wait(30)
    stats_now, _, caption_now = demo.refresh(request())
    assert stats_now.splitlines()[2].endswith("| 34 | 10 |")  # during the answer, after it
    assert "restored during the answer: 34 · restored after the answer: 10" in caption_now
    assert demo.refresh(request()) == (gr.skip(), gr.skip(), gr.skip())
    outs = ask(demo, "And the bottom right?", history=history, policy="Hard", max_new=6)
    _, history, stats, _, _ = outs[-1]
    assert len(history) == 4 and history[3]["content"].strip()
    rows = [line for line in stats.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2 and rows[1].startswith("| 2 | Hard 0.3 mmtok |")
    cells = rows[0].split("|")[3:9]  # TTFT, TPOT, tokens, deferred, in prefill, during
    assert all(c.strip().replace(".", "").isdigit() for c in cells), rows[0]
    stats_now = session.chat.stats
    assert stats_now[0].restored_after_answer == 10 and stats_now[1].restored_in_prefill == 0
    panel = demo.side_panel(session)
    assert "restored during the answer: 34" in panel[2] and "not restored yet" not in panel[2]


def test_stop_ends_the_answer_at_the_next_step(demo, uploads):
    image = uploads / "stop.png"
    make_image(8, (128, 128)).save(image)
    turn = demo.respond({"text": "Describe everything.", "files": [str(image)]}, [], "Raincheck", 0.3, 4, "uniform",
                        200, request("stopper"))
    next(turn)  # the question is shown
    next(turn)  # the first piece
    demo.stop(request("stopper"))
    outs = list(turn)
    session = demo.sessions.get("stopper")
    assert session.chat.stats[0].new_tokens < 200
    assert outs[-1][0].submit_btn is True and outs[-1][0].stop_btn is False
    # the conversation goes on from where the answer stopped
    outs = ask(demo, "Go on.", history=outs[-1][1], max_new=4, key="stopper")
    assert len(session.chat.stats) == 2 and session.chat.stats[1].new_tokens == 4


def test_video_upload(demo, uploads):
    path = write_video(uploads / "clip.mp4", make_video(3, num_frames=8, size=(128, 96)), fps=4)
    frames = app.load_video(path, max_frames=16)
    assert frames.shape[0] == 4 and frames.shape[0] % 2 == 0 and frames.shape[-1] == 3  # 2 s at 2 fps
    outs = ask(demo, "What happens?", files=[path], max_new=20, key="video")
    _, history, stats, overlay, caption = outs[-1]
    assert history[1]["content"].strip() and "| 1 |" in stats
    session = demo.sessions.get("video")
    plan = session.chat.cache.plans[0]
    assert plan.modalities == ["video", "video"]  # 4 frames, temporal patch 2: two spans
    assert overlay is not None and caption.startswith("Turn 1")


def test_sessions_are_separate_and_freed(runtime, uploads):
    demo = app.RaincheckDemo(runtime, max_sessions=1)
    image = uploads / "s.png"
    make_image(9, (128, 128)).save(image)
    ask(demo, "What is it?", files=[image], max_new=4, key="a")
    chat_a = demo.sessions.get("a").chat
    ask(demo, "What is it?", files=[image], max_new=4, key="b")
    assert chat_a.closed and demo.sessions.get("a") is None  # over capacity: the idle one was closed
    chat_b = demo.sessions.get("b").chat
    assert chat_b is not chat_a and len(chat_b.stats) == 1
    outs = ask(demo, "Again?", max_new=4, key="b")  # an empty history starts a new conversation
    assert demo.sessions.get("b").chat is not chat_b and chat_b.closed
    assert len(outs[-1][1]) == 2
    demo.end_session(request("b"))  # demo.unload
    assert len(demo.sessions) == 0
    cleared = demo.new_chat(request("b"))
    assert cleared[0] == [] and cleared[2] == app.NO_STATS


def test_stateless_turns(runtime, uploads):
    """What ZeroGPU allows: a fresh cache per question, the conversation re-prefilled, nothing restored after."""
    demo = app.RaincheckDemo(runtime, stateless=True)
    image = uploads / "z.png"
    make_image(10, (128, 128)).save(image)
    outs = ask(demo, "What is it?", files=[image], max_new=6, key="z")
    outs = ask(demo, "And then?", history=outs[-1][1], max_new=6, key="z")
    _, history, stats, overlay, caption = outs[-1]
    session = demo.sessions.get("z")
    assert session.chat is None and len(session.messages) == 4 and len(history) == 4
    first, second = session.stats()
    assert first.deferred == second.deferred == 11  # the image is deferred again on the fresh cache
    assert first.restored_after_answer == second.restored_after_answer == 0
    assert "Stateless turns" in stats and caption.startswith("Turn 2")
    # the stop button works here too (not on ZeroGPU, where the answer runs in another process)
    turn = demo.respond({"text": "Long answer?", "files": []}, history, "Raincheck", 0.3, 4, "uniform", 200,
                        request("z"))
    next(turn), next(turn)
    demo.stop(request("z"))
    list(turn)
    assert session.stats()[2].new_tokens < 200
    demo.end_session(request("z"))


def test_plan_view_states_and_overlay():
    view = app.PlanView(spans=[(10, 16)], modalities=["image"], kept=torch.tensor([10, 13]),
                        deferred=torch.tensor([11, 12, 14, 15]), policy="raincheck", restored=3, during=1)
    assert view.states()[0].tolist() == [app.KEPT, app.DURING, app.AFTER, app.KEPT, app.AFTER, app.PENDING]
    hard = app.PlanView([(10, 16)], ["image"], torch.tensor([10, 13]), torch.tensor([11, 12, 14, 15]), "hard", 0, 0)
    assert hard.states()[0].tolist() == [app.KEPT, app.DROPPED, app.DROPPED, app.KEPT, app.DROPPED, app.DROPPED]
    media = [app.Media("image", make_image(0, (96, 64)), [(2, 3)])]
    picture = app.render_overlay(view, media)
    assert picture is not None
    pixels = np.asarray(picture)
    # the token map (right half): cell (0, 0) kept -> green, cell (1, 2) pending -> grey
    half = (picture.width - 4) // 2 + 4
    cell_w, cell_h = (picture.width - half) / 3, picture.height / 2
    assert tuple(pixels[int(cell_h / 2), half + int(cell_w / 2)]) == app.STATE_COLORS[app.KEPT]
    assert tuple(pixels[int(1.5 * cell_h), half + int(2.5 * cell_w)]) == app.STATE_COLORS[app.PENDING]
    assert app.overlay_caption(view) == ("kept at first: 2 · restored during the answer: 1 · "
                                         "restored after the answer: 2 · not restored yet: 1")
    # a grid that does not match the span is not drawn (no crash)
    assert app.render_overlay(view, [app.Media("image", make_image(0), [(2, 2)])]) is None


def test_load_model_falls_back_to_the_tiny_random_model(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "hf_raincheck.gridqa", None)  # not in this version: ImportError
    runtime = app.load_model(device="cpu")
    assert runtime.random_weights and "random" in runtime.name
    assert type(runtime.model).__name__ == "Qwen3VLForConditionalGeneration"
