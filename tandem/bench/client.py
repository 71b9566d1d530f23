"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Works with /v1/completions and /v1/chat/completions of tandem, vLLM, SGLang and
llama.cpp. Timing follows `vllm bench serve`, with one difference: only a chunk that
carries text counts as a token arrival, so a server that sends a role-only chunk before
the first token does not look faster than it is.

- TTFT: from sending the request to the first chunk with text.
- ITL: the gaps between consecutive chunks with text (one token per chunk for every server
  above; a chunk holding several tokens counts as one gap).
- latency (E2E): from sending to the last chunk with text.
- output tokens: `usage.completion_tokens` from the final chunk (asked for with
  `stream_options.include_usage`); when a server omits it, the caller counts the text
  with the tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from tandem.bench.workloads import BenchRequest


@dataclass
class RequestSpec:
    """What every request of a run shares."""

    url: str  # full endpoint URL
    model: str
    chat: bool = False
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    send_class: bool = False  # send each request's class as `slo_class` (tandem's SLO classes)


@dataclass
class RequestResult:
    cls: str = "default"
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int | None = None  # None until counted: usage, else the tokenizer
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds, to the last token
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    start_time: float = 0.0  # perf_counter() when sent
    generated_text: str = ""


def build_payload(spec: RequestSpec, req: BenchRequest) -> dict:
    payload: dict = {"model": spec.model, "max_tokens": req.output_len}
    if spec.chat:
        payload["messages"] = list(req.messages or ({"role": "user", "content": req.prompt},))
    else:
        payload["prompt"] = req.prompt
    payload |= {
        "temperature": spec.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.ignore_eos:
        # vLLM, SGLang, tandem and llama-server know ignore_eos; llama-cpp-python's server
        # only min_tokens, which holds EOS back just the same.
        payload["ignore_eos"] = True
        payload["min_tokens"] = req.output_len
    if req.priority is not None:
        payload["priority"] = req.priority
    if spec.send_class:
        payload["slo_class"] = req.cls
    return payload | (req.body or {}) | spec.extra_body


def chunk_text(data: dict, chat: bool) -> str | None:
    """The text a stream chunk carries (None for a chunk without choices)."""
    choices = data.get("choices")
    if not choices:
        return None
    if not chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send(client: httpx.AsyncClient, spec: RequestSpec, req: BenchRequest) -> RequestResult:
    out = RequestResult(cls=req.cls, prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    out.start_time = start
    text: list[str] = []
    try:
        async with client.stream(
            "POST", spec.url, json=build_payload(spec, req), headers=spec.headers
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {body[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments (pings), event names
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data and not data.get("choices"):
                    out.error = f"stream error: {json.dumps(data['error'])[:300]}"
                    return out
                piece = chunk_text(data, spec.chat)
                if piece:
                    if not text:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    text.append(piece)
                usage = data.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    out.output_len = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens"):
                        out.prompt_len = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        out.cached_tokens = int(details["cached_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text = "".join(text)
    if not text:
        out.error = "the stream carried no token"
        return out
    out.latency = last - start
    out.success = True
    return out


def make_client(timeout: float | None = None) -> httpx.AsyncClient:
    """No connection cap: the benchmark, not the pool, decides how many requests are open."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, trust_env=False)


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(base_url: str, headers: dict | None = None, wait: float = 0.0) -> str:
    """The first model a server lists under /v1/models, waiting up to `wait` seconds for a
    server that is still starting (refusing connections, or 503)."""
    url = f"{base_url}/v1/models"
    deadline = time.monotonic() + wait
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        while True:
            try:
                resp = await client.get(url, headers=headers)
                if resp.status_code != 503:
                    break
                problem = "503"
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise ValueError(f"server: {url} did not answer ({problem})")
            await asyncio.sleep(0.5)
    if resp.status_code != 200:
        raise ValueError(f"server: {url} answered HTTP {resp.status_code}: {resp.text[:200]}")
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"server: {url} lists no model; pass --model")
    return models[0]["id"]
