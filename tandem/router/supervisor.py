"""Local workers the router starts and stops (`tandem router --autoscale`): each a process
from `--worker-command` with `{port}` filled in, on this machine.

A started worker joins the pool only once its /health answers 200 and a one-token warm-up
request has come back, so no client waits on a cold start. One that exits or is not ready
within `start_timeout` is killed and counted a failed start; starts then back off (doubling
from 5 s to 5 minutes) and say why in the log, so a broken command never spins. A worker
chosen for removal (the least loaded the router started) is drained: the pool stops routing
to it, its requests in flight finish (up to `drain_timeout`), then it gets SIGTERM (and
SIGKILL 30 s later). Every action is logged and counted in the router's /metrics. Workers
die with the router (PR_SET_PDEATHSIG), however it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tandem.router.autoscale import AutoscalePolicy

log = logging.getLogger("tandem")
MIN_BACKOFF, MAX_BACKOFF = 5.0, 300.0


@dataclass
class Managed:
    port: int
    proc: subprocess.Popen
    url: str
    started: float
    worker_id: str | None = None  # in the pool once ready
    draining: bool = False


class LocalSupervisor:
    def __init__(self, command: str, pool, policy: AutoscalePolicy, metrics, client: httpx.AsyncClient,
                 log_dir: Path, start_timeout: float = 300.0, drain_timeout: float = 600.0,
                 interval: float = 1.0, signals=None, api_key: str | None = None) -> None:  # fmt: skip
        if "{port}" not in command:
            raise ValueError("worker_command must contain {port} (where the worker listens)")
        self.command, self.pool, self.policy, self.metrics = command, pool, policy, metrics
        self.client, self.log_dir = client, log_dir
        self.start_timeout, self.drain_timeout, self.interval = (
            start_timeout,
            drain_timeout,
            interval,
        )
        self.signals = signals  # () -> FleetSignals of the pool; the router's
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # warm-up's
        self.managed: dict[int, Managed] = {}
        self.backoff, self.retry_at = 0.0, 0.0
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None

    # ---- the loop ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                self.step(time.monotonic())
            except Exception:  # a bug here must not take the router down
                log.exception("router: autoscaler step failed")
            await asyncio.sleep(self.interval)

    def step(self, now: float) -> None:
        starting = sum(1 for m in self.managed.values() if m.worker_id is None)
        # the router's signals, every field (the SLO attainment too), with the starts added
        base = dataclasses.replace(self.signals(), starting=starting)
        decision = self.policy.decide(now, base)
        self.metrics.desired_workers.set(decision.desired)
        self.metrics.starting_workers.set(starting)
        fleet = base.serving + starting
        if decision.desired > fleet and now >= self.retry_at:
            for _ in range(decision.desired - fleet):
                log.info("router: scaling up to %d workers (%s)", decision.desired, decision.reason)
                self._spawn(now)
        elif decision.desired < fleet:
            victim = self._least_loaded()
            if victim is not None:
                log.info("router: scaling down to %d workers (%s): draining %s", decision.desired, decision.reason, victim.url)  # fmt: skip
                self._track(self._drain(victim))

    # ---- starting -----------------------------------------------------------------------------
    def _spawn(self, now: float) -> None:
        from tandem.distributed.launch import free_port

        port = free_port("127.0.0.1")
        argv = shlex.split(self.command.format(port=port))
        out = open(self.log_dir / f"worker-{port}.log", "wb")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_router)  # fmt: skip
        out.close()
        m = Managed(port, proc, f"http://127.0.0.1:{port}", now)
        self.managed[port] = m
        self.metrics.scale_actions.labels("up").inc()
        self._track(self._wait_ready(m))

    async def _wait_ready(self, m: Managed) -> None:
        deadline = m.started + self.start_timeout
        why = f"not ready within {self.start_timeout:g} s"
        while time.monotonic() < deadline:
            if m.proc.poll() is not None:
                why = f"exited with {m.proc.returncode} (log: {self.log_dir / f'worker-{m.port}.log'})"
                break
            try:
                if (await self.client.get(m.url + "/health", timeout=2)).status_code == 200:
                    refused = await self._warm_up(m)
                    if refused:
                        why = f"its warm-up request was refused: {refused}"
                        break
                    m.worker_id = self.pool.add(m.url).state.id
                    self.backoff = 0.0
                    log.info("router: worker %s at %s ready after %.1f s", m.worker_id, m.url, time.monotonic() - m.started)  # fmt: skip
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
        self.backoff = min(MAX_BACKOFF, max(MIN_BACKOFF, self.backoff * 2))
        self.retry_at = time.monotonic() + self.backoff
        log.warning("router: worker on port %d failed to start: %s; next start in %.0f s", m.port, why, self.backoff)  # fmt: skip
        self.metrics.scale_actions.labels("failed_start").inc()
        await self._stop(m)

    async def _warm_up(self, m: Managed) -> str | None:
        """One token through the worker: its first step's one-off costs before clients come.
        -> why the worker refused it (a key it does not take: --worker-api-key), or None."""
        h = self.headers
        r = await self.client.get(m.url + "/v1/models", headers=h, timeout=10)
        if r.status_code != 200:
            return f"/v1/models {r.status_code} {r.text[:200]}"
        body = {"model": r.json()["data"][0]["id"], "prompt": "Hello", "max_tokens": 1}
        r = await self.client.post(m.url + "/v1/completions", json=body, headers=h,
                                   timeout=self.start_timeout)  # fmt: skip
        return None if r.status_code == 200 else f"/v1/completions {r.status_code} {r.text[:200]}"

    # ---- stopping -----------------------------------------------------------------------------
    def _least_loaded(self) -> Managed | None:
        ready = [m for m in self.managed.values() if m.worker_id is not None and not m.draining]
        workers = self.pool.workers
        ready = [m for m in ready if m.worker_id in workers]
        return min(ready, key=lambda m: workers[m.worker_id].state.load, default=None)

    async def _drain(self, m: Managed) -> None:
        m.draining = True
        self.metrics.scale_actions.labels("down").inc()
        worker = self.pool.workers.get(m.worker_id)
        if worker is not None:
            worker.state.draining = True  # no new requests
            deadline = time.monotonic() + self.drain_timeout
            while worker.state.in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            self.pool.remove(m.worker_id)
        await self._stop(m)
        log.info("router: worker at %s drained and stopped", m.url)

    async def _stop(self, m: Managed) -> None:
        self.managed.pop(m.port, None)
        if m.proc.poll() is None:
            m.proc.send_signal(signal.SIGTERM)
            for _ in range(300):
                if m.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            else:
                m.proc.kill()
        m.proc.wait()

    def _track(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """The router is stopping: its workers stop with it."""
        if self._loop is not None:
            self._loop.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for m in list(self.managed.values()):
            await self._stop(m)


def _die_with_router() -> None:
    """In the worker, before exec: SIGTERM when the router dies, however it dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
