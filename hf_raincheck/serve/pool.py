"""`ConversationPool`: the conversations' `DeferredPrefillCache`s kept between requests, within a memory budget.

A conversation is keyed by its messages (`messages.ParsedMessage.key`), its last one the answer the server gave.
A request continues the conversation whose key is the longest strict prefix of the request's messages; it takes
the conversation out of the pool (no other request can use or evict it meanwhile) and puts it back, extended,
when its answer is done. Putting back evicts least recently used conversations until the pool's caches fit the
budget (an evicted conversation's next request is prefilled again from its messages). The server puts a
conversation in trimmed (`turn.finish_turn`: `DeferredPrefillCache.trim`): KV buffers and filled-slot mask of its
own, of the slots it holds rounded up to 256, never a row of a batched call's shared buffers; so ``bytes`` is the
memory the pooled conversations keep alive, and evicting one frees its bytes. The pool is used from the
scheduler's thread only; ``snapshot`` may be read from any thread.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class Conversation:
    id: int
    model_ref: weakref.ref
    key: tuple  # the message keys: the conversation so far, ending with the server's answer
    cache: object  # DeferredPrefillCache
    sequences: torch.Tensor  # [1, L] the exact token ids the cache holds (prompt + answer)
    turns: int = 0
    nbytes: int = 0  # the storages its cache holds (shared ones whole)
    storages: dict = field(default_factory=dict)  # `cache_storages` of its cache when last measured
    last_used: float = field(default_factory=time.monotonic)


def cache_storages(cache) -> dict[tuple[int, int], int]:
    """The memory a cache holds: ``{(address, size): size}`` of every tensor storage it references (KV entries,
    the deferred store, recurrent states), each once. The rows of one batched `generate` hold views of shared
    KV buffers: their caches name the same storages."""
    seen: dict[tuple[int, int], int] = {}
    visited: set[int] = set()

    def walk(obj, depth: int) -> None:
        if depth > 6 or id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value, depth + 1)
        elif type(obj).__module__.startswith(("hf_raincheck", "transformers.cache_utils")) and hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                if name in ("_completion", "_model_ref", "config"):
                    continue
                walk(value, depth + 1)

    walk(cache, 0)
    return seen


def cache_nbytes(cache) -> int:
    """Bytes of the tensors a cache holds (`cache_storages`; a shared buffer counts whole)."""
    return sum(cache_storages(cache).values())


class ConversationPool:
    """Conversation caches between requests, least recently used evicted beyond ``budget_bytes``.

    ``bytes`` is the memory the pooled caches hold: every tensor storage they reference, whole, each counted once
    however many conversations hold it (a storage shared by two caches is freed when the last of them is evicted
    or moves out of it; the server's conversations come in trimmed, with storages of their own)."""

    def __init__(self, budget_bytes: int):
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"ConversationPool: budget_bytes must be an int > 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._conversations: OrderedDict[int, Conversation] = OrderedDict()  # LRU order, oldest first
        self._by_key: dict[tuple, list[int]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.peak_bytes = 0
        self.bytes = 0
        self._storage_refs: dict[tuple[int, int], int] = {}  # storage -> pooled conversations holding it

    # ------------------------------------------------------------------ requests
    def checkout(self, model, key: tuple) -> Conversation | None:
        """Takes out the conversation whose key is the longest strict prefix of `key` (None: none matches)."""
        with self._lock:
            for n in range(len(key) - 1, 0, -1):
                for conv_id in reversed(self._by_key.get(key[:n], [])):
                    conv = self._conversations[conv_id]
                    if conv.model_ref() is model:
                        self._remove(conv)
                        self.hits += 1
                        return conv
            self.misses += 1
            return None

    def new(self, model, key: tuple, cache, sequences: torch.Tensor) -> Conversation:
        return Conversation(id=next(self._ids), model_ref=weakref.ref(model), key=key, cache=cache,
                            sequences=sequences)

    def checkin(self, conv: Conversation) -> list[int]:
        """Puts a conversation back (most recently used); returns the ids evicted to fit the budget."""
        storages = cache_storages(conv.cache)
        conv.last_used = time.monotonic()
        with self._lock:
            conv.storages, conv.nbytes = storages, sum(storages.values())
            self._conversations[conv.id] = conv
            self._by_key.setdefault(conv.key, []).append(conv.id)
            self._hold(storages)
            evicted = []
            while self.bytes > self.budget_bytes and self._conversations:
                oldest = next(iter(self._conversations.values()))
                self._remove(oldest)
                evicted.append(oldest.id)
                self.evictions += 1
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            return evicted

    def remeasure(self, conv: Conversation) -> None:
        """Updates a pooled conversation's size (its deferred store shrinks as tokens are restored)."""
        storages = cache_storages(conv.cache)
        with self._lock:
            if conv.id in self._conversations:
                self._release(conv.storages)
                self._hold(storages)
                conv.storages, conv.nbytes = storages, sum(storages.values())

    # ------------------------------------------------------------------ between requests
    def restorable(self) -> Conversation | None:
        """The most recently used pooled conversation with deferred tokens pending (None: none)."""
        with self._lock:
            for conv in reversed(self._conversations.values()):
                if conv.cache.pending > 0:
                    return conv
        return None

    def discard(self, conv: Conversation) -> None:
        with self._lock:
            if conv.id in self._conversations:
                self._remove(conv)

    def clear(self) -> None:
        with self._lock:
            for conv in list(self._conversations.values()):
                self._remove(conv)

    def conversations(self) -> list[Conversation]:
        with self._lock:
            return list(self._conversations.values())

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "conversations": len(self._conversations),
                "bytes": self.bytes,
                "budget_bytes": self.budget_bytes,
                "peak_bytes": self.peak_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "pending": sum(c.cache.pending for c in self._conversations.values()),
                # over the pooled conversations' whole lives: deferred = restored (prefill + decode + after) + pending
                "deferred": sum(sum(t.deferred for t in c.cache.turn_stats) for c in self._conversations.values()),
                "restored_in_prefill": sum(c.cache.stats.during_prefill for c in self._conversations.values()),
                "restored_during_decode": sum(c.cache.stats.during_decode for c in self._conversations.values()),
                "restored_after_answer": sum(c.cache.stats.after_answer for c in self._conversations.values()),
            }

    def _remove(self, conv: Conversation) -> None:
        del self._conversations[conv.id]
        ids = self._by_key[conv.key]
        ids.remove(conv.id)
        if not ids:
            del self._by_key[conv.key]
        self._release(conv.storages)

    def _hold(self, storages: dict) -> None:
        for storage, nbytes in storages.items():
            count = self._storage_refs.get(storage, 0)
            if count == 0:
                self.bytes += nbytes
            self._storage_refs[storage] = count + 1

    def _release(self, storages: dict) -> None:
        for storage, nbytes in storages.items():
            count = self._storage_refs[storage] - 1
            if count == 0:
                del self._storage_refs[storage]
                self.bytes -= nbytes
            else:
                self._storage_refs[storage] = count
