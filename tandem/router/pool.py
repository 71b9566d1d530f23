"""The router's workers: who they are, whether they are healthy, and how loaded.

A prober checks every worker's /health each `probe_interval` and reads its /metrics (running,
waiting, KV usage, prefix hits). `eject_after` failed probes or 5xx answers in a row eject a
worker (circuit breaker): no request is routed to it, and it is probed with backoff (doubling
up to `max_backoff`) until it answers again, when it is readmitted. Workers are added and
removed while the router runs (`add`, `remove`, or a watched file of URLs, one per line).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.router.policy import RoutingPolicy, WorkerState

log = logging.getLogger("tandem")
_SLO_COUNTERS = {"tandem:slo_requests_total": 0, "tandem:slo_met_total": 1}  # per class
_GAUGES = {
    "tandem:num_requests_running": "running",
    "tandem:num_requests_waiting": "waiting",
    "tandem:kv_cache_usage_perc": "kv_usage",
}


@dataclass
class Worker:
    state: WorkerState
    failures: int = 0  # consecutive failed probes or 5xx answers
    next_probe: float = 0.0
    backoff: float = 0.0
    requests: int = 0  # routed to it, ever
    prefix_queries: float = 0.0  # its own prefix-cache counters, as last scraped
    prefix_hits: float = 0.0
    ejections: int = 0
    errors: list[str] = field(default_factory=list)
    instance: str | None = None  # the process behind the URL, as its /health names it
    slo: dict[str, tuple[float, float]] = field(default_factory=dict)  # class -> (done, met)


class WorkerPool:
    def __init__(
        self,
        urls: list[str],
        policy: RoutingPolicy,
        client: httpx.AsyncClient,
        probe_interval: float = 1.0,
        probe_timeout: float = 2.0,
        eject_after: int = 2,
        max_backoff: float = 30.0,
        watch_file: str | None = None,
    ) -> None:
        self.policy, self.client = policy, client
        self.probe_interval, self.probe_timeout = probe_interval, probe_timeout
        self.eject_after, self.max_backoff = eject_after, max_backoff
        self.watch_file = Path(watch_file) if watch_file else None
        self._watched: set[str] = set()
        self.workers: dict[str, Worker] = {}
        self._ids = 0
        for url in urls:
            self.add(url)
        self._task: asyncio.Task | None = None

    # ---- membership ---------------------------------------------------------------------
    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        for w in self.workers.values():
            if w.state.url == url:
                return w
        self._ids += 1
        worker = Worker(WorkerState(f"w{self._ids}", url))
        self.workers[worker.state.id] = worker
        log.info("router: worker %s at %s added", worker.state.id, url)
        return worker

    def remove(self, worker_id: str) -> bool:
        worker = self.workers.pop(worker_id, None)
        if worker is not None:
            self.policy.forget(worker_id)
            log.info("router: worker %s at %s removed", worker_id, worker.state.url)
        return worker is not None

    def _sync_file(self) -> None:
        if self.watch_file is None:
            return
        try:
            lines = self.watch_file.read_text().split()
        except OSError:
            return
        urls = {u.rstrip("/") for u in lines if u.startswith("http")}
        for url in urls - self._watched:
            self.add(url)
        for url in self._watched - urls:
            for wid, w in list(self.workers.items()):
                if w.state.url == url:
                    self.remove(wid)
        self._watched = urls

    # ---- choosing ---------------------------------------------------------------------------
    def healthy(self) -> list[WorkerState]:
        """The workers requests may go to: healthy, and not being drained."""
        return [w.state for w in self.workers.values() if w.state.healthy and not w.state.draining]

    def order(self, request) -> list[WorkerState]:
        return self.policy.rank(self.healthy(), request)

    def failed(self, worker_id: str, why: str) -> None:
        """A request to the worker failed (unreachable, 5xx, timed out)."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        worker.failures += 1
        worker.errors = (worker.errors + [why])[-5:]
        if worker.failures >= self.eject_after and worker.state.healthy:
            self._eject(worker, why)

    def succeeded(self, worker_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.failures = 0

    def _eject(self, worker: Worker, why: str) -> None:
        worker.state.healthy = False
        worker.ejections += 1
        worker.backoff = self.probe_interval
        worker.next_probe = time.monotonic() + worker.backoff
        log.warning("router: worker %s ejected (%s)", worker.state.id, why)

    # ---- probing ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._probe_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _probe_loop(self) -> None:
        while True:
            self._sync_file()
            now = time.monotonic()
            due = [w for w in self.workers.values() if w.next_probe <= now]
            await asyncio.gather(*(self.probe(w) for w in due))
            await asyncio.sleep(self.probe_interval / 4)

    async def probe(self, worker: Worker) -> None:
        try:
            r = await self.client.get(worker.state.url + "/health", timeout=self.probe_timeout)
            ok = r.status_code == 200
            if ok:
                m = await self.client.get(worker.state.url + "/metrics", timeout=self.probe_timeout)
                self._read_metrics(worker, m.text)
        except httpx.HTTPError as e:
            ok, why = False, type(e).__name__
        else:
            why = f"/health {r.status_code}"
        now = time.monotonic()
        if ok:
            self._check_identity(worker, r)
            if not worker.state.healthy:
                log.info("router: worker %s readmitted", worker.state.id)
            worker.state.healthy, worker.failures, worker.backoff = True, 0, 0.0
            worker.next_probe = now + self.probe_interval
            return
        worker.failures += 1
        if worker.state.healthy and worker.failures >= self.eject_after:
            self._eject(worker, why)
        elif not worker.state.healthy:
            worker.backoff = min(self.max_backoff, max(self.probe_interval, worker.backoff * 2))
            worker.next_probe = now + worker.backoff
        else:
            worker.next_probe = now + self.probe_interval

    def _check_identity(self, worker: Worker, health: httpx.Response) -> None:
        """A new process at the worker's URL (restarted: same address, empty cache) makes
        the policy forget what it believed the old one cached."""
        try:
            body = health.json()
            instance = str(body["instance_id"]) if isinstance(body, dict) else None
        except (ValueError, KeyError):
            instance = None  # a worker that names no instance (not tandem, or older)
        if instance and worker.instance and instance != worker.instance:
            self.policy.forget(worker.state.id)
            log.info(
                "router: worker %s restarted (instance %s, was %s): its prefix cache is forgotten",
                worker.state.id,
                instance,
                worker.instance,
            )
        worker.instance = instance or worker.instance

    def _read_metrics(self, worker: Worker, text: str) -> None:
        sums: dict[str, float] = {}
        slo: dict[str, list[float]] = {}
        for line in text.splitlines():
            if not line.startswith("tandem:"):
                continue
            name, _, value = line.rpartition(" ")
            key = name.split("{", 1)[0]
            try:
                sums[key] = sums.get(key, 0.0) + float(value)
            except ValueError:
                continue
            if key in _SLO_COUNTERS and 'class="' in name:
                cls = name.split('class="', 1)[1].split('"', 1)[0]
                slo.setdefault(cls, [0.0, 0.0])[_SLO_COUNTERS[key]] += float(value)
        worker.slo = {cls: (done, met) for cls, (done, met) in slo.items()}
        for metric, attr in _GAUGES.items():
            if metric in sums:
                value = sums[metric]
                setattr(worker.state, attr, value if attr == "kv_usage" else int(value))
        worker.prefix_queries = sums.get("tandem:prefix_cache_queries_total", 0.0)
        worker.prefix_hits = sums.get("tandem:prefix_cache_hits_total", 0.0)
