"""`RaincheckConfig.to_dict` / `from_dict`: a JSON round trip, and clear errors for what cannot be serialised."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from hf_raincheck import RaincheckConfig


def test_round_trip_through_json():
    config = RaincheckConfig(policy="hard", retention=0.25, chunk_size=7, guard_tokens=3, pruning="hiprune",
                             pruning_options={}, completion="next_turn", completion_chunk_size=64,
                             attn_backend="eager", visibility="causal", gdn_backend="torch", fused=False, seed=5)
    d = config.to_dict()
    assert set(d) == {f.name for f in fields(RaincheckConfig)}
    back = RaincheckConfig.from_dict(json.loads(json.dumps(d)))
    assert back == config
    assert RaincheckConfig.from_dict(RaincheckConfig().to_dict()) == RaincheckConfig()


def test_round_trip_keeps_selector_options():
    config = RaincheckConfig(pruning="mmtok", pruning_options={"alpha": 0.5})
    back = RaincheckConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert back == config and back.pruning_options == {"alpha": 0.5}
    assert back.pruning_options is not config.pruning_options


def test_auto_chunk_size_resolves_per_model_kind():
    config = RaincheckConfig()
    assert config.chunk_size == "auto"
    assert config.for_model(gdn_layers=True) == RaincheckConfig(chunk_size=RaincheckConfig.CHUNK_GDN) != config
    assert config.for_model(gdn_layers=False) == RaincheckConfig(chunk_size=RaincheckConfig.CHUNK_ATTENTION)
    assert (RaincheckConfig.CHUNK_ATTENTION, RaincheckConfig.CHUNK_GDN) == (31, 63)
    explicit = RaincheckConfig(chunk_size=15)
    assert explicit.for_model(gdn_layers=True) is explicit
    assert RaincheckConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_missing_keys_take_defaults():
    assert RaincheckConfig.from_dict({"retention": 0.5}) == RaincheckConfig(retention=0.5)
    assert RaincheckConfig.from_dict({}) == RaincheckConfig()


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match=r"unknown keys \['chunk', 'z'\]; known keys: \['policy'"):
        RaincheckConfig.from_dict({"chunk": 3, "z": 1, "retention": 0.5})


def test_from_dict_validates_values_and_type():
    with pytest.raises(ValueError, match=r"RaincheckConfig\.retention must be in \(0, 1\]"):
        RaincheckConfig.from_dict({"retention": 2.0})
    with pytest.raises(ValueError, match="from_dict: expected a dict, got str"):
        RaincheckConfig.from_dict("retention=0.5")


def test_callable_selector_cannot_be_serialised():
    config = RaincheckConfig(pruning=lambda ctx: None)
    with pytest.raises(ValueError, match=r"to_dict: pruning=.* is a callable"):
        config.to_dict()


def test_custom_schedule_cannot_be_serialised():
    config = RaincheckConfig(schedule=lambda step, pending: 1)
    with pytest.raises(ValueError, match=r"to_dict: schedule=.* is a custom callable"):
        config.to_dict()
