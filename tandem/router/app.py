"""`tandem router`: one OpenAI-compatible front end over many `tandem serve` workers.

Plain mode (`--worker URL...`): each completion goes to the first worker the policy ranks
(router/policy.py). A request that fails before its first token (worker unreachable, a 5xx,
ejected by the prober while it waited: a stalled worker is found by its probes timing out,
not by hope) is retried on the next worker, bounded by `max_attempts` and `retry_deadline`;
one that fails mid-stream ends with an error event (no silent truncation, no token twice).
A streamed answer is held back until its first token (or end) arrives, so a retry never
repeats what the client has seen. A client that leaves aborts the request on the worker.

PD mode (`--prefill URL... --decode URL...`; also `tandem proxy`): the three-stage handoff of
disagg/proxy.py. Both modes share the gate (API key), forwarding and metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
from dataclasses import dataclass

import aiohttp
import httpx
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tandem.router.autoscale import AttainmentWindow, AutoscaleConfig, FleetSignals
from tandem.router.forwarding import read_request
from tandem.router.policy import RouteRequest, WorkerState, prompt_text, session_of
from tandem.router.pool import WorkerPool
from tandem.server.errors import APIError, bad_request, server_error, unavailable
from tandem.server.security import Access, AccessGate
from tandem.server.streaming import DONE, cancel_on_disconnect, sse_error

log = logging.getLogger("tandem")


@dataclass(frozen=True)
class RouterConfig:
    max_attempts: int = 3
    retry_deadline: float = 30.0  # seconds from arrival within which a retry may start
    request_timeout: float = 600.0  # the longest a worker may take to its first token
    stream_timeout: float = 60.0  # the longest silence inside a streamed answer
    worker_tls: ssl.SSLContext | None = None  # https:// workers signed by a private CA


class RouterMetrics:
    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem:router_requests", "Requests routed, by worker",
                                ["worker"], registry=r)  # fmt: skip
        self.retries = Counter("tandem:router_retries", "Requests retried on another worker",
                               registry=r)  # fmt: skip
        self.failed = Counter("tandem:router_failed", "Requests no worker could serve",
                              registry=r)  # fmt: skip
        self.ejections = Gauge("tandem:router_worker_ejections", "Times a worker was ejected",
                               ["worker"], registry=r)  # fmt: skip
        self.healthy = Gauge("tandem:router_worker_healthy", "1 if the worker gets requests",
                             ["worker"], registry=r)  # fmt: skip
        # scaling signals, for an autoscaler (deploy/kubernetes/keda-scaledobject.yaml)
        self.queue = Gauge("tandem:router_worker_queue_depth",
                           "Requests waiting on the worker (its /metrics) or in flight to it",
                           ["worker"], registry=r)  # fmt: skip
        self.queue_per_worker = Gauge(
            "tandem:router_queue_depth_per_worker",
            "Mean queue depth over healthy workers: scale out when it stays high",
            registry=r,
        )
        self.predicted_ttft = Gauge(
            "tandem:router_predicted_ttft_seconds",
            "Cost-model TTFT of a 512-token prompt on the best worker now",
            registry=r,
        )
        self.hit_estimate = Gauge(
            "tandem:router_prefix_hit_estimate",
            "Share of prompt chunks the router expected cached where it sent them",
            registry=r,
        )
        # the autoscaler (--autoscale): what it wants, what it did
        self.desired_workers = Gauge(
            "tandem:router_desired_workers",
            "Workers the autoscaler wants serving (an HPA/KEDA target; without --autoscale "
            "the serving workers plus any the queue asks for)",
            registry=r,
        )
        self.starting_workers = Gauge(
            "tandem:router_workers_starting", "Workers started and not yet serving", registry=r
        )
        self.scale_actions = Counter(
            "tandem:router_scale_actions",
            "Autoscaler actions: up (a worker started), down (drained and stopped), failed_start",
            ["action"],
            registry=r,
        )
        self.session_moves = Counter(
            "tandem:router_session_moves",
            "Agent sessions reopened on another worker (theirs died, or affinity yielded)",
            registry=r,
        )
        self.worker_hit_rate = Gauge(
            "tandem:router_worker_prefix_hit_rate",
            "Prefix-cache hit rate each worker reports (its own counters)",
            ["worker"],
            registry=r,
        )


class Router:
    def __init__(self, pool: WorkerPool, config: RouterConfig, client: httpx.AsyncClient):
        self.pool, self.config, self.client = pool, config, client
        self.session = None
        self.metrics = RouterMetrics()
        self.supervisor = None  # router/supervisor.py's LocalSupervisor, with --autoscale
        self.attainment = AttainmentWindow()  # SLO attainment per class, the last minute
        self.opened: dict[str, bytes] = {}  # agent session -> its open body, to reopen it

    async def complete(self, path: str, request: Request) -> Response:
        raw, body, headers = await read_request(request)
        stream = isinstance(body, dict) and body.get("stream") is True
        route = RouteRequest(prompt_text(body), session_of(body, headers))
        result = await cancel_on_disconnect(
            request.receive, self._attempts(path, raw, headers, stream, route)
        )
        return Response(status_code=499) if result is None else result

    async def _attempts(self, path, raw, headers, stream: bool, route: RouteRequest):
        deadline = time.monotonic() + self.config.retry_deadline
        tried: set[str] = set()
        for attempt in range(self.config.max_attempts):
            order = [w for w in self.pool.order(route) if w.id not in tried]
            if not order or (attempt and time.monotonic() > deadline):
                break
            worker = order[0]
            tried.add(worker.id)
            if attempt:
                self.metrics.retries.inc()
            answer = await self._try(worker, path, raw, headers, stream, route)
            if answer is not None:
                return answer
        self.metrics.failed.inc()
        return unavailable(
            f"no worker could serve the request (tried {len(tried)})", retry_after=1
        ).response()

    async def _try(self, worker: WorkerState, path, raw, headers, stream, route):
        """The worker's answer, or None when it failed before its first token (retry)."""
        if route.session is not None:
            await self._follow_session(worker, route.session, headers)
        receipt = self.pool.policy.routed(worker, route)
        self.metrics.requests.labels(worker.id).inc()
        self.pool.workers[worker.id].requests += 1
        worker.in_flight += 1
        worker.pending_prefill_tokens += route.tokens
        held = True  # the in-flight count and the connection, until the relay takes them
        response = None
        try:
            if not stream:
                answer = await self._watched(worker, self._fetch(worker.url + path, raw, headers))
                if answer.status >= 500:
                    raise _Failed(f"HTTP {answer.status}", busy=answer.status == 503)
                self.pool.succeeded(worker.id)
                return Response(answer.content, answer.status, media_type=answer.media_type)
            response = await self._watched(worker, self._open(worker.url + path, raw, headers))
            if response.status >= 500:
                raise _Failed(f"HTTP {response.status}", busy=response.status == 503)
            if response.status != 200:
                content = await self._watched(worker, response.read())
                media = response.headers.get("content-type", "application/json")
                return Response(content, status_code=response.status, media_type=media)
            chunks = response.content.iter_any()
            first = await self._watched(worker, _until_first_token(chunks))
            self.pool.succeeded(worker.id)
            held = False
            return StreamingResponse(
                self._relay(worker, response, first, chunks),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        except _Failed as e:
            log.warning("router: worker %s failed before a token: %s", worker.id, e)
            self.pool.policy.withdraw(worker.id, receipt)  # it holds none of this prompt
            if not e.busy:  # an overloaded worker (503) is retried elsewhere, not ejected
                self.pool.failed(worker.id, str(e))
            return None
        finally:  # also when the client left (cancelled): closing aborts it on the worker
            worker.pending_prefill_tokens = max(0, worker.pending_prefill_tokens - route.tokens)
            if held:
                worker.in_flight -= 1
                if response is not None:
                    response.release()  # unread (an error, a cancel): its connection closes

    # ---- agent sessions: opened on one worker, their turns kept there ---------------------
    async def open_session(self, request: Request) -> Response:
        """Open the session on the worker the policy picks, and bind it there."""
        raw, body, headers = await read_request(request)
        for worker in self.pool.order(RouteRequest("")):
            try:
                r = await self.client.post(f"{worker.url}/open_session", content=raw,
                                           headers=headers, timeout=10)  # fmt: skip
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                sid = r.json()
                opened = dict(body) if isinstance(body, dict) else {}
                self.opened[sid] = json.dumps({**opened, "session_id": sid}).encode()
                self.pool.policy.bind(sid, worker.id)
            return Response(r.content, r.status_code, media_type="application/json")
        return unavailable("no worker is reachable").response()

    async def close_session(self, request: Request) -> Response:
        raw, body, headers = await read_request(request)
        sid = body.get("session_id") if isinstance(body, dict) else None
        home = self.pool.policy.worker_of(sid) if isinstance(sid, str) else None
        order = self.pool.order(RouteRequest(""))
        for worker in sorted(order, key=lambda w: w.id != home):
            try:
                r = await self.client.post(f"{worker.url}/close_session", content=raw,
                                           headers=headers, timeout=10)  # fmt: skip
            except httpx.HTTPError:
                continue
            if r.status_code == 200 and isinstance(sid, str):
                self.opened.pop(sid, None)
                self.pool.policy.unbind(sid)
            return Response(r.content, r.status_code, media_type="application/json")
        return unavailable("no worker is reachable").response()

    async def _follow_session(self, worker: WorkerState, sid: str, headers: dict) -> None:
        """A turn going to another worker than its session's (that one died, or affinity
        yielded to the load): open the session there first, so the turn is served (with a
        cold cache) instead of refused. A session the router never opened is left alone."""
        opened = self.opened.get(sid)
        if opened is None or self.pool.policy.worker_of(sid) in (None, worker.id):
            return
        try:
            r = await self.client.post(f"{worker.url}/open_session", content=opened,
                                       headers=headers, timeout=10)  # fmt: skip
        except httpx.HTTPError as e:
            log.warning("router: reopening session %s on %s: %s", sid, worker.id, e)
            return
        if r.status_code in (200, 409):  # (409: it is open there already)
            self.metrics.session_moves.inc()
            log.info("router: session %s moved to worker %s", sid, worker.id)

    def _session(self) -> aiohttp.ClientSession:
        """The worker connections, opened in the serving loop. aiohttp, not httpx: through
        httpx (and httpcore) the router spent 1.05 ms of CPU per forwarded request, with
        aiohttp 0.54 ms (benchmarks/router.py, docs/router.md). httpx still probes workers."""
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=0, keepalive_timeout=60, ssl=self.config.worker_tls or True
                ),
                auto_decompress=False,  # bytes pass through as the worker sent them
            )
        return self.session

    async def _open(self, url: str, raw: bytes, headers: dict) -> aiohttp.ClientResponse:
        """A streamed answer: its status and headers are in; the body is read as it comes."""
        timeout = aiohttp.ClientTimeout(sock_connect=5.0, sock_read=self.config.stream_timeout)
        return await self._session().post(url, data=raw, headers=headers, timeout=timeout)

    async def _fetch(self, url: str, raw: bytes, headers: dict) -> _Answer:
        """A whole answer (bounded by _watched's request timeout)."""
        timeout = aiohttp.ClientTimeout(sock_connect=5.0)
        async with self._session().post(url, data=raw, headers=headers, timeout=timeout) as r:
            content = await r.read()
            return _Answer(r.status, content, r.headers.get("content-type", "application/json"))

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def _watched(self, worker: WorkerState, work):
        """Await `work` unless the worker is ejected or the request timeout passes first."""
        task = asyncio.ensure_future(work)
        deadline = time.monotonic() + self.config.request_timeout
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.2)
                if done:
                    return task.result()
                if not worker.healthy:
                    raise _Failed("ejected by the prober while waiting")
                if time.monotonic() > deadline:
                    raise _Failed(f"no answer in {self.config.request_timeout:g} s")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise _Failed(type(e).__name__) from None
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _relay(self, worker: WorkerState, response, first: bytes, chunks):
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # mid-stream: end it clearly
            log.warning("router: worker %s broke mid-stream: %s", worker.id, type(e).__name__)
            self.pool.failed(worker.id, type(e).__name__)
            yield sse_error(f"the worker failed mid-stream ({type(e).__name__})")
            yield DONE
        finally:
            worker.in_flight -= 1
            response.release()  # read to the end: back to the pool; else its connection closes

    def fleet_signals(self) -> FleetSignals:
        """The autoscaler's view of the serving workers (healthy, not draining)."""
        serving = self.pool.healthy()
        ttft = None
        policy = self.pool.policy
        if hasattr(policy, "predicted_ttft") and serving:
            probe = RouteRequest("x" * 2048)
            ttft = min(policy.predicted_ttft(s, probe) for s in serving)
        totals = {(w.state.id, cls): counts for w in self.pool.workers.values()
                  for cls, counts in w.slo.items()}  # fmt: skip
        self.attainment.observe(time.monotonic(), totals)
        return FleetSignals(
            serving=len(serving),
            queued=sum(max(s.waiting, s.in_flight - s.running, 0) for s in serving),
            load=sum(s.load for s in serving),
            max_kv_usage=max((s.kv_usage for s in serving), default=0.0),
            predicted_ttft=ttft,
            slo_attainment=self.attainment.worst(),
        )

    def refresh_metrics(self) -> None:
        if self.supervisor is None:  # no autoscaler: the workers the load asks for
            s = self.fleet_signals()
            target = AutoscaleConfig().target_queue_per_worker
            self.metrics.desired_workers.set(max(s.serving, math.ceil(s.load / target)))
        workers = list(self.pool.workers.values())
        healthy = [w.state for w in workers if w.state.healthy]
        for w in workers:
            s = w.state
            self.metrics.healthy.labels(s.id).set(1 if s.healthy else 0)
            self.metrics.ejections.labels(s.id).set(w.ejections)
            self.metrics.queue.labels(s.id).set(max(s.waiting, s.in_flight - s.running, 0))
            if w.prefix_queries:
                self.metrics.worker_hit_rate.labels(s.id).set(w.prefix_hits / w.prefix_queries)
        if healthy:
            depth = sum(max(s.waiting, s.in_flight - s.running, 0) for s in healthy)
            self.metrics.queue_per_worker.set(depth / len(healthy))
        policy = self.pool.policy
        if getattr(policy, "queried_chunks", 0):
            self.metrics.hit_estimate.set(policy.matched_chunks / policy.queried_chunks)
        if hasattr(policy, "predicted_ttft") and healthy:
            probe = RouteRequest("x" * 2048)
            self.metrics.predicted_ttft.set(min(policy.predicted_ttft(s, probe) for s in healthy))


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    content: bytes
    media_type: str


