"""Which CPUs each rank of this node computes on (vLLM's VLLM_CPU_OMP_THREADS_BIND): ranks
that share cores slow each other down, and torch's threads follow the process's affinity."""

from __future__ import annotations

import os
from pathlib import Path

import torch

NODES = Path("/sys/devices/system/node")


def cpu_binds(spec: str, ranks: list[int], nodes: Path = NODES) -> dict[int, list[int]]:
    """rank -> its CPUs: `auto` gives each NUMA node's CPUs (of this process's) to an equal
    share of the ranks, split evenly in order, so no rank straddles two memory buses (one
    node: this process's CPUs split evenly); `none` binds nothing; `0-3|4-7` names each
    rank's (this node's ranks in order)."""
    if spec == "none":
        return {}
    if spec == "auto":
        mine = set(os.sched_getaffinity(0))
        numa = [c for c in (sorted(mine & set(cpus)) for cpus in numa_nodes(nodes)) if c]
        if len(numa) > 1 and len(ranks) % len(numa) == 0:
            per = len(ranks) // len(numa)
            binds = {}
            for i, cpus in enumerate(numa):
                binds |= _split(cpus, ranks[i * per : (i + 1) * per])
            return binds
        # node by node, so an even share stays within a node where it fits in one
        ordered = [c for cpus in numa for c in cpus]
        return _split(ordered + sorted(mine - set(ordered)), ranks)
    parts = spec.split("|")
    if len(parts) != len(ranks):
        raise ValueError(
            f"cpu_threads_bind: {spec!r} names {len(parts)} ranks' CPUs; this node runs "
            f"{len(ranks)} ranks (one list each, joined by |)"
        )
    return {r: parse_cpus(p) for r, p in zip(ranks, parts)}


def _split(cpus: list[int], ranks: list[int]) -> dict[int, list[int]]:
    if len(cpus) < len(ranks):  # more ranks than CPUs: they share, round robin
        return {r: [cpus[i % len(cpus)]] for i, r in enumerate(ranks)}
    per = len(cpus) // len(ranks)
    return {r: cpus[i * per : (i + 1) * per] for i, r in enumerate(ranks)}


def numa_nodes(root: Path = NODES) -> list[list[int]]:
    """Each NUMA node's CPUs, as Linux lists them (none where it does not)."""
    nodes = sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    return [parse_cpus(text) for p in nodes if (text := (p / "cpulist").read_text().strip())]


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
