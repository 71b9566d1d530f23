"""The router's PD mode (`tandem router --prefill URL... --decode URL...`, or `tandem proxy`):
for each completion request, the three-stage handoff of server/kv_handoff.py:

    1. reserve   POST decode  body + {"do_remote_prefill": true}  -> x-tandem-kv-transfer header
    2. prefill   POST prefill body + {"do_remote_decode": true, **header} -> KV streams to decode
    3. decode    relay the decode instance's response (its body, already open since stage 1)

Every stage is bounded. An instance that cannot be reached, refuses (503) or times out is
skipped for the next one; with no prefill instance left, the decode instance's reservation is
dropped (closing its response aborts it there) and the request runs colocated on a decode
instance; with no decode instance, colocated on a prefill one. A decode instance that dies or
stalls mid-stream ends the client's stream with an error event, never a hang. A client that
goes away cancels whatever stage runs, which closes the connections and aborts the request on
both sides.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import httpx
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tandem.router.forwarding import read_request
from tandem.router.pd_ratio import RateWindow
from tandem.router.policy import LeastLoad, PrefixAware, RouteRequest, prompt_text
from tandem.router.pool import WorkerPool
from tandem.server.errors import error_response, unavailable
from tandem.server.kv_handoff import HEADER
from tandem.server.streaming import DONE, cancel_on_disconnect, sse_error

log = logging.getLogger("tandem")
_STAGE_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    reserve_timeout: float = 10.0  # the decode side's reservation answer
    prefill_timeout: float = 60.0  # the prefill instance's whole answer (prompt + KV sent)
    stream_timeout: float = 60.0  # the longest gap between two chunks of the decode stream
    # the longest a non-streamed answer may take (its body comes whole, at the end)
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("proxy: give at least one --prefill and one --decode URL")
        for name in ("reserve_timeout", "prefill_timeout", "stream_timeout", "request_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (seconds), got {getattr(self, name)!r}")


class _Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series, as vLLM
        self.registry = CollectorRegistry()
        self.stage = Histogram(
            "tandem:pd_handoff_stage_seconds",
            "Seconds each stage of a handoff took: reserve, prefill, first_byte (decode)",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "tandem:pd_requests",
            "Completion requests, by how they were served: handoff, colocated (a fallback)",
            ["served"],
            registry=self.registry,
        )
        self.healthy = Gauge(
            "tandem:pd_instances_healthy",
            "Instances the prober last saw healthy, by role (prefill, decode)",
            ["role"],
            registry=self.registry,
        )
        self.retries = Counter(
            "tandem:pd_instance_failures",
            "Instances skipped at a stage (unreachable, refused or timed out)",
            ["stage"],
            registry=self.registry,
        )
        self.role_moves = Counter(
            "tandem:pd_role_moves",
            "Instances moved between the pools (--pd-ratio auto), by the role taken and "
            "outcome (moved, failed: the instance refused or was unreachable)",
            ["role", "outcome"],
            registry=self.registry,
        )


class _Failed(Exception):
    """This instance could not do the stage; try another."""


class Proxy:
    def __init__(
        self,
        config: ProxyConfig,
        client: httpx.AsyncClient | None = None,
        probe_interval: float = 1.0,
    ) -> None:
        self.config = config
        self.client = client or httpx.AsyncClient(
            timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
        )
        self.metrics = _Metrics()
        # The router's pools: probed health and load. Decode instances by prefix (their radix
        # cache is what saves the transfer), prefill instances by load.
        self.decode_pool = WorkerPool(list(config.decode), PrefixAware(), self.client,
                                      probe_interval)  # fmt: skip
        self.prefill_pool = WorkerPool(list(config.prefill), LeastLoad(), self.client,
                                       probe_interval)  # fmt: skip
        for role, pool in (("prefill", self.prefill_pool), ("decode", self.decode_pool)):
            self.metrics.healthy.labels(role).set_function(lambda pool=pool: len(pool.healthy()))
        self.prefill_sent = RateWindow()  # prompt tokens sent to prefill, for the ratio policy
        self.balancer = None  # disagg/roles.py RoleBalancer, with --pd-ratio auto

    def start(self) -> None:
        self.decode_pool.start()
        self.prefill_pool.start()
        if self.balancer is not None:
            self.balancer.start()

    async def stop(self) -> None:
        if self.balancer is not None:
            await self.balancer.stop()
        await self.decode_pool.stop()
        await self.prefill_pool.stop()

    # ---- a completion request ---------------------------------------------------------
    async def complete(self, path: str, request: Request) -> Response:
        raw, body, headers = await read_request(request)
        if not isinstance(body, dict):  # the instance says what is wrong with it
            return await self._colocated(path, raw, headers, self.config.decode, stream=False)
        body.pop("kv_transfer_params", None)  # ours to set
        stream = body.get("stream") is True
        result = await cancel_on_disconnect(
            request.receive, self._handoff(path, body, headers, stream)
        )
        return Response(status_code=499) if result is None else result

    async def _handoff(self, path: str, body: dict, headers: dict, stream: bool) -> Response:
        raw = json.dumps(body).encode()
        route = RouteRequest(prompt_text(body))
        decode = await self._reserve(path, body, headers, route, stream)
        if decode is None:  # no decode instance could reserve: run it where it can run
            self.metrics.requests.labels("colocated").inc()
            return await self._colocated(
                path, raw, headers, self.config.decode + self.config.prefill, stream
            )
        response, reservation = decode
        try:
            done = await self._prefill_stage(path, body, headers, reservation, route)
        except BaseException:
            await response.aclose()
            raise
        if isinstance(done, Response):  # the client's request is bad: say so
            await response.aclose()
            return done
        if not done:  # no prefill instance did it: drop the reservation, decode does it all
            await response.aclose()
            self.metrics.requests.labels("colocated").inc()
            return await self._colocated(path, raw, headers, self.config.decode, stream)
        self.metrics.requests.labels("handoff").inc()
        return await self._relay(response, stream, time.monotonic())

    async def _reserve(
        self, path: str, body: dict, headers: dict, route: RouteRequest, stream: bool
    ):
        """Stage 1: (open decode response, reservation) from the first decode instance that
        reserves; None if none does. A 4xx other than overload is the client's error: the
        colocated run that follows reports it."""
        payload = json.dumps({**body, "kv_transfer_params": {"do_remote_prefill": True}})
        for worker in self.decode_pool.order(route):
            url = worker.url
            t0 = time.monotonic()
            try:
                response = await self._open(
                    url + path, payload, headers, self.config.reserve_timeout, stream
                )
            except _Failed as e:
                log.warning("proxy: decode %s: %s", url, e)
                self.decode_pool.failed(worker.id, str(e))
                self.metrics.retries.labels("reserve").inc()
                continue
            if response.status_code != 200 or HEADER not in response.headers:
                status = response.status_code
                await response.aclose()
                if status < 500 and status != 429:
                    return None
                self.metrics.retries.labels("reserve").inc()
                continue
            self.decode_pool.policy.routed(worker, route)
            self.metrics.stage.labels("reserve").observe(time.monotonic() - t0)
            return response, json.loads(response.headers[HEADER])
        return None

    async def _prefill_stage(
        self, path: str, body: dict, headers: dict, reservation: dict, route: RouteRequest
    ):
        """Stage 2: True once a prefill instance computed the prompt and sent its KV; False
        if none could; a Response for an error that is the client's."""
        kv = {"do_remote_decode": True, **reservation}
        body = {**body, "stream": False, "kv_transfer_params": kv}
        body.pop("stream_options", None)
        payload = json.dumps(body)
        for worker in self.prefill_pool.order(route):
            url = worker.url
            t0 = time.monotonic()
            worker.pending_prefill_tokens += route.tokens
            self.prefill_sent.add(t0, route.tokens)
            try:
                response = await asyncio.wait_for(
                    self.client.post(url + path, content=payload, headers=headers),
                    self.config.prefill_timeout,
                )
            except (httpx.HTTPError, asyncio.TimeoutError) as e:
                log.warning("proxy: prefill %s: %s", url, type(e).__name__)
                self.prefill_pool.failed(worker.id, type(e).__name__)
                self.metrics.retries.labels("prefill").inc()
                continue
            finally:
                worker.pending_prefill_tokens -= route.tokens
            if response.status_code == 200:
                self.metrics.stage.labels("prefill").observe(time.monotonic() - t0)
                return True
            if 400 <= response.status_code < 500 and response.status_code != 429:
                return _passthrough(response)
            self.metrics.retries.labels("prefill").inc()
        return False

    async def _colocated(
        self, path: str, raw: bytes, headers: dict, urls: tuple[str, ...], stream: bool
    ) -> Response:
        """The whole request on one instance, the first that answers."""
        for url in urls:
            try:
                # a non-streamed colocated answer sends its headers only once it is done
                wait = self.config.reserve_timeout if stream else self.config.request_timeout
                response = await self._open(url + path, raw, headers, wait, stream)
            except _Failed as e:
                log.warning("proxy: %s: %s", url, e)
                continue
            if response.status_code >= 500 and response.status_code != 501:
                await response.aclose()
                continue
            return await self._relay(response, stream, time.monotonic())
        return unavailable("no instance could serve the request", retry_after=1).response()

    async def _open(
        self, url: str, payload, headers: dict, timeout: float, stream: bool
    ) -> httpx.Response:
        """POST, and return once the status and headers are in (the body streams later): a
        streamed body may fall silent for stream_timeout, a whole one for request_timeout."""
        silence = self.config.stream_timeout if stream else self.config.request_timeout
        request = self.client.build_request(
            "POST",
            url,
            content=payload,
            headers=headers,
            timeout=httpx.Timeout(silence, connect=min(timeout, 5.0)),
        )
        try:
            return await asyncio.wait_for(self.client.send(request, stream=True), timeout)
        except (httpx.HTTPError, asyncio.TimeoutError) as e:
            raise _Failed(type(e).__name__) from None

    # ---- stage 3: the decode instance's answer -------------------------------------------
    async def _relay(self, response: httpx.Response, stream: bool, t0: float) -> Response:
        if not stream or response.status_code != 200:
            try:
                content = await response.aread()
            except httpx.HTTPError as e:
                return _broken(e)
            finally:
                await response.aclose()
            self.metrics.stage.labels("first_byte").observe(time.monotonic() - t0)
            return _json_answer(response.status_code, content)
        return StreamingResponse(
            self._events(response, t0),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _events(self, response: httpx.Response, t0: float):
        first = True
        try:
            async for chunk in response.aiter_raw():
                if first:
                    self.metrics.stage.labels("first_byte").observe(time.monotonic() - t0)
                    first = False
                yield chunk
        except httpx.HTTPError as e:  # the decode instance died or stalled mid-stream
            log.warning("proxy: the decode stream broke: %s", type(e).__name__)
            yield sse_error(f"the decode instance failed mid-stream ({type(e).__name__})")
            yield DONE
        finally:
            await response.aclose()

    # ---- everything else goes to a decode instance ---------------------------------------
    async def forward(self, method: str, path: str, request: Request) -> Response:
        body, _, headers = await read_request(request)
        for url in [w.url for w in self.decode_pool.order(RouteRequest(""))]:
            try:
                r = await self.client.request(
                    method, url + path, content=body, headers=headers, timeout=10
                )
            except httpx.HTTPError:
                continue
            return _passthrough(r)
        return unavailable("no decode instance is reachable").response()

    async def healthy(self) -> bool:
        """At least one decode instance is healthy (prefill ones are a speed-up only), as
        the prober last saw them."""
        return bool(self.decode_pool.healthy())


def _passthrough(r: httpx.Response) -> Response:
    media = r.headers.get("content-type", "application/json")
    return Response(r.content, status_code=r.status_code, media_type=media)


def _json_answer(status: int, content: bytes) -> Response:
    """A decode instance's non-streaming answer. Its status was sent before its body: an
    error JSON in a 200 (server/streaming.py HeadersFirstResponse) gets its status back."""
    if status == 200 and content.startswith(b'{"error"'):
        try:
            error = json.loads(content)["error"]
        except (ValueError, KeyError, TypeError):
            error = {}
        if error.get("type") == "invalid_request_error":
            status = 400
        else:
            status = 503 if error.get("code") == "service_unavailable" else 500
    return Response(content, status_code=status, media_type="application/json")


def _broken(e: Exception) -> Response:
    return error_response(
        502,
        f"the decode instance failed before answering ({type(e).__name__})",
        "server_error",
        code="bad_gateway",
    )
