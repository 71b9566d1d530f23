"""Request bodies, with vLLM's field names and defaults, parsed strictly.

A wrong type is a 400 naming the field; ranges are checked by SamplingParams, whose errors
name the field too. Every integer is bounded to 64 bits and every string must be valid
Unicode (no lone surrogates) before anything else looks at the body. Unknown fields are
ignored, as OpenAI clients send a few we do not use.

Structured output comes by OpenAI's `response_format`, vLLM's `structured_outputs` or its
older `guided_*` fields (one of them a request); tools by `tools` and `tool_choice`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    WithJsonSchema,
)

from tandem.core.sampling_params import INT64_MAX, SamplingParams
from tandem.server.errors import bad_request
from tandem.structured.params import StructuredOutputsParams, check_schema


def _integral(value):
    """JSON Schema counts 3.0 as an integer, and so do vLLM's (lax) models: accept it."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int64 = Annotated[int, BeforeValidator(_integral), Field(ge=-(2**63), le=INT64_MAX)]
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# Checked by CompletionRequest.prompts() for clearer errors; described exactly for clients.
PromptField = Annotated[
    Any,
    WithJsonSchema(
        {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1},
            _TOKENS,
            {"type": "array", "items": _TOKENS, "minItems": 1},
        ]}
    ),
]  # fmt: skip


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class KVTransferRequest(_Model):
    """One sequence's part of a handoff: the decode side's id for it, the first prompt
    position it lacks, and the prompt it reserved for (its length and digest), so a prefill
    instance that tokenizes the body differently refuses instead of sending wrong KV."""

    id: str
    start: Int64
    num_tokens: Int64
    digest: str


class KVTransferField(_Model):
    """`kv_transfer_params`, as vLLM names it, set by `tandem proxy`. To a decode instance:
    {"do_remote_prefill": true}; it reserves and answers in the x-tandem-kv-transfer
    header. To a prefill instance: {"do_remote_decode": true, **that header}."""

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    address: str | None = None
    requests: list[KVTransferRequest] | None = None


class JSONSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(_Model):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _SamplingRequest(_Model):
    """Fields both completion endpoints share."""

    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: Int64 | None = None  # default: the SLO class's (0 without classes)
    slo_class: str | None = None  # a class of --slo-classes (default: the default class)
    ttft_ms: float | None = None  # this request's own targets, over its class's
    tpot_ms: float | None = None
    user: str | None = None
    # vLLM's: cached KV is shared only among requests of the same salt (a tenant's own)
    cache_salt: str | None = None
    # a turn of an agent session (server/sessions.py): the id, or SGLang's {"id": ...}
    session_id: str | None = None
    session_params: dict[str, Any] | None = None
    kv_transfer_params: KVTransferField | None = None  # prefill/decode disaggregation
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _structured: StructuredOutputsParams | None = PrivateAttr(None)

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        self._structured = self._structured_params()

    @property
    def structured(self) -> StructuredOutputsParams | None:
        return self._structured

    def _structured_params(self) -> StructuredOutputsParams | None:
        """The grammar the output must match, from whichever field the client used."""
        rf = self.response_format
        given = [n for n in ("structured_outputs", *_GUIDED) if getattr(self, n) is not None]
        if rf is not None and rf.type != "text":
            given.insert(0, "response_format")
        if not given:
            return None
        if len(given) > 1:
            raise bad_request(f"{given[1]}: give one way of structuring output, got {given}",
                              given[1])  # fmt: skip
        field = given[0]
        try:
            if field == "response_format":
                if rf.type == "json_object":
                    return StructuredOutputsParams(json_object=True, source=field)
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise ValueError("response_format.json_schema.schema: field required")
                return StructuredOutputsParams(json=rf.json_schema.schema_, source=field)
            if field == "structured_outputs":
                so = self.structured_outputs.model_dump(exclude_none=True)
                so = {k.rstrip("_"): v for k, v in so.items()}
                return StructuredOutputsParams(**so, source=field)
            kind = field.removeprefix("guided_")
            return StructuredOutputsParams(**{kind: getattr(self, field)}, source=field)
        except ValueError as e:
            raise bad_request(str(e), field) from None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        """defaults: the server's sampling defaults (--generation-config) for unset fields."""
        d = defaults or {}
        try:
            return SamplingParams(
                n=self.n,
                temperature=_or(self.temperature, d.get("temperature", 1.0)),
                top_p=_or(self.top_p, d.get("top_p", 1.0)),
                top_k=_or(self.top_k, d.get("top_k", 0)),
                min_p=_or(self.min_p, d.get("min_p", 0.0)),
                presence_penalty=_or(self.presence_penalty, 0.0),
                frequency_penalty=_or(self.frequency_penalty, 0.0),
                repetition_penalty=_or(self.repetition_penalty, d.get("repetition_penalty", 1.0)),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ttft_ms=self.ttft_ms,
                tpot_ms=self.tpot_ms,
                structured_outputs=self.structured,
            )
        except ValueError as e:
            raise bad_request(str(e)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: PromptField  # required
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    # vLLM's: each choice carries its prompt's and its own token ids (RL trainers score
    # exactly the tokens sampled, never a re-tokenized text)
    return_token_ids: bool = False

    def check(self) -> None:
        super().check()
        if self.return_token_ids and self.stream:
            raise bad_request("return_token_ids: not supported with stream", "return_token_ids")
        if self.suffix:
            raise bad_request("suffix: not supported", "suffix")
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
    content: Annotated[
        str | list[dict[str, Any]] | None,
        WithJsonSchema(  # text parts are all _text_of() accepts
            {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                            "required": ["type", "text"],
                        },
                    },
                    {"type": "null"},
                ]
            }
        ),
    ] = None

    def as_template_input(self) -> dict[str, Any]:
        message = dict(self.model_extra or {})
        message["role"] = self.role
        message["content"] = _text_of(self.content)
        return message


