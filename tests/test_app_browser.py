"""The Gradio demo in a real browser: `examples/app.py --tiny-random` on localhost, driven by Playwright + chromium.

Upload a generated image, ask two questions, check that both answers stream in (the DOM changed several times while
each answer grew), that the stats panel shows numbers for both turns and that the overlay is drawn; then an empty
message shows an error toast and changes nothing, and closing the page ends the session. A full-page screenshot
goes to ``tests/artifacts/app_browser.png`` (git-ignored).

The browser is Debian's ``chromium`` (``.ci/run`` installs it with apt; ``RAINCHECK_CHROMIUM`` overrides the path);
Playwright never downloads one. Without chromium or playwright the test fails under CI (``CI`` set) and is skipped
otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hf_raincheck.testing import make_image

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
SERVER_START_S = 120
ANSWER_S = 60
ANSWER_TOKENS = 160  # the tiny random model always answers max_new_tokens tokens


def _missing(what: str) -> None:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"browser test: {what}; CI must run it (.ci/run installs chromium with apt and playwright with "
                    "pip install -e .[test])", pytrace=False)
    pytest.skip(f"browser test: {what}")


@pytest.fixture
def chromium() -> str:
    """Debian's chromium (``RAINCHECK_CHROMIUM`` overrides), checked before the app starts; playwright importable."""
    path = os.environ.get("RAINCHECK_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        _missing("no `chromium` on PATH (Debian: apt-get install -y --no-install-recommends chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing("playwright is not installed (pip install -e .[test])")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(url: str, process: subprocess.Popen, log: Path) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost: never through a proxy
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the app exited with {process.returncode}:\n{log.read_text()[-3000:]}", pytrace=False)
        try:
            with opener.open(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the app did not answer on {url} within {SERVER_START_S} s:\n{log.read_text()[-3000:]}",
                pytrace=False)


@pytest.fixture
def server(tmp_path, request):
    """``examples/app.py`` (``--tiny-random`` unless the test is parametrized with other arguments) in a subprocess
    on a free port; yields its URL and its log file."""
    model_args = getattr(request, "param", ["--tiny-random"])
    port = _free_port()
    log = tmp_path / "app.log"
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        GRADIO_TEMP_DIR=str(tmp_path / "gradio"),
        GRADIO_ANALYTICS_ENABLED="False",
        HF_HUB_OFFLINE="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        TOKENIZERS_PARALLELISM="false",
    )
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "app.py"), *model_args, "--host", "127.0.0.1",
             "--port", str(port), "--threads", "1"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_for_server(url, process, log)
        yield url, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


# Records, on every DOM change of the chat, how many answers there are and the length of the last one.
_RECORD_ANSWERS = """() => {
  window.__answers = [];
  const chat = document.querySelector('#chat');
  new MutationObserver(() => {
    const bots = chat.querySelectorAll('[data-testid="bot"]');
    if (bots.length) window.__answers.push([bots.length, bots[bots.length - 1].innerText.trim().length]);
  }).observe(chat, {subtree: true, childList: true, characterData: true});
}"""


def _stats_rows(page) -> list[list[str]]:
    return [row.locator("td").all_inner_texts() for row in page.locator("#stats tbody tr").all()]


def _settled_text(locator, timeout_s: float = 15.0) -> str:
    """The element's text once Gradio's pending-update timer ("0.0s", prepended to a component while its update is
    on the way) is gone (CI once read the caption mid-update); the text as it is after `timeout_s` otherwise."""
    deadline = time.monotonic() + timeout_s
    text = locator.inner_text()
    while re.match(r"\s*\d+(\.\d+)?s\b", text) and time.monotonic() < deadline:
        time.sleep(0.1)
        text = locator.inner_text()
    return text


def _ask(page, question: str, turn: int) -> None:
    box = page.locator("#input textarea")
    box.fill(question)
    box.press("Enter")
    # the turn is over when the stats table has its row and the submit button is back
    page.wait_for_function(f"() => document.querySelectorAll('#stats tbody tr').length >= {turn}",
                           timeout=ANSWER_S * 1000)
    page.locator("#input [data-testid='submit-button']").wait_for(state="visible", timeout=ANSWER_S * 1000)


