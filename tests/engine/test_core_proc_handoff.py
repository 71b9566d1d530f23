"""A decode instance's engine-core loop answers a reservation, and passes on a committed
transfer's first token, before it runs its next step: a step on a busy decode instance is
tens of ms, and the proxy waits on the first, the client on the second. The loop runs on
real ZeroMQ sockets around a core and KV receiver that record what was sent when."""

from __future__ import annotations

import os

import msgspec
import pytest
import zmq

from tandem.core.sampling_params import SamplingParams
from tandem.engine.core_proc import EngineCoreProc
from tandem.engine.messages import (
    RESERVE,
    CoreMessage,
    CoreOutputs,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
)


class Outbox:
    def __init__(self) -> None:
        self.sent: list[CoreOutputs] = []
        self.decoder = msgspec.msgpack.Decoder(CoreMessage)

    def send(self, data, copy=True) -> None:
        self.sent.append(self.decoder.decode(data))


class BusyCore:
    """A core with a request decoding: its one step records what had been sent before it."""

    stalled = False

    def __init__(self) -> None:
        self.compiling = {}  # no request waits for a grammar
        self.proc: EngineCoreProc | None = None
        self.sent_before_step: list[CoreOutputs] | None = None

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list[EngineCoreOutput]:
        self.sent_before_step = list(self.proc.outbox.sent)
        self.proc.stopping = True
        return [EngineCoreOutput("decoding", [7])]

    def stats(self) -> EngineStats:
        return EngineStats(1, 0, 0.0, 0, 0, 0, 0)


class ArrivedKV:
    """KVReceiving's surface: reservations hold 16 tokens; `committed` comes out of the
    first poll, as a finished transfer's first token does."""

    def __init__(self, socket, committed: list[EngineCoreOutput]) -> None:
        self.socket, self.committed = socket, committed

    def reserve(self, request) -> int:
        return 16

    def poll(self, timeout_ms: int = 0) -> list[EngineCoreOutput]:
        out, self.committed = self.committed, []
        return out

    def next_deadline_in(self) -> None:
        return None

    def fill_stats(self, stats) -> None:
        pass


@pytest.fixture
def loop():
    ctx = zmq.Context()
    inbox, client, kv_socket = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inbox.bind("inproc://inbox")
    client.connect("inproc://inbox")
    kv_socket.bind("inproc://kv")

    def run(messages, committed=()) -> tuple[BusyCore, list[CoreOutputs]]:
        core = BusyCore()
        proc = EngineCoreProc(
            core, inbox, Outbox(), os.getppid(), ArrivedKV(kv_socket, list(committed))
        )
        core.proc = proc
        for frames in messages:
            client.send_multipart(frames)
        proc.run()
        return core, proc.outbox.sent

    yield run
    ctx.destroy(linger=0)


def reserve_message(rid: str) -> list[bytes]:
    request = EngineCoreRequest(rid, list(range(20)), SamplingParams(max_tokens=4), 0.0)
    return [RESERVE, msgspec.msgpack.encode(request)]


def test_a_reservation_is_answered_before_the_next_step(loop):
    core, sent = loop([reserve_message("r1")])
    assert [m.reserved for m in core.sent_before_step] == [[("r1", 16)]]
    assert [o.request_id for o in sent[-1].outputs] == ["decoding"]  # the step's, after


def test_a_committed_transfers_first_token_goes_out_before_the_next_step(loop):
    core, sent = loop([], committed=[EngineCoreOutput("r2", [42])])
    assert [[(o.request_id, o.new_token_ids) for o in m.outputs]
            for m in core.sent_before_step] == [[("r2", [42])]]  # fmt: skip
    assert [o.request_id for o in sent[-1].outputs] == ["decoding"]


def test_with_nothing_to_answer_a_step_sends_one_message(loop):
    core, sent = loop([])
    assert core.sent_before_step == []
    assert len(sent) == 1
