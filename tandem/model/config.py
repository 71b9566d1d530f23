"""ModelConfig: the architecture facts the model and runner need, from config.json or GGUF."""

from __future__ import annotations

from dataclasses import dataclass, field

# architecture name -> whether q/k/v projections carry a bias
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"architectures {archs} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers 5 folds rope settings into rope_parameters; older files keep them apart.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: default, llama3"
            )
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=SUPPORTED_ARCHITECTURES[arch] or bool(cfg.get("attention_bias", False)),
            rope_scaling=rope if rope_type == "llama3" else None,
            sliding_window=window,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )
