"""An engine-core process loop around a core with work it cannot schedule (a request parked
until a message arrives, as a PD decode request waits for its KV). Run by
test_core_proc_idle.py as `python -m tests.engine.parked_core INBOX OUTBOX`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import zmq

from tandem.engine.core_proc import EngineCoreProc
from tandem.engine.messages import EngineStats


class ParkedCore:
    """Has an unfinished request; every step schedules nothing, as EngineCore reports it."""

    def __init__(self) -> None:
        self.stalled = False
        self.steps = 0
        self.compiling = {}  # no request waits for a grammar

    def has_unfinished(self) -> bool:
        return True

    def step(self):
        self.steps += 1
        self.stalled = True
        return []

    def add_request(self, request) -> None:
        self.stalled = False

    def abort_requests(self, ids) -> None:
        self.stalled = False

    def expire_sessions(self) -> list[str]:
        return []  # no agent session pins anything here

    def stats(self) -> EngineStats:
        return EngineStats(0, self.steps, 0.0, 0, 0, 0, 0)


def launch(tmp_path):
    """-> (context, inbox PUSH, outbox PULL, process): a parked core on ipc sockets in
    tmp_path, for a test to talk to."""
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{tmp_path}/in")
    outbox.bind(f"ipc://{tmp_path}/out")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.parked_core", f"ipc://{tmp_path}/in",
         f"ipc://{tmp_path}/out"],
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    return ctx, inbox, outbox, proc


def main() -> None:
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(sys.argv[1])
    outbox.connect(sys.argv[2])
    EngineCoreProc(ParkedCore(), inbox, outbox, os.getppid()).run()
    ctx.destroy(linger=1000)


if __name__ == "__main__":
    main()
