"""The engine-core process blocks on its socket while its work cannot progress: it spends no
CPU until a message arrives, then steps once and blocks again."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import zmq

from tandem.engine.messages import ABORT, SHUTDOWN, CoreMessage, CoreOutputs
from tests.engine.parked_core import launch


def _loop_cpu_seconds(pid: int) -> float:
    """CPU time of the process's main thread, the one running the loop (its thread id is the
    pid): the ZMQ I/O thread and interpreter start-up residue are not the loop spinning."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def test_core_with_a_parked_request_uses_no_cpu_until_a_message_arrives(tmp_path):
    ctx, inbox, outbox, proc = launch(tmp_path)
    decoder = msgspec.msgpack.Decoder(CoreMessage)
    try:
        assert outbox.poll(30_000), "the loop never stepped"
        first = decoder.decode(outbox.recv())
        assert isinstance(first, CoreOutputs) and first.stats.num_waiting == 1
        time.sleep(0.5)  # past start-up
        before, sent = _loop_cpu_seconds(proc.pid), 0
        end = time.monotonic() + 2.0
        while time.monotonic() < end:  # keep reading, so a spinning loop never blocks on send
            if outbox.poll(20):
                outbox.recv()
                sent += 1
        used = _loop_cpu_seconds(proc.pid) - before
        # A spinning loop uses ~2 CPU seconds here, one polling every millisecond 0.11; the
        # blocked loop wakes 4 times (its 500 ms idle poll) and uses ~0.
        assert used < 0.1, f"the parked core spun: {used:.2f} CPU seconds in 2 s"
        assert sent == 0, f"it stepped {sent} times with nothing new"

        inbox.send_multipart([ABORT, msgspec.msgpack.encode(["nobody"])])
        assert outbox.poll(5_000)
        assert decoder.decode(outbox.recv()).stats.num_waiting == 2  # one step per message
        assert not outbox.poll(300)
    finally:
        try:  # (a core that died has no peer to take it: never block on it)
            inbox.send_multipart([SHUTDOWN], zmq.NOBLOCK)
        except zmq.Again:
            pass
        try:
            assert proc.wait(10) == 0
        finally:
            proc.kill()
            ctx.destroy(linger=0)
