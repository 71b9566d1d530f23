"""The KV link under attack, over real ZeroMQ sockets on loopback: CURVE admits only known
prefill keys (an unknown or keyless sender's frames never arrive, and the refusal is logged
and counted), and whatever bytes reach the decoder, malformed or hostile, are dropped and
counted, never a crash; the receiver keeps taking good transfers."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.cli import main
from tandem.kv_transfer.connector import Assembler, KVReceiver, KVSender, KVSendError
from tandem.kv_transfer.curve import SenderKeys
from tandem.kv_transfer.wire import LayerHeader, decode_layer, encode_layer
from tests.disagg.test_connector import _collect, _kv


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    """`tandem keys generate` for a decode instance, a known and an unknown prefill."""
    root = tmp_path_factory.mktemp("keys")
    for folder, name in (("decode", "decode"), ("prefill", "p0"), ("stranger", "s0")):
        assert main(["keys", "generate", str(root / folder), "--name", name]) == 0
    return {"decode_secret": str(root / "decode/decode.key_secret"),
            "decode_public": str(root / "decode/decode.key"), "prefills": str(root / "prefill"),
            "p0": str(root / "prefill/p0.key_secret"),
            "stranger": str(root / "stranger/s0.key_secret")}  # fmt: skip


@pytest.fixture
def receiver(keys):
    r = KVReceiver("tcp://127.0.0.1:0", context=zmq.Context(), secret_key=keys["decode_secret"],
                   peer_keys=keys["prefills"])  # fmt: skip
    yield r
    r.close()


def _send_quietly(sender: KVSender, address: str, rid: str, kv) -> None:
    try:
        sender.send(address, rid, 0, kv)
    except KVSendError:  # no handshake, no connection: the send is refused at once
        pass


def test_a_known_prefill_key_transfers_kv_exactly(receiver, keys):
    sender = KVSender(keys=SenderKeys(keys["p0"], keys["decode_public"]))
    kv = _kv(1)
    sender.send(receiver.address, "a", 0, kv)
    got = _collect(receiver, 1)
    assert torch.equal(got["a"][1], kv) and receiver.num_refused == 0
    sender.close()


def test_an_unknown_key_or_no_key_is_refused_and_logged_and_nothing_arrives(receiver, keys, caplog):
    stranger = KVSender(keys=SenderKeys(keys["stranger"], keys["decode_public"]),
                        send_timeout_ms=500)  # fmt: skip
    keyless = KVSender(send_timeout_ms=500)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        for sender in (stranger, keyless):
            _send_quietly(sender, receiver.address, "intruder", _kv(2))
        deadline = time.monotonic() + 5
        while receiver.num_refused == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert _collect(receiver, 1, timeout_s=1.0) == {}
    assert receiver.bytes_received == 0 and receiver.num_partial == 0
    assert receiver.num_refused >= 1
    assert "kv link: refused a sender with an unknown key" in caplog.text
    for s in (stranger, keyless):
        s.close()


def test_a_sender_that_does_not_hold_the_decode_key_cannot_connect(receiver, keys):
    """A prefill told the wrong server key (an impostor's address) never sends it KV."""
    wrong = SenderKeys(keys["p0"], keys["stranger"].removesuffix("_secret"))
    sender = KVSender(keys=wrong, send_timeout_ms=500)
    _send_quietly(sender, receiver.address, "misdirected", _kv(3))
    assert _collect(receiver, 1, timeout_s=1.0) == {}
    sender.close()


def test_the_peer_keys_flag_must_name_a_folder_of_public_keys(tmp_path, keys):
    with pytest.raises(ValueError, match="kv_peer_keys: no public .key files"):
        KVReceiver("tcp://127.0.0.1:0", secret_key=keys["decode_secret"], peer_keys=str(tmp_path))
    with pytest.raises(ValueError, match="kv_secret_key: .* holds a public key"):
        SenderKeys(keys["decode_public"], keys["decode_public"])


_headers = st.builds(
    LayerHeader,
    request_id=st.text(max_size=8),
    layer=st.integers(-2, 5),
    num_layers=st.integers(-1, 5),
    start=st.integers(-5, 10),
    end=st.integers(-5, 10),
    dtype=st.sampled_from(["float32", "bfloat16", "int8", "float64", "complex", ""]),
    shape=st.tuples(st.integers(-2, 4), st.integers(-1, 3), st.integers(-1, 4)),
    scaled=st.booleans(),
)
_frames = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=5),  # noise
    st.tuples(
        _headers.map(msgspec.msgpack.encode), st.binary(max_size=128), st.binary(max_size=128)
    ).map(list),  # a plausible header, wrong-sized tensors
    st.tuples(
        _headers.map(msgspec.msgpack.encode),
        st.binary(max_size=128),
        st.binary(max_size=128),
        st.binary(max_size=32),
    ).map(list),  # fmt: skip
)


@settings(max_examples=300, deadline=None)
@given(_frames)
def test_the_wire_decoder_refuses_anything_malformed_with_a_value_error(frames):
    try:
        header, k, v, scales = decode_layer(frames)
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
        return
    assert k.shape == v.shape == tuple(header.shape)  # what it accepts is consistent
    assert k.numel() * k.element_size() == len(frames[1])


@pytest.fixture(scope="module")
def open_link():
    receiver, sender = KVReceiver("tcp://127.0.0.1:0", context=zmq.Context()), KVSender()
    yield receiver, sender
    sender.close()
    receiver.close()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(_frames, min_size=1, max_size=4))
def test_hostile_frames_on_the_link_are_dropped_and_a_good_transfer_still_lands(open_link, bursts):
    receiver, sender = open_link
    sock = sender._socket(receiver.address)
    for frames in bursts:
        sock.send_multipart(frames)
    kv = _kv(4)
    frames = encode_layer("replayed", 0, 1, 0, kv[0, 0], kv[0, 1])
    sock.send_multipart([bytes(f) for f in frames])  # the same layer twice: a replay
    sock.send_multipart([bytes(f) for f in frames])
    sender.send(receiver.address, "good", 0, kv)
    got, assemble, deadline = None, Assembler(), time.monotonic() + 10
    while got is None and time.monotonic() < deadline:
        if ("good", 0) in receiver.poll(assemble, 100):
            got = assemble.take("good")
    assert got is not None and torch.equal(got, kv)
    receiver.expire(0)  # whatever hostile partial transfers were started
    receiver.poll(lambda *a: None, 50)
    receiver.expire(0)
    assert receiver.num_partial == 0
