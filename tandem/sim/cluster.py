"""A cluster description: instance groups (hardware, count, tensor-parallel degree, price),
the model, the router policy and the engine settings every instance runs with. From YAML or
JSON, checked with errors naming the field.

    model: llama-3-8b            # a built-in spec, or a config.json
    router: prefix_aware         # round_robin | least_load | prefix_aware | cost
    scheduling_policy: fcfs      # fcfs | priority | slo
    engine: {max_num_seqs: 256, max_num_batched_tokens: 8192, block_size: 16}
    groups:
      - {name: h100, hardware: H100, count: 4, tp: 1, price_per_hour: 2.5}
      - {name: local, cost_model: cost.json, kv_tokens: 100000, count: 1}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tandem.core.cost_model import CostModel
from tandem.sim.specs import HARDWARE, ModelSpec, kv_capacity_tokens, roofline_cost_model


@dataclass(frozen=True)
class GroupSpec:
    name: str
    count: int
    cost_model: CostModel
    kv_tokens: int  # KV capacity of one instance
    hardware: str
    tp: int = 1
    price_per_hour: float = 0.0  # of one instance (all its devices)


@dataclass(frozen=True)
class ClusterSpec:
    model: ModelSpec
    groups: list[GroupSpec]
    router: str = "round_robin"
    scheduling_policy: str = "fcfs"
    engine: dict = field(default_factory=dict)

    @property
    def num_instances(self) -> int:
        return sum(g.count for g in self.groups)

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return cls.from_dict(data, Path(path).parent)

    @classmethod
    def from_dict(cls, data: dict, base: Path = Path(".")) -> ClusterSpec:
        if not isinstance(data, dict):
            raise ValueError("cluster: must be a mapping")
        model = ModelSpec.load(str(data.get("model", "llama-3-8b")))
        groups = [_group(g, i, model, base) for i, g in enumerate(data.get("groups") or [])]
        if not groups:
            raise ValueError("cluster.groups: give at least one instance group")
        engine = dict(data.get("engine") or {})
        unknown = set(engine) - {"max_num_seqs", "max_num_batched_tokens", "block_size"}
        if unknown:
            raise ValueError(f"cluster.engine: unknown setting(s) {sorted(unknown)}")
        return cls(
            model,
            groups,
            data.get("router", "round_robin"),
            data.get("scheduling_policy", "fcfs"),
            engine,
        )


def _group(g: dict, i: int, model: ModelSpec, base: Path) -> GroupSpec:
    where = f"cluster.groups[{i}]"
    if g.get("role", "both") != "both":
        raise ValueError(f"{where}.role: only 'both' (colocated) instances are simulated yet")
    count, tp = g.get("count", 1), g.get("tp", 1)
    for name, value in (("count", count), ("tp", tp)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{where}.{name} must be an integer >= 1, got {value!r}")
    if "cost_model" in g:  # a profile fitted on real hardware (`tandem profile`)
        if "kv_tokens" not in g:
            raise ValueError(f"{where}.kv_tokens: a profiled group needs its KV capacity")
        cost = CostModel.load(base / g["cost_model"])
        kv, hardware = int(g["kv_tokens"]), g.get("hardware", "profiled")
    else:
        hardware = g.get("hardware")
        if hardware not in HARDWARE:
            raise ValueError(
                f"{where}.hardware must be one of {sorted(HARDWARE)}, got {hardware!r}"
            )
        hw = HARDWARE[hardware]
        cost = roofline_cost_model(hw, model, tp)
        kv = int(g.get("kv_tokens") or kv_capacity_tokens(hw, model, tp))
    return GroupSpec(g.get("name", f"group{i}"), count, cost, kv, hardware, tp,
                     float(g.get("price_per_hour", 0.0)))  # fmt: skip
