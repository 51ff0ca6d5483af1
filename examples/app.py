"""Raincheck chat demo (Gradio): ask several questions about images or a video, compare Full / Hard / Raincheck.

    python examples/app.py                                   # the default model (see `load_model`), CPU
    python examples/app.py --tiny-random                     # the tiny random Qwen3-VL: gibberish, real mechanics
    python examples/app.py --model Qwen/Qwen3-VL-8B-Instruct --device cuda

Also the ``app.py`` of a Hugging Face Space (see README, "Space"): with no arguments it reads the checkpoint from
the ``RAINCHECK_MODEL`` environment variable (a Space variable), and on ZeroGPU hardware it switches to stateless
turns (``--stateless``), because GPU state does not outlive a ``@spaces.GPU`` call.

Every browser session has its own `RaincheckChat` (keyed by Gradio's session hash, closed when the page is closed):
its `DeferredPrefillCache` is kept between questions, and the deferred tokens an answer left are restored in the
background while you read it. The side panel sets the policy, retention, chunk size and selector (they apply from
the next question on: images already in the conversation keep the plan they were prefilled with), shows per turn
TTFT, TPOT and how many deferred tokens were restored during and after the answer, and draws which regions of the
latest image (or video frames) were kept for the first prefill and which were restored later.

Images and videos are loaded here with Pillow / PyAV, the equivalent of `qwen_vl_utils.process_vision_info`'s
fetch step (open, EXIF orientation, RGB; frames sampled at 2 fps, 4..``--max-frames``, an even count), and resized
by the model's own processor with its own pixel limits. qwen-vl-utils itself is not used: it imports torchvision at
import time (checked with qwen-vl-utils 0.0.14), which this CPU install does not have.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import gradio as gr
import numpy as np
import torch
from PIL import Image, ImageDraw, ImageOps
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_raincheck import RaincheckChat, RaincheckConfig, TurnStats
from hf_raincheck.images import eight_bit
from hf_raincheck.models import get_adapter
from hf_raincheck.pruning import available_selectors

logger = logging.getLogger("raincheck_demo")

# ---------------------------------------------------------------------------------------------------------- limits
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "MPO")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi")
MAX_IMAGE_BYTES = 10 * 2**20
MAX_VIDEO_BYTES = 50 * 2**20
MIN_IMAGE_SIDE = 32  # px: one merged Qwen-VL token is 28 or 32 px
MAX_IMAGE_SIDE = 8192
MAX_IMAGE_PIXELS = 40_000_000
MAX_ASPECT_RATIO = 50  # Qwen's smart_resize refuses > 200
MAX_IMAGES_PER_MESSAGE = 4
MAX_VIDEOS_PER_MESSAGE = 1
MAX_VIDEO_SECONDS = 120.0
VIDEO_SAMPLE_FPS = 2.0  # as qwen_vl_utils
MAX_TEXT_CHARS = 4000
MAX_NEW_TOKENS_LIMIT = 1024

POLICIES = {"Full": "full", "Hard": "hard", "Raincheck": "raincheck"}

# overlay: what happened to each merged visual token of a span
KEPT, DURING, AFTER, PENDING, DROPPED = range(5)
STATE_NAMES = {KEPT: "kept at first", DURING: "restored during the answer", AFTER: "restored after the answer",
               PENDING: "not restored yet", DROPPED: "dropped (Hard)"}
STATE_COLORS = {KEPT: (60, 180, 75), DURING: (40, 110, 255), AFTER: (255, 150, 0), PENDING: (150, 150, 150),
                DROPPED: (0, 0, 0)}
STATE_ALPHA = {DURING: 170, AFTER: 170, PENDING: 190, DROPPED: 210}
LEGEND = ("Each image (or video frame step): tinted picture and token map, one cell per merged visual token. "
          "<span style='color:#3cb44b'>Green</span> (untinted) = kept for the first prefill, "
          "<span style='color:#286eff'>blue</span> = restored during the answer (fused decode steps), "
          "<span style='color:#ff9600'>orange</span> = restored after it (background worker, or folded into the "
          "next question's prefill), grey = not restored yet, black = dropped (Hard).")


class InputError(ValueError):
    """An input the demo refuses; its message is shown in the UI."""


# ---------------------------------------------------------------------------------------------------------- model
@dataclass
class Runtime:
    """The model the demo serves."""

    model: object
    processor: object
    name: str
    random_weights: bool = False  # answers are gibberish (the tiny random test model)
    default_max_new_tokens: int = 128


def load_model(model: str | None = None, device: str | None = None, tiny_random: bool = False) -> Runtime:
    """The demo's model: ``model`` (a hub id or a local path) if given; else the shipped tiny trained model
    (``hf_raincheck.gridqa.load_default``) when this version of the package has it; else the tiny *random* Qwen3-VL
    of `hf_raincheck.testing` (``tiny_random=True`` forces it).

    The one place to change what the demo runs by default.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if model:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        if _on_zero_gpu():  # ZeroGPU: load on the CPU, `.to("cuda")` at import time (the `spaces` package defers it)
            loaded = AutoModelForImageTextToText.from_pretrained(model, dtype=dtype).to("cuda")
        else:
            loaded = AutoModelForImageTextToText.from_pretrained(model, dtype=dtype, device_map=device)
        return Runtime(loaded.eval(), AutoProcessor.from_pretrained(model), model, default_max_new_tokens=256)
    if not tiny_random:
        try:
            from hf_raincheck.gridqa import load_default
        except ImportError:
            load_default = None
        if load_default is not None:
            loaded, processor = load_default(arch="qwen3_vl")
            if device != "cpu":
                loaded = loaded.to(device)
            return Runtime(loaded.eval(), processor, "hf_raincheck GridQA tiny Qwen3-VL (trained)",
                           default_max_new_tokens=64)
    from hf_raincheck.testing import tiny_qwen3_vl

    loaded, processor = tiny_qwen3_vl(seed=0)
    return Runtime(loaded.to(device), processor, "tiny random Qwen3-VL (hf_raincheck.testing)", random_weights=True,
                   default_max_new_tokens=48)


