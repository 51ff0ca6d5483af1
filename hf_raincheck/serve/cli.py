"""``hf-raincheck serve [MODEL] [options]`` (and ``python -m hf_raincheck.serve``): the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
import sys

from ..config import RaincheckConfig, parse_chunk_size
from .app import DEFAULT_CACHE_BUDGET_MB
from .images import DEFAULT_CACHE_MB as DEFAULT_IMAGE_CACHE_MB
from .scheduler import DEFAULT_BATCH_WINDOW_S, DEFAULT_MAX_BATCH_SIZE
from .models import DEFAULT_MODEL


def build_parser(prog: str = "hf-raincheck serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a vision-language model with Raincheck behind an OpenAI-compatible API "
                    "(POST /v1/chat/completions, streaming or not; GET /v1/models, /health, /v1/raincheck/stats).")
    parser.add_argument("model", nargs="?", default=None,
                        help=f"Hub id or local path of a supported model (default: {DEFAULT_MODEL}, the shipped tiny "
                             "GridQA Qwen3-VL, on the CPU)")
    rc = parser.add_argument_group("Raincheck")
    rc.add_argument("--policy", default="raincheck", choices=["raincheck", "hard", "full"])
    rc.add_argument("--retention", type=float, default=0.3, help="visual tokens prefilled first, per image (0.3)")
    rc.add_argument("--pruning", default="mmtok", help="selector: mmtok, hiprune, divprune, visionzip, uniform, random")
    rc.add_argument("--chunk-size", type=parse_chunk_size, default="auto",
                    help="deferred tokens per fused decode step, or 'auto' (31; 63 for models with Gated DeltaNet "
                         "layers)")
    rc.add_argument("--guard-tokens", type=int, default=16, help="plain decode steps before fusing (16)")
    rc.add_argument("--completion-chunk-size", type=int, default=256,
                    help="deferred tokens per restoration forward between requests; also the most a new request "
                         "waits for it (256)")
    rc.add_argument("--attn-backend", default="auto", choices=["auto", "sdpa", "eager", "flash"])
    rc.add_argument("--raincheck-config", default=None,
                    help="a JSON object of RaincheckConfig fields (overrides the options above)")
    rc.add_argument("--no-restore-between-requests", action="store_true",
                    help="leave pending deferred tokens to each conversation's next request (folded into its "
                         "prefill) instead of restoring them while the server is idle")
    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000, help="0: a free port")
    srv.add_argument("--cache-budget-mb", type=float, default=DEFAULT_CACHE_BUDGET_MB,
                     help=f"memory of the conversation caches kept between requests, LRU-evicted beyond it "
                          f"({DEFAULT_CACHE_BUDGET_MB})")
    srv.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                     help="the most concurrent requests answered by one batched generate call; requests batch when "
                          f"their sampling settings are equal, max_tokens aside (1: one request at a time; "
                          f"{DEFAULT_MAX_BATCH_SIZE})")
    srv.add_argument("--batch-window-ms", type=float, default=DEFAULT_BATCH_WINDOW_S * 1000,
                     help="how long after a request arrives the server waits for others to batch with it; requests "
                          "that arrive while the model is busy are batched anyway "
                          f"(0: no waiting; {DEFAULT_BATCH_WINDOW_S * 1000:g})")
    srv.add_argument("--image-dir", action="append", default=[],
                     help="a folder image_url local paths may point into (repeatable; none: local paths refused)")
    srv.add_argument("--image-cache-mb", type=float, default=DEFAULT_IMAGE_CACHE_MB,
                     help="decoded images kept for follow-up turns that send the same image again (MB of pixels; "
                          f"0: decode every time; {DEFAULT_IMAGE_CACHE_MB})")
    srv.add_argument("--device", default="auto",
                     help="device_map of the model (auto, cuda, cpu, ...; the default model: cpu unless given)")
    srv.add_argument("--dtype", default="auto",
                     help="dtype of the model (auto, bfloat16, float16, ...; the default model: float32 unless given)")
    srv.add_argument("--attn-implementation", default=None, help="transformers attention implementation")
    srv.add_argument("--trust-remote-code", action="store_true")
    srv.add_argument("--log-level", default="info")
    return parser


def raincheck_config_from_args(args) -> RaincheckConfig:
    fields = dict(policy=args.policy, retention=args.retention, pruning=args.pruning, chunk_size=args.chunk_size,
                  guard_tokens=args.guard_tokens, completion_chunk_size=args.completion_chunk_size,
                  attn_backend=args.attn_backend)
    if args.raincheck_config:
        extra = json.loads(args.raincheck_config)
        if not isinstance(extra, dict):
            raise ValueError(f"--raincheck-config must be a JSON object, got {args.raincheck_config!r}")
        fields.update(extra)
    return RaincheckConfig(**fields)


def main(argv: list[str] | None = None, prog: str = "hf-raincheck serve") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        config = raincheck_config_from_args(args)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    if args.max_batch_size < 1:
        parser.error(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if not 0 <= args.batch_window_ms <= 10000:
        parser.error(f"--batch-window-ms must be in [0, 10000], got {args.batch_window_ms:g}")
    if args.image_cache_mb < 0:
        parser.error(f"--image-cache-mb must be >= 0, got {args.image_cache_mb:g}")
    from .app import RaincheckServer

    try:
        server = RaincheckServer(
            args.model, config, cache_budget_mb=args.cache_budget_mb,
            restore_between_requests=not args.no_restore_between_requests, max_batch_size=args.max_batch_size,
            batch_window_ms=args.batch_window_ms, image_dirs=args.image_dir, image_cache_mb=args.image_cache_mb,
            host=args.host, port=args.port, device=args.device, dtype=args.dtype,
            attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code,
            log_level=args.log_level)
    except (ValueError, OSError) as error:  # a model without a Raincheck adapter, a missing checkpoint, ...
        parser.exit(2, f"{parser.prog}: cannot serve {args.model or DEFAULT_MODEL}: {error}\n")
    print(f"hf-raincheck serve: {server.model_name} on {server.base_url} (POST /chat/completions)", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C / SIGINT after its graceful shutdown
        pass
    print("hf-raincheck serve: stopped", flush=True)
    return 0


def console_main(argv: list[str] | None = None) -> int:
    """The ``hf-raincheck`` console script: ``hf-raincheck serve ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hf-raincheck serve [MODEL] [options]   (hf-raincheck serve --help for the options)")
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"hf-raincheck: unknown command {argv[0]!r}; the commands are: serve", file=sys.stderr)
        return 2
    return main(argv[1:])
