"""Engine flags are generated from EngineConfig: one default per setting, shown in --help."""

from __future__ import annotations

import argparse
import subprocess
import sys
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


def test_vllm_dtype_spellings():
    assert EngineConfig(dtype="half").dtype == "float16"
    assert EngineConfig(dtype="float").dtype == "float32"
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="fp8")


def test_kv_cache_size_comes_from_the_first_setting_given(monkeypatch):
    from tandem.engine.config import KV_CACHE_SPACE_ENV, kv_cache_setting

    monkeypatch.delenv(KV_CACHE_SPACE_ENV, raising=False)
    assert kv_cache_setting(EngineConfig()) == (None, "default")
    monkeypatch.setenv(KV_CACHE_SPACE_ENV, "0.5")  # GiB, as VLLM_CPU_KVCACHE_SPACE
    assert kv_cache_setting(EngineConfig()) == (2**29, f"${KV_CACHE_SPACE_ENV}")
    assert kv_cache_setting(EngineConfig(kv_cache_memory=1.0)) == (2**30, "--kv-cache-memory")
    both = EngineConfig(kv_cache_memory=1.0, kv_cache_memory_bytes=1234)
    assert kv_cache_setting(both) == (1234, "--kv-cache-memory-bytes")
    monkeypatch.setenv(KV_CACHE_SPACE_ENV, "lots")
    with pytest.raises(ValueError, match=KV_CACHE_SPACE_ENV):
        kv_cache_setting(EngineConfig())


def test_a_set_step_budget_wins_else_it_defaults_by_how_chunks_attend():
    from tandem.engine.config import step_token_budget

    assert step_token_budget(EngineConfig(max_num_batched_tokens=96), True) == 96
    assert step_token_budget(EngineConfig(max_num_batched_tokens=96), False) == 96
    assert step_token_budget(EngineConfig(), chunks_in_place=True) == 512
    assert step_token_budget(EngineConfig(), chunks_in_place=False) == 2048
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_schedules_with_its_runners_step_budget(llama_path, dtype):
    from tandem import LLM

    llm = LLM(str(llama_path), dtype=dtype, kv_cache_memory=0.01, max_model_len=256)
    runner = llm.engine.runner
    layers = list(runner.model.attention_layers())
    # in place: every chunk goes to the C++ kernel on the paged cache, none to SDPA's own path
    in_place = all(a.prefill_kernel is not None and a.fresh_attend is None for a in layers)
    assert runner.chunks_in_place == in_place
    if dtype == "float32":
        assert not in_place  # only the bf16 kernel reads chunks in place
    assert llm.engine.scheduler.config.max_num_batched_tokens == (512 if in_place else 2048)
    set_budget = LLM(str(llama_path), dtype=dtype, kv_cache_memory=0.01, max_model_len=256,
                     max_num_batched_tokens=64)  # fmt: skip
    assert set_budget.engine.scheduler.config.max_num_batched_tokens == 64


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_tandem_version():
    from tandem import __version__

    done = _cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"tandem {__version__}"


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["bench", "serve"]])
def test_an_unknown_flag_prints_the_subcommands_usage(command):
    done = _cli(*command, "--no-such-flag")
    assert done.returncode == 2
    assert f"usage: tandem {' '.join(command)}" in done.stderr
    assert "unrecognized arguments: --no-such-flag" in done.stderr


@pytest.mark.parametrize(
    "command", [["serve"], ["generate"], ["bench", "serve"], ["bench", "compare"]]
)
def test_every_flag_of_every_subcommand_shows_its_default(command):
    text = _cli(*command, "--help").stdout
    options = text.split("options:", 1)[1]
    entries = [" ".join(e.split()) for e in options.split("\n  -")[1:]]
    missing = [e.split()[0] for e in entries if "(default" not in e and not e.startswith("h,")]
    assert not missing, missing
