"""What the simulator knows of models and accelerators, and the step-time model it derives
from them. Pure Python.

A model spec comes from a config.json (layers, heads, KV heads, head dim, sizes), so its
parameters, FLOPs and KV bytes per token follow. Accelerators we do not own are described by
their published dense bf16 FLOP/s, memory bandwidth and memory size; `roofline_cost_model`
turns (accelerator, model, tensor- and pipeline-parallel degrees) into the same five-coefficient
`CostModel` that `tandem profile` fits on real hardware, so the scheduler and router read a
simulated instance exactly as a real one. Such a model is derived, not measured: its `info`
says so, with the efficiency factors it assumed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tandem.core.cost_model import CostModel

GiB = 2**30


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    # a mixture of experts (0 experts: dense): each token multiplies `experts_per_token` of
    # them (and the shared expert, where there is one), but a step reads every expert a token
    # of it routes to: all of them, at a serving batch (1 - (1 - k/E)^B of them at B tokens)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0

    @classmethod
    def from_config(cls, name: str, cfg: dict) -> ModelSpec:
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        return cls(
            name=name,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            num_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if experts else 0,
            expert_intermediate_size=(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
            if experts
            else 0,  # fmt: skip
            shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        )

    @classmethod
    def load(cls, name_or_path: str) -> ModelSpec:
        """A built-in name (MODELS), a config.json, or a folder holding one."""
        if name_or_path in MODELS:
            return cls.from_config(name_or_path, MODELS[name_or_path])
        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"model: {name_or_path!r} is neither a built-in spec {sorted(MODELS)} nor a "
                f"config.json"
            )
        return cls.from_config(path.parent.name, json.loads(path.read_text()))

    def _layer_params(self, experts: int) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attention = h * (q + 2 * kv) + q * h + 2 * h
        if not self.num_experts:
            return attention + 3 * h * self.intermediate_size
        shared = 3 * h * self.shared_intermediate_size + (h if self.shared_intermediate_size else 0)
        router = h * self.num_experts
        return attention + router + shared + experts * 3 * h * self.expert_intermediate_size

    @property
    def layer_params(self) -> int:
        return self._layer_params(self.num_experts)

    @property
    def params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + embed * (1 if self.tie_word_embeddings else 2)

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies by (not the embedding lookup): of a mixture of
        experts, its active ones (its experts_per_token experts)."""
        active = self._layer_params(self.experts_per_token)
        return self.num_layers * active + self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_tflops: float  # dense, as published
    mem_bandwidth_gbs: float  # GB/s
    mem_gib: float
    interconnect_gbs: float = 0.0  # per-direction bandwidth between TP peers (GB/s)
    price_per_hour: float = 0.0  # one device, on demand (an assumption; groups may override)
    compute_efficiency: float = 0.5  # of peak FLOP/s a serving step reaches
    bandwidth_efficiency: float = 0.7  # of peak bandwidth


# Published peak figures (dense bf16, HBM bandwidth, memory); prices (typical on-demand
# cloud $/device-hour in 2026) and efficiencies are assumptions.
HARDWARE = {
    "H100": Hardware("H100", 989.0, 3350.0, 80.0, 450.0, 3.00),
    "H200": Hardware("H200", 989.0, 4800.0, 141.0, 450.0, 3.80),
    "A100": Hardware("A100", 312.0, 2039.0, 80.0, 300.0, 1.80),
    "L40S": Hardware("L40S", 362.0, 864.0, 48.0, 32.0, 1.00),
    "MI300X": Hardware("MI300X", 1307.0, 5300.0, 192.0, 448.0, 2.60),
}

_LLAMA3_8B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)  # fmt: skip
MODELS = {
    "llama-3-8b": _LLAMA3_8B,
    "llama-3-70b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=28672, vocab_size=128256),
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                         tie_word_embeddings=True),  # tandem's bundled model
    "qwen2.5-32b": dict(num_hidden_layers=64, hidden_size=5120, num_attention_heads=40,
                        num_key_value_heads=8, intermediate_size=27648, vocab_size=152064),
    "mixtral-8x7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                         num_local_experts=8, num_experts_per_tok=2),
    "qwen3-30b-a3b": dict(num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          moe_intermediate_size=768, vocab_size=151936, num_experts=128,
                          num_experts_per_tok=8),
}  # fmt: skip

