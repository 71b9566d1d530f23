"""Drive a workload against a server: sessions start at their arrival times, at most
`max_concurrency` at once, and each sends its requests in order.

A session holds a concurrency slot from its first request to its last, as one client
would; for single-request workloads that is vLLM's per-request `--max-concurrency`.
With `duration`, sessions start until the time is up (the workload repeats if it runs
out) and those already started finish; with an infinite rate that is a closed loop of
`max_concurrency` clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.bench.arrivals import arrival_times, arrival_times_until
from tandem.bench.client import RequestResult, RequestSpec, make_client, send
from tandem.bench.workloads import Session


@dataclass
class RunConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration: float | None = None  # seconds; None: every session once
    seed: int = 0
    think_time: float = 0.0  # seconds between a session's turns
    request_timeout: float | None = None
    progress: bool = True


@dataclass
class RunResult:
    results: list[RequestResult]  # in the order they were sent
    duration: float  # seconds, from the start of the run to the last answer
    start: float = 0.0  # perf_counter() at the start of the run


async def run_workload(
    sessions: list[Session],
    spec: RequestSpec,
    cfg: RunConfig,
    count_tokens: Callable[[str], int] | None = None,
) -> RunResult:
    if not sessions:
        raise ValueError("workload: no requests to send")
    if cfg.duration is not None and math.isinf(cfg.request_rate) and not cfg.max_concurrency:
        raise ValueError("--duration with an infinite request rate needs --max-concurrency")
    results: list[RequestResult] = []
    slots = (
        asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
    )
    pbar = _progress(cfg, sessions)

    async def run_session(session: Session) -> None:
        async with slots:
            for turn, req in enumerate(session.requests):
                if turn and cfg.think_time:
                    await asyncio.sleep(cfg.think_time)
                r = await send(client, spec, req)
                if r.success and r.output_len is None:
                    r.output_len = (
                        count_tokens(r.generated_text) if count_tokens else len(r.itl) + 1
                    )
                results.append(r)
                if pbar is not None:
                    pbar.update(1)

    async with make_client(cfg.request_timeout) as client:
        start = time.perf_counter()
        if cfg.duration is not None and math.isinf(cfg.request_rate):
            await _closed_loop(sessions, cfg, run_session, start)
        else:
            await _open_loop(sessions, cfg, run_session, start)
        duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    results.sort(key=lambda r: r.start_time)
    return RunResult(results, duration, start)


async def _open_loop(sessions, cfg: RunConfig, run_session, start: float) -> None:
    if cfg.duration is None:
        offsets = arrival_times(len(sessions), cfg.request_rate, cfg.burstiness, cfg.seed)
    else:
        offsets = arrival_times_until(cfg.duration, cfg.request_rate, cfg.burstiness, cfg.seed)
    tasks = []
    for offset, session in zip(offsets, itertools.cycle(sessions)):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(run_session(session)))
    await asyncio.gather(*tasks)


async def _closed_loop(sessions, cfg: RunConfig, run_session, start: float) -> None:
    queue = itertools.cycle(sessions)
    deadline = start + cfg.duration

    async def client_loop() -> None:
        while time.perf_counter() < deadline:
            await run_session(next(queue))

    await asyncio.gather(*(client_loop() for _ in range(cfg.max_concurrency)))


def _progress(cfg: RunConfig, sessions: list[Session]):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    total = None if cfg.duration is not None else sum(len(s.requests) for s in sessions)
    return tqdm(total=total, unit="req", dynamic_ncols=True, leave=False)
