"""A real HTTP server on a loopback port that streams OpenAI-style SSE with scripted delays.

It runs in its own process, so the benchmark client never waits on it for the GIL. The
payloads it received are listed by GET /requests.

The script of a request is read from its prompt (or last chat message), as `key=value`
words anywhere in the text: ttft (s before the first token), itl (s between tokens),
tokens (how many), usage (0 to leave out `usage`), status (an HTTP error code), role (1:
a chat role-only chunk right away). Unscripted prompts get `default`, with
tokens=max_tokens.

Each token's text is the time the server sent it, " 1234.567890" (`time.perf_counter()`,
the system-wide monotonic clock on Linux, the same clock as the client's): a test can
compare what the tool measured with what the server did, whatever the machine's load
did to the script.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import time

import httpx

DEFAULT = {"ttft": 0.02, "itl": 0.005, "tokens": None, "usage": 1, "status": 200, "role": 0}
WORD = re.compile(r"\b(ttft|itl|tokens|usage|status|role)=([0-9.]+)")


def script_of(text: str, max_tokens: int, default: dict) -> dict:
    script = dict(default)
    for key, value in WORD.findall(text):
        script[key] = float(value)
    if script["tokens"] is None:
        script["tokens"] = max_tokens
    return script


class ScriptedServer:
    def __init__(self, default: dict | None = None):
        self.default = {**DEFAULT, **(default or {})}
        self.port = 0

    def __enter__(self) -> ScriptedServer:
        ctx = multiprocessing.get_context("spawn")  # a clean child, whatever the test imported
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(self.default, child), daemon=True)
        self.proc.start()
        if not parent.poll(30):
            raise RuntimeError("scripted server did not start")
        self.port = parent.recv()
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> list[dict]:
        """The payloads received so far, in order."""
        return httpx.get(self.url + "/requests", trust_env=False).json()


def _serve(default: dict, conn) -> None:
    asyncio.run(_Handler(default).serve(conn))


class _Handler:
    def __init__(self, default: dict):
        self.default = default
        self.requests: list[dict] = []

    async def serve(self, conn) -> None:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """HTTP/1.1 with keep-alive, as real servers: requests in turn on one connection."""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
                raw = await reader.readexactly(int(length.group(1))) if length else b""
                body = json.loads(raw) if raw else {}
                if method == "GET" and path == "/requests":
                    await self._json(writer, self.requests)
                elif method == "GET" and path == "/v1/models":
                    await self._json(writer, {"object": "list", "data": [{"id": "scripted"}]})
                elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    self.requests.append(body)
                    await self._stream(writer, body, chat=path.endswith("chat/completions"))
                else:
                    await self._json(writer, {"error": "not found"}, status=404)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _json(self, writer, doc, status: int = 200) -> None:
        data = json.dumps(doc).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    async def _stream(self, writer, body: dict, chat: bool) -> None:
        start = time.perf_counter()
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        s = script_of(text, body.get("max_tokens", 16), self.default)
        if s["status"] != 200:
            await self._json(writer, {"error": "scripted"}, status=int(s["status"]))
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )

        async def chunk(data: bytes) -> None:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

        async def event(doc) -> None:
            await chunk(f"data: {json.dumps(doc)}\n\n".encode())

        if chat and s["role"]:
            await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        n = int(s["tokens"])
        for i in range(n):
            # each token is due at an absolute time, so scheduling jitter does not add up
            due = start + s["ttft"] + i * s["itl"]
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            stamp = f" {time.perf_counter():.6f}"
            piece = {"delta": {"content": stamp}} if chat else {"text": stamp}
            await event({"choices": [{"index": 0, **piece, "finish_reason": None}]})
        if s["usage"]:
            usage = {"prompt_tokens": 7, "completion_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": 3}}  # fmt: skip
            await event({"choices": [], "usage": usage})
        await chunk(b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
