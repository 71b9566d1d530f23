"""POST /v1/completions: one generation per prompt, n choices each, streamed or not."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from tandem.engine.async_llm import RequestError, RequestStream
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.server.deltas import ChoiceCursor
from tandem.server.logprobs import completion_logprobs
from tandem.server.protocol import CompletionRequest, parse
from tandem.server.security import charge_tokens
from tandem.server.serving import Prompt, Serving, error_json, usage
from tandem.server.streaming import (
    DONE,
    EventStreamResponse,
    HeadersFirstResponse,
    cancel_on_disconnect,
    json_response,
    merge,
    render_json,
    sse,
    sse_error,
)


async def create_completion(serving: Serving, request: Request) -> Response:
    req = parse(CompletionRequest, await request.body())
    lora_id = serving.check_model(req.model)
    prompts = [serving.prompt(p) for p in req.prompts()]
    params = req.sampling_params(req.max_tokens, req.logprobs, serving.sampling_defaults)
    params_per_prompt = [serving.fit(p, params) for p in prompts]
    job = _Job(serving, req, prompts, params.stop)
    kv = req.kv_transfer_params
    charge_tokens(request.scope, sum(len(p.token_ids) + pp.max_tokens * pp.n
                                     for p, pp in zip(prompts, params_per_prompt)))  # fmt: skip
    salt = serving.cache_salt(req.cache_salt, request.scope)
    key = request.scope.get("tandem.key")
    session = serving.join_session(
        req, request.headers, key, max(len(p.token_ids) for p in prompts)
    )
    streams = serving.generate(
        job.id, prompts, params_per_prompt, req.priority, req.slo_class, kv, lora_id, salt,
        session,
    )  # fmt: skip
    handoff = await serving.reservation(prompts, streams, kv)  # a decode instance's answer
    if req.stream and params.structured_outputs is not None:
        await serving.started(streams)  # a grammar that fails to compile is still a 400
    if req.stream:
        return EventStreamResponse(job.events(streams), streams, handoff)
    if handoff is not None:
        work = render_json(job.response, _collect(streams))
        return HeadersFirstResponse(work, streams, handoff, error_json)
    try:
        finals = await cancel_on_disconnect(request.receive, _collect(streams))
    finally:
        for s in streams:
            s.close()
    if finals is None:
        return Response(status_code=499)  # the client went away
    return json_response(job.response(finals))


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, output in merge(streams):
        finals[i] = output
    return finals


class _Job:
    """One completion request: its id, prompts, and how its choices are rendered."""

    def __init__(
        self, serving: Serving, req: CompletionRequest, prompts: list[Prompt], stops: list[str]
    ) -> None:
        self.stops = stops
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())  # this request's, on every chunk
        self.serving, self.req, self.prompts = serving, req, prompts
        self.n = req.n
        self.echo = [self._prompt_text(p) for p in prompts] if req.echo else None

    def _prompt_text(self, p: Prompt) -> str:
        return p.text if p.text is not None else self.serving.tokenizer.decode(p.token_ids)

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        chunk = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.serving.model_name,
            "choices": choices,
        }
        if usage_ is not None:
            chunk["usage"] = usage_
        return chunk

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(finals):
            prefix = self.echo[i] if self.echo else ""
            for c in out.outputs:
                lp = self._logprobs(c, 0, len(c.token_ids), len(prefix))
                choice = self._choice(i * self.n + c.index, prefix + c.text, lp, c)
                if self.req.return_token_ids:
                    choice["prompt_token_ids"] = self.prompts[i].token_ids
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        return self._chunk(choices, usage(self.prompts, finals))

    def _choice(self, index: int, text: str, logprobs, c: CompletionOutput | None) -> dict:
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason if c else None,
            "stop_reason": c.stop_reason if c else None,
        }

    def _logprobs(self, c: CompletionOutput, start: int, end: int, offset: int) -> dict | None:
        if self.req.logprobs is None:
            return None
        return completion_logprobs(c, start, end, offset)

    async def events(self, streams: list[RequestStream]):
        cursors = [ChoiceCursor(i * self.n, self.n, self.stops) for i in range(len(streams))]
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, output in merge(streams):
                finals[i] = output
                for d in cursors[i].deltas(output):
                    text = self.echo[i] + d.text if self.echo and d.first else d.text
                    start = offsets.get(d.index, len(self.echo[i]) if self.echo else 0)
                    lp = self._logprobs(d.output, d.token_start, d.token_end, start)
                    if lp is not None:
                        offsets[d.index] = start + sum(len(t) for t in lp["tokens"])
                    done = d.output if d.finish_reason else None
                    yield sse(self._chunk([self._choice(d.index, text, lp, done)]))
            if self.req.include_usage:
                yield sse(self._chunk([], usage(self.prompts, finals)))
        except RequestError as e:
            yield sse_error(str(e))
        yield DONE
