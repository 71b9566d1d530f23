"""The engine core's KV event publisher: vLLM's `--kv-events-config` and its ZeroMQ protocol,
so a subscriber written for vLLM (llm-d's, Dynamo's routers; vLLM's example) reads tandem's.

    PUB     [topic, seq (8 bytes, big-endian), msgpack KVEventBatch]  one per engine step
    ROUTER  replay: a REQ sends a start seq (8 bytes, big-endian) and gets back every batch
            still buffered from it on, [seq, payload] each, then [-1 (8 bytes), b""]

As vLLM's, an endpoint with `*` (or ipc://, inproc://) is bound, any other is connected to;
the replay endpoint is always bound. Sending runs on a thread of its own, so a slow network
never holds up a step; the replay buffer keeps the last `buffer_steps` batches.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, fields

import msgspec
import zmq

from tandem.core.kv_events import KVEventBatch

log = logging.getLogger("tandem")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields (the JSON of --kv-events-config)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # zmq | null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        """The flag's JSON -> a config, or None when events are off; a ValueError naming the
        field for anything else."""
        if text is None:
            return None
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_events_config: not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("kv_events_config: must be a JSON object")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"kv_events_config: unknown field {unknown[0]!r}")
        config = cls(**data)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher: zmq or null, got {config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name}: a positive integer, got {value!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(config, name), str):
                raise ValueError(f"kv_events_config.{name}: a string")
        if not isinstance(config.replay_endpoint, str | None):
            raise ValueError("kv_events_config.replay_endpoint: a string")
        if not isinstance(config.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events: true or false")
        if not config.enable_kv_cache_events or config.publisher == "null":
            return None
        return config


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self.dropped = 0  # batches refused by a full queue (a subscriber sees the seq gap)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s", endpoint,
                 f", replay on {config.replay_endpoint}" if self._replay else "")  # fmt: skip

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def shutdown(self, timeout: float = 1.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def build_publisher(text: str | None) -> ZmqEventPublisher | None:
    config = KVEventsConfig.parse(text)
    return ZmqEventPublisher(config) if config is not None else None
