"""What the Raincheck server's batched calls hold in memory under concurrent conversations, on the CPU.

    python benchmarks/serve_memory.py                      # 8 conversations x 3 turns, started 4 s apart
    python benchmarks/serve_memory.py --conversations 4 --stagger-s 0

Runs the real server (`RaincheckServer`, its scheduler and conversation pool) with streaming `openai` clients in
threads, as `benchmarks/serve.py` does, on a random-weight Qwen3-VL whose memory-relevant dimensions are the
Qwen3-VL-8B ones (vocabulary 151936, 32 query / 8 KV heads of 128, images of ``--image-tokens`` merged tokens)
with few layers and small hidden / MLP / vision sizes, so that it runs on a CPU. Conversation i starts
``i * --stagger-s`` seconds after the first (on a CPU a call takes seconds, so staggering is what mixes first
turns and follow-ups in one call, as the request timing does on a GPU).

After every batched call it prints one JSON line: the call's rows (conversation id, cached tokens, deferred tokens
pending, KV capacity before / after and the slots the row needs after: its length rounded up to 256), the KV
slots the pooled conversations hold and need, the bytes of every live conversation cache's tensors (each storage
once: shared batch buffers count whole) and the pool's own count; at the end, the same totals, the largest pool
and live-cache bytes seen after a call, and the pool's snapshot. The process's peak
resident memory (``VmHWM``) is printed too. Multiply the KV figures by (real layers / ``--layers``) for the real
model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

SHAPE = "qwen3-vl-8b-heads"  # the 8B's attention heads and vocabulary, few small layers (see the module docstring)


def scaled_shape(layers: int) -> dict:
    return dict(family="qwen3_vl",
                text=dict(hidden_size=256, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=512, vocab_size=151936, rope_theta=5e6,
                          mrope_section=[24, 20, 20]),
                vision=dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=256,
                            deepstack_visual_indexes=[0]))


def live_cache_bytes() -> tuple[int, int]:
    """(bytes of the tensors every live conversation / batch cache holds, each storage once; live batch caches)."""
    from hf_raincheck.cache import DeferredPrefillCache
    from hf_raincheck.cache.batched import BatchedDeferredPrefillCache
    from hf_raincheck.serve.pool import cache_storages

    seen, batches = {}, 0
    for obj in gc.get_objects():
        if type(obj) is BatchedDeferredPrefillCache:
            batches += 1
            for tensor in obj.keys + obj.values:
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        elif type(obj) is DeferredPrefillCache:
            seen.update(cache_storages(obj))
    return sum(seen.values()), batches


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return 0


def _capacity(cache) -> int | None:
    """KV slots of the cache's first attention layer (None: none written yet)."""
    return next((int(layer.keys.shape[2]) for layer in cache.layers if layer.is_initialized), None)


