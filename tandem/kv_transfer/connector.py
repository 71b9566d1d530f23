"""Moving KV between instances: a sender (the prefill side) and a receiver (the decode side)
over ZeroMQ, one message per layer in the wire format of wire.py.

    sender.send(address, request_id, start, kv)      # kv: [layers, 2, tokens, heads, dim]
    sender.send_layer(address, request_id, layer, num_layers, start, k, v)  # or one by one
    sender.send_done(address, TransferDone(request_id, first_token))         # then the token
    done = receiver.poll(on_layer, timeout_ms, on_done)  # each layer handed over as it lands;
                                                     # (request_id, start) once all are in
    receiver.expire(older_than_s)                    # transfers that stalled

A send never blocks for long: a decode side that is not connected (dead, never started) or
that stopped reading fails it within `send_timeout_ms` with KVSendError, so a prefill
instance never holds KV for a peer that will not take it.

TCP now; the interface (send the KV of a token range with a request id; receive whole
requests; give up on stalled ones) is what an RDMA transport (Mooncake's transfer engine,
NIXL) would implement too. Layers of different requests may interleave.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from tandem.kv_transfer.curve import SenderKeys, secure_receiver
from tandem.kv_transfer.wire import (
    TransferDone,
    decode_done,
    decode_layer,
    encode_done,
    encode_layer,
)


class KVSendError(RuntimeError):
    """The decode side did not take the KV in time (not connected, or not reading)."""


class KVSender:
    def __init__(
        self,
        context: zmq.Context | None = None,
        linger_ms: int = 5000,
        send_timeout_ms: int = 2000,
        keys: SenderKeys | None = None,
    ) -> None:
        self.context = context or zmq.Context.instance()
        self.keys = keys  # CURVE: only a peer holding the decode secret key gets the KV
        self.linger_ms, self.send_timeout_ms = linger_ms, send_timeout_ms
        self._sockets: dict[str, zmq.Socket] = {}
        self.bytes_sent = 0

    def send(self, address: str, request_id: str, start: int, kv: torch.Tensor) -> int:
        """Queue every layer of kv ([layers, 2, tokens, kv_heads, head_dim], on the CPU) for
        `address`; returns the tensor bytes sent. The frames are not copied."""
        num_layers = kv.shape[0]
        return sum(
            self.send_layer(address, request_id, i, num_layers, start, kv[i, 0], kv[i, 1])
            for i in range(num_layers)
        )

    def send_layer(
        self, address: str, request_id: str, layer: int, num_layers: int, start: int, k, v,
        scales=None,
    ) -> int:  # fmt: skip
        """Queue one layer's K and V ([tokens, kv_heads, head_dim], on the CPU; 8-bit ones
        with their scales [2, tokens, kv_heads])."""
        frames = encode_layer(request_id, layer, num_layers, start, k, v, scales)
        self._send(address, frames)
        sent = sum(f.nbytes for f in frames[1:])
        self.bytes_sent += sent
        return sent

    def send_done(self, address: str, done: TransferDone) -> None:
        self._send(address, encode_done(done))

    def connect(self, address: str) -> None:
        """Start connecting now (the first send then rarely waits for the handshake)."""
        self._socket(address)

    def _send(self, address: str, frames: list) -> None:
        sock = self._socket(address)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            pass
        if not sock.poll(self.send_timeout_ms, zmq.POLLOUT):
            raise KVSendError(
                f"kv: the decode instance at {address} did not take KV within "
                f"{self.send_timeout_ms} ms (not running, or not reading)"
            )
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._sockets[address] = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, self.linger_ms)
            # Queue only for a live connection: KV for a dead peer fails its send at once
            # instead of piling up in memory until the peer comes back.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            if self.keys is not None:
                self.keys.apply(sock)
            sock.connect(address)
        return sock

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()


@dataclass
class _Progress:
    num_layers: int
    start: int
    first_seen: float
    layers: set[int] = field(default_factory=set)


class KVReceiver:
    def __init__(
        self,
        address: str,
        context: zmq.Context | None = None,
        secret_key: str | None = None,
        peer_keys: str | None = None,
    ) -> None:
        """address: where to listen, e.g. tcp://127.0.0.1:0 (0: any free port). With
        secret_key and peer_keys (curve.py), only those peers' frames arrive."""
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.auth = self.peers = None
        if secret_key is not None:
            self.auth, self.peers = secure_receiver(self.socket, secret_key, peer_keys)
        self.socket.bind(address)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._progress: dict[str, _Progress] = {}
        self.bytes_received = 0
        self.num_malformed = 0

    def poll(self, on_layer, timeout_ms: int = 0, on_done=None) -> list[tuple[str, int]]:
        """Take every message that has arrived (waiting up to timeout_ms for the first),
        handing each layer to on_layer(request_id, layer, start, k, v, scales) as it comes
        (the decode engine writes it straight into its paged cache; k, v and an 8-bit
        layer's scales, else None, are views of the received frames, valid during the call) and each end-of-transfer message to
        on_done(TransferDone). Returns (request_id, start) of the requests whose layers are
        now all in. A malformed message is counted in `num_malformed` and dropped."""
        done = []
        if timeout_ms and not self.socket.poll(timeout_ms):
            return done
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return done
            try:
                if len(frames) == 1:
                    finished = decode_done([frames[0].buffer])
                else:
                    header, k, v, scales = decode_layer([f.buffer for f in frames])
            except (ValueError, msgspec.DecodeError, IndexError):
                self.num_malformed += 1
                continue
            if len(frames) == 1:
                if on_done is not None:
                    on_done(finished)
                continue
            self.bytes_received += sum(f.buffer.nbytes for f in frames[1:])
            progress = self._progress.setdefault(
                header.request_id, _Progress(header.num_layers, header.start, time.monotonic())
            )
            on_layer(header.request_id, header.layer, header.start, k, v, scales)
            progress.layers.add(header.layer)
            if len(progress.layers) == progress.num_layers:
                del self._progress[header.request_id]
                done.append((header.request_id, progress.start))

    def expire(self, older_than_s: float) -> list[str]:
        """Drop transfers whose first layer came more than older_than_s ago and that are
        still incomplete (the sender died or stalled); return their request ids."""
        cutoff = time.monotonic() - older_than_s
        stale = [rid for rid, p in self._progress.items() if p.first_seen < cutoff]
        for rid in stale:
            del self._progress[rid]
        return stale

    def forget(self, request_id: str) -> None:
        """The request was aborted or released: stop tracking what arrived of it."""
        self._progress.pop(request_id, None)

    @property
    def num_partial(self) -> int:
        return len(self._progress)

    @property
    def num_refused(self) -> int:
        """Senders refused for an unknown key (an authenticated link only)."""
        return self.peers.refused if self.peers is not None else 0

    def close(self) -> None:
        self.socket.close()
        if self.auth is not None:
            self.auth.stop()


class Assembler:
    """An on_layer that gathers each request's layers into one [layers, 2, tokens, kv_heads,
    head_dim] tensor (for tests and tools; the engine imports layers in place instead)."""

    def __init__(self) -> None:
        self._layers: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def __call__(self, request_id: str, layer: int, start: int, k, v, scales=None) -> None:
        self._layers.setdefault(request_id, []).append((layer, torch.stack([k, v])))  # copied

    def take(self, request_id: str) -> torch.Tensor:
        layers = sorted(self._layers.pop(request_id), key=lambda item: item[0])
        return torch.stack([t for _, t in layers])
