"""The engine core in its own process, talking to the server over ZeroMQ, as vLLM v1 does.
The messages are in engine/messages.py; this is the process's composition root and loop.

The core drains every pending message before each step and blocks on its sockets when it
has no work, or when its last step could do nothing (only a message can change that), so a
model step never waits on HTTP, HTTP never waits on a step, and an idle core uses no CPU. It
dies with its parent: PR_SET_PDEATHSIG on Linux, and a check of the parent's pid while idle.

A decode instance (--role decode) also listens for KV: it waits on both sockets at once,
waking for a request, a layer, or the next reservation deadline. A prefill instance
(--role prefill) sends KV from inside its runner (disagg/prefill.py).

Run as `python -m tandem.engine.core_proc` by `AsyncLLM`; not meant to be started by hand.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import zmq

from tandem.engine.control import ControlCalls
from tandem.engine.heap import freeze_startup_heap, resident_bytes
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
    CoreOutputs,
    CoreReady,
    EngineCoreOutput,
    EngineCoreRequest,
    LoRAOp,
    UtilityCall,
)
from tandem.logs import setup_logging

log = logging.getLogger("tandem")

_IDLE_POLL_MS = 500
_LOAD_POLL_MS = 5


class EngineCoreProc:
    """The busy loop around an EngineCore."""

    def __init__(
        self, core, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int, kv=None, sender=None
    ) -> None:
        self.core = core
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.kv = kv  # disagg.decode.KVReceiving on a decode instance
        self.sender = sender  # kv_transfer.connector.KVSender on a prefill instance
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        if kv is not None:
            self.poller.register(kv.socket, zmq.POLLIN)
        self.encoder = msgspec.msgpack.Encoder()
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.abort_decoder = msgspec.msgpack.Decoder(list[str])
        self.rejected: list[tuple[str, str]] = []
        self.reserved: list[tuple[str, int]] = []
        self.pending: list[EngineCoreOutput] = []  # committed or failed transfers
        self.lora_decoder = msgspec.msgpack.Decoder(LoRAOp)
        # Adapters being read off the step loop (their files, checked and converted), so a
        # load never holds up the steps of other requests.
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.loading: dict[str, tuple[LoRAOp, Future]] = {}
        self.lora_results: list[tuple[str, str]] = []
        self.utility_decoder = msgspec.msgpack.Decoder(UtilityCall)
        self.utility_results: list[tuple[str, str, object]] = []
        # control calls (RL: engine/control.py); the slow ones' waiting runs on the loader's
        # thread: op id -> (their work, what applies its result between steps)
        self.control = ControlCalls(core, emit=lambda outputs: self.pending.extend(outputs))
        self.updating: dict[str, tuple[Future, object]] = {}
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            idle = not self.core.has_unfinished() or self.core.stalled
            got = self._drain(block=idle)
            if self.stopping:
                break
            if self.reserved or self.pending:
                # A reservation's answer and a committed transfer's first token go out now,
                # not after the step: a step on a busy decode instance is tens of ms, and the
                # proxy waits on the first, the client on the second.
                self._send([])
            if self.core.has_unfinished() or got:
                # After aborts with nothing left, this step only releases their state; its
                # stats let the server's metrics see the freed blocks.
                self._send(self.core.step())

    def _drain(self, block: bool) -> int:
        """Handle every pending message (and KV); when `block`, first wait for one."""
        handled = 0
        if block:  # until a message, or KV that commits or fails a reservation (or a deadline)
            while not handled:
                ready = dict(self.poller.poll(self._wait_ms()))
                if self.inbox in ready:
                    break
                handled = self._take_kv() if self.kv is not None else 0
                handled += self._finish_loads() + self._finish_updates()
                handled += self._finish_compiles()
                handled += len(self.core.expire_sessions())  # freed blocks: stats go out
                self._exit_if_orphaned()
                self._check_ranks()
        else:
            self._exit_if_orphaned()
        if self.kv is not None:
            handled += self._take_kv()
        handled += self._finish_loads() + self._finish_updates()
        handled += self._finish_compiles()
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            self._handle(frames)
            handled += 1

    def _finish_compiles(self) -> int:
        """Admit the requests whose grammars compiled; refuse those that failed."""
        if not self.core.compiling:
            return 0
        before = len(self.core.compiling)
        refused = self.core.admit_compiled()
        self.rejected += refused
        if refused:
            self._send([])  # a refusal goes out now: its client waits on it alone
        return before - len(self.core.compiling)

    def _wait_ms(self) -> int:
        if self.loading or self.updating or self.core.compiling:  # look again soon
            return _LOAD_POLL_MS
        due = self.kv.next_deadline_in() if self.kv is not None else None
        return _IDLE_POLL_MS if due is None else max(1, min(_IDLE_POLL_MS, int(due * 1000) + 1))

    def _finish_loads(self) -> int:
        """Register the adapters whose files have been read; report every finished load."""
        done = [op_id for op_id, (_, f) in self.loading.items() if f.done()]
        for op_id in done:
            op, future = self.loading.pop(op_id)
            try:
                self.core.add_lora(op.lora_id, future.result())
                self.lora_results.append((op_id, ""))
            except Exception as e:
                self.lora_results.append((op_id, _reason(e)))
        return len(done)

    # ---- control calls (RL): between two steps ---------------------------------------------
    def _utility(self, call: UtilityCall) -> None:
        try:
            slow = self.control.slow(call.method)
            if slow is not None:  # its waiting (reads, a rendezvous, a broadcast) off the loop
                work, finish = slow(**call.args)
                self.updating[call.op_id] = (self.loader.submit(work), finish)
                return
            result = self.control.call(call.method, call.args)
        except Exception as e:
            self.utility_results.append((call.op_id, _reason(e), None))
            return
        self.utility_results.append((call.op_id, "", result))

    def _finish_updates(self) -> int:
        """Finish the slow control calls whose waiting is done (apply what they brought)."""
        done = [op_id for op_id, (f, _) in self.updating.items() if f.done()]
        for op_id in done:
            work, finish = self.updating.pop(op_id)
            try:
                self.utility_results.append((op_id, "", finish(work.result())))
            except Exception as e:
                self.utility_results.append((op_id, _reason(e), None))
        return len(done)

    def _take_kv(self) -> int:
        outputs = self.kv.poll()
        self.pending += outputs
        return len(outputs)

    def _decode_request(self, frame: bytes) -> EngineCoreRequest | None:
        """The request, or None after rejecting it: a request whose fields fail validation
        (a front end's bug, never the client's) is refused by id, never fatal to the core."""
        try:
            return self.request_decoder.decode(frame)
        except msgspec.ValidationError as e:
            fields = msgspec.msgpack.decode(frame)  # array_like: the request id comes first
            if not (isinstance(fields, list) and fields and isinstance(fields[0], str)):
                raise
            self.rejected.append((fields[0], str(e)))
            return None

    def _handle(self, frames: list[bytes]) -> None:
        kind = frames[0]
        if kind == ADD:
            request = self._decode_request(frames[1])
            if request is None:
                return
            try:
                if request.kv_transfer is not None:
                    if self.sender is None:
                        raise ValueError("kv_transfer: this instance does not send KV")
                    self.sender.connect(request.kv_transfer.address)
                self.core.add_request(request)
            except Exception as e:  # one bad request never takes the core down
                self.rejected.append((request.request_id, _reason(e)))
        elif kind == RESERVE:
            request = self._decode_request(frames[1])
            if request is None:
                return
            try:
                if self.kv is None:
                    raise ValueError("kv_transfer_params: this instance does not receive KV")
                held = self.kv.reserve(request)
                self.reserved.append((request.request_id, -1 if held is None else held))
            except Exception as e:
                self.rejected.append((request.request_id, _reason(e)))
        elif kind == LOAD_LORA:
            op = self.lora_decoder.decode(frames[1])
            self.loading[op.op_id] = (op, self.loader.submit(self.core.read_lora, op.path))
        elif kind == UNLOAD_LORA:
            op = self.lora_decoder.decode(frames[1])
            try:
                self.core.remove_lora(op.lora_id)
                self.lora_results.append((op.op_id, ""))
            except Exception as e:
                self.lora_results.append((op.op_id, _reason(e)))
        elif kind == UTILITY:
            self._utility(self.utility_decoder.decode(frames[1]))
        elif kind == CLOSE_SESSION:
            self.core.close_session(frames[1].decode())
        elif kind == ABORT:
            self.core.abort_requests(self.abort_decoder.decode(frames[1]))
        elif kind == SHUTDOWN:
            self.stopping = True

    def _send(self, outputs: list[EngineCoreOutput]) -> None:
        stats = self.core.stats()
        if self.kv is not None:
            self.kv.fill_stats(stats)
        if self.sender is not None:
            stats.kv_bytes_sent = self.sender.bytes_sent
        msg = CoreOutputs(
            self.pending + outputs, stats, self.rejected, self.reserved, self.lora_results,
            self.utility_results,
        )  # fmt: skip
        self.rejected, self.reserved, self.pending, self.lora_results = [], [], [], []
        self.utility_results = []
        self.outbox.send(self.encoder.encode(msg), copy=False)

    def _check_ranks(self) -> None:
        """An idle server with a split model still notices a rank that died (RankFailed
        ends the loop, and the server with it)."""
        check = getattr(self.core, "check_alive", None)
        if check is not None:
            check()

    def _exit_if_orphaned(self) -> None:
        if os.getppid() != self.parent_pid:
            log.warning("engine core: the server (pid %d) is gone; exiting", self.parent_pid)
            os._exit(1)


def _reason(e: Exception) -> str:
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this process when the parent dies; then check it has not already."""
    if sys.platform.startswith("linux"):
        try:
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="tandem engine core process (started by the server)")
    p.add_argument("--inbox", required=True, help="ZMQ address to receive requests on")
    p.add_argument("--outbox", required=True, help="ZMQ address to send outputs to")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = p.parse_args(argv)
    _die_with_parent(args.parent_pid)
    # SIGINT goes to the whole process group on Ctrl-C; the server decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging("core")

    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.setsockopt(zmq.RCVHWM, 0)
    outbox.setsockopt(zmq.SNDHWM, 0)
    inbox.connect(args.inbox)
    outbox.connect(args.outbox)
    outbox.setsockopt(zmq.LINGER, 5000)
    encoder = msgspec.msgpack.Encoder()
    try:
        config = _config(json.loads(args.config))
        import tandem.runner.builder  # noqa: F401  (torch and the model code: imported anyway)

        at_start = resident_bytes()  # the interpreter and its imports, before the model
        core, loaded = _build_core(config)
        core.rss_at_start = at_start
        kv, sender = _role(core, loaded, config)
    except Exception as e:  # report any startup failure to the server, which exits with it
        message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        outbox.send(encoder.encode(CoreFailed(message)))
        ctx.destroy(linger=5000)
        return 1
    freeze_startup_heap("engine core")
    outbox.send(encoder.encode(_ready(core, loaded, kv)))
    proc = EngineCoreProc(core, inbox, outbox, args.parent_pid, kv, sender)
    try:
        proc.run()
    except Exception as e:
        log.exception("engine core failed")
        outbox.send(encoder.encode(CoreFailed(f"engine core failed: {type(e).__name__}: {e}")))
        ctx.destroy(linger=2000)
        return 1
    if hasattr(core.runner, "close"):  # a split model's other ranks stop with it
        core.runner.close()
    ctx.destroy(linger=1000)
    return 0


