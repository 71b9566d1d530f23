"""Tiny seeded LoRA adapters made with peft on the tiny checkpoints (nothing downloaded), and
HF transformers + peft models on them: the reference for every LoRA parity test."""

from __future__ import annotations

from pathlib import Path

import pytest

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(base: Path, folder: Path, seed: int, rank: int = 8, targets=ALL_PROJECTIONS,
                  alpha: int = 16, rslora: bool = False) -> Path:  # fmt: skip
    """A PEFT adapter with random A and B (init_lora_weights=False: B is not zero), scaled
    so it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0)  # fmt: skip
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def adapters(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Three adapters on the tiny llama: all projections rank 8; attention only rank 4; MLP
    only rank 16 with rsLoRA scaling."""
    root, base = tmp_path_factory.mktemp("adapters"), checkpoints["llama"]
    return {
        "all": build_adapter(base, root / "all", seed=1),
        "attn": build_adapter(base, root / "attn", seed=2, rank=4,
                              targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "mlp": build_adapter(base, root / "mlp", seed=3, rank=16,
                             targets=["gate_proj", "up_proj", "down_proj"], rslora=True),
    }  # fmt: skip


@pytest.fixture(scope="session")
def peft_models(checkpoints, adapters):
    """HF + peft on the tiny llama with each adapter, run to max_new_tokens."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(name: str):
        if name not in cache:
            base = AutoModelForCausalLM.from_pretrained(
                str(checkpoints["llama"]), dtype=torch.float32
            )
            model = PeftModel.from_pretrained(base, str(adapters[name])).eval()
            model.generation_config.eos_token_id = None
            cache[name] = model
        return cache[name]

    return get
