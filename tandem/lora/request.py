"""LoRARequest: which adapter a request runs with, as vLLM's `vllm.lora.request.LoRARequest`.
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # >= 1; the engine's key for the adapter (0 is the base model)
    lora_path: str

    def __post_init__(self) -> None:
        if not (isinstance(self.lora_name, str) and self.lora_name):
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not (isinstance(self.lora_int_id, int) and self.lora_int_id >= 1):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not (isinstance(self.lora_path, str) and self.lora_path):
            raise ValueError(f"lora_path must be a path, got {self.lora_path!r}")
