"""Responses that outlive a client: Server-Sent Events, and non-streaming work, both
cancelled the moment the client disconnects (cancelling aborts their engine requests)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tandem.server.errors import error_body

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode
T = TypeVar("T")


def sse(payload) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def sse_error(message: str) -> bytes:
    """An error after the stream has started (status 200 is already sent), as vLLM does."""
    return b"data: " + error_body(message, "server_error") + b"\n\n"


def json_response(payload, status_code: int = 200) -> Response:
    return Response(_encode(payload), status_code=status_code, media_type="application/json")


async def render_json(render, work: Awaitable) -> bytes:
    """JSON bytes of render(the result of work)."""
    return _encode(render(await work))


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave async generators, yielding (which, item). Closing the merge closes them
    all, so their requests are aborted."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, end))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client goes away first, cancel it (closing its generators aborts
    their requests in the engine) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return None if task.cancelled() else task.result()


class EventStreamResponse(Response):
    """text/event-stream from an async generator of byte chunks. A client that disconnects
    cancels the generator at once, even while it waits for the engine, and closes `streams`
    (which aborts their requests) even if the generator never started."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncGenerator[bytes, None], streams: list, headers: dict | None = None
    ) -> None:
        self.events, self.streams = events, streams
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await cancel_on_disconnect(receive, self._stream(send))
        finally:
            await self.events.aclose()
            for stream in self.streams:
                stream.close()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class HeadersFirstResponse(Response):
    """JSON whose status and headers go out at once and whose body follows when `work` is
    done: a decode instance's answer in a handoff, whose header (the reservation) the proxy
    needs before the prefill starts. An error after that is the body, as OpenAI's error
    JSON; `tandem proxy` reads its type and code back into a status."""

    media_type = "application/json"

    def __init__(self, work: Awaitable[bytes], streams: list, headers: dict, on_error) -> None:
        self.work, self.streams, self.on_error = work, streams, on_error
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            body = await cancel_on_disconnect(receive, self.work)
        except Exception as e:
            body = self.on_error(e)
        finally:
            for stream in self.streams:
                stream.close()
        await send({"type": "http.response.body", "body": body or b"", "more_body": False})
