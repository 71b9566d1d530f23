"""The instruction-set level the CPU kernels are built for and the paths they choose.

Levels, each a superset of the one before:
  portable     plain x86-64 (SSE2): torch's DEFAULT vectors, every kernel's portable loop
  avx2         x86-64-v3 (AVX2, FMA, F16C): 8-float vectors
  avx512       x86-64-v4 (AVX512F/BW/DQ/VL): 16-float vectors, no bf16 dot products
  avx512_bf16  the CPU's own flags less AMX: vdpbf16ps (int4_gemm's dot path, the prefill
               kernel), VNNI (int8 activations), VBMI; bf16 is the default dtype
  amx          the CPU's own flags: AMX tiles (int4_gemm's tile path, torch's SDPA for prefill)

TANDEM_CPU_ISA=<level> runs a lower level than the CPU's (never a higher one: refused), so
every path a CPU kind would take can be tested on one machine. It also caps torch's own
kernels (ATEN_CPU_CAPABILITY) and oneDNN's (ONEDNN_MAX_CPU_ISA), set by `apply_to_torch()`
before torch is imported (tandem/__init__.py calls it).
"""

from __future__ import annotations

import functools
import os
import platform

ENV = "TANDEM_CPU_ISA"
LEVELS = ("portable", "avx2", "avx512", "avx512_bf16", "amx")
_NEEDS = {  # /proc/cpuinfo flags each level needs beyond the one below
    "avx2": {"avx2", "fma", "f16c", "bmi2", "movbe"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
    "avx512_bf16": {"avx512_bf16"},
    "amx": {"amx_tile", "amx_bf16"},
}
_MARCH = {  # what the compiler builds each level with
    "portable": ["-march=x86-64", "-mtune=generic"],
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4"],
    "avx512_bf16": ["-march=native"],  # and, on a CPU with AMX, _NO_AMX
    "amx": ["-march=native"],
}
_NO_AMX = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-DTANDEM_NO_AMX"]
_TORCH = {  # ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA
    "portable": ("default", "SSE41"),
    "avx2": ("avx2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE"),
    "avx512_bf16": ("avx512", "AVX512_CORE_BF16"),
}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        line = ""
    return set(line.partition(":")[2].split())


@functools.cache
def cpu_levels() -> tuple[str, ...]:
    """The levels this CPU runs, lowest first ('portable' alone off x86)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("portable",)
    flags, levels = cpu_flags(), ["portable"]
    for level in LEVELS[1:]:
        if not _NEEDS[level] <= flags:
            break
        levels.append(level)
    return tuple(levels)


def selected() -> str:
    """The level in force: $TANDEM_CPU_ISA if set (ValueError if unknown or above the CPU),
    else the CPU's highest."""
    want = os.environ.get(ENV, "").strip().lower()
    levels = cpu_levels()
    if not want:
        return levels[-1]
    if want not in LEVELS:
        raise ValueError(f"{ENV} must be one of {LEVELS}, got {want!r}")
    if want not in levels:
        raise ValueError(f"{ENV}={want}: this CPU runs at most {levels[-1]} ({', '.join(levels)})")
    return want


def at_least(level: str) -> bool:
    return LEVELS.index(selected()) >= LEVELS.index(level)


def compile_flags() -> list[str]:
    level = selected()
    below_amx = level == "avx512_bf16" and "amx" in cpu_levels()
    return _MARCH[level] + (_NO_AMX if below_amx else [])


def apply_to_torch() -> None:
    """Cap torch's and oneDNN's own kernels at the selected level; a no-op when none is set
    (or when the user set those variables, or the value is wrong: the engine's start says
    so). Must run before torch's first CPU op."""
    try:
        level = selected()
    except ValueError:
        return
    if not os.environ.get(ENV) or level == "amx":
        return
    aten, onednn = _TORCH[level]
    os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
