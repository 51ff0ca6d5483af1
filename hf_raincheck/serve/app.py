"""`RaincheckServer`: the FastAPI app of `transformers serve` (its `build_server`) with the Raincheck chat handler,
the conversation pool and the model's scheduler; runs in the foreground (the CLI) or in a thread (tests,
benchmarks). Of transformers' routes it keeps the middleware and ``/v1/chat/completions`` (the Raincheck handler);
``/v1/models`` lists the one model, ``/health`` reports the model's scheduler, the other generation endpoints and
``/load_model`` / ``/reset`` answer 404 with what to use instead."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

from ..config import RaincheckConfig
from ..transformers_coupling import serving_app
from .handler import RaincheckChatHandler, _Refused
from .images import DEFAULT_CACHE_MB as DEFAULT_IMAGE_CACHE_MB
from .images import ImageLoader
from .models import DEFAULT_MODEL, RaincheckModelManager
from .pool import ConversationPool
from .scheduler import DEFAULT_BATCH_WINDOW_S, DEFAULT_MAX_BATCH_SIZE, BatchingScheduler

DEFAULT_CACHE_BUDGET_MB = 4096


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RaincheckServer:
    """An OpenAI-compatible chat server with Raincheck and conversation cache reuse.

    Args:
        model: the model to serve (Hub id or path; None or ``DEFAULT_MODEL``: the shipped GridQA checkpoint, on
            the CPU unless ``device`` names another), or a model object already in memory (a supported
            ``...ForConditionalGeneration``; then ``processor`` is required, ``model_name`` names it, and
            ``device`` / ``dtype`` / ``attn_implementation`` / ``trust_remote_code`` do not apply). The server
            enables Raincheck on it (`enable_raincheck`, this instance only).
        processor: the processor of a model object (with a model name: loaded with the model, so not allowed).
        model_name: the name clients send as ``model`` for a model object (default: its ``name_or_path``).
        raincheck_config: the `RaincheckConfig` of every request (``completion`` is set to ``"next_turn"``:
            pending deferred tokens are restored by the scheduler between requests, or folded into the next one).
        cache_budget_mb: memory of the conversation caches kept between requests (LRU eviction beyond it).
        restore_between_requests: restore pending deferred tokens while no request is waiting.
        max_batch_size: the most concurrent requests run as one batched `generate` (1: one at a time).
        batch_window_ms: how long after a request arrives the server waits for others to batch with it (0: only
            the requests that arrived while the model was busy are batched).
        image_dirs: folders that ``image_url`` local paths may point into (none: local paths refused).
        image_cache_mb: decoded images kept for follow-up turns that send the same image again (MB of pixels; 0:
            decode every time).
        host / port: where to listen (port 0: a free port).
        device / dtype / attn_implementation / trust_remote_code: how a non-default model is loaded.
        log_level: uvicorn's log level.
    """

    def __init__(self, model=None, raincheck_config: RaincheckConfig | None = None,
                 cache_budget_mb: float = DEFAULT_CACHE_BUDGET_MB, restore_between_requests: bool = True,
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, batch_window_ms: float = DEFAULT_BATCH_WINDOW_S * 1000,
                 image_dirs=(), image_cache_mb: float = DEFAULT_IMAGE_CACHE_MB, host: str = "127.0.0.1",
                 port: int = 8000, device: str = "auto",
                 dtype: str | None = "auto", attn_implementation: str | None = None, trust_remote_code: bool = False,
                 log_level: str = "warning", processor=None, model_name: str | None = None):
        import uvicorn
        from transformers.cli.serving.utils import GenerationState

        config = raincheck_config if raincheck_config is not None else RaincheckConfig()
        if not isinstance(config, RaincheckConfig):
            raise ValueError(f"RaincheckServer: raincheck_config must be a RaincheckConfig, got {type(config).__name__}")
        if not isinstance(cache_budget_mb, (int, float)) or isinstance(cache_budget_mb, bool) or cache_budget_mb <= 0:
            raise ValueError(f"RaincheckServer: cache_budget_mb must be a number > 0, got {cache_budget_mb!r}")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"RaincheckServer: max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if (isinstance(batch_window_ms, bool) or not isinstance(batch_window_ms, (int, float))
                or not 0 <= batch_window_ms <= 10000):
            raise ValueError(f"RaincheckServer: batch_window_ms must be a number in [0, 10000], got "
                             f"{batch_window_ms!r}")
        preloaded = None
        if model is None or isinstance(model, str):
            if processor is not None or model_name is not None:
                raise ValueError("RaincheckServer: processor and model_name are for a model object; a model given by "
                                 "name loads its own processor and is served under that name")
            self.model_name = model or DEFAULT_MODEL
        else:
            if processor is None:
                raise ValueError(f"RaincheckServer: serving a model object ({type(model).__name__}) needs its "
                                 "processor= (the processor that builds its inputs)")
            self.model_name = model_name or str(getattr(model, "name_or_path", "") or "")
            if not self.model_name or "@" in self.model_name:
                raise ValueError("RaincheckServer: a model object needs a model_name without '@' (the name clients "
                                 f"send as `model`; default: its name_or_path), got {self.model_name!r}")
            preloaded = (model, processor)
        self.raincheck_config = dataclasses.replace(config, completion="next_turn")
        self.model_manager = RaincheckModelManager(
            force_model=self.model_name, preloaded=preloaded, device=device, dtype=dtype,
            attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
        self.pool = ConversationPool(int(cache_budget_mb * 1024 * 1024))
        self.scheduler = BatchingScheduler(self.pool, restore_between_requests=restore_between_requests,
                                           max_batch_size=max_batch_size, batch_window_s=batch_window_ms / 1000)
        self.generation_state = GenerationState()
        self.chat_handler = RaincheckChatHandler(self.model_manager, self.generation_state, self.raincheck_config,
                                                 self.scheduler, ImageLoader(image_dirs, image_cache_mb))
        self.app = serving_app(self.model_manager, self.chat_handler, _Refused, self.generation_state)
        self._add_routes()
        self.host = host
        self.port = free_port(host) if port == 0 else port
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=self.port, log_level=log_level))
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def model(self):
        return self.model_manager.load_model_and_processor()[0]

    def _add_routes(self) -> None:
        from fastapi.responses import JSONResponse

        pool, scheduler, manager = self.pool, self.scheduler, self.model_manager
        replaced = {"/v1/models", "/health", "/load_model", "/reset"}
        self.app.router.routes[:] = [r for r in self.app.router.routes if getattr(r, "path", None) not in replaced]

        @self.app.get("/v1/models")
        def list_models():  # the one model this server serves (transformers' lists the Hub cache's models)
            return JSONResponse({"object": "list", "data": manager.list_models()})

        @self.app.get("/health")
        def health():
            if not scheduler.running:
                return JSONResponse({"status": "unhealthy", "reason": "the model's scheduler has stopped"},
                                    status_code=503)
            return JSONResponse({"status": "ok"})

        @self.app.post("/load_model")
        @self.app.post("/reset")
        def fixed_model():
            return JSONResponse({"detail": f"hf-raincheck serve serves one model, {manager.force_model!r}, loaded "
                                           "when it starts; start another server for another model"},
                                status_code=404)

        @self.app.get("/v1/raincheck/stats")
        def raincheck_stats():
            return JSONResponse({**pool.snapshot(), "restored_between_requests": scheduler.restored_between_requests,
                                 "batches": scheduler.batch_stats.snapshot()})

    # ------------------------------------------------------------------ running
    def run(self) -> None:
        """Serves in the foreground until interrupted (the CLI)."""
        try:
            self.server.run()
        finally:
            self.close()

    def start(self, timeout: float = 60.0) -> "RaincheckServer":
        """Serves in a background thread; returns once the server accepts connections."""
        def serve():
            asyncio.run(self.server.serve())

        self._thread = threading.Thread(target=serve, name="raincheck-serve-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stops serving (waits for the thread) and releases the conversations and the model's thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.close()

    def close(self) -> None:
        self.scheduler.stop()
        self.pool.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