class FunctionField(_Model):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolField(_Model):
    type: Literal["function"]
    function: FunctionField


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolField] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        super().check()
        self._check_tools()
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise bad_request(f"top_logprobs must be an integer >= 0, got {self.top_logprobs}")
            if not self.logprobs:
                raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")

    def _check_tools(self) -> None:
        for i, tool in enumerate(self.tools or []):
            if tool.function.parameters is not None:
                try:
                    check_schema(tool.function.parameters, f"tools[{i}].function.parameters")
                except ValueError as e:
                    raise bad_request(str(e), "tools") from None
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if not self.tools:
            raise bad_request(f"tool_choice: {self.tool_choice_name} needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in [t.function.name for t in self.tools]:
                raise bad_request(
                    f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice"
                )
        if choice != "auto" and self.structured is not None:
            raise bad_request(
                f"tool_choice: {self.tool_choice_name} constrains the output already; "
                f"drop {self.structured.source}",
                "tool_choice",
            )
        if self.stream and self.n > 1:
            raise bad_request("n: streamed tool calls are one choice a request (n = 1)", "n")

    @property
    def effective_tool_choice(self):
        """ "none" | "auto" | "required" | {"type": "function", ...}: OpenAI's default is
        auto when there are tools."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice

    @property
    def tool_choice_name(self) -> str:
        choice = self.tool_choice
        return repr(choice.function.name) if isinstance(choice, NamedToolChoice) else repr(choice)

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
    tokens: list[Int64]


class LoadLoRAAdapterRequest(_Model):  # vLLM's POST /v1/load_lora_adapter
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Model):  # vLLM's POST /v1/unload_lora_adapter
    lora_name: str = Field(min_length=1)
    lora_int_id: Int64 | None = None


class RoleRequest(_Model):  # POST /role: a prefill or decode instance switches
    role: Literal["prefill", "decode"]


MAX_JSON_DEPTH = 64


def parse(model: type[_Model], body: bytes) -> Any:
    """Bytes -> validated request, or a 400 naming the first bad field."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"body: malformed JSON: {e}", "body") from None
    except RecursionError:
        raise bad_request("body: JSON nested too deeply", "body") from None
    if not isinstance(data, dict):
        raise bad_request("body: must be a JSON object", "body")
    _check_values(data)
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    if hasattr(request, "check"):
        request.check()
    return request


def _check_values(data: dict) -> None:
    """Refuse what no field may hold: nesting past MAX_JSON_DEPTH, and strings that are not
    valid Unicode (JSON allows a lone surrogate such as "\\ud800"; UTF-8 cannot carry it)."""
    stack = [(v, 1, k) for k, v in data.items()] + [(k, 1, None) for k in data]
    while stack:
        value, depth, field = stack.pop()  # field: the top-level field it is part of
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"{field}: nested deeper than {MAX_JSON_DEPTH} levels", field)
        if isinstance(value, str):
            if not _is_unicode(value):
                where = field if field is not None and _is_unicode(field) else "body"
                raise bad_request(f"{where}: not valid Unicode text (a lone surrogate)", where)
        elif isinstance(value, dict):
            stack.extend((x, depth + 1, field) for item in value.items() for x in item)
        elif isinstance(value, list):
            stack.extend((x, depth + 1, field) for x in value)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
