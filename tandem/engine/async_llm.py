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
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from tandem.core.sampling_params import SamplingParams
from tandem.core.slo import DEFAULT_CLASS, SLOClass
from tandem.engine.config import EngineConfig
from tandem.engine.messages import (
    ABORT,
    ADD,
    CLOSE_SESSION,
    LOAD_LORA,
    RESERVE,
    SHUTDOWN,
    UNLOAD_LORA,
    UTILITY,
    CoreFailed,
    CoreMessage,
    CoreOutputs,
    CoreReady,
    EngineCoreOutput,
    EngineStats,
    KVTransferParams,
    LoRAOp,
    UtilityCall,
)
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.outputs import RequestOutput
from tandem.engine.tokenizer import load_tokenizer

log = logging.getLogger("tandem")


class RequestError(RuntimeError):
    """A request ended without its completion; `status` is the HTTP status that says why."""

    status = 500


class EngineDeadError(RequestError):
    """The engine core process failed; no request can be served (the server exits)."""

    status = 503


class RequestAbortedError(RequestError):
    """The server aborted the request (its shutdown deadline passed)."""

    status = 503


class RequestRejectedError(RequestError):
    """The core refused the request at intake (a check the server had not made)."""

    status = 400


class RequestFailedError(RequestError):
    """Computing this request failed in the engine; the other requests went on."""


class RequestShedError(RequestError):
    """The scheduler shed the request: it could no longer meet its SLO (its class says so)."""

    status = 503


class Observer(Protocol):
    """Receives what metrics need; implemented by the server, optional."""

    def on_outputs(self, outputs: list[RequestOutput], num_new_tokens: int, now: float) -> None: ...

    def on_stats(self, stats: EngineStats) -> None: ...

    def on_abort(self, request_id: str) -> None: ...

    def on_add(self, request_id: str, slo: SLOClass) -> None: ...

    def on_shed(self, request_id: str) -> None: ...


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


class RequestStream:
    """A request's cumulative outputs as they grow; the last one is finished. Closing it
    before then (the client went away) aborts the request in the core."""

    def __init__(self, engine: AsyncLLM, request_id: str, collector: _Collector) -> None:
        self.engine, self.request_id, self._collector = engine, request_id, collector
        self.finished = False
        # (child id, future of the prompt tokens the core holds, -1 for no room): the
        # reservations of a request whose prompt KV a prefill instance sends
        self.reservations: list[tuple[str, asyncio.Future]] = []
        self._first: RequestOutput | None = None  # taken by started(), yielded first
        self.on_end: Callable[[], None] | None = None  # called once, when it ends either way

    async def started(self) -> None:
        """Wait for the first output, raising the request's error if it fails before one
        (a grammar that does not compile): a streamed response then starts only once there
        is something to send, so such a failure can still be a 4xx."""
        if self._first is None and not self.finished:
            self._first = await self.__anext__()

    async def reserved(self) -> list[tuple[str, int]]:
        """(child id, prompt tokens already held here) per sequence, once the core has
        reserved them; -1 where it had no room."""
        return [(rid, await fut) for rid, fut in self.reservations]

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        if self.finished:
            raise StopAsyncIteration
        try:
            output = await self._collector.get()
        except BaseException:  # cancelled (client gone), aborted, engine dead
            self.close()
            raise
        if output.finished:
            self.finished = True
            self.engine._release(self.request_id, abort=False)
            self._ended()
        return output

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._release(self.request_id, abort=True)
            self._ended()

    def _ended(self) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()

    async def aclose(self) -> None:
        self.close()


@dataclasses.dataclass
class _CoreLink:
    """The core process and the sockets to it."""

    proc: subprocess.Popen
    ctx: zmq.asyncio.Context
    inbox: zmq.asyncio.Socket  # we push requests; named from the core's side
    outbox: zmq.asyncio.Socket  # we pull outputs
    tmpdir: tempfile.TemporaryDirectory  # holds the ipc socket files

    def close(self) -> None:
        _kill(self.proc)
        self.ctx.destroy(linger=0)
        self.tmpdir.cleanup()


