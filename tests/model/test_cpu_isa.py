"""Every CPU path runs on whatever machine runs the suite: TANDEM_CPU_ISA forces a lower
instruction-set level (never a higher one), the kernels and torch's own then take that
level's paths, and the model parity tests pass at each level this CPU runs and without a
compiler. The levels that ran are in the report header and in each case's id."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem import cpu_isa
from tandem.model import kernels

# The tests that hold each kernel path to the float path (and HF's) on the same weights.
PARITY_TESTS = [
    "tests/model/test_cpu_isa.py::test_the_kernels_take_the_paths_of_the_level_in_force",
    "tests/model/test_fused_kernels.py",
    "tests/model/test_paged_attention_kernel.py",
    "tests/model/test_prefill_attention.py",
    "tests/model/test_quantized_weights.py",
    "tests/engine/test_hf_parity.py",
]


def test_an_unknown_level_or_one_above_the_cpu_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_levels", lambda: ("portable", "avx2"))
    monkeypatch.setenv(cpu_isa.ENV, "sse9")
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA must be one of"):
        cpu_isa.selected()
    monkeypatch.setenv(cpu_isa.ENV, "avx512")
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA=avx512: this CPU runs at most avx2"):
        cpu_isa.selected()
    monkeypatch.setenv(cpu_isa.ENV, "AVX2")
    assert cpu_isa.selected() == "avx2" and cpu_isa.at_least("portable")
    assert not cpu_isa.at_least("avx512")
    monkeypatch.delenv(cpu_isa.ENV)
    assert cpu_isa.selected() == "avx2"  # the CPU's highest


def test_each_level_builds_for_its_own_instruction_set(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_levels", lambda: cpu_isa.LEVELS)
    flags = {}
    for level in cpu_isa.LEVELS:
        monkeypatch.setenv(cpu_isa.ENV, level)
        flags[level] = cpu_isa.compile_flags()
    assert flags["portable"][0] == "-march=x86-64" and flags["avx2"] == ["-march=x86-64-v3"]
    assert flags["avx512"] == ["-march=x86-64-v4"] and flags["amx"] == ["-march=native"]
    assert "-mno-amx-tile" in flags["avx512_bf16"] and "-DTANDEM_NO_AMX" in flags["avx512_bf16"]


def test_the_levels_a_cpu_runs_follow_its_flags(monkeypatch):
    levels = {
        "fpu sse2": ("portable",),
        "avx2 fma f16c bmi2 movbe": ("portable", "avx2"),
        "avx2 fma f16c bmi2 movbe avx512f avx512bw avx512vl avx512dq avx512cd avx512_bf16": (
            "portable", "avx2", "avx512", "avx512_bf16"),
        "avx512f avx512bw avx512vl avx512dq avx512cd amx_tile amx_bf16": ("portable",),
    }  # fmt: skip
    for flags, want in levels.items():
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda flags=flags: set(flags.split()))
        cpu_isa.cpu_levels.cache_clear()
        assert cpu_isa.cpu_levels() == want, flags
    cpu_isa.cpu_levels.cache_clear()


def test_the_kernels_take_the_paths_of_the_level_in_force():
    """What each level runs: the vector width, int4_gemm's path, the prefill kernel, int8
    activations, native bf16, and torch's own capability."""
    level = cpu_isa.selected()
    at = cpu_isa.at_least
    capability = torch.backends.cpu.get_cpu_capability()
    if os.environ.get(cpu_isa.ENV):  # capped: torch's kernels too
        want = {"portable": "DEFAULT", "avx2": "AVX2"}.get(level, "AVX512")
        assert capability == want or level == "amx"
    if kernels.fused() is None:  # the no-compiler run: every kernel falls back
        assert kernels.dequant() is None and kernels.paged_decode_attention() is None
        assert kernels.prefill_attention() is None
        return
    assert kernels.vec_lanes() == (16 if at("avx512") and capability.startswith("AVX512") else 8)
    dequant, flags = kernels.dequant(), cpu_isa.cpu_flags()
    dot = at("avx512_bf16") and "avx512vbmi" in flags  # int4_gemm's dot path needs VBMI too
    assert dequant.gemm_path() == ("amx" if at("amx") else "dot" if dot else "")
    assert (kernels.prefill_attention() is not None) == at("avx512_bf16")
    int8 = level == "avx512_bf16" and dot and "avx512_vnni" in flags
    assert dequant.int8_activations_here() == int8
    from tandem.runner.builder import resolve_dtype

    native_bf16 = resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert native_bf16 == at("avx512_bf16"), level


LOWER_LEVELS = [lvl for lvl in cpu_isa.LEVELS if lvl != cpu_isa.cpu_levels()[-1]]


@pytest.mark.slow
@pytest.mark.parametrize("level", [*LOWER_LEVELS, "no-compiler"])
def test_the_parity_tests_pass_at_each_level_this_cpu_runs(level, tmp_path):
    """The suite itself runs at the CPU's own level; here the parity tests run again at each
    level below it (and with no compiler: every kernel on the torch path). A level skips only
    where this CPU lacks it."""
    if level != "no-compiler" and level not in cpu_isa.cpu_levels():
        pytest.skip(f"this CPU runs at most {cpu_isa.cpu_levels()[-1]}")
    env = dict(os.environ, TANDEM_CPU_ISA="" if level == "no-compiler" else level)
    env.pop("ATEN_CPU_CAPABILITY", None), env.pop("ONEDNN_MAX_CPU_ISA", None)
    if level == "no-compiler":  # a kernel cache of its own, and no compiler to fill it
        env.update(TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), CXX=str(tmp_path / "no-cxx"))
    # The tiny seeded models take every kernel path the 135M model does, in seconds; its
    # own runs (3 minutes a level, 10 at portable, where torch's kernels have no vectors)
    # stay in the suite at the CPU's level.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x",
         "-m", "not default_model", *PARITY_TESTS],
        capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip
    tail = "\n".join(done.stdout.splitlines()[-25:])
    assert done.returncode == 0, f"at {level}:\n{tail}"
    assert " passed" in tail and " failed" not in tail
    print(f"\n{level}: {tail.splitlines()[-1]}")