def _on_zero_gpu() -> bool:
    return bool(os.environ.get("SPACES_ZERO_GPU"))


# ---------------------------------------------------------------------------------------------------------- inputs
def upload_dir() -> str:
    """Gradio's upload folder (``GRADIO_TEMP_DIR`` or ``<tmp>/gradio``): the only place files are read from."""
    return os.path.realpath(os.environ.get("GRADIO_TEMP_DIR") or os.path.join(_tempdir(), "gradio"))


def _tempdir() -> str:
    import tempfile

    return tempfile.gettempdir()


def parse_message(message) -> tuple[str, list[str]]:
    """``(text, file paths)`` of a `gr.MultimodalTextbox` value; refuses an empty or over-long message."""
    if isinstance(message, str):
        message = {"text": message, "files": []}
    if not isinstance(message, dict):
        raise InputError("Unexpected message format.")
    text = message.get("text") or ""
    if not isinstance(text, str):
        raise InputError("Unexpected message format.")
    text = text.strip()
    files = []
    for item in message.get("files") or []:
        path = item.get("path") if isinstance(item, dict) else item
        if not isinstance(path, str) or not path:
            raise InputError("Unexpected file entry in the message.")
        files.append(path)
    if not text:
        raise InputError("Type a question (an attachment alone is not a message)." if files else
                         "The message is empty: type a question.")
    if len(text) > MAX_TEXT_CHARS:
        raise InputError(f"The message is too long ({len(text)} characters; at most {MAX_TEXT_CHARS}).")
    return text, files


def check_upload(path: str) -> str:
    """The kind (``"image"`` / ``"video"``) of an uploaded file; refuses files outside Gradio's upload folder, other
    types, and files over the size limits. Returns after checking name and size only (content: `load_image` /
    `load_video`)."""
    name = os.path.basename(path)
    real = os.path.realpath(path)
    root = upload_dir()
    if os.path.commonpath([real, root]) != root or not os.path.isfile(real):
        raise InputError(f"{name}: not a file uploaded through this page.")
    ext = os.path.splitext(name)[1].lower()
    if ext in IMAGE_EXTENSIONS:
        kind, limit = "image", MAX_IMAGE_BYTES
    elif ext in VIDEO_EXTENSIONS:
        kind, limit = "video", MAX_VIDEO_BYTES
    else:
        allowed = ", ".join(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)
        raise InputError(f"{name}: unsupported file type {ext or '(none)'!r}; upload an image or a video ({allowed}).")
    size = os.path.getsize(real)
    if size > limit:
        raise InputError(f"{name}: {size / 2**20:.1f} MB is over the {limit // 2**20} MB limit for {kind}s.")
    if size == 0:
        raise InputError(f"{name}: the file is empty.")
    return kind


def _check_dims(name: str, width: int, height: int, what: str = "image") -> None:
    if min(width, height) < MIN_IMAGE_SIDE:
        raise InputError(f"{name}: {what} of {width}x{height} px is too small (at least {MIN_IMAGE_SIDE} px a side).")
    if max(width, height) > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
        raise InputError(f"{name}: {what} of {width}x{height} px is too large (at most {MAX_IMAGE_SIDE} px a side "
                         f"and {MAX_IMAGE_PIXELS / 1e6:.0f} MP).")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise InputError(f"{name}: aspect ratio {max(width, height) / min(width, height):.0f}:1 is too extreme "
                         f"(at most {MAX_ASPECT_RATIO}:1).")


