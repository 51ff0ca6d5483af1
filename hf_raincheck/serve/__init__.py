"""An OpenAI-compatible Raincheck server built on `transformers serve` (``hf-raincheck serve [MODEL]``).

* :mod:`.cli` — the command line (``hf-raincheck serve``, ``python -m hf_raincheck.serve``).
* :mod:`.app` — `RaincheckServer`: transformers' FastAPI app with the Raincheck handler, pool and scheduler.
* :mod:`.models` — `RaincheckModelManager`: transformers' model manager + the shipped GridQA checkpoint.
* :mod:`.handler` — `RaincheckChatHandler`: ``/v1/chat/completions`` (a `ChatCompletionHandler` subclass).
* :mod:`.messages` / :mod:`.images` — OpenAI messages and ``image_url`` parts -> the processor's messages.
* :mod:`.pool` — `ConversationPool`: conversation caches between requests, LRU within a memory budget.
* :mod:`.scheduler` — `BatchingScheduler`: the model's thread; concurrent requests collected into batches;
  restoration when idle.
* :mod:`.batch` — which requests share a call (`batch_key`), one batched `generate` per group (`run_batch`), the
  one-at-a-time fallback when a batched call fails.
* :mod:`.streaming` — `FanOutStreamer`: a batched call's streamed tokens, row by row, to each request's stream.
* :mod:`.turn` — one request's turn: inputs, context check, the answer's bookkeeping.
* :mod:`.stats` — the ``usage.raincheck`` extension.

Needs the ``serve`` extra (``pip install "hf_raincheck[serve]"``: fastapi, uvicorn, openai via
``transformers[serving]``), which pins transformers to the serving code it is built on
(`transformers_coupling.SUPPORTED_SERVING_TRANSFORMERS`; importing this package under another version raises an
`ImportError` that says so).
"""

from ..transformers_coupling import check_serving_version

check_serving_version()  # (before the modules that import transformers' serving code)

from .app import RaincheckServer  # noqa: E402
from .models import DEFAULT_MODEL  # noqa: E402
from .pool import ConversationPool  # noqa: E402

__all__ = ["RaincheckServer", "ConversationPool", "DEFAULT_MODEL"]
