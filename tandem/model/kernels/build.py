"""Compile the C++ sources with torch.utils.cpp_extension on first use.

A built module is cached (kernel_cache.py: torch's extensions directory, TORCH_EXTENSIONS_DIR)
under a name hashed from the source, the flags, the torch version and this CPU's feature
flags, so an edit or a torch upgrade rebuilds and a cache shared across machines never loads
code built for another instruction set. A build takes 20-60 s of CPU once, bounded by
--kernel-build-timeout; later processes load it in well under a second.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tandem import cpu_isa
from tandem.model.kernels.kernel_cache import load_or_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
LORA_SOURCE = Path(__file__).with_name("lora_bgmv.cpp")
DEQUANT_SOURCE = Path(__file__).with_name("dequant.cpp")
FUSED_SOURCE = Path(__file__).with_name("fused.cpp")
PREFILL_SOURCE = Path(__file__).with_name("prefill_attention.cpp")
BITMASK_SOURCE = Path(__file__).with_name("token_bitmask.cpp")


def enabled() -> bool:
    return os.environ.get("TANDEM_NO_CPP_KERNELS", "") in ("", "0")


def paged_decode_attention():
    """The decode kernel `(q, k_cache, v_cache, block_tables, context_lens, scale) -> out`,
    or None: use the torch path. See paged_attention.cpp for shapes."""
    if not enabled():
        return None
    module = _load()
    return None if module is None else module.paged_decode_attention


def lora_bgmv():
    """`(y, x, a, bt, slots) -> None`: y += each token's own LoRA update, in place (see
    lora_bgmv.cpp), or None: use the torch path."""
    if not enabled():
        return None
    module = _load(LORA_SOURCE, "tandem_lora_bgmv", "the C++ LoRA kernel")
    return None if module is None else module.lora_bgmv


def dequant():
    """The module with `dequant_int4_t` and `dequant_int8` (see dequant.cpp), or None: use
    the torch path."""
    if not enabled():
        return None
    return _load(DEQUANT_SOURCE, "tandem_dequant", "the C++ dequantization kernels")


def fused():
    """The module with `rms_norm`, `add_rms_norm`, `rope_`, `silu_and_mul` and `write_kv` (see
    fused.cpp), or None: use the torch path."""
    if not enabled():
        return None
    return _load(
        FUSED_SOURCE, "tandem_fused", "the C++ fused layer kernels", (SOURCE, DEQUANT_SOURCE)
    )


def prefill_attention():
    """The prefill kernel `(q, k_cache, v_cache, block_tables, starts, context_lens, scale)
    -> out`
    (see prefill_attention.cpp), or None: use the torch path. Only where the CPU computes
    bf16 dot products (AVX512-BF16)."""
    if not enabled():
        return None
    module = _load(PREFILL_SOURCE, "tandem_prefill_attention", "the C++ prefill attention kernel")
    return module.prefill_attention if module is not None and module.available() else None


def token_bitmask():
    """`(logits, bitmask, rows) -> None`: grammar masks applied to float32 logits in place
    (see token_bitmask.cpp), or None: use the torch path."""
    if not enabled():
        return None
    # portable: its loop gains nothing from wider vectors, and one build serves every ISA level
    module = _load(
        BITMASK_SOURCE, "tandem_token_bitmask", "the C++ token bitmask kernel", portable=True
    )
    return None if module is None else module.apply_token_bitmask_


def prebuild() -> None:
    """Build (or load) every kernel now, in parallel: a first start on a 2-core machine then
    compiles in about half the time it takes one after the other."""
    if not enabled() or platform.machine().lower() not in ("x86_64", "amd64"):
        return
    loaders = (
        paged_decode_attention, lora_bgmv, dequant, fused, prefill_attention, token_bitmask,
    )  # fmt: skip
    with ThreadPoolExecutor(max_workers=len(loaders)) as pool:
        list(pool.map(lambda load: load(), loaders))


def configure(build_timeout: float) -> None:
    """Seconds this process may spend building the C++ kernels, all of them together (or
    waiting for another process that builds them); past them the kernels not yet built run
    on the torch path (--kernel-build-timeout)."""
    global _build_budget
    if not build_timeout > 0:
        raise ValueError(f"kernel_build_timeout must be > 0 (seconds), got {build_timeout!r}")
    _build_budget = _BuildBudget(float(build_timeout))


class _BuildBudget:
    """The seconds left for builds, counted from the first build that waits or compiles."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started: float | None = None

    def left(self) -> float:
        if self.started is None:
            self.started = time.monotonic()
        return self.seconds - (time.monotonic() - self.started)


DEFAULT_BUILD_TIMEOUT = 300.0
_build_budget = _BuildBudget(DEFAULT_BUILD_TIMEOUT)


@functools.cache
def _load(
    source: Path = SOURCE,
    stem: str = "tandem_paged_attention",
    what="the C++ attention kernel",
    includes: tuple[Path, ...] = (),
    portable: bool = False,
):
    """Build (or load the cached build of) `source`; `includes` are the sources it
    #includes, which its build tag covers too; portable: built for any x86-64, whatever the
    ISA level in force."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.info("C++ kernels are built for x86 only; using the torch attention path")
        return None
    try:
        isa = [] if portable else [*cpu_isa.compile_flags(), *_vec_flags()]
        cflags = ["-O3", *isa, "-fopenmp"]
        name = f"{stem}_{_build_tag(cflags, source, *includes)}"
        return load_or_build(name, source, cflags, ["-fopenmp"], _build_budget.left, what)
    except Exception as e:  # an unwritable cache, a module that will not import
        log.warning("%s unavailable (%s: %s); using the torch path", what, type(e).__name__, e)
        log.debug("C++ kernel load failed", exc_info=True)
        return None


def vec_lanes() -> int:
    """Floats in the kernels' at::vec vector (16, 8, or 8 for the portable default): the
    decode kernel needs head_dim a multiple of it."""
    return 16 if "AVX512" in _vec_flags()[0] else 8


def _vec_flags() -> list[str]:
    """at::vec at the vector width torch's own CPU kernels run here (AVX-512's 16 floats,
    AVX2's 8, else its portable default), within the level in force (cpu_isa.py): the fused
    kernels then compute at torch's width, and their exp is the one torch's silu calls, so
    they beat torch's ops at every size instead of losing from ~64 rows (a 2,048-row SiLU*mul
    1.15 vs 1.36 ms, RoPE 0.67 vs 0.95 on an AMX Xeon; built for AVX2 there, 1.65 and 0.70)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512") and cpu_isa.at_least("avx512"):
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if cpu_isa.at_least("avx2"):
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


def _build_tag(cflags: list[str], *sources: Path) -> str:
    h = hashlib.sha256()
    for source in sources:
        h.update(source.read_bytes())
    h.update(" ".join(cflags).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:12]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()