def load_image(path: str) -> Image.Image:
    """An uploaded image as RGB (EXIF orientation applied); checks its format and dimensions before decoding it."""
    name = os.path.basename(path)
    try:
        with Image.open(path) as image:
            if image.format not in IMAGE_FORMATS:
                raise InputError(f"{name}: not a supported image ({image.format or 'unknown format'}).")
            _check_dims(name, *image.size)
            image.seek(0)
            loaded = eight_bit(ImageOps.exif_transpose(image), name).convert("RGB")  # 16-bit / float: scaled
    except InputError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as error:
        raise InputError(f"{name}: cannot be read as an image ({type(error).__name__}).") from None
    _check_dims(name, *loaded.size)
    return loaded


def load_video(path: str, max_frames: int = 16) -> np.ndarray:
    """Frames ``(T, H, W, 3)`` uint8 of an uploaded video, sampled at 2 fps (4..max_frames frames, an even count,
    spread evenly over longer clips), each at most 640 px a side, with PyAV."""
    name = os.path.basename(path)
    try:
        import av
    except ImportError:
        raise InputError("Video input needs PyAV (`pip install av`), which is not installed here.") from None
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise InputError(f"{name}: no video stream.")
            stream = container.streams.video[0]
            duration = None
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / 1e6
            if duration is not None and duration > MAX_VIDEO_SECONDS:
                raise InputError(f"{name}: {duration:.0f} s is longer than the {MAX_VIDEO_SECONDS:.0f} s limit.")
            _check_dims(name, stream.codec_context.width, stream.codec_context.height, "video")
            count = max(4, min(max_frames, int(math.ceil((duration or 2.0) * VIDEO_SAMPLE_FPS))))
            count -= count % 2
            targets = np.linspace(0.0, max(duration or 0.0, 0.0), count, endpoint=False) if duration else None
            frames, decoded = [], 0
            for frame in container.decode(stream):
                decoded += 1
                if decoded > 30 * MAX_VIDEO_SECONDS * 4:
                    break
                when = frame.time if frame.time is not None else decoded / 24.0
                if targets is None:
                    frames.append(frame)
                    if len(frames) >= count:
                        break
                elif len(frames) < count and when + 1e-6 >= targets[len(frames)]:
                    frames.append(frame)
                    if len(frames) == count:
                        break
            images = []
            for frame in frames:
                image = frame.to_image()
                image.thumbnail((640, 640))
                images.append(np.asarray(image.convert("RGB")))
    except InputError:
        raise
    except Exception as error:  # noqa: BLE001 - any decoder failure is a bad upload
        raise InputError(f"{name}: cannot be read as a video ({type(error).__name__}).") from None
    if len(images) < 2:
        raise InputError(f"{name}: the video has fewer than 2 frames.")
    if len(images) % 2:
        images.append(images[-1])  # an even count, as the temporal patch of 2 frames needs
    return np.stack(images)


# Restoration starts with the first decode step, as in examples/chat.py (the library's default waits 16 tokens): on
# the shipped GridQA models a first answer that lists a row or column then reads its deferred cells after they are
# restored (with 16 guard tokens it reads its first cells before anything is restored and is almost always wrong).
DEMO_GUARD_TOKENS = 0


def make_config(policy: str, retention, chunk_size, selector: str, completion: str = "background") -> RaincheckConfig:
    """The `RaincheckConfig` of the side panel's settings."""
    if policy not in POLICIES:
        raise InputError(f"Unknown policy {policy!r}; pick one of {', '.join(POLICIES)}.")
    if selector not in available_selectors():
        raise InputError(f"Unknown selector {selector!r}.")
    try:
        retention = float(retention)
        chunk = int(chunk_size)
        if chunk != float(chunk_size):
            raise ValueError
    except (TypeError, ValueError):
        raise InputError("Retention must be a number and the chunk size a whole number.") from None
    try:
        return RaincheckConfig(policy=POLICIES[policy], retention=retention, chunk_size=chunk, pruning=selector,
                               completion=completion, guard_tokens=DEMO_GUARD_TOKENS)
    except ValueError as error:
        raise InputError(str(error)) from None


# ---------------------------------------------------------------------------------------------------------- overlay
@dataclass
class PlanView:
    """What the overlay needs of a `DeferralPlan` (a live plan, or a copy from a stateless turn)."""

    spans: list[tuple[int, int]]
    modalities: list[str]
    kept: torch.Tensor
    deferred: torch.Tensor
    policy: str
    restored: int  # deferred tokens restored so far (a prefix of `deferred`)
    during: int  # ... of which during the answer

    @classmethod
    def of(cls, plan, during: int, restored: int | None = None) -> "PlanView":
        return cls(list(plan.spans), list(plan.modalities), plan.kept.cpu(), plan.deferred.cpu(), plan.policy,
                   plan.restored if restored is None else restored, during)

    def states(self) -> list[np.ndarray]:
        """Per span, the state code of each of its tokens (raster order)."""
        out = []
        order = {int(i): r for r, i in enumerate(self.deferred.tolist())}
        for start, stop in self.spans:
            codes = np.full(stop - start, KEPT, dtype=np.int8)
            for index in range(start, stop):
                rank = order.get(index)
                if rank is None:
                    continue
                if self.policy == "hard":
                    code = DROPPED
                elif rank < self.during:
                    code = DURING
                elif rank < self.restored:
                    code = AFTER
                else:
                    code = PENDING
                codes[index - start] = code
            out.append(codes)
        return out