STEP_OVERHEAD_S = 0.002  # scheduling, launches and sampling of one step (an assumption)
ALLREDUCE_LATENCY_S = 10e-6  # per all-reduce with TP > 1 (two a layer)
STAGE_HANDOFF_S = 20e-6  # per pipeline stage boundary a step crosses (pp > 1)
ALLTOALL_LATENCY_S = 20e-6  # per all-to-all (expert parallelism: two a MoE layer)


def roofline_cost_model(hw: Hardware, model: ModelSpec, tp: int = 1, dtype_bytes: int = 2,
                        pp: int = 1, ep: bool = False) -> CostModel:  # fmt: skip
    """step seconds = weights read once + compute per token + KV read + attention FLOPs,
    each divided by what `tp` devices provide, plus two all-reduces a layer with tp > 1.

    A mixture of experts computes its active parameters per token and reads all of them each
    step. Split by expert (ep, over the tp devices, tandem's --enable-expert-parallel), each
    token's row also travels to its k experts and back, (tp - 1) / tp of them to another
    device: two all-to-alls a MoE layer, with routing assumed balanced over the devices.

    With pp > 1 stages, a step passes through them in turn, as tandem's engine runs one
    batch at a time: each stage reads its own weights at its own devices' speed, so the
    sums are those of one stage holding everything, plus each hand-off (the hidden state and
    the residual stream of every token, and a latency). Pipeline parallelism buys memory, not
    step time: the other stages idle while one computes (a bubble of (pp - 1) / pp)."""
    flops = hw.bf16_tflops * 1e12 * hw.compute_efficiency * tp
    bandwidth = hw.mem_bandwidth_gbs * 1e9 * hw.bandwidth_efficiency * tp
    per_token = 2 * model.matmul_params / flops  # seconds of matmul per token
    link = hw.interconnect_gbs * 1e9
    if tp > 1:  # each token's hidden state crosses the interconnect twice a layer
        per_token += 2 * model.num_layers * model.hidden_size * dtype_bytes * (tp - 1) / tp / link
    const = STEP_OVERHEAD_S + model.params * dtype_bytes / bandwidth
    if tp > 1:
        const += 2 * model.num_layers * ALLREDUCE_LATENCY_S
    if ep and model.num_experts and tp > 1:  # dispatch and combine
        rows = 2 * model.experts_per_token * model.hidden_size * dtype_bytes * (tp - 1) / tp
        per_token += model.num_layers * rows / link
        const += 2 * model.num_layers * ALLTOALL_LATENCY_S
    if pp > 1:  # hidden state and residual, stage to stage
        per_token += (pp - 1) * 2 * model.hidden_size * dtype_bytes / link
        const += (pp - 1) * STAGE_HANDOFF_S
    kv = model.kv_bytes_per_token(dtype_bytes) / bandwidth
    chunk = 4 * model.num_layers * model.num_heads * model.head_dim / flops  # QK and PV
    info = {
        "source": "roofline (derived, not measured)",
        "hardware": hw.name,
        "model": model.name,
        "tp": tp,
        "pp": pp,
        **({"ep": True} if ep and model.num_experts and tp > 1 else {}),
        "compute_efficiency": hw.compute_efficiency,
        "bandwidth_efficiency": hw.bandwidth_efficiency,
    }
    return CostModel((const, per_token, per_token, kv, chunk), info)


def kv_capacity_tokens(hw: Hardware, model: ModelSpec, tp: int, utilization: float = 0.9,
                       dtype_bytes: int = 2, pp: int = 1) -> int:  # fmt: skip
    """Tokens of KV that fit beside the weights on `tp` x `pp` devices (vLLM's memory rule)."""
    devices = tp * pp
    free = hw.mem_gib * GiB * devices * utilization - model.params * dtype_bytes
    if free <= 0:
        raise ValueError(
            f"{model.name} ({model.params * dtype_bytes / GiB:.0f} GiB of weights) does not fit "
            f"on {devices} x {hw.name} ({hw.mem_gib:g} GiB each)"
        )
    return int(free // model.kv_bytes_per_token(dtype_bytes))
