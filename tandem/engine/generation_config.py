"""Default sampling settings from a model's generation_config.json, as vLLM's
`--generation-config`: `auto` reads the model's own, `vllm` ignores it, a folder reads that
folder's. A request's own fields always win."""

from __future__ import annotations

import json
from pathlib import Path

# generation_config.json key -> SamplingParams field
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(setting: str, model_path: str | Path) -> dict:
    if setting == "vllm":
        return {}
    folder = Path(model_path) if setting == "auto" else Path(setting)
    file = folder / "generation_config.json"
    if not file.exists():
        if setting == "auto":
            return {}
        raise ValueError(f"generation_config: {str(file)!r} does not exist")
    try:
        data = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"generation_config: {str(file)!r} is not valid JSON: {e}") from None
    return {k: data[k] for k in _SAMPLING_KEYS if data.get(k) is not None}