@dataclass
class Media:
    """One image or video of a turn, as shown to the model, and its merged-token grid(s)."""

    kind: str  # "image" | "video"
    data: object  # PIL image | frames (T, H, W, 3)
    grids: list[tuple[int, int]] = field(default_factory=list)  # (h, w) merged tokens per span


def _merged_grids(processor, cache_grids: dict, media: list[Media]) -> None:
    """Fills each medium's per-span merged grids from the conversation's grids (the processor's ``*_grid_thw``,
    kept by the cache) and the processor's merge size; this turn's media are the last ones of their modality."""
    for modality in ("image", "video"):
        items = [m for m in media if m.kind == modality]
        grids = cache_grids.get(modality)
        if not items or grids is None:
            continue
        owner = processor.image_processor if modality == "image" else getattr(processor, "video_processor", None)
        merge = int(getattr(owner, "merge_size", None) or getattr(processor.image_processor, "merge_size", 2))
        rows = grids.tolist()[-len(items):]
        for item, (t, h, w) in zip(items, rows):
            item.grids = [(int(h) // merge, int(w) // merge)] * (int(t) if modality == "video" else 1)


def _paint(image: Image.Image, grid: tuple[int, int], codes: np.ndarray, size: int = 256) -> Image.Image:
    """The image with each merged token's cell tinted by its state, and beside it the same grid as a plain map."""
    image = image.convert("RGB")
    scale = size / max(image.size)
    image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
    h, w = grid
    layer = Image.new("RGBA", image.size, (0, 0, 0, 0))
    tint = ImageDraw.Draw(layer)
    schematic = Image.new("RGB", image.size, (255, 255, 255))
    plain = ImageDraw.Draw(schematic)
    for r in range(h):
        for c in range(w):
            box = (c * image.width / w, r * image.height / h, (c + 1) * image.width / w - 1,
                   (r + 1) * image.height / h - 1)
            code = int(codes[r * w + c])
            if code != KEPT:
                tint.rectangle(box, fill=STATE_COLORS[code] + (STATE_ALPHA[code],))
            plain.rectangle(box, fill=STATE_COLORS[code], outline=(255, 255, 255))
    tinted = Image.alpha_composite(image.convert("RGBA"), layer).convert("RGB")
    panel = Image.new("RGB", (2 * image.width + 4, image.height), (255, 255, 255))
    panel.paste(tinted, (0, 0))
    panel.paste(schematic, (image.width + 4, 0))
    return panel


def render_overlay(view: PlanView, media: list[Media], temporal_patch: int = 2) -> Image.Image | None:
    """Panels (one per image, one per video frame step) of the plan's spans, tiled 2 per row."""
    panels = []
    spans = view.states()
    queue = [(m, k) for m in media for k in range(len(m.grids))]
    for (medium, k), codes, modality in zip(queue, spans, view.modalities):
        if medium.kind != modality:
            return None
        h, w = medium.grids[k]
        if h * w != codes.size:
            return None
        if medium.kind == "image":
            picture = medium.data
        else:
            frames = medium.data
            picture = Image.fromarray(frames[min(k * temporal_patch, len(frames) - 1)])
        panels.append(_paint(picture, (h, w), codes))
    if not panels or len(queue) != len(spans):
        return None
    columns = min(2, len(panels))
    rows = math.ceil(len(panels) / columns)
    cell_w = max(p.width for p in panels) + 6
    cell_h = max(p.height for p in panels) + 6
    sheet = Image.new("RGB", (columns * cell_w, rows * cell_h), (255, 255, 255))
    for i, panel in enumerate(panels):
        sheet.paste(panel, ((i % columns) * cell_w + 3, (i // columns) * cell_h + 3))
    return sheet


def overlay_caption(view: PlanView) -> str:
    counts = {code: 0 for code in STATE_NAMES}
    for codes in view.states():
        for code, n in zip(*np.unique(codes, return_counts=True)):
            counts[int(code)] += int(n)
    parts = [f"{STATE_NAMES[c]}: {n}" for c, n in counts.items() if n or c == KEPT]
    return " · ".join(parts)


# ---------------------------------------------------------------------------------------------------------- sessions
class _StopOnEvent(StoppingCriteria):
    """Ends `generate` normally (the turn is recorded, the cache stays consistent) once `event` is set."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _HistoryChat(RaincheckChat):
    """A `RaincheckChat` whose first turn carries an earlier conversation (stateless turns: a fresh cache per call)."""

    def __init__(self, *args, history: list[dict] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self._history = list(history)

    def _inputs(self, message: dict):
        if self._sequences is not None or not self._history:
            return super()._inputs(message)
        inputs = self.processor.apply_chat_template(self._history + [message], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True, return_tensors="pt")
        return {k: v.to(self.model.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@dataclass
class TurnView:
    settings: str  # e.g. "Raincheck 0.3 / chunk 31 / mmtok"
    media: list[Media]
    plan: object | None = None  # the live DeferralPlan (stateful) or a PlanView (stateless)
    stats: TurnStats | None = None  # stateless turns: final stats


class Session:
    """One browser session: a `RaincheckChat` (stateful) or the messages so far (stateless), and its turns."""

    def __init__(self, runtime: Runtime, stateless: bool):
        self.runtime = runtime
        self.stateless = stateless
        self.chat: RaincheckChat | None = None
        self.messages: list[dict] = []  # stateless: the conversation so far
        self.turns: list[TurnView] = []
        self.stop = threading.Event()
        self.busy = False
        self.closing = False
        self.rendered = None  # what the stats panel shows (to skip unchanged refreshes)

    def stats(self) -> list[TurnStats]:
        if self.stateless:
            return [t.stats for t in self.turns if t.stats is not None]
        return self.chat.stats if self.chat is not None else []

    def close(self) -> None:
        """Stops the background worker and frees the cache (later, at the end of a turn still streaming)."""
        self.closing = True
        self.stop.set()
        if self.busy:
            return
        if self.chat is not None:
            try:
                self.chat.close()
            except RuntimeError:
                return
        self.chat = None
        self.messages = []


class Sessions:
    """Sessions by Gradio session hash; the least recently used idle ones are closed beyond `capacity`."""

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._items: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Session | None:
        with self._lock:
            session = self._items.get(key)
            if session is not None:
                self._items.move_to_end(key)
            return session

    def start(self, key: str, session: Session) -> Session:
        with self._lock:
            old = self._items.pop(key, None)
            self._items[key] = session
            evicted = [k for k, s in self._items.items() if not s.busy and k != key]
            evicted = evicted[: max(0, len(self._items) - self.capacity)]
            closing = [self._items.pop(k) for k in evicted]
        for s in ([old] if old is not None else []) + closing:
            s.close()
        return session

    def end(self, key: str) -> None:
        with self._lock:
            session = self._items.pop(key, None)
        if session is not None:
            session.close()

    def __len__(self) -> int:
        return len(self._items)


def _session_key(request) -> str:
    key = getattr(request, "session_hash", None)
    if not key:
        raise InputError("No session: reload the page.")
    return str(key)


# ---------------------------------------------------------------------------------------------------------- the app
_STATELESS_RUNTIME: Runtime | None = None  # the model a stateless (ZeroGPU) turn uses, in the GPU worker too


def _stateless_turn(history: list[dict], text: str, images: list, videos: list, config: RaincheckConfig,
                    generate_kwargs: dict, stop: threading.Event | None = None):
    """One turn on a fresh cache (stateless mode): yields answer pieces, then ``(TurnStats, PlanView | None, grids,
    answer)``.

    On ZeroGPU this runs inside ``@spaces.GPU``: nothing it builds on the GPU outlives the call, so the cache is
    discarded at its end and nothing is restored after the answer (``completion="next_turn"``). `stop` (not on
    ZeroGPU: an event of this process cannot reach the GPU worker) ends the answer early."""
    runtime = _STATELESS_RUNTIME
    if stop is not None:
        generate_kwargs = dict(generate_kwargs, stopping_criteria=StoppingCriteriaList([_StopOnEvent(stop)]))
    with _HistoryChat(runtime.model, runtime.processor, config, history=history, **generate_kwargs) as chat:
        yield from chat.stream(text, images=images or None, videos=videos or None)
        stats = chat.stats[-1]
        cache = chat.cache
        view = None
        if cache.plans:
            view = PlanView.of(cache.plans[-1], during=stats.restored_during_decode)
        grids = {k: v.cpu() for k, v in cache.media_grids.items()}
        answer = chat.messages[-1]["content"][0]["text"]
    yield (stats, view, grids, answer)


def _gpu(fn):
    """``spaces.GPU`` on ZeroGPU hardware, else `fn` itself."""
    if not _on_zero_gpu():
        return fn
    import spaces

    return spaces.GPU(duration=120)(fn)


class RaincheckDemo:
    """The demo's handlers (plain methods: the tests call them without a browser) and its Gradio layout."""

    def __init__(self, runtime: Runtime, stateless: bool = False, max_sessions: int = 16, max_frames: int = 16):
        global _STATELESS_RUNTIME
        self.runtime = runtime
        self.stateless = stateless
        self.max_frames = max_frames
        self.sessions = Sessions(max_sessions)
        video_processor = getattr(runtime.processor, "video_processor", None)
        if video_processor is not None and hasattr(video_processor, "do_sample_frames"):
            # frames are sampled here (2 fps); the processor takes them all (see README: timestamps)
            video_processor.do_sample_frames = False
        self.temporal_patch = int(getattr(video_processor, "temporal_patch_size", 2) or 2)
        _STATELESS_RUNTIME = runtime
        self._stateless_turn = _gpu(_stateless_turn)

    # ------------------------------------------------------------------ handlers
    def respond(self, message, history, policy, retention, chunk_size, selector, max_new_tokens,
                request: gr.Request = None):
        """The chat handler (a generator): checks the inputs, streams the answer, then updates the side panel.

        Yields ``(textbox, chatbot, stats, overlay, caption)``; refused inputs raise `gr.Error` (shown in the UI)."""
        try:
            text, files = parse_message(message)
            config = make_config(policy, retention, chunk_size, selector,
                                 completion="next_turn" if self.stateless else "background")
            max_new = int(max_new_tokens)
            if not 1 <= max_new <= MAX_NEW_TOKENS_LIMIT:
                raise InputError(f"Max new tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}.")
            kinds = [check_upload(path) for path in files]
            if kinds.count("image") > MAX_IMAGES_PER_MESSAGE:
                raise InputError(f"At most {MAX_IMAGES_PER_MESSAGE} images per message.")
            if kinds.count("video") > MAX_VIDEOS_PER_MESSAGE:
                raise InputError(f"At most {MAX_VIDEOS_PER_MESSAGE} video per message.")
            # images first, then videos: the order RaincheckChat puts them in the message (and the plan's spans)
            media = [Media("image", load_image(p)) for p, k in zip(files, kinds) if k == "image"]
            media += [Media("video", load_video(p, self.max_frames)) for p, k in zip(files, kinds) if k == "video"]
            key = _session_key(request)
        except InputError as error:
            raise gr.Error(str(error), print_exception=False) from None

        session = self.sessions.get(key)
        if session is None or session.closing or not history:
            if history:  # the page shows a conversation the server has closed (too many open sessions)
                gr.Warning("This conversation had been closed on the server; this question starts a new one.")
                history = []
            session = self.sessions.start(key, Session(self.runtime, self.stateless))
        if session.busy:
            raise gr.Error("The previous answer is still streaming: stop it or wait.", print_exception=False)
        session.busy = True
        session.stop.clear()

        shown = list(history or [])
        shown.append({"role": "user", "content": [{"path": p} for p in files] + [text]})
        shown.append({"role": "assistant", "content": ""})
        busy_box = gr.MultimodalTextbox(value=None, submit_btn=False, stop_btn=True)
        pieces = self._run_turn(session, text, media, config, max_new)
        try:
            yield busy_box, shown, gr.skip(), gr.skip(), gr.skip()
            answer = ""
            for piece in pieces:
                answer += piece
                shown[-1] = {"role": "assistant", "content": answer}
                yield gr.skip(), shown, gr.skip(), gr.skip(), gr.skip()
            if not answer.strip():
                shown[-1] = {"role": "assistant", "content": "(empty answer)"}
        except gr.Error:
            raise
        except (ValueError, RuntimeError) as error:
            logger.warning("turn refused: %s", error)
            raise gr.Error(f"The model could not answer: {error}", print_exception=False) from None
        except Exception as error:  # noqa: BLE001 - shown as a message, logged with its traceback
            logger.exception("turn failed")
            raise gr.Error(f"The model failed on this question ({type(error).__name__}); see the server log.",
                           print_exception=False) from None
        finally:
            pieces.close()
            session.busy = False
            if session.closing:
                session.close()
        stats, overlay, caption = self.side_panel(session)
        yield gr.MultimodalTextbox(value=None, submit_btn=True, stop_btn=False), shown, stats, overlay, caption

    def _run_turn(self, session: Session, text: str, media: list[Media], config: RaincheckConfig, max_new: int):
        images = [m.data for m in media if m.kind == "image"]
        videos = [m.data for m in media if m.kind == "video"]
        kwargs = {"max_new_tokens": max_new}
        if self.runtime.random_weights:
            kwargs["min_new_tokens"] = max_new  # random weights may stop at once; show the whole schedule
        turn = TurnView(_settings_label(config), media)
        if self.stateless:
            result = None
            stop = None if _on_zero_gpu() else session.stop
            for item in self._stateless_turn(list(session.messages), text, images, videos, config, kwargs, stop):
                if isinstance(item, str):
                    yield item
                else:
                    result = item
            stats, view, grids, answer = result
            content = [{"type": "image", "image": i} for i in images] + [{"type": "video", "video": v} for v in videos]
            session.messages.append({"role": "user", "content": content + [{"type": "text", "text": text}]})
            session.messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
            turn.stats, turn.plan = stats, view
            _merged_grids(self.runtime.processor, grids, media)
            session.turns.append(turn)
            return
        if session.chat is None:
            session.chat = RaincheckChat(self.runtime.model, self.runtime.processor, config)
        chat = session.chat
        chat.config = config  # settings apply from this question on
        plans_before = len(chat.cache.plans) if chat.cache is not None else 0
        criteria = StoppingCriteriaList([_StopOnEvent(session.stop)])
        stream = chat.stream(text, images=images or None, videos=videos or None, stopping_criteria=criteria,
                             **kwargs)
        try:
            yield from stream
        finally:
            session.stop.set()  # closed early (the page went away): end generate at its next step,
            stream.close()  # then wait for it (a finished stream: no-op)
            if len(chat.stats) > len(session.turns):  # the turn was recorded (also when stopped)
                cache = chat.cache
                if cache is not None and len(cache.plans) > plans_before:
                    turn.plan = cache.plans[-1]
                    _merged_grids(self.runtime.processor, cache.media_grids, media)
                session.turns.append(turn)

    def stop(self, request: gr.Request = None) -> None:
        """The stop button: the answer ends at the next decode step (kept in the conversation as far as it got)."""
        session = self.sessions.get(getattr(request, "session_hash", None) or "")
        if session is not None:
            session.stop.set()

    def new_chat(self, request: gr.Request = None):
        """Forgets the conversation (frees its cache); returns the cleared components."""
        key = getattr(request, "session_hash", None)
        if key:
            self.sessions.end(str(key))
        return [], gr.MultimodalTextbox(value=None, submit_btn=True, stop_btn=False), NO_STATS, None, ""

    def end_session(self, request: gr.Request = None) -> None:
        """`demo.unload`: the page was closed; stop the worker and free the cache."""
        key = getattr(request, "session_hash", None)
        if key:
            self.sessions.end(str(key))
            logger.info("session %s ended", str(key)[:8])

    def refresh(self, request: gr.Request = None):
        """The timer: updates the side panel while a background worker restores tokens (skips when unchanged)."""
        session = self.sessions.get(getattr(request, "session_hash", None) or "")
        if session is None or session.busy or not session.turns:
            return gr.skip(), gr.skip(), gr.skip()
        key = self._render_key(session)
        if key == session.rendered:
            return gr.skip(), gr.skip(), gr.skip()
        return self.side_panel(session)

    # ------------------------------------------------------------------ side panel
    def _render_key(self, session: Session):
        stats = session.stats()
        last = _latest_with_plan(session)
        restored = None if last is None or last.plan is None else last.plan.restored
        return tuple((s.restored_after_answer, s.restored_in_prefill) for s in stats), len(stats), restored

    def side_panel(self, session: Session):
        """``(stats markdown, overlay image, caption)`` of a session."""
        session.rendered = self._render_key(session)
        stats = session.stats()
        table = [
            "| # | settings | TTFT ms | TPOT ms | tokens | deferred | restored in prefill | during answer | after |",
            "| --: | --- | --: | --: | --: | --: | --: | --: | --: |",
        ]
        for i, (turn, s) in enumerate(zip(session.turns, stats), 1):
            tpot = "–" if s.tpot_s is None else f"{1e3 * s.tpot_s:.1f}"
            table.append(f"| {i} | {turn.settings} | {1e3 * s.ttft_s:.1f} | {tpot} | {s.new_tokens} | {s.deferred} "
                         f"| {s.restored_in_prefill} | {s.restored_during_decode} | {s.restored_after_answer} |")
        note = ""
        if session.stateless:
            note = "\n\nStateless turns (ZeroGPU): each question re-prefills the conversation on a fresh cache; " \
                   "nothing is restored after an answer."
        elif session.chat is not None and session.chat.completion_running:
            note = "\n\nRestoring the rest in the background…"
        overlay, caption = None, ""
        last = _latest_with_plan(session)
        if last is not None:
            turn_no = session.turns.index(last) + 1
            stat = stats[turn_no - 1]
            view = last.plan if isinstance(last.plan, PlanView) else PlanView.of(last.plan, stat.restored_during_decode)
            overlay = render_overlay(view, last.media, self.temporal_patch)
            caption = f"Turn {turn_no} ({last.settings}): {overlay_caption(view)}"
        return "\n".join(table) + note, overlay, caption

    # ------------------------------------------------------------------ layout
    def default_chunk_size(self) -> int:
        """The package's ``chunk_size="auto"`` for the served model (31; 63 with Gated DeltaNet layers)."""
        return RaincheckConfig().for_model(get_adapter(self.runtime.model).gdn_glue is not None).chunk_size

    def build(self):
        """The Gradio Blocks app."""
        with gr.Blocks(title="Raincheck: deferred multimodal prefill") as demo:
            gr.Markdown(
                "## Raincheck: deferred multimodal prefill\n"
                "Attach images or a video, ask several questions. **Hard** prefills only the kept share of the "
                "visual tokens and drops the rest; **Raincheck** prefills the same share first (shorter time to "
                "first token) and restores the rest in small chunks during the answer and between questions; "
                "**Full** prefills everything.\n\n"
                f"Model: **{self.runtime.name}**." + (
                    " Its weights are random: **the answers are gibberish**; the timings and the restoration "
                    "schedule are real." if self.runtime.random_weights else ""),
                elem_id="header",
            )
            with gr.Row():
                with gr.Column(scale=1):
                    chatbot = gr.Chatbot(label="Chat", height=460, elem_id="chat", group_consecutive_messages=False)
                    textbox = gr.MultimodalTextbox(
                        file_types=["image", "video", *IMAGE_EXTENSIONS, *VIDEO_EXTENSIONS], file_count="multiple",
                        sources=["upload"], placeholder="Ask about an image or a video (attach with the clip)",
                        submit_btn=True, stop_btn=False, elem_id="input", show_label=False,
                    )
                    new_chat = gr.Button("New chat", elem_id="new-chat", size="sm")
                with gr.Column(scale=1):
                    with gr.Accordion("Settings (apply from the next question)", open=True):
                        policy = gr.Radio(list(POLICIES), value="Raincheck", label="Policy", elem_id="policy")
                        retention = gr.Slider(0.05, 1.0, value=0.3, step=0.05, label="Retention (kept share)",
                                              elem_id="retention")
                        chunk = gr.Slider(1, 128, value=self.default_chunk_size(), step=1,
                                          label="Chunk size (deferred tokens per step)",
                                          elem_id="chunk")
                        selector = gr.Dropdown(available_selectors(), value="mmtok", label="Selector",
                                               elem_id="selector")
                        max_new = gr.Slider(1, MAX_NEW_TOKENS_LIMIT, value=self.runtime.default_max_new_tokens,
                                            step=1, label="Max new tokens", elem_id="max-new")
                    stats = gr.Markdown(NO_STATS, elem_id="stats")
                    gr.Markdown(STATS_NOTE, elem_id="stats-note")
                    overlay = gr.Image(label="Kept and restored regions (latest image)", type="pil",
                                       interactive=False, elem_id="overlay", height=280)
                    caption = gr.Markdown("", elem_id="overlay-caption")
                    gr.Markdown(LEGEND, elem_id="legend")
            outputs = [textbox, chatbot, stats, overlay, caption]
            turn = textbox.submit(self.respond, [textbox, chatbot, policy, retention, chunk, selector, max_new],
                                  outputs, show_progress="hidden", concurrency_limit=1, concurrency_id="model")
            turn.then(lambda: gr.MultimodalTextbox(submit_btn=True, stop_btn=False), None, textbox, queue=False,
                      show_progress="hidden")
            textbox.stop(self.stop, None, None, queue=False)
            new_chat.click(self.new_chat, None, outputs, queue=False)
            chatbot.clear(self.new_chat, None, outputs, queue=False)
            gr.Timer(1.0).tick(self.refresh, None, [stats, overlay, caption], queue=False, show_progress="hidden")
            demo.unload(self.end_session)
        return demo


NO_STATS = "Per-turn statistics appear here after the first answer."
STATS_NOTE = ("Settings: policy, retention/chunk size, selector. Restored: deferred tokens of an earlier question "
              "folded into this prefill, carried by this answer's decode steps, and restored after this answer (the "
              "background worker; the count grows while you read).")


def _settings_label(config: RaincheckConfig) -> str:
    """E.g. ``Raincheck 0.3/31 mmtok``, ``Hard 0.5 uniform``, ``Full``."""
    name = {v: k for k, v in POLICIES.items()}[config.policy]
    if config.policy == "full":
        return name
    chunk = f"/{config.chunk_size}" if config.policy == "raincheck" else ""
    return f"{name} {config.retention:g}{chunk} {config.pruning}"


def _latest_with_plan(session: Session) -> TurnView | None:
    for turn in reversed(session.turns):
        if turn.plan is not None:
            return turn
    return None


# ---------------------------------------------------------------------------------------------------------- main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.environ.get("RAINCHECK_MODEL") or None,
                        help="a supported checkpoint (hub id or local path; default: $RAINCHECK_MODEL, else the "
                             "shipped tiny model)")
    parser.add_argument("--tiny-random", action="store_true", help="the tiny random Qwen3-VL (gibberish answers)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--stateless", action="store_true", default=_on_zero_gpu(),
                        help="a fresh cache per question (what ZeroGPU allows; on by default there)")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--max-sessions", type=int, default=16, help="open conversations kept (LRU beyond)")
    parser.add_argument("--max-frames", type=int, default=16, help="frames sampled from a video (2 fps, even)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.model and args.tiny_random:
        parser.error("--model and --tiny-random exclude each other")
    if args.max_frames < 4:
        parser.error("--max-frames must be >= 4")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    runtime = load_model(args.model, args.device, tiny_random=args.tiny_random)
    app = RaincheckDemo(runtime, stateless=args.stateless, max_sessions=args.max_sessions, max_frames=args.max_frames)
    demo = app.build()
    demo.queue(max_size=64)
    print(f"model: {runtime.name} | stateless: {args.stateless}", flush=True)
    demo.launch(server_name=args.host, server_port=args.port, max_file_size=MAX_VIDEO_BYTES, show_error=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
