"""Tokenizer loading and chat templates, through transformers."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(folder: Path | str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {str(folder)!r}: {e}") from e


# Arguments of transformers' apply_chat_template, not variables of the template: passed as
# chat_template_kwargs they would change what it returns (tensors, dicts, truncation).
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    **template_vars,
) -> list[int]:
    """Token ids of the conversation under the tokenizer's chat template; template_vars are
    extra variables of the template (vLLM's chat_template_kwargs); tools: OpenAI's tool
    definitions, for a template that renders them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the model's tokenizer has no chat template")
    reserved = sorted(set(template_vars) & RESERVED_TEMPLATE_ARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs: {reserved} are not template variables")
    if tools:
        template_vars["tools"] = tools
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **template_vars
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    ids = list(ids)
    if not all(isinstance(t, int) for t in ids):
        raise ValueError("messages: the chat template did not produce token ids")
    return ids


def load_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the Jinja text itself (as vLLM tells them
    apart: text with braces or a newline is a template, anything else a path)."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
