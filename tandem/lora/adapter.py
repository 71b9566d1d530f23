"""Read a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) and check it
against the base model, into per-layer (A, B) pairs for tandem's fused projections:

    q_proj, k_proj, v_proj -> qkv_proj        gate_proj, up_proj -> gate_up_proj
    o_proj -> o_proj                          down_proj -> down_proj

B is scaled once here (lora_alpha / r, or / sqrt(r) with rsLoRA). Anything tandem cannot
apply exactly (DoRA, biases, modules_to_save, per-module ranks, the embeddings or lm_head)
is refused with a ValueError naming it; nothing is half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tandem.core.model_config import ModelConfig

# checkpoint module -> (tandem's fused module, shard index)
SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.[\w-]+)?\.weight$"
)


@dataclass
class AdapterWeights:
    rank: int
    # (layer, fused module, shard) -> (A [r, in], B [out, r] scaled), float32 on the CPU
    pairs: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())

    def digest(self) -> bytes:
        """A name for these weights (the KV tiers key an adapter's KV by it)."""
        h = hashlib.blake2b(repr(self.rank).encode(), digest_size=16)
        for key in sorted(self.pairs):
            h.update(repr(key).encode())
            for t in self.pairs[key]:
                h.update(t.contiguous().view(torch.uint8).numpy())
        return h.digest()


def shard_shapes(cfg: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """Fused module -> (in, out) of each of its shards."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    return {
        "qkv_proj": [(h, q), (h, kv), (h, kv)],
        "o_proj": [(q, h)],
        "gate_up_proj": [(h, i), (h, i)],
        "down_proj": [(i, h)],
    }


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> AdapterWeights:
    folder = Path(path)
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"lora_path: {str(folder)!r} has no adapter_config.json")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"lora_path: adapter_config.json is not valid JSON ({e})") from None
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter: peft_type {config.get('peft_type')!r} is not LORA")
    if not (isinstance(rank, int) and rank >= 1):
        raise ValueError(f"adapter: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"adapter: rank {rank} exceeds --max-lora-rank {max_rank}")
    for field, ok in (
        ("use_dora", not config.get("use_dora")),
        ("bias", config.get("bias", "none") == "none"),
        ("modules_to_save", not config.get("modules_to_save")),
        ("rank_pattern", not config.get("rank_pattern")),
        ("alpha_pattern", not config.get("alpha_pattern")),
        ("fan_in_fan_out", not config.get("fan_in_fan_out")),
    ):
        if not ok:
            raise ValueError(f"adapter: {field}={config.get(field)!r} is not supported")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise ValueError(f"lora_path: {str(folder)!r} has no adapter_model.safetensors")
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"adapter: cannot read adapter_model.safetensors ({e})") from None

    shapes = shard_shapes(cfg)
    halves: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in SHARDS:
            raise ValueError(f"adapter: weight {key!r} targets no projection tandem adapts")
        layer, (fused, shard) = int(m.group(1)), SHARDS[m.group(2)]
        if layer >= cfg.num_layers:
            raise ValueError(f"adapter: {key!r} is for layer {layer}; the base model has "
                             f"{cfg.num_layers}")  # fmt: skip
        if fused in ("gate_up_proj", "down_proj") and cfg.is_moe_layer(layer):
            raise ValueError(f"adapter: {key!r} targets layer {layer}'s MLP, a mixture of "
                             "experts: LoRA adapts attention projections there")  # fmt: skip
        halves.setdefault((layer, fused, shard), {})[m.group(3)] = t
    if not halves:
        raise ValueError("adapter: adapter_model.safetensors holds no LoRA weights")
    pairs = {}
    for (layer, fused, shard), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter: layer {layer} {fused} shard {shard} lacks lora_A or lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        fan_in, fan_out = shapes[fused][shard]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise ValueError(
                f"adapter: layer {layer} {fused}[{shard}] has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, but the base model needs A ({rank}, {fan_in}) and B "
                f"({fan_out}, {rank}): it was trained for another base model"
            )
        pairs[(layer, fused, shard)] = (a.contiguous(), (b * scale).contiguous())
    return AdapterWeights(rank, pairs)
