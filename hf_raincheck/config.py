"""`RaincheckConfig`: every knob of deferred multimodal prefill, validated at construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, ClassVar, Literal, Union

POLICIES = ("full", "hard", "raincheck")
COMPLETIONS = ("background", "blocking", "next_turn")
ATTN_BACKENDS = ("auto", "sdpa", "eager", "flash")
VISIBILITIES = ("boundary", "causal")
GDN_BACKENDS = ("auto", "torch", "fla")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"RaincheckConfig.{name} must be an int >= {minimum}, got {value!r}")


def parse_chunk_size(text: str) -> int | str:
    """A command line's ``--chunk-size``: an int, or ``auto`` (`RaincheckConfig.chunk_size`); validated there."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"chunk size must be an int >= 1 or 'auto', got {text!r}") from None


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"RaincheckConfig.{name} must be one of {list(allowed)}, got {value!r}")


@dataclass
class RaincheckConfig:
    """How `generate` prefills the visual tokens of a prompt.

    Args:
        policy: ``"raincheck"`` (prefill the kept tokens first, restore the deferred ones later),
            ``"hard"`` (prefill the kept tokens, never restore the rest: the pruning baseline) or
            ``"full"`` (plain prefill of everything).
        retention: fraction rho in (0, 1] of each image span / video frame kept for the first prefill;
            span m of N_m tokens keeps ``N_m - floor((1 - rho) * N_m)`` tokens.
        chunk_size: deferred tokens carried by one fused decode step (>= 1), or ``"auto"`` (default): the
            model's own default, resolved per call (`for_model`). ``"auto"`` is `CHUNK_ATTENTION` (31, the paper's)
            for models whose layers are all attention layers: there a fused step's extra cost follows the rows it
            carries, so the chunk size barely moves the answer's total and 31 keeps each fused step close to a
            decode step. For models with Gated DeltaNet layers (Qwen3.5) it is `CHUNK_GDN` (63): there a fused
            step also costs a fixed amount of GPU work whatever it carries (see ``step_deferred_budget``), so half
            as many steps cost less in all; at batch 1 (Qwen3.5-9B shape, compiled, 4096-token image, 256 tokens,
            three paired rounds on an H200) TPOT / Full was 1.097 with 31 and 1.030 with 63, restoration ending at
            token 63 instead of 110 (benchmarks page, "Latency"). A fused step of 63 rows takes longer than one of
            31 (11.2 against 10.0 ms there, decode-only 7.4).
        guard_tokens: decode steps 1..guard_tokens carry no deferred tokens (>= 0).
        pruning: a registered selector name (see ``hf_raincheck.pruning.available_selectors()``): ``"mmtok"``
            (default, query-aware), ``"hiprune"``, ``"divprune"``, ``"visionzip"`` (VisionZip-Select),
            ``"uniform"``, ``"random"``; or a callable ``fn(ctx) -> LongTensor`` of kept indices into
            ``input_ids[0]``.
        pruning_options: keyword options of a registered selector (e.g. ``{"alpha": 0.5}`` for mmtok); unknown
            names or bad values raise ``ValueError``. Options and defaults: each ``hf_raincheck.pruning.<name>``
            module docstring.
        completion: what happens to deferred tokens still pending when the answer ends:
            ``"background"`` (default: `generate` returns at once and a worker thread prefills them in
            ``completion_chunk_size`` chunks, taking ``cache.lock`` per chunk; the next `generate` on the cache
            stops it within one chunk and folds what is left into its own prefill; see ``cache.wait()`` /
            ``cache.cancel()``), ``"blocking"`` (prefill them before `generate` returns) or ``"next_turn"``
            (fold them into the next `generate` call on the same cache, or run `complete_deferred` yourself).
        completion_chunk_size: tokens per forward when completing outside decoding (>= 1); also the most a
            new request waits for a running background worker.
        attn_backend: attention for Raincheck's forwards: ``"auto"`` (sdpa: see the benchmarks page), ``"sdpa"``,
            ``"eager"`` (the plain reference) or ``"flash"`` (the flash_attn package's kernels, flash-attn 2/3 or 4;
            each forward's keys gathered past the pending deferred slots; restored rows under
            ``visibility="causal"`` take SDPA; `generate` raises if flash_attn is missing).
        visibility: what a deferred row sees: ``"boundary"`` (the whole prefix before the plan's boundary,
            as in the paper) or ``"causal"`` (only cached entries at or before its own logical index). Applies
            to attention layers; Gated DeltaNet layers always continue the state at the boundary (rule 3).
        fused: ``True`` (default): a decode step's deferred chunk rides in the step's own forward (decode row last).
            ``False``: the chunk runs as a forward of its own just before the decode step (same result up to float
            rounding; a control for benchmarks, to show what fusion buys).
        gdn_backend: kernels for Gated DeltaNet layers (Qwen3.5): ``"auto"`` (fla-core on CUDA when installed,
            else torch; compiled static-cache steps too, where the kernels are one opaque custom op),
            ``"torch"`` (transformers' torch code, CPU and CUDA) or ``"fla"``.
        schedule: optional callable ``schedule(step, pending) -> int`` asked once per decode step how many
            deferred tokens to carry (``step`` counts decode steps from 1). Default: ``chunk_size`` once
            ``step > guard_tokens``.
        seed: seed of the ``random`` selector.
        step_deferred_budget: batches only (``generate`` with B > 1 rows): the most deferred tokens one shared
            decode step carries over all its rows (>= 1), None for no cap, or ``"auto"`` (default): the model's
            own default, resolved per call (`step_budget`). Each row carries at most ``ceil(budget / B)`` a step
            (B: the batch's rows), and when the rows' schedules ask for more than the budget it is shared evenly
            (each row at most what its schedule asks; the rest goes to the rows that want more). The per-row cap
            keeps a fused step's padded shape ``[B, cap + 1]`` at the budget's size (rows are padded to the
            widest). ``"auto"`` is `STEP_BUDGET_ATTENTION` (128) for models whose layers are all attention layers:
            a decode step of an 8B-class model stays memory-bound up to roughly 200 rows on an H200 (its bf16
            compute over memory bandwidth), so 128 deferred rows plus the decode rows of a batch of 16 keep a fused
            step close to a plain decode step's time. For models with Gated DeltaNet layers (Qwen3.5) it is
            `STEP_BUDGET_GDN` (1024): there a fused step costs a fixed amount of GPU work over a decode step
            whatever its rows carry (every GDN layer continues each row's prefix state, joins it into the live
            state and passes the states once more), so fewer, wider fused steps cost less in all; at B = 16 the
            Qwen3.5-9B shape's compiled TPOT / Full went 1.25 (128) -> 1.18 (256) -> 1.10 (512) in one sweep, and
            1.149 (512) -> 1.094 (1024) in a later paired run (benchmarks page, "Batches"). With 1024 and the
            63-token chunk, B = 2-16 rows carry their whole chunk and a fused step is ``[B, 64]``: a multiple of 64
            rows, which the GEMMs tile without a ragged edge. A batch-1 call ignores it.

    ``to_dict()`` / ``RaincheckConfig.from_dict(d)`` give and take a JSON-serialisable dict (what
    ``generation_config.json`` holds when ``model.generation_config.raincheck_config`` is set).
    """

    policy: str = "raincheck"
    retention: float = 0.3
    chunk_size: int | Literal["auto"] = "auto"
    guard_tokens: int = 16
    pruning: Union[str, Callable[..., Any]] = "mmtok"
    pruning_options: dict = field(default_factory=dict)
    completion: str = "background"
    completion_chunk_size: int = 256
    attn_backend: str = "auto"
    visibility: str = "boundary"
    gdn_backend: str = "auto"
    fused: bool = True
    schedule: Callable[[int, int], int] | None = None
    seed: int = 0
    step_deferred_budget: int | None | Literal["auto"] = "auto"

    #: ``chunk_size="auto"`` for models whose layers are all attention layers
    CHUNK_ATTENTION: ClassVar[int] = 31
    #: ``chunk_size="auto"`` for models with Gated DeltaNet layers
    CHUNK_GDN: ClassVar[int] = 63
    #: ``step_deferred_budget="auto"`` for models whose layers are all attention layers
    STEP_BUDGET_ATTENTION: ClassVar[int] = 128
    #: ``step_deferred_budget="auto"`` for models with Gated DeltaNet layers
    STEP_BUDGET_GDN: ClassVar[int] = 1024

    def __post_init__(self) -> None:
        _check_choice("policy", self.policy, POLICIES)
        if isinstance(self.retention, bool) or not isinstance(self.retention, (int, float)):
            raise ValueError(f"RaincheckConfig.retention must be a float in (0, 1], got {self.retention!r}")
        if not (0.0 < float(self.retention) <= 1.0) or math.isnan(float(self.retention)):
            raise ValueError(f"RaincheckConfig.retention must be in (0, 1], got {self.retention!r}")
        self.retention = float(self.retention)
        if self.chunk_size != "auto":
            if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
                raise ValueError(f"RaincheckConfig.chunk_size must be an int >= 1 or 'auto', got {self.chunk_size!r}")
        _check_int("guard_tokens", self.guard_tokens, 0)
        _check_int("completion_chunk_size", self.completion_chunk_size, 1)
        _check_int("seed", self.seed, 0)
        budget = self.step_deferred_budget
        if not (budget is None or budget == "auto" or (isinstance(budget, int) and not isinstance(budget, bool)
                                                       and budget >= 1)):
            raise ValueError(
                f"RaincheckConfig.step_deferred_budget must be an int >= 1, None (no cap) or 'auto', got {budget!r}"
            )
        _check_choice("completion", self.completion, COMPLETIONS)
        _check_choice("attn_backend", self.attn_backend, ATTN_BACKENDS)
        _check_choice("visibility", self.visibility, VISIBILITIES)
        _check_choice("gdn_backend", self.gdn_backend, GDN_BACKENDS)
        if not isinstance(self.fused, bool):
            raise ValueError(f"RaincheckConfig.fused must be True or False, got {self.fused!r}")
        if not (isinstance(self.pruning, str) or callable(self.pruning)):
            raise ValueError(
                f"RaincheckConfig.pruning must be a registered selector name or a callable, got {self.pruning!r}"
            )
        if isinstance(self.pruning, str):
            from .pruning import available_selectors

            if self.pruning not in available_selectors():
                raise ValueError(
                    f"RaincheckConfig.pruning must be one of {available_selectors()} or a callable, "
                    f"got {self.pruning!r}"
                )
        if not isinstance(self.pruning_options, dict):
            raise ValueError(f"RaincheckConfig.pruning_options must be a dict, got {self.pruning_options!r}")
        from .pruning import resolve_options

        resolve_options(self.pruning, self.pruning_options)  # unknown option names or bad values: ValueError
        if self.schedule is not None and not callable(self.schedule):
            raise ValueError(f"RaincheckConfig.schedule must be callable(step, pending) -> int, got {self.schedule!r}")

    def for_model(self, gdn_layers: bool) -> "RaincheckConfig":
        """This config with ``chunk_size="auto"`` resolved for a model with (`gdn_layers`) or without Gated
        DeltaNet layers (`CHUNK_GDN` or `CHUNK_ATTENTION`); itself when nothing is left to resolve. `generate`
        runs with this (``cache.config`` keeps the config as given)."""
        if self.chunk_size != "auto":
            return self
        return replace(self, chunk_size=self.CHUNK_GDN if gdn_layers else self.CHUNK_ATTENTION)

    def step_budget(self, gdn_layers: bool) -> int | None:
        """`step_deferred_budget` for a model with (`gdn_layers`) or without Gated DeltaNet layers: ``"auto"``
        resolved to `STEP_BUDGET_GDN` or `STEP_BUDGET_ATTENTION`, any other value as given."""
        if self.step_deferred_budget == "auto":
            return self.STEP_BUDGET_GDN if gdn_layers else self.STEP_BUDGET_ATTENTION
        return self.step_deferred_budget

    def kept_budget(self, num_tokens: int) -> int:
        """Tokens kept from a span of `num_tokens`: ``N - floor((1 - rho) N)`` (all of them under ``full``)."""
        if self.policy == "full":
            return num_tokens
        # the epsilon keeps float noise such as (1 - 0.7) * 10 = 3.0000000000000004 on the intended side
        dropped = math.floor((1.0 - self.retention) * num_tokens + 1e-9)
        return num_tokens - dropped

    def to_dict(self) -> dict:
        """Every field by name, JSON-serialisable; `from_dict` gives the config back.

        Raises `ValueError` naming the field for what cannot be serialised: a callable ``pruning`` selector, a
        custom ``schedule``, ``pruning_options`` that JSON cannot hold.
        """
        if callable(self.pruning):
            raise ValueError(
                f"RaincheckConfig.to_dict: pruning={self.pruning!r} is a callable and cannot be serialised; use a "
                "registered selector name (hf_raincheck.pruning.available_selectors()) to save the config"
            )
        if self.schedule is not None:
            raise ValueError(
                f"RaincheckConfig.to_dict: schedule={self.schedule!r} is a custom callable and cannot be serialised; "
                "leave schedule=None (chunk_size / guard_tokens) to save the config"
            )
        try:
            options = json.loads(json.dumps(self.pruning_options))
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"RaincheckConfig.to_dict: pruning_options={self.pruning_options!r} cannot be serialised to JSON "
                f"({error})"
            ) from error
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["pruning_options"] = options
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "RaincheckConfig":
        """The config of a `to_dict` dict (missing fields take their defaults; values validated as at construction).

        Raises `ValueError` for a non-dict or for unknown keys (naming them and the known ones).
        """
        if not isinstance(d, dict):
            raise ValueError(f"RaincheckConfig.from_dict: expected a dict, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"RaincheckConfig.from_dict: unknown keys {unknown}; known keys: {known}")
        values = dict(d)
        if isinstance(values.get("pruning_options"), dict):
            values["pruning_options"] = dict(values["pruning_options"])
        return cls(**values)
