"""Engine flags are generated from EngineConfig: one default per setting, shown in --help."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from tandem.engine.config import EngineConfig, add_engine_args, engine_config_from_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_no_flags_give_the_config_defaults():
    assert engine_config_from_args(_parser().parse_args([]), None) == EngineConfig()


def test_every_setting_has_a_flag_whose_help_shows_its_default():
    engine_help = _parser().format_help().split("engine:", 1)[1]
    entries = {
        e.split()[0].rstrip(","): " ".join(e.split()) for e in engine_help.split("\n  -")[1:]
    }
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "-" + f.name.replace("_", "-")  # the split ate the first dash
        assert flag in entries, flag
        shown = f"(default: {f.default})" if f.default is not None else "(default: "
        assert shown in entries[flag], entries[flag]  # None is said in words


def test_flags_parse_to_typed_values():
    args = _parser().parse_args(
        "--block-size 8 --kv-cache-memory 0.5 --no-enable-prefix-caching --max-model-len 512 "
        "--dtype float32".split()
    )
    cfg = engine_config_from_args(args, "m")
    assert (cfg.model, cfg.block_size, cfg.kv_cache_memory) == ("m", 8, 0.5)
    assert cfg.enable_prefix_caching is False and cfg.max_model_len == 512
    assert cfg.dtype == "float32"


def test_a_bad_value_names_its_setting():
    args = _parser().parse_args(["--block-size", "0"])
    with pytest.raises(ValueError, match="block_size"):
        engine_config_from_args(args, None)
