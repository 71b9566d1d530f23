"""The engine core in its own process, talking to the server over ZeroMQ, as vLLM v1 does.
The messages are in engine/messages.py; this is the process's composition root and loop.

The core drains every pending message before each step and blocks on its socket when it has
no work, or when its last step could do nothing (only a message can change that), so a model
step never waits on HTTP, HTTP never waits on a step, and an idle core uses no CPU. It dies
with its parent: PR_SET_PDEATHSIG on Linux, and a check of the parent's pid while idle.

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

import msgspec
import zmq

from tandem.engine.messages import (
    ABORT,
    ADD,
    SHUTDOWN,
    CoreFailed,
    CoreOutputs,
    CoreReady,
    EngineCoreOutput,
    EngineCoreRequest,
)

log = logging.getLogger("tandem")

_IDLE_POLL_MS = 500


class EngineCoreProc:
    """The busy loop around an EngineCore."""

    def __init__(self, core, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.abort_decoder = msgspec.msgpack.Decoder(list[str])
        self.rejected: list[tuple[str, str]] = []
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            idle = not self.core.has_unfinished() or self.core.stalled
            got = self._drain(block=idle)
            if self.stopping:
                break
            if self.core.has_unfinished() or got:
                # After aborts with nothing left, this step only releases their state; its
                # stats let the server's metrics see the freed blocks.
                self._send(self.core.step())

    def _drain(self, block: bool) -> int:
        """Handle every pending message; when `block`, first wait for one."""
        if block:
            while not self.inbox.poll(_IDLE_POLL_MS):
                self._exit_if_orphaned()
        else:
            self._exit_if_orphaned()
        handled = 0
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            self._handle(frames)
            handled += 1

    def _handle(self, frames: list[bytes]) -> None:
        kind = frames[0]
        if kind == ADD:
            request = self.request_decoder.decode(frames[1])
            try:
                self.core.add_request(request)
            except Exception as e:  # one bad request never takes the core down
                reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                self.rejected.append((request.request_id, reason))
        elif kind == ABORT:
            self.core.abort_requests(self.abort_decoder.decode(frames[1]))
        elif kind == SHUTDOWN:
            self.stopping = True

    def _send(self, outputs: list[EngineCoreOutput]) -> None:
        msg = CoreOutputs(outputs, self.core.stats(), self.rejected)
        self.rejected = []
        self.outbox.send(self.encoder.encode(msg), copy=False)

    def _exit_if_orphaned(self) -> None:
        if os.getppid() != self.parent_pid:
            log.warning("engine core: the server (pid %d) is gone; exiting", self.parent_pid)
            os._exit(1)


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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(message)s")

    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.setsockopt(zmq.RCVHWM, 0)
    outbox.setsockopt(zmq.SNDHWM, 0)
    inbox.connect(args.inbox)
    outbox.connect(args.outbox)
    outbox.setsockopt(zmq.LINGER, 5000)
    encoder = msgspec.msgpack.Encoder()
    try:
        core, loaded = _build_core(json.loads(args.config))
    except Exception as e:  # report any startup failure to the server, which exits with it
        message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        outbox.send(encoder.encode(CoreFailed(message)))
        ctx.destroy(linger=5000)
        return 1
    outbox.send(encoder.encode(_ready(core, loaded)))
    proc = EngineCoreProc(core, inbox, outbox, args.parent_pid)
    try:
        proc.run()
    except Exception as e:
        log.exception("engine core failed")
        outbox.send(encoder.encode(CoreFailed(f"engine core failed: {type(e).__name__}: {e}")))
        ctx.destroy(linger=2000)
        return 1
    ctx.destroy(linger=1000)
    return 0


def _build_core(config: dict):
    from tandem.engine.builder import build_engine
    from tandem.engine.config import EngineConfig

    return build_engine(EngineConfig(**config))


def _ready(core, loaded) -> CoreReady:
    return CoreReady(
        pid=os.getpid(),
        model_path=str(loaded.model_path),
        max_model_len=loaded.max_model_len,
        max_request_tokens=core.scheduler.max_request_tokens,
        vocab_size=loaded.model_config.vocab_size,
    )


if __name__ == "__main__":
    code = main()
    # Nothing is left to clean up; skip the interpreter's slow teardown of torch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
