"""Request bodies, with vLLM's field names and defaults, parsed strictly.

A wrong type is a 400 naming the field; ranges are checked by SamplingParams, whose errors
name the field too. Unknown fields are ignored, as OpenAI clients send a few we do not use.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.core.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.server.errors import bad_request


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class _SamplingRequest(_Model):
    """Fields both completion endpoints share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n,
                temperature=_or(self.temperature, 1.0),
                top_p=_or(self.top_p, 1.0),
                top_k=_or(self.top_k, 0),
                min_p=_or(self.min_p, 0.0),
                presence_penalty=_or(self.presence_penalty, 0.0),
                frequency_penalty=_or(self.frequency_penalty, 0.0),
                repetition_penalty=_or(self.repetition_penalty, 1.0),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as e:
            raise bad_request(str(e)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]], checked by prompts()
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise bad_request("suffix: not supported", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.echo and self.logprobs is not None:
            raise bad_request("echo: not supported together with logprobs (no prompt logprobs)")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if all(_is_token(t) for t in p):
                return [p]
            if all(isinstance(s, str) for s in p):
                return list(p)
            if all(isinstance(s, list) and s and all(_is_token(t) for t in s) for s in p):
                return list(p)
        raise bad_request(
            "prompt: must be a non-empty string, list of strings, list of token ids "
            "or list of lists of token ids",
            "prompt",
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        message = dict(self.model_extra or {})
        message["role"] = self.role
        message["content"] = _text_of(self.content)
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(
                    f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                    f"got {self.top_logprobs}"
                )
            if not self.logprobs:
                raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")

    @property
    def max_output_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


def parse(model: type[_Model], body: bytes) -> Any:
    """Bytes -> validated request, or a 400 naming the first bad field."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"body: malformed JSON: {e}", "body") from None
    if not isinstance(data, dict):
        raise bad_request("body: must be a JSON object", "body")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    if hasattr(request, "check"):
        request.check()
    return request


def _validation_error(e: ValidationError):
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if isinstance(p, int) or not _is_type_name(p)]
    field = ".".join(loc) or "body"
    if err["type"] == "missing":
        return bad_request(f"{field}: field required", loc[0] if loc else None)
    got = err.get("input")
    return bad_request(f"{field}: {err['msg']} (got {got!r:.80})", loc[0] if loc else None)


def _is_type_name(part: str) -> bool:
    # pydantic puts the union member tried into the location: ("stop", "list[str]", 0)
    return "[" in part or part in ("str", "int", "float", "bool", "none", "dict", "list")


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _or(value, default):
    return default if value is None else value


def _text_of(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request("messages: only text content parts are supported", "messages")
        parts.append(part["text"])
    return "\n".join(parts)
