"""Which CPUs each rank of this node computes on (vLLM's VLLM_CPU_OMP_THREADS_BIND): ranks
that share cores slow each other down, and torch's threads follow the process's affinity."""

from __future__ import annotations

import os

import torch


def cpu_binds(spec: str, ranks: list[int]) -> dict[int, list[int]]:
    """rank -> its CPUs: `auto` splits this process's CPUs evenly in order, `none` binds
    nothing, `0-3|4-7` names each rank's (this node's ranks in order)."""
    if spec == "none":
        return {}
    if spec == "auto":
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < len(ranks):  # more ranks than CPUs: they share, round robin
            return {r: [cpus[i % len(cpus)]] for i, r in enumerate(ranks)}
        per = len(cpus) // len(ranks)
        return {r: cpus[i * per : (i + 1) * per] for i, r in enumerate(ranks)}
    parts = spec.split("|")
    if len(parts) != len(ranks):
        raise ValueError(
            f"cpu_threads_bind: {spec!r} names {len(parts)} ranks' CPUs; this node runs "
            f"{len(ranks)} ranks (one list each, joined by |)"
        )
    return {r: parse_cpus(p) for r, p in zip(ranks, parts)}


def parse_cpus(text: str) -> list[int]:
    cpus = []
    try:
        for item in text.split(","):
            a, _, b = item.partition("-")
            cpus += range(int(a), int(b or a) + 1)
    except ValueError:
        raise ValueError(f"cpu_threads_bind: {text!r} is not a CPU list such as 0-3 or 0,2") from None  # fmt: skip
    if not cpus:
        raise ValueError(f"cpu_threads_bind: {text!r} names no CPU")
    return cpus


def use_cpus(cpus: list[int] | None):
    """Bind this process and torch's threads to `cpus`; -> a function that undoes it (an
    offline LLM in the user's own process gives the process back as it found it)."""
    if not cpus:
        return None
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))

    def restore() -> None:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)

    return restore
