"""KV over real ZeroMQ sockets on loopback TCP: whole requests arrive byte for byte, layers of
different requests interleave, and a transfer that stalls is given up on."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.kv_transfer.connector import Assembler, KVReceiver, KVSender


def _kv(seed: int, layers=3, tokens=5, heads=2, dim=4, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, tokens, heads, dim, generator=g).to(dtype)


def _collect(receiver: KVReceiver, n: int, timeout_s: float = 10.0) -> dict:
    got, deadline, assemble = {}, time.monotonic() + timeout_s, Assembler()
    while len(got) < n and time.monotonic() < deadline:
        for rid, start in receiver.poll(assemble, 100):
            got[rid] = (start, assemble.take(rid))
    return got


@pytest.fixture
def pair():
    receiver = KVReceiver("tcp://127.0.0.1:0")
    sender = KVSender()
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_requests_arrive_whole_and_exact(pair, dtype):
    sender, receiver = pair
    a, b = _kv(1, dtype=dtype), _kv(2, tokens=17, dtype=dtype)
    sent = sender.send(receiver.address, "a", 8, a) + sender.send(receiver.address, "b", 0, b)
    got = _collect(receiver, 2)
    assert got["a"][0] == 8 and torch.equal(got["a"][1], a)
    assert got["b"][0] == 0 and torch.equal(got["b"][1], b)
    assert got["a"][1].dtype == dtype
    assert sent == receiver.bytes_received == (a.numel() + b.numel()) * a.element_size()
    assert receiver.num_partial == 0


def test_a_transfer_missing_layers_is_expired_not_kept(pair):
    sender, receiver = pair
    kv = _kv(3)
    sender.send(receiver.address, "whole", 0, kv)
    sender.send(receiver.address, "cut", 0, kv[:1].expand(1, *kv.shape[1:]))  # 1 of 1 layers
    got = _collect(receiver, 2)
    assert set(got) == {"whole", "cut"}
    # a sender that dies after the first layer of three
    from tandem.kv_transfer.wire import encode_layer

    sock = sender._socket(receiver.address)
    sock.send_multipart(encode_layer("stalled", 0, 3, 0, kv[0, 0], kv[0, 1]), copy=False)
    deadline = time.monotonic() + 5
    while receiver.num_partial == 0 and time.monotonic() < deadline:
        receiver.poll(Assembler(), 50)
    assert receiver.num_partial == 1
    assert receiver.expire(60.0) == []  # not stale yet
    time.sleep(0.05)
    assert receiver.expire(0.01) == ["stalled"] and receiver.num_partial == 0


def test_an_empty_range_travels_too(pair):
    sender, receiver = pair
    empty = torch.zeros(2, 2, 0, 2, 4)
    sender.send(receiver.address, "none", 12, empty)
    got = _collect(receiver, 1)
    assert got["none"][0] == 12 and got["none"][1].shape == (2, 2, 0, 2, 4)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_8_bit_layers_arrive_as_stored_with_their_scales(pair, dtype):
    """An 8-bit cache's layers cross as their bytes plus a float32 scale per token and KV
    head: a quarter of float32's bytes and the scales, bit for bit."""
    sender, receiver = pair
    from tandem.model.kv_quant import quantize_kv

    x = _kv(3, layers=1, tokens=6, heads=2, dim=8)[0]  # [2, T, H, D]
    (k, ks), (v, vs) = quantize_kv(x[0], dtype), quantize_kv(x[1], dtype)
    sent = sender.send_layer(receiver.address, "q", 0, 1, 4, k, v, torch.stack([ks, vs]))
    got = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        receiver.poll(lambda *a: got.append([t.clone() if t is not None else t for t in a[3:]]), 100)  # fmt: skip
    ((gk, gv, gs),) = got
    assert gk.dtype == dtype and torch.equal(gk.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(gv.view(torch.uint8), v.view(torch.uint8))
    assert torch.equal(gs, torch.stack([ks, vs]))
    assert sent == receiver.bytes_received == 2 * k.numel() + 4 * 2 * 6 * 2
    with pytest.raises(ValueError, match="travel with scales"):
        sender.send_layer(receiver.address, "q", 0, 1, 4, k, v)  # 8-bit without its scales