def _needed(cache) -> int:
    """The KV slots a cache needs between calls: its length rounded up to 256 (`DeferredPrefillCache.trim`)."""
    return -(-max(cache.length, 1) // 256) * 256


def _row_cache(pool, turn):
    """The cache a finished row left in the pool (its conversation continued, or the new one whose key extends the
    request's messages by the answer); None if the row failed or was evicted."""
    if turn.conv is not None:
        return turn.conv.cache
    return next((c.cache for c in pool.conversations() if c.key[:-1] == turn.key), None)


def pooled_slots(pool) -> tuple[int, int]:
    """(KV slots per layer the pooled conversations hold, slots they need: `_needed`), summed over them."""
    caches = [c.cache for c in pool.conversations() if _capacity(c.cache) is not None]
    return sum(_capacity(c) for c in caches), sum(_needed(c) for c in caches)


def _cuda_allocated() -> int | None:
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else None


class CallLog:
    """Records every batched call of the Raincheck server's scheduler (`hf_raincheck.serve.scheduler` runs them
    through its module-level ``run_batch``, replaced while installed; one process, one log): its rows (conversation
    id, prompt and cached tokens, deferred tokens pending, KV capacity before / after, slots needed after), the
    pooled conversations' KV slots held and needed, its seconds, whether it
    raised, the pool's bytes after it, on CUDA the bytes allocated before / after it and the peak since
    `install`, and with ``census=True`` the bytes every live conversation cache holds (`live_cache_bytes`: a walk
    over the garbage collector's objects, slow).

    Attributes:
        entries: one dict per call, in order.
    """

    def __init__(self, census: bool = False, echo: bool = False):
        self.entries: list[dict] = []
        self.census = census
        self.echo = echo
        self._original = None
        self._start = time.monotonic()

    def install(self) -> "CallLog":
        from hf_raincheck.serve import scheduler as scheduler_module

        if self._original is not None:
            raise RuntimeError("CallLog: already installed")
        self._original = original = scheduler_module.run_batch
        self._start = time.monotonic()

        def logged(group, pool, stats):
            rows = [dict(conversation=None if t.conv is None else t.conv.id, prompt=t.prompt_tokens,
                         cached=t.cached_tokens, pending=0 if t.conv is None else t.conv.cache.pending,
                         capacity=None if t.conv is None else _capacity(t.conv.cache)) for t in group]
            entry = dict(at_s=round(time.monotonic() - self._start, 2), rows=rows, allocated_before=_cuda_allocated())
            began = time.monotonic()
            try:
                original(group, pool, stats)
            except BaseException as error:
                entry["error"] = f"{type(error).__name__}: {error}"
                raise
            finally:
                entry["seconds"] = round(time.monotonic() - began, 2)
                for row, turn in zip(rows, group):
                    cache = _row_cache(pool, turn)
                    row["capacity_after"] = None if cache is None else _capacity(cache)
                    row["needed_after"] = None if cache is None else _needed(cache)
                entry["pooled_slots"], entry["pooled_slots_needed"] = pooled_slots(pool)
                entry["allocated_after"] = _cuda_allocated()
                if entry["allocated_after"] is not None:
                    import torch

                    entry["peak_allocated_so_far"] = torch.cuda.max_memory_allocated()
                entry["pool_bytes"] = pool.bytes
                if self.census:
                    entry["live_cache_bytes"], entry["live_batch_caches"] = live_cache_bytes()
                self.entries.append(entry)
                if self.echo:
                    print(json.dumps(entry), flush=True)

        scheduler_module.run_batch = logged
        return self

    def uninstall(self) -> None:
        from hf_raincheck.serve import scheduler as scheduler_module

        if self._original is not None:
            scheduler_module.run_batch = self._original
            self._original = None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--stagger-s", type=float, default=4.0, help="seconds between the conversations' starts")
    parser.add_argument("--think-ms", type=float, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--batch-window-ms", type=float, default=5)
    parser.add_argument("--cache-budget-mb", type=float, default=16384)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--request-timeout-s", type=float, default=None,
                        help="a client's timeout per request (default: benchmarks/serve.py's, 180 s; a slow CPU "
                             "running a call of many rows with large images needs more)")
    args = parser.parse_args(argv)
    for flag in ("conversations", "turns", "max_tokens", "layers", "max_batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.stagger_s < 0 or args.think_ms < 0:
        parser.error("--stagger-s and --think-ms must be >= 0")
    if args.request_timeout_s is not None and args.request_timeout_s <= 0:
        parser.error(f"--request-timeout-s must be > 0, got {args.request_timeout_s}")

    import torch

    import serve as bench
    import serve_model
    import shapes

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.request_timeout_s is not None:
        bench.REQUEST_TIMEOUT_S = args.request_timeout_s
    shapes.SHAPES[SHAPE] = scaled_shape(args.layers)
    processor = serve_model.load_processor(args.image_tokens)
    model = serve_model.build(SHAPE, "cpu", torch.bfloat16, processor)
    options = argparse.Namespace(retention=0.3, pruning="mmtok", cache_budget_mb=args.cache_budget_mb,
                                 max_batch_size=args.max_batch_size, batch_window_ms=args.batch_window_ms,
                                 model=None, image_tokens=args.image_tokens, max_tokens=args.max_tokens,
                                 turns=args.turns)
    side = bench.RaincheckSide(options, model, processor)
    log = CallLog(census=True, echo=True)
    try:
        for i in range(args.conversations):
            bench.image_url(args.image_tokens, 200 + i)
        log.install()

        def conversation(i):
            time.sleep(i * args.stagger_s)
            bench.conversation(side, options, 200 + i, args.turns, args.think_ms / 1000)

        threads = [threading.Thread(target=conversation, args=(i,)) for i in range(args.conversations)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        side.settle(900)
        live, batches = live_cache_bytes()
        slots, needed = pooled_slots(side.server.pool)
        report = dict(calls=log.entries, live_cache_mib=live / 2**20, live_batch_caches=batches,
                      pooled_slots=slots, pooled_slots_needed=needed,
                      max_pool_mib_after_a_call=max((e["pool_bytes"] for e in log.entries), default=0) / 2**20,
                      max_live_cache_mib_after_a_call=max((e["live_cache_bytes"] for e in log.entries),
                                                          default=0) / 2**20,
                      pool=side.server.pool.snapshot(), batches=side.server.scheduler.batch_stats.snapshot(),
                      peak_rss_gib=peak_rss_bytes() / 2**30)
        print(json.dumps({k: v for k, v in report.items() if k != "calls"}), flush=True)
        return report
    finally:
        log.uninstall()
        side.stop()


if __name__ == "__main__":
    main()