def _config(config: dict):
    from tandem.engine.config import EngineConfig

    return EngineConfig(**config)


def _build_core(config):
    from tandem.engine.builder import build_engine

    core, loaded = build_engine(config)
    if core.grammars is not None:
        core.grammars.prepare()  # the vocabulary for grammars, while the server starts
    return core, loaded


def _role(core, loaded, config):
    """The KV ends of a prefill or decode instance: (KVReceiving | None, KVSender | None);
    both for one that may switch roles (--enable-role-switching): the role it serves is the
    server's to say, and each end acts only on the requests that ask for it."""
    num_layers = loaded.model_config.num_layers
    if config.role == "both":
        return None, None
    kv = sender = None
    if config.role == "prefill" or config.enable_role_switching:
        from tandem.disagg.prefill import KVSendingRunner
        from tandem.kv_transfer.connector import KVSender

        keys = None
        if config.kv_secret_key:
            from tandem.kv_transfer.curve import SenderKeys

            keys = SenderKeys(config.kv_secret_key, config.kv_peer_keys)
        sender = KVSender(keys=keys)
        core.runner = KVSendingRunner(core.runner, sender, num_layers)
    if config.role == "decode" or config.enable_role_switching:
        from tandem.disagg.decode import KVReceiving
        from tandem.kv_transfer.connector import KVReceiver

        try:
            receiver = KVReceiver(f"tcp://{config.kv_host}:{config.kv_port}",
                                  secret_key=config.kv_secret_key, peer_keys=config.kv_peer_keys)  # fmt: skip
        except zmq.ZMQError as e:
            raise ValueError(
                f"kv_port: cannot listen for KV on {config.kv_host}:{config.kv_port}: {e}"
            ) from None
        log.info("%s role: receiving KV on %s (%s)", config.role, receiver.address,
                 "CURVE: known prefill keys only" if receiver.auth else "unauthenticated")  # fmt: skip
        kv = KVReceiving(core, receiver, num_layers, config.kv_transfer_timeout)
    return kv, sender


def _ready(core, loaded, kv) -> CoreReady:
    return CoreReady(
        pid=os.getpid(),
        model_path=str(loaded.model_path),
        max_model_len=loaded.max_model_len,
        max_request_tokens=core.scheduler.max_request_tokens,
        vocab_size=loaded.model_config.vocab_size,
        kv_address=kv.address if kv is not None else None,
        quantization=loaded.weights,
    )


if __name__ == "__main__":
    code = main()
    # Nothing is left to clean up; skip the interpreter's slow teardown of torch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
