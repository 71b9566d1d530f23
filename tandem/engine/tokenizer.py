"""Tokenizer loading and chat templates, through transformers."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(folder: Path | str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {str(folder)!r}: {e}") from e


def apply_chat_template(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, **kwargs
) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