def test_two_questions_in_a_real_browser(chromium, server, tmp_path):
    from playwright.sync_api import sync_playwright

    url, log = server
    image = tmp_path / "grid.png"
    make_image(11, (256, 256)).save(image)
    started = time.monotonic()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(30_000)
            page.goto(url, wait_until="domcontentloaded")
            page.locator("#input textarea").wait_for(state="visible")
            assert "answers are gibberish" in page.locator("#header").inner_text()
            page.evaluate(_RECORD_ANSWERS)

            # longer answers than the default 48 tokens, so that streaming spans many frames even on a fast machine
            max_new = page.locator("#max-new input[type=number]")
            max_new.fill(str(ANSWER_TOKENS))
            max_new.press("Enter")
            # upload the image (Gradio stores it in its upload folder), then two questions
            page.locator("#input input[type=file]").set_input_files(str(image))
            page.locator("#input .thumbnail-item img").wait_for(state="visible")
            _ask(page, "What is in the top left corner?", 1)
            page.locator("#overlay img").wait_for(state="visible")
            _ask(page, "And what is at the bottom right?", 2)

            answers = page.locator("#chat [data-testid='bot']").all_inner_texts()
            assert len(answers) == 2 and all(a.strip() for a in answers), answers
            assert page.locator("#chat [data-testid='user'] img").count() == 1  # the uploaded image, once
            growth = page.evaluate("window.__answers")
            for turn in (1, 2):
                lengths = {n for count, n in growth if count == turn and n > 0}
                assert len(lengths) >= 2, f"answer {turn} did not stream: {sorted(lengths)}"
                print(f"answer {turn}: {len(lengths)} lengths seen while streaming")

            rows = _stats_rows(page)
            assert len(rows) == 2, rows
            for row in rows:  # #, settings, TTFT, TPOT, tokens, deferred, in prefill, during, after
                assert row[1].startswith("Raincheck 0.3/31 mmtok"), row
                ttft, tpot, tokens = float(row[2]), float(row[3]), int(row[4])
                assert ttft > 0 and tpot > 0 and tokens == ANSWER_TOKENS, row
            assert [int(rows[0][5]), int(rows[1][5])] == [44, 0]  # 64 tokens, retention 0.3: 44 deferred
            assert int(rows[0][7]) > 0  # restored by fused decode steps during the first answer
            caption = _settled_text(page.locator("#overlay-caption"))
            assert caption.startswith("Turn 1") and "kept at first: 20" in caption, caption
            assert page.locator("[data-testid='toast-body']").filter(has_text="The model").count() == 0

            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "app_browser.png"), full_page=True)

            # an empty message: an error toast, shown in the UI, nothing sent
            page.locator("#input textarea").fill("   ")
            page.locator("#input textarea").press("Enter")
            toast = page.locator("[data-testid='toast-body']").filter(has_text="The message is empty")
            toast.first.wait_for(state="visible")
            assert "Traceback" not in page.locator("body").inner_text()

            assert len(_stats_rows(page)) == 2 and page.locator("#chat [data-testid='bot']").count() == 2

            # closing the page ends the session (demo.unload frees its cache)
            page.close()
            deadline = time.monotonic() + 20
            while "raincheck_demo INFO session" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert re.search(r"raincheck_demo INFO session \w+ ended", log.read_text()), log.read_text()[-2000:]
        finally:
            browser.close()
    print(f"browser part: {time.monotonic() - started:.1f} s")


@pytest.mark.parametrize("server", [[]], indirect=True)  # no model argument: the shipped GridQA Qwen3-VL
def test_shipped_model_answers_in_a_real_browser(chromium, server, tmp_path):
    """The demo's default model reads an uploaded grid: the second answer (Raincheck, after the first answer's
    deferred cells were restored) lists the asked row exactly."""
    from playwright.sync_api import sync_playwright

    from hf_raincheck.gridqa import is_correct, make_dialogue
    from hf_raincheck.gridqa.task import ROW_NAMES, _listing

    url, _ = server
    dialogue = make_dialogue(5, "test")
    image = tmp_path / "grid.png"
    dialogue.image().save(image)
    reference = _listing(dialogue.cells, [(6, c) for c in range(8)])  # row G
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(30_000)
            page.goto(url, wait_until="domcontentloaded")
            page.locator("#input textarea").wait_for(state="visible")
            header = page.locator("#header").inner_text()
            assert "GridQA" in header and "gibberish" not in header, header
            page.locator("#input input[type=file]").set_input_files(str(image))
            page.locator("#input .thumbnail-item img").wait_for(state="visible")
            _ask(page, "list row B.", 1)
            _ask(page, f"list row {ROW_NAMES[6]}.", 2)
            answers = page.locator("#chat [data-testid='bot']").all_inner_texts()
            assert len(answers) == 2 and answers[0].strip().startswith("B1"), answers
            assert is_correct(answers[1], reference), (answers[1], reference)
            rows = _stats_rows(page)
            assert [int(rows[0][5]), int(rows[1][5])] == [44, 0], rows
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "app_browser_gridqa.png"), full_page=True)
        finally:
            browser.close()
