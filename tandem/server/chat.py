"""POST /v1/chat/completions: the checkpoint's chat template, then one generation; with
tools, the calls read out of each choice (tandem/tool_calls), streamed as OpenAI's
deltas."""

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
from tandem.tool_calls.parsers import ToolParser
from tandem.tool_calls.prompt import conversation, template_knows_tools, tool_choice_grammar
from tandem.tool_calls.streaming import ToolCallStream, tool_call_json


def chat_prompt(
    serving: Serving,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> Prompt:
    knows_tools = template_knows_tools(getattr(serving.tokenizer, "chat_template", None))
    messages = conversation(
        [m.as_template_input() for m in messages], tools, knows_tools, serving.tool_call_parser
    )
    try:
        ids = apply_chat_template(
            serving.tokenizer,
            messages,
            add_generation_prompt,
            tools if knows_tools else None,
            **(template_kwargs or {}),
        )
    except ValueError as e:  # the message names the field: messages or chat_template_kwargs
        raise bad_request(str(e)) from None
    except Exception as e:  # a template that fails on these messages (jinja raises its own)
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
    return Prompt(None, ids)


async def create_chat_completion(serving: Serving, request: Request) -> Response:
    req = parse(ChatCompletionRequest, await request.body())
    lora_id = serving.check_model(req.model)
    tools, choice = None, req.effective_tool_choice
    grammar, parser = None, None
    if choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        parallel = req.parallel_tool_calls is not False
        grammar, parser = tool_choice_grammar(tools, choice, parallel)
        if choice == "auto":
            parser = serving.auto_tool_parser()
    prompt = chat_prompt(
        serving, req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools
    )
    params = req.sampling_params(req.max_output_tokens, req.num_logprobs, serving.sampling_defaults)
    if grammar is not None:
        params.structured_outputs = grammar
    params = serving.fit(prompt, params, "messages", "top_logprobs")
    job = _Job(serving, req, prompt, params.stop, parser)
    kv = req.kv_transfer_params
    charge_tokens(request.scope, len(prompt.token_ids) + params.max_tokens * params.n)
    salt = serving.cache_salt(req.cache_salt, request.scope)
    key = request.scope.get("tandem.key")
    session = serving.join_session(req, request.headers, key, len(prompt.token_ids))
    streams = serving.generate(
        job.id, [prompt], [params], req.priority, req.slo_class, kv, lora_id, salt, session
    )
    handoff = await serving.reservation([prompt], streams, kv)  # a decode instance's answer
    if req.stream and params.structured_outputs is not None:
        await serving.started(streams)  # a grammar that fails to compile is still a 400
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


def _tool_finish(finish_reason: str | None) -> str | None:
    """A choice that ended as the model meant to, with tool calls: "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    return last


class _Job:
    def __init__(
        self,
        serving: Serving,
        req: ChatCompletionRequest,
        prompt: Prompt,
        stops: list[str],
        parser: ToolParser | None = None,
    ) -> None:
        self.stops, self.parser = stops, parser
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
        choices = []
        for c in final.outputs:
            message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
            if self.parser is not None:
                parse = self.parser.parse(c.text, final=True)
                message["content"] = parse.content or None
                if parse.calls:
                    message["tool_calls"] = [tool_call_json(call) for call in parse.calls]
                    finish = _tool_finish(finish)
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(c, 0, len(c.token_ids)),
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            })  # fmt: skip
        return self._body("chat.completion", choices, usage([self.prompt], [final]))

    def _chunk(
        self, index: int, delta: dict, logprobs=None, c: CompletionOutput | None = None,
        finish_reason: str | None = None,
    ):  # fmt: skip
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason or (c.finish_reason if c else None),
        }
        if c is not None:
            choice["stop_reason"] = c.stop_reason
        return sse(self._body("chat.completion.chunk", [choice]))

    async def events(self, stream: RequestStream):
        n = self.req.n
        for i in range(n):
            yield self._chunk(i, {"role": "assistant", "content": ""})
        cursor = ChoiceCursor(0, n, self.stops)
        tools = [ToolCallStream(self.parser) for _ in range(n)] if self.parser else None
        texts = [""] * n
        final = None
        try:
            async for final in stream:
                for d in cursor.deltas(final):
                    lp = self._logprobs(d.output, d.token_start, d.token_end)
                    delta = {"content": d.text} if d.text else {}
                    finish = d.output.finish_reason if d.finish_reason else None
                    if tools is not None:
                        texts[d.index] += d.text
                        delta = self._tool_delta(tools[d.index], texts[d.index], finish)
                        if tools[d.index].num_calls and finish is not None:
                            finish = _tool_finish(finish)
                        if not delta and finish is None and lp is None:
                            continue  # held back: it may begin a tool call
                    yield self._chunk(d.index, delta, lp, d.output if finish else None, finish)
            if self.req.include_usage:
                yield sse(self._body("chat.completion.chunk", [], usage([self.prompt], [final])))
        except RequestError as e:
            yield sse_error(str(e))
        yield DONE

    @staticmethod
    def _tool_delta(tools: ToolCallStream, text: str, finish: str | None) -> dict:
        content, calls = tools.feed(text, final=finish is not None)
        delta = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta
