"""Which rank computes what: the ranks' grid (pipeline stages x tensor-parallel ranks), each
stage's layers, each rank's slice of the model's shapes, and the check that a model splits
at all. Plain Python (no torch): the engine's config check and the simulator use it too.

Rank r is stage r // tp, tensor-parallel rank r % tp; rank 0 is the driver (the engine
core's process), so the first stage's first rank holds the scheduler.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tandem.core.model_config import ModelConfig


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    # a mixture of experts' experts whole on the tensor-parallel ranks (distributed/experts.py),
    # placed by expert_placement; False: each expert split like an MLP
    ep: bool = False
    expert_placement: str = "linear"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    def stage_layers(self, stage: int, num_layers: int) -> range:
        """Consecutive layers, as even as can be; the first stages take one more each where
        the count does not divide (the last stage also computes the head)."""
        base, extra = divmod(num_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def max_stage_layers(self, num_layers: int) -> int:
        return -(-num_layers // self.pp)


def check_splits(cfg: ModelConfig, layout: ParallelLayout) -> None:
    """Refuse, at start, a model that cannot be split this way, saying which sizes can."""
    tp, pp = layout.tp, layout.pp
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if layout.ep and cfg.moe is None:
        raise ValueError("enable_expert_parallel: this model has no experts (not a mixture of experts)")  # fmt: skip
    if tp > 1 and cfg.qk_norm == "full":
        raise ValueError(
            "tensor_parallel_size: this model normalizes q and k over the whole projection "
            "(OLMoE), which a split over ranks does not compute; run it with 1"
        )
    if not splits(cfg, tp, layout.ep):
        ok = [n for n in range(1, cfg.num_heads + 1) if splits(cfg, n, layout.ep)]
        moe = cfg.moe
        experts = "" if moe is None else (
            f", {moe.num_experts} experts (one at least per rank)" if layout.ep
            else f", {moe.intermediate_size} columns per expert"
        ) + (f", {moe.shared_intermediate_size} shared-expert columns" if moe and moe.shared_intermediate_size else "")  # fmt: skip
        raise ValueError(
            f"tensor_parallel_size {tp} does not split this model: {cfg.num_heads} attention "
            f"heads, {cfg.num_kv_heads} KV heads, {cfg.intermediate_size} MLP columns"
            f"{experts} must each divide by it (KV heads may instead divide it, and are then "
            f"replicated); sizes that would: {', '.join(map(str, ok))}"
        )
    if pp > cfg.num_layers:
        raise ValueError(
            f"pipeline_parallel_size {pp} is more than the model's {cfg.num_layers} layers; "
            f"sizes that would: 1 to {cfg.num_layers}"
        )


def splits(cfg: ModelConfig, tp: int, ep: bool = False) -> bool:
    kv, moe = cfg.num_kv_heads, cfg.moe
    dense = cfg.intermediate_size if moe is None or moe.dense_layers else 0
    experts = moe is None or (moe.num_experts >= tp if ep else moe.intermediate_size % tp == 0)
    return (
        cfg.num_heads % tp == 0
        and (kv % tp == 0 or tp % kv == 0)
        and dense % tp == 0
        and experts
        and (moe is None or moe.shared_intermediate_size % tp == 0)
    )


def local_vocab(vocab_size: int, tp: int) -> int:
    """Rows of the embedding and head per rank, the last rank's padded."""
    return -(-vocab_size // tp)


def rank_config(cfg: ModelConfig, tp: int, held: tuple[int, ...] | None = None) -> ModelConfig:
    """The shapes one tensor-parallel rank builds: its heads, KV heads (one each, replicated,
    where there are fewer than ranks), MLP columns and vocabulary rows; its experts' columns,
    or (held: expert parallelism) its whole experts."""
    if tp == 1:
        return cfg
    moe = cfg.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // (1 if held else tp),
            shared_intermediate_size=moe.shared_intermediate_size // tp,
            held=held,
        )
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=max(1, cfg.num_kv_heads // tp),
        intermediate_size=cfg.intermediate_size // tp,
        vocab_size=local_vocab(cfg.vocab_size, tp),
        moe=moe,
    )


def kv_heads_of(cfg: ModelConfig, tp: int, tp_rank: int) -> range:
    """The model's KV heads a rank holds: its share, or the one it replicates."""
    kv = cfg.num_kv_heads
    if kv >= tp:
        n = kv // tp
        return range(tp_rank * n, (tp_rank + 1) * n)
    head = tp_rank * kv // tp
    return range(head, head + 1)
