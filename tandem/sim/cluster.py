"""A cluster description: instance groups (hardware, count, tensor-parallel degree, price),
the model, the router policy and the engine settings every instance runs with. From YAML or
JSON, checked with errors naming the field.

    model: llama-3-8b            # a built-in spec, or a config.json
    router: prefix_aware         # round_robin | least_load | prefix_aware | cost
    scheduling_policy: fcfs      # fcfs | priority | slo
    engine: {max_num_seqs: 256, max_num_batched_tokens: 8192, block_size: 16}
    groups:
      - {name: h100, hardware: H100, count: 4, tp: 1, pp: 1, price_per_hour: 2.5}
        # ep: true spreads a mixture of experts' experts over the tp devices (all-to-all)
      - {name: local, cost_model: cost.json, kv_tokens: 100000, count: 1}
      - {name: b200, count: 2, hardware: {name: B200, bf16_tflops: 2250, mem_bandwidth_gbs: 8000,
                                          mem_gib: 180, price_per_hour: 6.0}}  # any accelerator
      # per group also: role (below), prefix_caching: false (no radix cache), latency_ms
      # (what a request spends outside the engine's steps: HTTP, tokenization, a proxy's
      # hops; added to every time its client sees), step_ms and token_ms (host time a step
      # and a sampled token cost outside the runner: the engine loop's bookkeeping, a front
      # end on the same cores taking each step's outputs and streaming them; added to each
      # step, and per row that samples), request_ms (host time a request costs once, its
      # HTTP and tokenization: added to the first step that schedules it), step_scale (its
      # steps take this times the cost model's time: a server measured slower than its
      # profile, e.g. by the KV it sends from inside a prefill step; default 1),
      # step_noise: false (a profiled group's steps take the fitted time exactly instead of
      # straying as its profile's runs did), kv_offload_tokens and kv_offload_gbs (a
      # host-memory KV tier per instance: its capacity, and GB/s into the pool; sim/tiers.py)

A KV tier shared by every instance (a Redis), behind each one's host tier if it has one:

    kv_remote: {tokens: 50000000, bandwidth_gbs: 1.2, latency_ms: 0.5}

Prefill/decode disaggregation: groups with `role: prefill` and `role: decode`, and a link
between them (KV transfer time = bytes / bandwidth + latency, overlapped layer by layer):

    links:
      - {from: prefill, to: decode, bandwidth_gbs: 50, latency_ms: 0.05}
    prefill_router: least_load   # as `tandem proxy` picks; prefix_aware keeps a conversation's
                                 # history in one prefill instance's radix cache
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from tandem.core.cost_model import CostModel
from tandem.engine.config import SCHEDULING_POLICIES
from tandem.router.policy import POLICIES
from tandem.sim.specs import (
    HARDWARE,
    Hardware,
    ModelSpec,
    kv_capacity_tokens,
    roofline_cost_model,
)
from tandem.sim.tiers import TierSpec


@dataclass(frozen=True)
class GroupSpec:
    name: str
    count: int
    cost_model: CostModel
    kv_tokens: int  # KV capacity of one instance
    hardware: str
    tp: int = 1
    price_per_hour: float = (
        0.0  # of one instance (all its devices); roofline: the device's x tp x pp
    )
    role: str = "both"  # both | prefill | decode
    prefix_caching: bool = True  # its radix cache (off: every prompt computed, or sent, whole)
    latency_s: float = 0.0  # outside the engine's steps: added to every time its client sees
    step_noise: bool = True  # steps stray as the profile's runs did (if it measured that)
    token_s: float = 0.0  # host time per sampled token outside the runner: added to its step
    step_s: float = 0.0  # host time per step outside the runner: added to each
    step_scale: float = 1.0  # its steps take this times the cost model's time
    request_s: float = 0.0  # host time a request costs once: added to its first step
    kv_offload_tokens: int = 0  # a host-memory KV tier per instance (0: none)
    kv_offload_gbs: float = 25.0  # its bandwidth into the KV pool
    pp: int = 1  # pipeline stages (devices: tp x pp)


@dataclass(frozen=True)
class Link:
    bandwidth_gbs: float  # GB/s
    latency_s: float

    def transfer_seconds(self, nbytes: int) -> float:
        return nbytes / (self.bandwidth_gbs * 1e9)


@dataclass(frozen=True)
class ClusterSpec:
    model: ModelSpec
    groups: list[GroupSpec]
    router: str = "round_robin"
    scheduling_policy: str = "fcfs"
    engine: dict = field(default_factory=dict)
    links: dict[tuple[str, str], Link] = field(default_factory=dict)  # (prefill, decode) groups
    prefill_router: str = "least_load"  # how prefill instances are picked (the proxy's way)
    kv_remote: TierSpec | None = None  # a KV tier every instance shares (a Redis)

    @property
    def disaggregated(self) -> bool:
        return any(g.role != "both" for g in self.groups)

    @property
    def num_instances(self) -> int:
        return sum(g.count for g in self.groups)

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"cluster: cannot read {str(path)!r}: {e.strerror}") from None
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
        known = {"max_num_seqs", "max_num_batched_tokens", "block_size", "kv_offload_min_tokens"}
        unknown = set(engine) - known
        if unknown:
            raise ValueError(f"cluster.engine: unknown setting(s) {sorted(unknown)}")
        links = _links(data.get("links") or [], groups)
        router = data.get("router", "round_robin")
        prefill_router = data.get("prefill_router", "least_load")
        policy = data.get("scheduling_policy", "fcfs")
        for key, value in (("router", router), ("prefill_router", prefill_router)):
            if value not in POLICIES:
                raise ValueError(f"cluster.{key} must be one of {POLICIES}, got {value!r}")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"cluster.scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}"
            )
        remote = _remote_tier(data.get("kv_remote"))
        return cls(model, groups, router, policy, engine, links, prefill_router, remote)


def _group(g: dict, i: int, model: ModelSpec, base: Path) -> GroupSpec:
    where = f"cluster.groups[{i}]"
    role = g.get("role", "both")
    if role not in ("both", "prefill", "decode"):
        raise ValueError(f"{where}.role must be both, prefill or decode, got {role!r}")
    count, tp, pp = g.get("count", 1), g.get("tp", 1), g.get("pp", 1)
    for name, value in (("count", count), ("tp", tp), ("pp", pp)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{where}.{name} must be an integer >= 1, got {value!r}")
    if "cost_model" in g:  # a profile fitted on real hardware (`tandem profile`)
        if "kv_tokens" not in g:
            raise ValueError(f"{where}.kv_tokens: a profiled group needs its KV capacity")
        cost = CostModel.load(base / g["cost_model"])
        kv, hardware = int(g["kv_tokens"]), g.get("hardware", "profiled")
        price = 0.0
    else:
        hw = _hardware(g.get("hardware"), f"{where}.hardware")
        hardware = hw.name
        if tp * pp > 1 and not hw.interconnect_gbs > 0:
            raise ValueError(
                f"{where}.hardware.interconnect_gbs: tp {tp} x pp {pp} needs the link between devices"  # fmt: skip
            )
        ep = g.get("ep", False)
        if not isinstance(ep, bool):
            raise ValueError(f"{where}.ep must be true or false, got {ep!r}")
        cost = roofline_cost_model(hw, model, tp, pp=pp, ep=ep)
        kv = int(g.get("kv_tokens") or kv_capacity_tokens(hw, model, tp, pp=pp))
        price = hw.price_per_hour * tp * pp
    caching, noise = g.get("prefix_caching", True), g.get("step_noise", True)
    for name, value in (("prefix_caching", caching), ("step_noise", noise)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}.{name} must be true or false, got {value!r}")
    host = {k: g.get(k, 0.0) for k in ("latency_ms", "token_ms", "step_ms", "request_ms")}
    for name, value in host.items():
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
            raise ValueError(f"{where}.{name} must be a number >= 0, got {value!r}")
    scale = g.get("step_scale", 1.0)
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
        raise ValueError(f"{where}.step_scale must be a number > 0, got {scale!r}")
    offload, gbs = g.get("kv_offload_tokens", 0), g.get("kv_offload_gbs", 25.0)
    if not (isinstance(offload, int) and not isinstance(offload, bool) and offload >= 0):
        raise ValueError(f"{where}.kv_offload_tokens must be an integer >= 0, got {offload!r}")
    if not (isinstance(gbs, (int, float)) and not isinstance(gbs, bool) and gbs > 0):
        raise ValueError(f"{where}.kv_offload_gbs must be a number > 0, got {gbs!r}")
    return GroupSpec(g.get("name", f"group{i}"), count, cost, kv, hardware, tp,
                     float(g.get("price_per_hour", price)), role, caching,
                     host["latency_ms"] / 1000, noise, host["token_ms"] / 1000,
                     host["step_ms"] / 1000, float(scale), host["request_ms"] / 1000,
                     offload, float(gbs), pp)  # fmt: skip


def _remote_tier(value) -> TierSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"tokens", "bandwidth_gbs", "latency_ms"}:
        raise ValueError("cluster.kv_remote: a mapping of tokens, bandwidth_gbs, latency_ms")
    tokens, gbs, ms = value.get("tokens"), value.get("bandwidth_gbs"), value.get("latency_ms", 0)
    if not (isinstance(tokens, int) and tokens > 0):
        raise ValueError(f"cluster.kv_remote.tokens must be an integer > 0, got {tokens!r}")
    for name, v in (("bandwidth_gbs", gbs), ("latency_ms", ms)):
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0) or (
            name == "bandwidth_gbs" and not v > 0
        ):
            raise ValueError(f"cluster.kv_remote.{name} must be a number > 0, got {v!r}")
    return TierSpec("redis", tokens, float(gbs), float(ms) / 1000)


def _hardware(value, where: str) -> Hardware:
    """A built-in accelerator by name, or any other from its published figures:
    {name, bf16_tflops, mem_bandwidth_gbs, mem_gib, and optionally interconnect_gbs,
    price_per_hour, compute_efficiency, bandwidth_efficiency}."""
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(Hardware)}
        unknown = set(value) - fields
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(fields)}"
            )
        try:
            hw = Hardware(**value)
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from None
        for name in ("bf16_tflops", "mem_bandwidth_gbs", "mem_gib"):
            if not (isinstance(getattr(hw, name), (int, float)) and getattr(hw, name) > 0):
                raise ValueError(f"{where}.{name} must be > 0, got {getattr(hw, name)!r}")
        return hw
    if value not in HARDWARE:
        raise ValueError(
            f"{where} must be one of {sorted(HARDWARE)} or a mapping of published figures, "
            f"got {value!r}"
        )
    return HARDWARE[value]


def _links(items: list, groups: list[GroupSpec]) -> dict[tuple[str, str], Link]:
    roles = {g.name: g.role for g in groups}
    prefill = [g.name for g in groups if g.role == "prefill"]
    decode = [g.name for g in groups if g.role == "decode"]
    if bool(prefill) != bool(decode) or (prefill and any(r == "both" for r in roles.values())):
        raise ValueError(
            "cluster.groups: a disaggregated cluster needs prefill and decode groups (and no "
            "colocated ones)"
        )
    links = {}
    for i, item in enumerate(items):
        src, dst = item.get("from"), item.get("to")
        if roles.get(src) != "prefill" or roles.get(dst) != "decode":
            raise ValueError(f"cluster.links[{i}]: from a prefill group to a decode group")
        bw = item.get("bandwidth_gbs")
        if not (isinstance(bw, (int, float)) and bw > 0):
            raise ValueError(f"cluster.links[{i}].bandwidth_gbs must be > 0, got {bw!r}")
        links[(src, dst)] = Link(float(bw), float(item.get("latency_ms", 0.0)) / 1000)
    for src in prefill:
        for dst in decode:
            if (src, dst) not in links:
                raise ValueError(f"cluster.links: no link from {src!r} to {dst!r}")
    return links
