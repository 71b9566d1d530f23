"""What the endpoints share: the model name check, prompts (tokenized, validated, fitted to
the context), admission control, and starting generations on the engine."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

from tandem.core.sampling_params import SamplingParams
from tandem.core.slo import SLOClass, default_class
from tandem.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    RequestAbortedError,
    RequestError,
    RequestStream,
)
from tandem.engine.outputs import RequestOutput
from tandem.server import kv_handoff
from tandem.server.errors import (
    APIError,
    bad_request,
    error_body,
    not_found,
    server_error,
    unavailable,
)
from tandem.server.lora import LoRARegistry
from tandem.server.protocol import KVTransferField
from tandem.server.sessions import OpenSessionRequest, Session, Sessions

log = logging.getLogger("tandem")


@dataclass
class Prompt:
    text: str | None  # None when the client sent token ids
    token_ids: list[int]


class Serving:
    def __init__(
        self,
        engine: AsyncLLM,
        served_names: list[str],
        max_waiting: int | None = None,
        sampling_defaults: dict | None = None,
        log_requests: bool = False,
        slo_classes: dict[str, SLOClass] | None = None,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        cache_salt_per_api_key: bool = False,
    ) -> None:
        self.engine = engine
        self.loras = LoRARegistry(engine, engine.config.enable_lora)
        self.tokenizer = engine.tokenizer
        self.served_names = served_names
        self.model_name = served_names[0]
        self.role = engine.config.role  # prefill | decode | both; POST /role switches it
        self.max_waiting = max_waiting
        self.sampling_defaults = sampling_defaults or {}  # for fields a request leaves unset
        self.log_requests = log_requests
        self.slo_classes = slo_classes or {}
        self.default_slo = default_class(self.slo_classes)
        self.created = int(time.time())  # the model's, in /v1/models
        # tool_choice "auto": the parser that reads calls out of the model's text
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # every API key its own cache tenant: its requests' salts are prefixed by its name
        self.cache_salt_per_api_key = cache_salt_per_api_key
        self.sessions = Sessions(engine.close_session)  # agent sessions (server/sessions.py)

    def open_session(self, req: OpenSessionRequest, scope) -> str:
        """A new session's id; a 429 naming --max-pinned-fraction while pinned prefixes
        take all the pool they may."""
        stats = self.engine.stats
        if stats is not None and stats.max_pinned_blocks <= stats.num_pinned_blocks:
            raise APIError(
                429,
                f"sessions: pinned prefixes hold {stats.num_pinned_blocks} KV blocks, all that "
                "--max-pinned-fraction allows; close a session or wait for one to expire",
                "rate_limit_error",
                "session_id",
                "pinned_kv_full",
            )
        return self.sessions.open(req, scope.get("tandem.key")).id

    def join_session(self, req, headers, key: str | None, num_prompt_tokens: int) -> Session | None:
        """The open session a request names (body `session_id`, SGLang's `session_params`,
        or the `x-session-id` header), or None."""
        params = req.session_params or {}
        unsupported = sorted(k for k in params if k != "id" and params[k] is not None)
        if unsupported:
            raise bad_request(
                f"session_params.{unsupported[0]}: not supported; send the whole conversation "
                "each turn (the prefix cache finds the part a branch shares)",
                f"session_params.{unsupported[0]}",
            )
        sid = req.session_id or params.get("id") or headers.get("x-session-id")
        if sid is None:
            return None
        if not isinstance(sid, str):
            raise bad_request("session_params.id: must be a string", "session_params.id")
        session = self.sessions.get(sid, key)
        if session.capacity_tokens is not None and num_prompt_tokens > session.capacity_tokens:
            raise bad_request(
                f"prompt: {num_prompt_tokens} tokens is past the session's capacity_tokens "
                f"({session.capacity_tokens})",
                "prompt",
            )
        return session

    def cache_salt(self, salt: str | None, scope) -> str | None:
        """The salt a request's KV is cached under: its own cache_salt (a non-empty string),
        inside its API key's namespace with --cache-salt-per-api-key."""
        if salt is not None and not salt:
            raise bad_request("cache_salt: must be a non-empty string", "cache_salt")
        if not self.cache_salt_per_api_key:
            return salt
        key = scope.get("tandem.key") or "anonymous"
        return f"key:{key}" if salt is None else f"key:{key}\x00{salt}"

    def auto_tool_parser(self):
        """The parser for tool_choice "auto" (400 when the server was not started for it)."""
        from tandem.tool_calls.parsers import PARSERS

        if not (self.enable_auto_tool_choice and self.tool_call_parser):
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set (or send tool_choice "none", "required" or a named function)',
                "tool_choice",
            )
        return PARSERS[self.tool_call_parser]()

    def slo(self, name: str | None, priority: int | None) -> tuple[SLOClass, int]:
        """The request's class (by name, else the default) and its priority (its own, else
        the class's)."""
        cls = self.default_slo
        if name is not None:
            cls = self.slo_classes.get(name)
            if cls is None:
                known = sorted(self.slo_classes) or "none: start the server with --slo-classes"
                raise bad_request(f"slo_class: unknown class {name!r}; known: {known}", "slo_class")
        return cls, cls.priority if priority is None else priority

    def check_model(self, name: str | None) -> int:
        """The LoRA adapter a request's `model` names (0: the base model); 404 for a name
        that is neither a served model name nor a loaded adapter."""
        if not name or name in self.served_names:
            return 0
        lora_id = self.loras.lora_id(name)
        if lora_id is None:
            raise not_found(f"The model `{name}` does not exist.", "model", "model_not_found")
        return lora_id

    # ---- prompts -------------------------------------------------------------------
    def prompt(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            if not ids:
                raise bad_request("prompt: must not be empty (it has no tokens)", "prompt")
            return Prompt(prompt, ids)
        vocab = self.engine.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"prompt: token id {bad} is out of range [0, {vocab})", "prompt")
        return Prompt(None, list(prompt))

    def fit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        what: str = "prompt",
        logprobs_field: str = "logprobs",
    ) -> SamplingParams:
        """Check the prompt and its output budget fit the context and the KV pool; with no
        max_tokens, allow as many as fit. Returns the params to run with."""
        try:
            limit = self.engine.config.max_logprobs
            params.check_for_model(self.engine.vocab_size, limit, logprobs_field)
        except ValueError as e:
            raise bad_request(str(e)) from None
        n, limit = len(prompt.token_ids), self.engine.max_model_len
        if n >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {n} input tokens. Please reduce the length of the input messages.",
                what,
            )
        max_tokens = params.max_tokens
        if max_tokens is not None and n + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). "
                f"Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        pool = self.engine.max_request_tokens
        if max_tokens is None or n + max_tokens > pool:
            if max_tokens is not None or n >= pool:
                raise bad_request(
                    f"max_tokens: the request needs up to {n + (max_tokens or 1)} tokens of KV "
                    f"cache but the server's pool holds {pool}; lower max_tokens",
                    "max_tokens",
                )
            if params.min_tokens > pool - n:
                raise bad_request(
                    f"min_tokens: {params.min_tokens} output tokens do not fit after the "
                    f"{n}-token prompt (the server holds at most {pool} tokens a request)",
                    "min_tokens",
                )
            params = copy.copy(params)
            params.max_tokens = pool - n
        return params

    # ---- running -------------------------------------------------------------------
    def admit(self, num_sequences: int) -> None:
        """Refuse work the server cannot queue: 503 with Retry-After past --max-waiting."""
        if self.engine.dead:
            raise unavailable(f"the engine is dead: {self.engine.dead}")
        if self.max_waiting is None:
            return
        # Sequences that find a free place in the running batch do not wait.
        waiting = self.engine.num_waiting
        would_wait = waiting + max(0, num_sequences - self.engine.num_free_slots)
        if would_wait > self.max_waiting:
            raise unavailable(
                f"The server is overloaded: {waiting} sequences wait to run, this request "
                f"would make it {would_wait}, and the limit (--max-waiting) is "
                f"{self.max_waiting}. Retry later.",
                retry_after=1,
            )

    def generate(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: list[SamplingParams],
        priority: int | None = None,
        slo_class: str | None = None,
        kv: KVTransferField | None = None,
        lora_id: int = 0,
        cache_salt: str | None = None,
        session: Session | None = None,
    ) -> list[RequestStream]:
        """Start one generation per prompt (admission checked for all of them first). `kv`:
        this request's part in a prefill/decode handoff (server/kv_handoff.py)."""
        slo, priority = self.slo(slo_class, priority)
        kv_handoff.check_role(kv, self.role, self.engine.config.enable_role_switching)
        remote_prefill = kv is not None and kv.do_remote_prefill
        sends = None
        if kv is not None and kv.do_remote_decode:
            sends = kv_handoff.destinations(kv, [p.token_ids for p in prompts], params[0].n)
        self.admit(sum(p.n for p in params))
        if self.log_requests:
            for prompt, p in zip(prompts, params):
                log.info("request %s: %d prompt tokens, %s", request_id, len(prompt.token_ids), p)
        streams = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(
                    self.engine.add_request(
                        prompt.text, prompt.token_ids, p, rid, priority, slo,
                        remote_prefill, sends[i] if sends else None, lora_id, cache_salt,
                        (session.id, session.ttl_s) if session else None,
                    )
                )  # fmt: skip
                if session is not None:
                    streams[-1].on_end = self.sessions.begin(session)
        except ValueError as e:
            for s in streams:
                s.close()
            raise bad_request(str(e)) from None
        return streams

    @staticmethod
    async def started(streams: list[RequestStream]) -> None:
        """Wait until each stream has output (or raise its error): for requests that can
        still be refused by the core (a grammar that does not compile) before a stream
        response commits to status 200."""
        try:
            for s in streams:
                await s.started()
        except BaseException:
            for s in streams:
                s.close()
            raise

    async def reservation(
        self, prompts: list[Prompt], streams: list[RequestStream], kv: KVTransferField | None
    ) -> dict[str, str] | None:
        """A decode instance's answer to a handoff (the header that says what to send), once
        its core has reserved; None for any other request."""
        if kv is None or not kv.do_remote_prefill:
            return None
        try:
            ids = [p.token_ids for p in prompts]
            return await kv_handoff.reservation(self.engine.kv_address, ids, streams)
        except BaseException:
            for s in streams:
                s.close()
            raise


def api_error(e: RequestError) -> APIError:
    """The HTTP error for a request that ended without its completion."""
    if isinstance(e, EngineDeadError):
        return unavailable(f"the engine is dead: {e}")
    if isinstance(e, RequestAbortedError):
        return unavailable(f"request aborted: {e}")
    if e.status == 400:
        return bad_request(str(e))
    if e.status == 503:  # shed: the message names the SLO
        return unavailable(str(e))
    return server_error(f"the request failed in the engine: {e}")


def error_json(e: Exception) -> bytes:
    """OpenAI's error JSON for an exception raised after a response has started."""
    if isinstance(e, RequestError):
        e = api_error(e)
    if not isinstance(e, APIError):
        e = server_error(f"internal error: {type(e).__name__}: {e}")
    return error_body(e.message, e.type, e.param, e.code)


def usage(prompts: list[Prompt], outputs: list[RequestOutput]) -> dict:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # OpenAI's field: prompt tokens whose KV came from the prefix cache or a KV tier
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
        # RL rollouts (--enable-rl-endpoints): the weights that produced the last tokens
        **({"weight_version": outputs[-1].weight_version} if outputs[-1].weight_version else {}),
    }
