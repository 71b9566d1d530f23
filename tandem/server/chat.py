"""POST /v1/chat/completions: the checkpoint's chat template, then one generation."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from tandem.engine.async_llm import RequestError, RequestStream
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.engine.tokenizer import apply_chat_template
from tandem.server.deltas import ChoiceCursor
from tandem.server.errors import bad_request
from tandem.server.logprobs import chat_logprobs
from tandem.server.protocol import ChatCompletionRequest, ChatMessage, parse
from tandem.server.security import charge_tokens
from tandem.server.serving import Prompt, Serving, error_json, usage
from tandem.server.streaming import (
    DONE,
    EventStreamResponse,
    HeadersFirstResponse,
    cancel_on_disconnect,
    json_response,
    render_json,
    sse,
    sse_error,
)


def chat_prompt(
    serving: Serving,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
) -> Prompt:
    conversation = [m.as_template_input() for m in messages]
    try:
        ids = apply_chat_template(
            serving.tokenizer, conversation, add_generation_prompt, **(template_kwargs or {})
        )
    except ValueError as e:  # the message names the field: messages or chat_template_kwargs
        raise bad_request(str(e)) from None
    except Exception as e:  # a template that fails on these messages (jinja raises its own)
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
    return Prompt(None, ids)


async def create_chat_completion(serving: Serving, request: Request) -> Response:
    req = parse(ChatCompletionRequest, await request.body())
    lora_id = serving.check_model(req.model)
    prompt = chat_prompt(serving, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
    params = req.sampling_params(req.max_output_tokens, req.num_logprobs, serving.sampling_defaults)
    params = serving.fit(prompt, params, "messages", "top_logprobs")
    job = _Job(serving, req, prompt, params.stop)
    kv = req.kv_transfer_params
    charge_tokens(request.scope, len(prompt.token_ids) + params.max_tokens * params.n)
    streams = serving.generate(job.id, [prompt], [params], req.priority, req.slo_class, kv, lora_id)
    handoff = await serving.reservation([prompt], streams, kv)  # a decode instance's answer
    if req.stream:
        return EventStreamResponse(job.events(streams[0]), streams, handoff)
    if handoff is not None:
        work = render_json(job.response, _last(streams[0]))
        return HeadersFirstResponse(work, streams, handoff, error_json)
    try:
        final = await cancel_on_disconnect(request.receive, _last(streams[0]))
    finally:
        streams[0].close()
    if final is None:
        return Response(status_code=499)  # the client went away
    return json_response(job.response(final))


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    return last


class _Job:
    def __init__(
        self, serving: Serving, req: ChatCompletionRequest, prompt: Prompt, stops: list[str]
    ) -> None:
        self.stops = stops
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())  # this request's, on every chunk
        self.serving, self.req, self.prompt = serving, req, prompt

    def _body(self, obj: str, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.serving.model_name,
            "choices": choices,
        }
        if usage_ is not None:
            body["usage"] = usage_
        return body

    def _logprobs(self, c: CompletionOutput, start: int, end: int) -> dict | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(c, start, end, self.req.top_logprobs or 0)

    def response(self, final: RequestOutput) -> dict:
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c, 0, len(c.token_ids)),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ]
        return self._body("chat.completion", choices, usage([self.prompt], [final]))

    def _chunk(self, index: int, delta: dict, logprobs=None, c: CompletionOutput | None = None):
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason if c else None,
        }
        if c is not None:
            choice["stop_reason"] = c.stop_reason
        return sse(self._body("chat.completion.chunk", [choice]))

    async def events(self, stream: RequestStream):
        n = self.req.n
        for i in range(n):
            yield self._chunk(i, {"role": "assistant", "content": ""})
        cursor = ChoiceCursor(0, n, self.stops)
        final = None
        try:
            async for final in stream:
                for d in cursor.deltas(final):
                    lp = self._logprobs(d.output, d.token_start, d.token_end)
                    delta = {"content": d.text} if d.text else {}
                    yield self._chunk(d.index, delta, lp, d.output if d.finish_reason else None)
            if self.req.include_usage:
                yield sse(self._body("chat.completion.chunk", [], usage([self.prompt], [final])))
        except RequestError as e:
            yield sse_error(str(e))
        yield DONE