class _Failed(Exception):
    def __init__(self, why: str, busy: bool = False) -> None:
        super().__init__(why)
        self.busy = busy


async def _until_first_token(chunks) -> bytes:
    """Read a streamed answer until an event that carries a token, a finish, an error or
    the end; return everything read so far."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        for event in buffer.split(b"\n\n")[:-1]:
            if _carries_output(event):
                return buffer
    return buffer  # the stream ended


def _carries_output(event: bytes) -> bool:
    data = event.strip().removeprefix(b"data: ")
    if data == b"[DONE]":
        return True
    try:
        payload = json.loads(data)
    except ValueError:
        return True  # not ours to judge: pass it on
    if "error" in payload:
        return True
    for c in payload.get("choices", []):
        if c.get("text") or (c.get("delta") or {}).get("content") or c.get("finish_reason"):
            return True
    return False


def build_app(
    access: Access,
    registry,
    complete,
    forward,
    healthy,
    metrics_text,
    router: Router | None = None,
) -> Starlette:
    """The front end both modes share: `complete(path, request)` serves completions,
    `forward(method, path, request)` everything else. Plain Starlette, not FastAPI: the
    router parses no models, and FastAPI's layers (dependencies, body limit, telemetry)
    were a sixth of its time per request (py-spy)."""

    def completions(path: str):
        async def endpoint(request: Request) -> Response:
            return await complete(path, request)

        return Route(path, endpoint, methods=["POST"])

    def forwarded(path: str, method: str):
        async def endpoint(request: Request) -> Response:
            return await forward(method, path, request)

        return Route(path, endpoint, methods=[method])

    async def health(_: Request) -> Response:
        if await healthy():
            return Response(status_code=200)
        return unavailable("no worker is healthy").response()

    async def metrics(_: Request) -> Response:
        return Response(metrics_text(), media_type=CONTENT_TYPE_LATEST)

    async def api_error(_: Request, e: APIError) -> Response:
        return e.response()

    async def unexpected(_: Request, e: Exception) -> Response:
        log.exception("router: unexpected error")
        return server_error(f"router: {type(e).__name__}: {e}").response()

    routes = [
        completions("/v1/completions"),
        completions("/v1/chat/completions"),
        *(forwarded(path, "GET") for path in ("/v1/models", "/version")),
        *(forwarded(path, "POST") for path in ("/tokenize", "/detokenize")),
        Route("/health", health),
        Route("/ping", health),  # vLLM's alias of /health
        Route("/metrics", metrics),
        *(_worker_routes(router.pool) if router is not None else ()),
        *(_session_routes(router) if router is not None else ()),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(AccessGate, access=access, registry=registry)],
        exception_handlers={APIError: api_error, Exception: unexpected},
    )


def _session_routes(router: Router) -> list[Route]:
    return [
        Route("/open_session", router.open_session, methods=["POST"]),
        Route("/close_session", router.close_session, methods=["POST"]),
    ]


def _worker_routes(pool: WorkerPool) -> list[Route]:
    def listing(w) -> dict:
        s = w.state
        return {"id": s.id, "url": s.url, "healthy": s.healthy, "draining": s.draining, "requests": w.requests,
                "in_flight": s.in_flight, "running": s.running, "waiting": s.waiting,
                "kv_usage": s.kv_usage, "ejections": w.ejections}  # fmt: skip

    async def workers(_: Request) -> Response:
        return Response(json.dumps([listing(w) for w in pool.workers.values()]),
                        media_type="application/json")  # fmt: skip

    async def add_worker(request: Request) -> Response:
        try:
            url = json.loads(await request.body())["url"]
        except (ValueError, KeyError, TypeError):
            raise bad_request('url: send {"url": "http://host:port"}', "url") from None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise bad_request("url: must be an http(s) URL", "url")
        worker = pool.add(url)
        await pool.probe(worker)
        return Response(json.dumps(listing(worker)), status_code=201,
                        media_type="application/json")  # fmt: skip

    async def remove_worker(request: Request) -> Response:
        worker_id = request.path_params["worker_id"]
        if not pool.remove(worker_id):
            return Response(json.dumps({"error": {"message": f"no worker {worker_id!r}",
                            "type": "not_found"}}), status_code=404)  # fmt: skip
        return Response(status_code=204)

    return [
        Route("/workers", workers, methods=["GET"]),
        Route("/workers", add_worker, methods=["POST"]),
        Route("/workers/{worker_id}", remove_worker, methods=["DELETE"]),
    ]


def plain_app(router: Router, access: Access) -> Starlette:
    async def forward(method: str, path: str, request: Request) -> Response:
        body, _, headers = await read_request(request)
        for worker in router.pool.order(RouteRequest("")):
            try:
                r = await router.client.request(
                    method, worker.url + path, content=body, headers=headers, timeout=10
                )
            except httpx.HTTPError:
                continue
            media = r.headers.get("content-type", "application/json")
            return Response(r.content, status_code=r.status_code, media_type=media)
        return unavailable("no worker is reachable").response()

    async def healthy() -> bool:
        return bool(router.pool.healthy())

    def metrics_text() -> bytes:
        router.refresh_metrics()
        return generate_latest(router.metrics.registry)

    return build_app(access, router.metrics.registry, router.complete, forward, healthy,
                     metrics_text, router)  # fmt: skip


def pd_app(proxy, access: Access) -> Starlette:
    """PD mode: completions run the handoff (disagg/proxy.py)."""

    def metrics_text() -> bytes:
        return generate_latest(proxy.metrics.registry)

    return build_app(access, proxy.metrics.registry, proxy.complete, proxy.forward,
                     proxy.healthy, metrics_text)  # fmt: skip