class AsyncLLM:
    """Create with `await AsyncLLM.start(config)`."""

    def __init__(self, config: EngineConfig, link: _CoreLink, ready: CoreReady, tokenizer):
        self.config = config
        self.proc = link.proc
        self._link, self._inbox, self._outbox = link, link.inbox, link.outbox
        self.core_pid = ready.pid
        self.model_path = ready.model_path
        self.max_model_len = ready.max_model_len
        self.quantization = ready.quantization
        self.max_request_tokens = ready.max_request_tokens
        self.vocab_size = ready.vocab_size
        self.kv_address = ready.kv_address  # a decode instance's, for the reservation answer
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self.observer: Observer | None = None
        self.on_dead: Callable[[str], None] | None = None  # the server exits on it
        self.stats: EngineStats | None = None
        self.dead: str | None = None  # why the core died, once it has
        self._lora_ops: dict[str, asyncio.Future] = {}  # LoRA loads and unloads in flight
        self._calls: dict[str, asyncio.Future] = {}  # control calls in flight (call_core)
        # RL: the weights' version (each update's answer sets it, before the outputs of the
        # steps after it are read), and generation paused: new requests are held here
        # (request id -> their messages) until resume
        self.weight_version = "default"
        self.report_weight_version = False  # put it on every output (the server's RL mode)
        self.paused: str | None = None  # the pause's mode
        self._core_paused = False  # the core told to stop stepping (abort, keep)
        self.sleeping = 0  # the sleep level (0: awake); new requests are held meanwhile
        self._held: dict[str, list[tuple[bytes, bytes]]] = {}
        self._collectors: dict[str, _Collector] = {}
        self._unscheduled: set[str] = set()  # child ids sent to the core, no token yet
        self._reservations: dict[str, asyncio.Future] = {}  # child id -> held tokens
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
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.setsockopt(zmq.SNDHWM, 0)  # never drop or block an add: the core drains all
        outbox.setsockopt(zmq.RCVHWM, 0)
        inbox.bind(in_addr)
        outbox.bind(out_addr)
        cmd = [
            sys.executable, "-m", "tandem.engine.core_proc",
            "--inbox", in_addr, "--outbox", out_addr,
            "--parent-pid", str(os.getpid()),
            "--config", json.dumps(dataclasses.asdict(config)),
        ]  # fmt: skip
        # Started from the main thread: PR_SET_PDEATHSIG fires when the starting thread exits.
        link = _CoreLink(subprocess.Popen(cmd), ctx, inbox, outbox, tmpdir)
        # Load the tokenizer while the core loads the model, when we know where it is (a GGUF
        # file's tokenizer appears only once the core has converted it).
        early = _tokenizer_folder(config)
        loading = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, early)) if early else None
        try:
            ready = await _wait_ready(link.proc, outbox)
            tokenizer = await loading if loading else load_tokenizer(ready.model_path)
        except BaseException:
            link.close()
            raise
        engine = cls(config, link, ready, tokenizer)
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
        self._link.close()

    # ---- requests ------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences waiting for room in the running batch, as best known now: the core's
        count at its last step, or those sent without a token yet beyond the batch's free
        slots, whichever is more."""
        stats = self.stats
        running, waiting = (stats.num_running, stats.num_waiting) if stats else (0, 0)
        free = max(0, self.config.max_num_seqs - running)
        return max(waiting, len(self._unscheduled) - free)

    @property
    def num_free_slots(self) -> int:
        """Places in the running batch not taken by running or just-sent sequences."""
        running = self.stats.num_running if self.stats else 0
        return max(0, self.config.max_num_seqs - running - len(self._unscheduled))

    @property
    def num_in_flight(self) -> int:
        return len(self._collectors)

    def add_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        slo: SLOClass = DEFAULT_CLASS,
        remote_prefill: bool = False,
        kv_transfer: list[KVTransferParams] | None = None,
        lora_id: int = 0,
        cache_salt: str | None = None,
        session: tuple[str, float] | None = None,
    ) -> RequestStream:
        """Send the request to the core now; iterate the stream for its outputs.

        remote_prefill: a decode instance's request whose prompt KV a prefill instance will
        send; the core reserves for it (await `stream.reserved()`). kv_transfer: a prefill
        instance's request, one destination per sequence, whose prompt KV goes there."""
        if self.dead:
            raise EngineDeadError(self.dead)
        if kv_transfer is not None and len(kv_transfer) != params.n:
            raise ValueError(
                f"kv_transfer_params: {len(kv_transfer)} requests for {params.n} sequences"
            )
        request_id = request_id or uuid.uuid4().hex
        core_requests = self.processor.add_request(
            request_id, prompt, prompt_token_ids, params, time.monotonic(), priority, slo,
            lora_id=lora_id, cache_salt=cache_salt,
        )  # fmt: skip
        for creq, transfer in zip(core_requests, kv_transfer or ()):
            creq.kv_transfer = transfer
        for creq in core_requests if session is not None else ():
            creq.session_id, creq.session_ttl = session  # its prefix pinned after, for the TTL
        try:  # built whole before anything is registered or sent: a failure leaves no trace
            payloads = [self._encoder.encode(creq) for creq in core_requests]
        except (OverflowError, TypeError, ValueError) as e:
            self.processor.abort(request_id)
            raise ValueError(f"request: cannot be encoded for the engine: {e}") from None
        collector = self._collectors[request_id] = _Collector()
        if self.observer is not None:
            self.observer.on_add(request_id, core_requests[0].slo)
        stream = RequestStream(self, request_id, collector)
        loop = asyncio.get_running_loop() if remote_prefill else None
        for creq, payload in zip(core_requests, payloads):
            self._unscheduled.add(creq.request_id)
            if remote_prefill:
                future = self._reservations[creq.request_id] = loop.create_future()
                stream.reservations.append((creq.request_id, future))
            kind = RESERVE if remote_prefill else ADD
            if self.paused or self.sleeping:
                self._held.setdefault(request_id, []).append((kind, payload))
            else:
                self._send(kind, payload)
        return stream

    def _release(self, request_id: str, abort: bool) -> None:
        for child_id in self.processor.child_ids(request_id):
            self._resolve_reservation(child_id, RequestAbortedError("the request was closed"))
        if self._collectors.pop(request_id, None) is not None and abort:
            self.abort(request_id)

    def _resolve_reservation(self, child_id: str, result: int | Exception) -> None:
        future = self._reservations.pop(child_id, None)
        if future is None or future.done():
            return
        if isinstance(result, Exception):
            future.set_exception(result)
            future.exception()  # retrieved: nobody may be awaiting it any more
        else:
            future.set_result(result)

    # ---- LoRA adapters --------------------------------------------------------------------
    async def load_lora(self, lora_id: int, path: str) -> None:
        """Have the core read and register an adapter; a ValueError says why it could not."""
        await self._lora_op(LOAD_LORA, LoRAOp(uuid.uuid4().hex, lora_id, path))

    async def unload_lora(self, lora_id: int) -> None:
        await self._lora_op(UNLOAD_LORA, LoRAOp(uuid.uuid4().hex, lora_id))

    async def _lora_op(self, kind: bytes, op: LoRAOp) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        future = self._lora_ops[op.op_id] = asyncio.get_running_loop().create_future()
        self._send(kind, self._encoder.encode(op))
        error = await future
        if error:
            raise ValueError(error)

    # ---- control calls (RL): pause, resume, weight updates, cache resets ------------------
    async def call_core(self, method: str, timeout: float, **args) -> dict:
        """Run a control call in the core between two steps; -> its result. A ValueError
        says why it could not; TimeoutError past `timeout` seconds (the call may still run)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        op_id = uuid.uuid4().hex
        future = self._calls[op_id] = asyncio.get_running_loop().create_future()
        self._send(UTILITY, self._encoder.encode(UtilityCall(op_id, method, args)))
        try:
            error, result = await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(op_id, None)
        if error:
            raise ValueError(error)
        return result or {}

    async def pause(self, mode: str, timeout: float, recompute_kv: bool = False) -> dict:
        """Hold new requests here until resume; then "abort" ends every request in flight
        (finish_reason "abort"), "keep" holds them in the core with their KV, "wait" returns
        once they have finished. A pause that fails (or times out) from running is undone."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode: {mode!r} is not one of abort, wait, keep")
        if mode == "wait" and self._core_paused:
            raise ValueError(
                "mode: wait cannot end while the core holds the running requests (a keep "
                "pause); resume first, or pause with abort"
            )
        before, self.paused = self.paused, mode
        try:
            if mode != "wait":
                self._core_paused = True  # (until resume says otherwise, whatever happens)
                return await self.call_core("pause", timeout, mode=mode, recompute_kv=recompute_kv)
            deadline = time.monotonic() + timeout
            while set(self._collectors) - set(self._held):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"requests still running after {timeout:g} s")
                await asyncio.sleep(0.01)
            return {"num_aborted": 0, "num_held": 0}
        except BaseException:
            if before is None:
                await self.resume(timeout)
            else:
                self.paused = before
            raise

    async def resume(self, timeout: float) -> None:
        """Continue: the core steps again, the held requests go to it in arrival order."""
        if self._core_paused and not self.dead:
            await self.call_core("resume", timeout)
        self._core_paused = False
        self.paused = None
        self._release_held()

    async def sleep(self, level: int, timeout: float) -> dict:
        """Free the core's memory (level 1: the KV pool; 2: the model too) while no request
        is in flight; new ones are held until wake_up. -> what the core measured."""
        if set(self._collectors) - set(self._held):
            raise ValueError("sleep: requests are in flight; pause (mode abort or wait) first")
        before, self.sleeping = self.sleeping, max(self.sleeping, level)  # hold from now on
        try:
            result = await self.call_core("sleep", timeout, level=level)
        except BaseException:
            self.sleeping = before
            self._release_held()
            raise
        self.sleeping = result["level"]
        return result

    async def wake_up(self, timeout: float) -> dict:
        result = await self.call_core("wake_up", timeout) if self.sleeping else {}
        self.sleeping = 0
        self._release_held()
        return result

    def _release_held(self) -> None:
        """Send the held requests in arrival order, unless paused or asleep still."""
        if self.paused or self.sleeping:
            return
        held, self._held = self._held, {}
        for messages in held.values():
            for kind, payload in messages:
                self._send(kind, payload)

    def abort(self, request_id: str) -> None:
        if self._held.pop(request_id, None) is not None:  # never sent: nothing to stop there
            self._unscheduled.difference_update(self.processor.child_ids(request_id))
            self.processor.abort(request_id)
            if self.observer is not None:
                self.observer.on_abort(request_id)
            return
        ids = self.processor.child_ids(request_id)
        self.processor.abort(request_id)
        self._unscheduled.difference_update(ids)
        if ids and not self.dead:
            self._send(ABORT, self._encoder.encode(ids))
        if self.observer is not None:
            self.observer.on_abort(request_id)

    def close_session(self, session_id: str) -> None:
        """Unpin an agent session's prefix in the core (its blocks stay cached, evictable)."""
        if not self.dead:
            self._send(CLOSE_SESSION, session_id.encode())

    def abort_all(self, error: Exception) -> None:
        """End every request in flight; their generators raise `error`."""
        for request_id in list(self._collectors):
            collector = self._collectors.pop(request_id)
            self.abort(request_id)
            collector.fail(error)

    def _send(self, kind: bytes, payload: bytes) -> None:
        # PUSH over ipc to a connected peer: queued at once, never blocks the event loop.
        self._inbox.send_multipart([kind, payload], copy=False)

    # ---- background tasks ------------------------------------------------------------
    async def _output_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(CoreMessage)
        try:
            while True:
                msg = decoder.decode(await self._outbox.recv(copy=False))
                if isinstance(msg, CoreFailed):
                    self._fail(msg.message)
                    return
                self._handle(msg)
        except Exception as e:  # a bug here would hang every request: fail them instead
            log.exception("processing the engine core's outputs failed")
            self._fail(f"processing outputs failed: {type(e).__name__}: {e}")

    def _handle(self, msg: CoreOutputs) -> None:
        if msg.stats is not None:
            self.stats = msg.stats
            if self.observer is not None:
                self.observer.on_stats(msg.stats)
        for op_id, error in msg.lora_results:
            future = self._lora_ops.pop(op_id, None)
            if future is not None and not future.done():
                future.set_result(error)
        for op_id, error, result in msg.utility_results:
            if not error and isinstance(result, dict) and "weight_version" in result:
                self.weight_version = result["weight_version"]  # for the outputs below
            future = self._calls.get(op_id)
            if future is not None and not future.done():
                future.set_result((error, result))
        for child_id, held in msg.reserved:
            self._resolve_reservation(child_id, held)
        for child_id, reason in msg.rejected:
            self._resolve_reservation(child_id, RequestRejectedError(reason))
            self._fail_request(child_id, RequestRejectedError(reason))
        for o in msg.outputs:
            if o.error is not None:
                error = RequestShedError if o.finish_reason == "shed" else RequestFailedError
                self._fail_request(o.request_id, error(o.error))
        if not msg.outputs:
            return
        self._unscheduled.difference_update(o.request_id for o in msg.outputs)
        results, stopped = self.processor.process(msg.outputs)
        if stopped:
            self._send(ABORT, self._encoder.encode(stopped))  # finished by a stop string
        if self.observer is not None:
            self.observer.on_outputs(results, _num_tokens(msg.outputs), time.monotonic())
        for output in results:
            if self.report_weight_version:
                output.weight_version = self.weight_version
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)

    def _fail_request(self, child_id: str, error: RequestError) -> None:
        """One of a request's sequences cannot finish: the request fails, its others stop."""
        request_id = self.processor.parent_id(child_id)
        collector = self._collectors.pop(request_id, None) if request_id else None
        if collector is not None:
            if isinstance(error, RequestShedError) and self.observer is not None:
                self.observer.on_shed(request_id)
            self.abort(request_id)
            collector.fail(error)

    async def _watch_core(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(0.2)
        if not self._closing:
            await asyncio.sleep(0.2)  # let a CoreFailed message with the reason land first
            self._fail(f"engine core process exited with code {self.proc.returncode}")

    def _fail(self, reason: str) -> None:
        if self.dead:
            return
        log.error("engine core is dead: %s", reason)
        self.dead = reason
        for child_id in list(self._reservations):
            self._resolve_reservation(child_id, EngineDeadError(reason))
        for future in self._lora_ops.values():
            if not future.done():
                future.set_result(f"the engine is dead: {reason}")
        for future in self._calls.values():
            if not future.done():
                future.set_result((f"the engine is dead: {reason}", None))
        self._lora_ops.clear()
        for collector in self._collectors.values():
            collector.fail(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)


async def _wait_ready(proc: subprocess.Popen, outbox, report_every: float = 30.0) -> CoreReady:
    """The core's CoreReady; while it loads the model (and builds kernels, bounded by
    --kernel-build-timeout), a line every `report_every` seconds says what the start waits for."""
    decoder = msgspec.msgpack.Decoder(CoreMessage)
    start = time.monotonic()
    next_report = start + report_every
    while True:
        if time.monotonic() >= next_report:
            log.info(
                "waiting for the engine core process (pid %d) to load the model: %.0f s so far",
                proc.pid,
                time.monotonic() - start,
            )
            next_report += report_every
        if await outbox.poll(200):
            msg = decoder.decode(await outbox.recv())
            if isinstance(msg, CoreFailed):
                raise ValueError(msg.message)
            if isinstance(msg, CoreReady):
                return msg
        elif proc.poll() is not None and not await outbox.poll(200):
            raise ValueError(f"engine core process exited with code {proc.returncode} at startup")


def _tokenizer_folder(config: EngineConfig) -> str | None:
    if config.tokenizer:
        return config.tokenizer
    if config.model and os.path.isfile(os.path.join(config.model, "config.json")):
        return config.model
    return None


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _num_tokens(outputs: list[EngineCoreOutput]) -> int:
    return sum(len(o.new_token_ids) for o in outputs)
