"""The decode side of a handoff: reservations, the KV that fills them, and their deadlines.

    kv = KVReceiving(core, KVReceiver("tcp://127.0.0.1:7100"), num_layers, timeout_s=60)
    held = kv.reserve(request)         # prompt tokens already here (the rest will come), or None
    outputs = kv.poll(timeout_ms)      # import what arrived; commit finished transfers;
                                       # fail those past their deadline or sent wrong

A reservation's layers are written straight into its blocks as they land. The transfer's
last message carries the first token; with every layer in, the request is committed and
decodes from the next step. Whatever goes wrong (a stall, a sender that dies, a range or
shape that does not fit) ends in a failed request with its blocks returned, never in a
reservation held forever. KV for a request no longer reserved (aborted, failed) is dropped.
"""

from __future__ import annotations

import logging
import time

from tandem.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from tandem.kv_transfer.connector import KVReceiver
from tandem.kv_transfer.wire import TransferDone

log = logging.getLogger("tandem")


class KVReceiving:
    def __init__(
        self, core, receiver: KVReceiver, num_layers: int, timeout_s: float, clock=time.monotonic
    ) -> None:
        self.core, self.receiver, self.num_layers = core, receiver, num_layers
        self.timeout_s, self.clock = timeout_s, clock
        self.address = receiver.address
        self._deadline: dict[str, float] = {}  # request id -> when its reservation is given up
        self._reserved_at: dict[str, float] = {}
        self._layers: dict[str, set[int]] = {}  # the layers in so far, by request
        self._outputs: list[EngineCoreOutput] = []
        self.cached_tokens = 0  # prompt tokens reservations found here (not sent)
        self.failures = 0
        self.transfer_seconds: list[float] = []  # since the last stats

    @property
    def socket(self):
        return self.receiver.socket

    def reserve(self, req: EngineCoreRequest) -> int | None:
        held = self.core.reserve(req)
        if held is not None:
            now = self.clock()
            self._reserved_at[req.request_id] = now
            self._deadline[req.request_id] = now + self.timeout_s
            self.cached_tokens += held
        return held

    def next_deadline_in(self) -> float | None:
        """Seconds until the earliest reservation deadline (None: no reservation)."""
        return min(self._deadline.values()) - self.clock() if self._deadline else None

    def poll(self, timeout_ms: int = 0) -> list[EngineCoreOutput]:
        """Take the KV that has arrived; return the outputs of requests committed or failed."""
        self.receiver.poll(self._on_layer, timeout_ms, self._on_done)
        self.receiver.expire(self.timeout_s)  # partial transfers of requests gone meanwhile
        for rid in [r for r in self._deadline if r not in self.core.scheduler.reserved]:
            self._drop(rid)  # aborted
        self._expire()
        outputs, self._outputs = self._outputs, []
        return outputs

    def fill_stats(self, stats: EngineStats) -> None:
        stats.kv_bytes_received = self.receiver.bytes_received
        stats.kv_cached_tokens = self.cached_tokens
        stats.kv_transfer_failures = self.failures
        stats.kv_transfer_seconds, self.transfer_seconds = self.transfer_seconds, []

    # ---- the receiver's callbacks ------------------------------------------------------
    def _on_layer(self, rid: str, layer: int, start: int, k, v, scales=None) -> None:
        req = self.core.scheduler.reserved.get(rid)
        if req is None:
            return  # aborted, failed or expired: late KV is dropped
        if start != req.num_computed_tokens or start + k.shape[0] != req.num_prompt_tokens:
            self._fail(
                rid,
                f"KV transfer rejected: it carries positions [{start}, {start + k.shape[0]}) but "
                f"the reservation lacks [{req.num_computed_tokens}, {req.num_prompt_tokens})",
            )
            return
        try:
            self.core.receive_layer(rid, layer, start, k, v, scales)
        except (ValueError, RuntimeError, IndexError) as e:
            self._fail(rid, f"KV transfer rejected: {e}")
            return
        self._layers.setdefault(rid, set()).add(layer)

    def _on_done(self, done: TransferDone) -> None:
        rid = done.request_id
        if rid not in self.core.scheduler.reserved:
            return
        if len(self._layers.get(rid, ())) != self.num_layers:
            self._fail(rid, "KV transfer rejected: it ended before all of its layers arrived")
            return
        started = self._reserved_at[rid]
        self._drop(rid)
        self.transfer_seconds.append(self.clock() - started)
        self._outputs += self.core.commit(rid, done.first_token, done.logprobs)

    # ---- bookkeeping ---------------------------------------------------------------------
    def _expire(self) -> None:
        now = self.clock()
        for rid, deadline in list(self._deadline.items()):
            if now >= deadline:
                self._fail(rid, f"KV transfer timed out after {self.timeout_s:g} s")

    def _fail(self, rid: str, why: str) -> None:
        log.warning("request %s: %s", rid, why)
        self.failures += 1
        self._drop(rid)
        self._outputs += self.core.fail_reserved(rid, why)

    def _drop(self, rid: str) -> None:
        self._deadline.pop(rid, None)
        self._reserved_at.pop(rid, None)
        self._layers.pop(rid, None)
        self.receiver.forget(rid)
