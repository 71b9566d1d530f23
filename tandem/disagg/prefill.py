"""The prefill side of a handoff: a runner that streams the prompt KV of requests bound for a
decode instance, layer by layer, while the step that completes their prompt runs.

    runner = KVSendingRunner(model_runner, KVSender())

It wraps the model runner and decides nothing about what runs: for each request in the plan
whose chunk ends its prompt and that carries `kv_transfer`, it sends layer i's K and V of
the positions the decode side lacks as soon as layer i is written (the runner's
on_layer_written hook), then the sampled first token. Earlier chunks' KV is already in the
cache, so one send per layer covers the whole range. The request then finishes here (its
max_tokens is 1 on this side) and its blocks go back at once: nothing is held for a decode
side that never comes. A send that fails fails that request alone (RunnerOutput.errors).
"""

from __future__ import annotations

import logging

from tandem.core.runner import RunnerOutput
from tandem.core.scheduler import ScheduledRequest, SchedulerOutput
from tandem.kv_transfer.connector import KVSender, KVSendError
from tandem.kv_transfer.wire import TransferDone

log = logging.getLogger("tandem")


class KVSendingRunner:
    def __init__(self, runner, sender: KVSender, num_layers: int) -> None:
        self.runner, self.sender, self.num_layers = runner, sender, num_layers

    def __getattr__(self, name: str):  # export/import and the rest: the wrapped runner's
        return getattr(self.runner, name)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        sends = [s for s in plan.scheduled if _completes_prompt(s)]
        if not sends:
            return self.runner.execute(plan)
        failed: dict[str, str] = {}
        # A split model's layers are gathered from its ranks, which only a step's end allows
        # (the ranks are inside the forward until then): its layers go after the step.
        split = getattr(self.runner, "distributed", None) is not None
        if not split:
            self.runner.on_layer_written = lambda layer: self._send_layer(layer, sends, failed)
        try:
            result = self.runner.execute(plan)
        finally:
            self.runner.on_layer_written = None
        for layer in range(self.num_layers if split else 0):
            self._send_layer(layer, sends, failed)
        for s in sends:
            req, rid = s.request, s.request.request_id
            tokens, logprobs = result.sampled.get(rid), result.logprobs.get(rid)
            if rid not in failed and tokens:
                done = TransferDone(
                    req.kv_transfer.remote_request_id, tokens[0], logprobs[0] if logprobs else None
                )
                try:
                    self.sender.send_done(req.kv_transfer.address, done)
                except KVSendError as e:
                    failed[rid] = str(e)
        result.errors.update(failed)
        return result

    def _send_layer(self, layer: int, sends: list[ScheduledRequest], failed: dict) -> None:
        for s in sends:
            req = s.request
            if req.request_id in failed:
                continue
            t = req.kv_transfer
            k, v, scales = self.runner.export_layer(
                req.block_ids, layer, t.start, req.num_prompt_tokens
            )
            try:
                self.sender.send_layer(
                    t.address, t.remote_request_id, layer, self.num_layers, t.start, k, v, scales
                )
            except KVSendError as e:
                log.warning("request %s: %s", req.request_id, e)
                failed[req.request_id] = str(e)


def _completes_prompt(s: ScheduledRequest) -> bool:
    req = s.request
    return req.kv_transfer is not None and s.start + s.num_new_tokens == req.num_prompt_tokens
