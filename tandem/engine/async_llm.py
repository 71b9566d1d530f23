"""AsyncLLM: the server's asyncio handle on an engine core running in its own process.

It sends adds and aborts over ZeroMQ; one background task receives the core's outputs, runs
the OutputProcessor (detokenize, stop strings, n-way fan-in) and hands each request its
latest output. Outputs are cumulative, so a slow reader simply skips to the newest one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from tandem.core.sampling_params import SamplingParams
from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCoreOutput, EngineStats
from tandem.engine.core_proc import (
    ABORT,
    ADD,
    SHUTDOWN,
    CoreFailed,
    CoreMessage,
    CoreOutputs,
    CoreReady,
)
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.outputs import RequestOutput
from tandem.engine.tokenizer import load_tokenizer

log = logging.getLogger("tandem")


class EngineDeadError(RuntimeError):
    """The engine core process failed; no request can be served."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (shutdown deadline passed, or the core refused it)."""


class Observer(Protocol):
    """Receives what metrics need; implemented by the server, optional."""

    def on_outputs(self, outputs: list[RequestOutput], num_new_tokens: int, now: float) -> None: ...

    def on_stats(self, stats: EngineStats) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


class _Collector:
    """One request's mailbox: the latest cumulative output, or an error."""

    __slots__ = ("output", "error", "event")

    def __init__(self) -> None:
        self.output: RequestOutput | None = None
        self.error: Exception | None = None
        self.event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self.output = output
        self.event.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.event.set()

    async def get(self) -> RequestOutput:
        await self.event.wait()
        self.event.clear()
        if self.error is not None:
            raise self.error
        output, self.output = self.output, None
        return output


