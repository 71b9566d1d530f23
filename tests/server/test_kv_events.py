"""KV events through a real server, read by a subscriber written with plain pyzmq and msgpack
as vLLM's example subscriber is (not tandem's classes): BlockStored for a prompt's blocks with
their tokens, BlockRemoved once other traffic evicts them, sequence numbers without gaps, and
the replay socket sending back what was published."""

from __future__ import annotations

import time

import httpx
import msgpack
import pytest
import zmq

BLOCK = 16


@pytest.fixture
def subscriber(events_server):
    pub, _ = events_server.kv_events
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.5)  # the subscription reaches the publisher before anything is sent
    yield sub
    sub.close(linger=0)


def complete(server, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def receive(sub, until, timeout: float = 15.0) -> list[tuple[int, list]]:
    """(seq, events) batches until `until(all events so far)` holds."""
    got, events = [], []
    deadline = time.monotonic() + timeout
    while not until(events):
        assert sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no batch in time"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        ts, batch_events, *rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank in ([], [None], [0])
        got.append((int.from_bytes(seq, "big"), batch_events))
        events += batch_events
    return got


def test_a_subscriber_sees_a_prompts_blocks_stored_and_later_removed(events_server, subscriber):
    prompt = [(7 * i + 3) % 200 + 20 for i in range(50)]
    complete(events_server, prompt)

    def stored_prompt(events):
        tokens = [t for e in events if e[0] == "BlockStored" for t in e[3]]
        return tokens[: 3 * BLOCK] == prompt[: 3 * BLOCK]

    batches = receive(subscriber, stored_prompt)
    stored = [e for _, es in batches for e in es if e[0] == "BlockStored"]
    tag, hashes, parent, tokens, block_size, lora_id, medium = stored[0]
    assert parent is None and block_size == BLOCK and lora_id is None and medium == "CPU"
    ours = [h for e in stored for h in e[1]][:3]
    assert all(isinstance(h, int) for h in ours) and len(set(ours)) == 3
    seqs = [s for s, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps

    for i in range(4):  # distinct prompts that need the 24-block pool back
        complete(events_server, [(11 * j + i) % 200 + 20 for j in range(200)])
    receive(
        subscriber,
        lambda events: set(ours) <= {h for e in events if e[0] == "BlockRemoved" for h in e[1]},
    )


def test_the_replay_socket_sends_back_every_batch_from_a_sequence_number(events_server):
    _, replay_address = events_server.kv_events
    complete(events_server, [(5 * i + 1) % 200 + 20 for i in range(40)])
    time.sleep(0.5)  # the step's batch reaches the publisher's buffer
    # a DEALER, framed as a REQ (an empty delimiter first): the answer is many messages
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_address)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                break
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    finally:
        dealer.close(linger=0)
    assert replayed and replayed[0][0] == 0
    assert [s for s, _ in replayed] == list(range(len(replayed)))
    assert any(e[0] == "BlockStored" for _, b in replayed for e in b[1])
