"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated with errors naming the
field. Torch-free, so the engine config can hold it."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 2  # ngram: the shortest
    model: str | None = None  # draft_model: a checkpoint tandem loads, with the same tokenizer
    # draft_model: KV blocks of its own pool (default: as many as the target's pool)
    num_draft_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(
                    f"speculative_config.{name} must be {allowed}, got {getattr(self, name)!r}"
                )

        check(self.method in METHODS, "method", f"one of {METHODS}")
        check(_int_in(self.num_speculative_tokens, 1, 16), "num_speculative_tokens", "in [1, 16]")
        check(_int_in(self.prompt_lookup_min, 1, 64), "prompt_lookup_min", "in [1, 64]")
        check(
            _int_in(self.prompt_lookup_max, self.prompt_lookup_min, 64),
            "prompt_lookup_max",
            f"in [prompt_lookup_min ({self.prompt_lookup_min}), 64]",
        )
        if self.method == "draft_model":
            check(isinstance(self.model, str) and bool(self.model), "model", "a model path")
        check(
            self.num_draft_kv_blocks is None or _int_in(self.num_draft_kv_blocks, 2, 2**31),
            "num_draft_kv_blocks",
            "an integer >= 2",
        )

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a JSON string or a dict (or None, or one already parsed). As vLLM, a `model`
        without a `method` is a draft model, and model "[ngram]" means n-gram lookup."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r:.80}")
        value = dict(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        if value.get("model") == "[ngram]":
            value["method"], value["model"] = "ngram", None
        if "method" not in value:
            value["method"] = "draft_model" if value.get("model") else None
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**value)

    def describe(self) -> str:
        if self.method == "ngram":
            return (
                f"ngram (k={self.num_speculative_tokens}, "
                f"n={self.prompt_lookup_min}..{self.prompt_lookup_max})"
            )
        return f"draft model {self.model} (k={self.num_speculative_tokens})"


def _int_in(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
