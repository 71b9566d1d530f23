"""Logprobs in the two OpenAI shapes, for the tokens [start, end) of one choice."""

from __future__ import annotations

from tandem.engine.outputs import CompletionOutput, Logprob

_FLOOR = -9999.0  # JSON has no -inf; OpenAI sends this floor instead


def _lp(x: float) -> float:
    return max(x, _FLOOR)


def completion_logprobs(c: CompletionOutput, start: int, end: int, offset: int) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; `offset` is where the
    first token's text starts in the choice's text."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for i in range(start, end):
        step = c.logprobs[i]
        chosen = step[c.token_ids[i]]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(_lp(chosen.logprob))
        # the sampled token plus the top k, as vLLM and OpenAI: up to k + 1 entries. Distinct
        # tokens can decode alike (partial UTF-8); the sampled one keeps its key.
        top = {chosen.decoded_token: _lp(chosen.logprob)}
        for e in step.values():
            top.setdefault(e.decoded_token, _lp(e.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(chosen.decoded_token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(c: CompletionOutput, start: int, end: int, num_top: int) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""
    content = []
    for i in range(start, end):
        step = c.logprobs[i]
        entry = _chat_entry(step[c.token_ids[i]])
        ranked = sorted(step.values(), key=lambda e: e.rank if e.rank is not None else 1 << 30)
        entry["top_logprobs"] = [_chat_entry(e) for e in ranked[:num_top]]
        content.append(entry)
    return {"content": content}


def _chat_entry(e: Logprob) -> dict:
    token = e.decoded_token or ""
    return {"token": token, "logprob": _lp(e.logprob), "bytes": list(token.encode("utf-8"))}
