"""An OpenAI-compatible Raincheck server built on `transformers serve` (``hf-raincheck serve [MODEL]``).

* :mod:`.cli` — the command line (``hf-raincheck serve``, ``python -m hf_raincheck.serve``).
* :mod:`.app` — `RaincheckServer`: transformers' FastAPI app with the Raincheck handler, pool and scheduler.
* :mod:`.models` — `RaincheckModelManager`: the one model, in this process (the shipped GridQA checkpoint, a model
  object, or a name loaded as transformers serve loads it).
* :mod:`.handler` — `RaincheckChatHandler`: ``/v1/chat/completions`` (a `ChatCompletionHandler` subclass).
* :mod:`.messages` / :mod:`.images` — OpenAI messages and ``image_url`` parts -> the processor's messages.
* :mod:`.pool` — `ConversationPool`: conversation caches between requests, LRU within a memory budget.
* :mod:`.scheduler` — `BatchingScheduler`: the model's thread; concurrent requests collected into batches;
  restoration when idle.
* :mod:`.batch` — which requests share a call (`batch_key`), one batched `generate` per group (`run_batch`), the
  one-at-a-time fallback when a batched call fails.
* :mod:`.streaming` — `TextQueueStreamer` (a request's answer into its SSE queue) and `FanOutStreamer` (a batched
  call's streamed tokens, row by row, to each request's streamer).
* :mod:`.turn` — one request's turn: inputs, context check, the answer's bookkeeping.
* :mod:`.stats` — the ``usage.raincheck`` extension.

Needs the ``serve`` extra (``pip install "hf_raincheck[serve]"``: fastapi, uvicorn, openai via
``transformers[serving]``); follows the serving code of the transformers versions the package supports
(`transformers_coupling`, item 18).
"""

from .app import RaincheckServer
from .models import DEFAULT_MODEL
from .pool import ConversationPool

__all__ = ["RaincheckServer", "ConversationPool", "DEFAULT_MODEL"]