class AsyncLLM:
    def __init__(self, proc: subprocess.Popen, ready: CoreReady, ctx, inbox, outbox, tmpdir):
        self.proc = proc
        self.core_pid = ready.pid
        self.model_path = ready.model_path
        self.max_model_len = ready.max_model_len
        self.max_request_tokens = ready.max_request_tokens
        self.vocab_size = ready.vocab_size
        self._ctx, self._inbox, self._outbox, self._tmpdir = ctx, inbox, outbox, tmpdir
        self.tokenizer = None
        self.processor: OutputProcessor | None = None
        self.observer: Observer | None = None
        self.stats: EngineStats | None = None
        self.dead: str | None = None  # why the core died, once it has
        self._collectors: dict[str, _Collector] = {}
        self._unscheduled: set[str] = set()  # child ids sent to the core, no token yet
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    # ---- lifecycle ---------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig) -> AsyncLLM:
        """Spawn the core, wait until its model is loaded; raise ValueError if it fails."""
        tmpdir = tempfile.TemporaryDirectory(prefix="tandem-")
        in_addr = f"ipc://{tmpdir.name}/in"
        out_addr = f"ipc://{tmpdir.name}/out"
        ctx = zmq.asyncio.Context()
        inbox, outbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)  # named from the core's side
        inbox.bind(in_addr)
        outbox.bind(out_addr)
        inbox.setsockopt(zmq.LINGER, 0)
        cmd = [
            sys.executable, "-m", "tandem.engine.core_proc",
            "--inbox", in_addr, "--outbox", out_addr,
            "--parent-pid", str(os.getpid()),
            "--config", json.dumps(dataclasses.asdict(config)),
        ]  # fmt: skip
        # Started from the main thread: PR_SET_PDEATHSIG fires when the starting thread exits.
        proc = subprocess.Popen(cmd, start_new_session=False)
        try:
            ready = await _wait_ready(proc, outbox)
        except BaseException:
            _kill(proc)
            ctx.destroy(linger=0)
            tmpdir.cleanup()
            raise
        engine = cls(proc, ready, ctx, inbox, outbox, tmpdir)
        engine.tokenizer = load_tokenizer(config.tokenizer or ready.model_path)
        engine.processor = OutputProcessor(engine.tokenizer)
        engine._tasks = [
            asyncio.create_task(engine._output_loop()),
            asyncio.create_task(engine._watch_core()),
        ]
        return engine

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Abort everything, stop the core and wait for it; kill it past `timeout`."""
        self._closing = True
        self.abort_all(RequestAbortedError("the server is shutting down"))
        for task in self._tasks:
            task.cancel()
        if self.proc.poll() is None:
            try:
                await self._inbox.send_multipart([SHUTDOWN])
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            _kill(self.proc)
        self._ctx.destroy(linger=0)
        self._tmpdir.cleanup()

    # ---- requests ------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences sent to the core that have not produced a token yet."""
        return len(self._unscheduled)

    @property
    def num_in_flight(self) -> int:
        return len(self._collectors)

    async def generate(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output as it grows; the last one is finished.
        Closing the generator early (a client went away) aborts the request in the core."""
        if self.dead:
            raise EngineDeadError(self.dead)
        request_id = request_id or uuid.uuid4().hex
        collector = _Collector()
        core_requests = self.processor.add_request(
            request_id, prompt, prompt_token_ids, params, time.monotonic(), priority
        )
        self._collectors[request_id] = collector
        for creq in core_requests:
            self._unscheduled.add(creq.request_id)
            self._send(ADD, self._encoder.encode(creq))
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            if self._collectors.pop(request_id, None) is not None and not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        ids = self.processor.child_ids(request_id)
        self.processor.abort(request_id)
        self._unscheduled.difference_update(ids)
        if ids and not self.dead:
            self._send(ABORT, self._encoder.encode(ids))
        if self.observer is not None:
            self.observer.on_abort(request_id)

    def abort_all(self, error: Exception) -> None:
        """End every request in flight; their generators raise `error`."""
        for request_id, collector in list(self._collectors.items()):
            self.abort(request_id)
            collector.fail(error)

    def _send(self, kind: bytes, payload: bytes) -> None:
        # PUSH over ipc to a connected peer: queued at once, never blocks the event loop.
        self._inbox.send_multipart([kind, payload], copy=False)

    # ---- background tasks ------------------------------------------------------------
    async def _output_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(CoreMessage)
        while True:
            msg = decoder.decode(await self._outbox.recv(copy=False))
            if isinstance(msg, CoreFailed):
                self._fail(msg.message)
                return
            self._handle(msg)

    def _handle(self, msg: CoreOutputs) -> None:
        if msg.stats is not None:
            self.stats = msg.stats
            if self.observer is not None:
                self.observer.on_stats(msg.stats)
        for child_id, reason in msg.rejected:
            self._reject(child_id, reason)
        if not msg.outputs:
            return
        self._unscheduled.difference_update(o.request_id for o in msg.outputs)
        results, stopped = self.processor.process(msg.outputs)
        if stopped:
            self._send(ABORT, self._encoder.encode(stopped))  # finished by a stop string
        if self.observer is not None:
            self.observer.on_outputs(results, _num_tokens(msg.outputs), time.monotonic())
        for output in results:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)

    def _reject(self, child_id: str, reason: str) -> None:
        for request_id, collector in list(self._collectors.items()):
            if child_id in self.processor.child_ids(request_id):
                self.abort(request_id)
                collector.fail(RequestAbortedError(reason))

    async def _watch_core(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(0.5)
        if not self._closing:
            await asyncio.sleep(0.5)  # let a CoreFailed message with the reason land first
            self._fail(f"engine core process exited with code {self.proc.returncode}")

    def _fail(self, reason: str) -> None:
        if self.dead:
            return
        log.error("engine core is dead: %s", reason)
        self.dead = reason
        for collector in self._collectors.values():
            collector.fail(EngineDeadError(reason))


async def _wait_ready(proc: subprocess.Popen, outbox) -> CoreReady:
    decoder = msgspec.msgpack.Decoder(CoreMessage)
    while True:
        if await outbox.poll(200):
            msg = decoder.decode(await outbox.recv())
            if isinstance(msg, CoreFailed):
                raise ValueError(msg.message)
            if isinstance(msg, CoreReady):
                return msg
        elif proc.poll() is not None and not await outbox.poll(200):
            raise ValueError(f"engine core process exited with code {proc.returncode} at startup")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _num_tokens(outputs: list[EngineCoreOutput]) -> int:
    return sum(len(o.new_token_ids) for o in outputs)
