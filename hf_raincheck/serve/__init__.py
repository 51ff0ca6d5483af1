"""An OpenAI-compatible Raincheck server built on `transformers serve` (``hf-raincheck serve [MODEL]``).

* :mod:`.cli` — the command line (``hf-raincheck serve``, ``python -m hf_raincheck.serve``).
* :mod:`.app` — `RaincheckServer`: transformers' FastAPI app with the Raincheck handler, pool and scheduler.
* :mod:`.models` — `RaincheckModelManager`: transformers' model manager + the shipped GridQA checkpoint.
* :mod:`.handler` — `RaincheckChatHandler`: ``/v1/chat/completions`` (a `ChatCompletionHandler` subclass).
* :mod:`.messages` / :mod:`.images` — OpenAI messages and ``image_url`` parts -> the processor's messages.
* :mod:`.pool` — `ConversationPool`: conversation caches between requests, LRU within a memory budget.
* :mod:`.scheduler` — `SerialScheduler`: one turn at a time on the model's thread; restoration when idle.
* :mod:`.turn` — one request's turn: inputs, context check, `generate`, bookkeeping.
* :mod:`.stats` — the ``usage.raincheck`` extension.

Needs the ``serve`` extra (``pip install "hf_raincheck[serve]"``: fastapi, uvicorn, openai via
``transformers[serving]``).
"""

from .app import RaincheckServer
from .models import DEFAULT_MODEL
from .pool import ConversationPool

__all__ = ["RaincheckServer", "ConversationPool", "DEFAULT_MODEL"]
