"""The two halves of a handoff in one process, over real sockets: KVSendingRunner on a prefill
engine streams layers while the step that ends the prompt runs; KVReceiving on a decode
engine imports them, commits, and gives up on what is late, wrong or incomplete, with its
blocks returned every time."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.disagg.decode import KVReceiving
from tandem.disagg.prefill import KVSendingRunner
from tandem.engine.messages import EngineCoreRequest, KVTransferParams
from tandem.kv_transfer.connector import KVReceiver, KVSender
from tandem.kv_transfer.wire import TransferDone

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(37)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _engine(path, dtype="float32", block_size=4) -> LLM:
    return LLM(str(path), dtype=dtype, block_size=block_size, kv_cache_memory=0.01)


def _request(rid: str, max_tokens: int = 8) -> EngineCoreRequest:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(rid, list(PROMPT), params, arrival_time=0.0)


@pytest.fixture
def pair(llama_path):
    """(prefill engine with a sending runner, decode engine, its KVReceiving, fake clock)."""
    prefill, decode = _engine(llama_path), _engine(llama_path)
    layers = prefill.model_config.num_layers
    sender = KVSender(send_timeout_ms=300)
    prefill.engine.runner = KVSendingRunner(prefill.engine.runner, sender, layers)
    clock = FakeClock()
    receiver = KVReceiver("tcp://127.0.0.1:0")
    kv = KVReceiving(decode.engine, receiver, layers, timeout_s=5.0, clock=clock)
    yield prefill, decode, kv, clock
    sender.close()
    receiver.close()


def _poll_until(kv: KVReceiving, timeout_s: float = 5.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outputs = kv.poll(50)
        if outputs:
            return outputs
    return []


def _run_prefill(prefill: LLM, request: EngineCoreRequest) -> list:
    prefill.engine.add_request(request)
    outputs = []
    while prefill.engine.has_unfinished():
        outputs += prefill.engine.step()
    prefill.engine.step()  # release finished state
    return outputs


def _no_blocks_held(*llms: LLM) -> None:
    for llm in llms:
        llm.engine.scheduler.check_invariants()
        assert llm.engine.scheduler.kv.usage == 0


def test_layers_stream_during_the_last_prefill_step_and_the_decode_side_commits(pair):
    prefill, decode, kv, _ = pair
    request = _request("r")
    held = kv.reserve(copy.deepcopy(request))
    assert held == 0
    sent = copy.deepcopy(request)
    sent.kv_transfer = KVTransferParams(kv.address, "r", held)
    (out,) = _run_prefill(prefill, sent)
    assert out.finish_reason == "length" and len(out.new_token_ids) == 1  # one token here
    (first,) = _poll_until(kv)
    assert first.new_token_ids == out.new_token_ids and first.error is None
    tokens = list(first.new_token_ids)
    while decode.engine.has_unfinished():
        tokens += [t for o in decode.engine.step() for t in o.new_token_ids]
    reference = prefill.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert tokens == reference[0].outputs[0].token_ids
    assert kv.receiver.bytes_received == prefill.engine.runner.sender.bytes_sent > 0
    decode.engine.step()
    _no_blocks_held(prefill, decode)


def test_a_reservation_whose_kv_never_comes_fails_at_its_deadline(pair):
    _, decode, kv, clock = pair
    kv.reserve(_request("late"))
    assert decode.engine.scheduler.kv.usage > 0
    clock.now = 4.9
    assert kv.poll() == [] and kv.next_deadline_in() == pytest.approx(0.1)
    clock.now = 5.0
    (failed,) = kv.poll()
    assert failed.request_id == "late" and "timed out after 5 s" in failed.error
    assert kv.failures == 1
    decode.engine.step()
    _no_blocks_held(decode)


def test_kv_for_the_wrong_positions_is_rejected_and_the_reservation_released(pair):
    _, decode, kv, _ = pair
    kv.reserve(_request("wrong"))
    sender = KVSender()
    k = torch.zeros(5, decode.model_config.num_kv_heads, decode.model_config.head_dim)
    sender.send_layer(kv.address, "wrong", 0, kv.num_layers, 3, k, k)  # not [0, 37)
    (failed,) = _poll_until(kv)
    assert "positions [3, 8)" in failed.error and "lacks [0, 37)" in failed.error
    decode.engine.step()
    _no_blocks_held(decode)
    sender.close()


def test_a_transfer_that_ends_before_all_its_layers_is_rejected(pair):
    _, decode, kv, _ = pair
    kv.reserve(_request("cut"))
    cfg = decode.model_config
    sender = KVSender()
    k = torch.zeros(len(PROMPT), cfg.num_kv_heads, cfg.head_dim)
    sender.send_layer(kv.address, "cut", 0, kv.num_layers, 0, k, k)  # one layer of several
    sender.send_done(kv.address, TransferDone("cut", 7))
    (failed,) = _poll_until(kv)
    assert "before all of its layers" in failed.error
    decode.engine.step()
    _no_blocks_held(decode)
    sender.close()


def test_kv_for_an_aborted_reservation_is_dropped(pair):
    prefill, decode, kv, _ = pair
    kv.reserve(_request("gone"))
    decode.engine.abort_requests(["gone"])
    sent = _request("gone")
    sent.kv_transfer = KVTransferParams(kv.address, "gone", 0)
    _run_prefill(prefill, sent)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert kv.poll(50) == []
    decode.engine.step()
    _no_blocks_held(prefill, decode)


def test_an_unreachable_decode_side_fails_only_that_request_on_the_prefill_side(pair, llama_path):
    prefill, _, _, _ = pair
    lost = _request("lost")
    lost.kv_transfer = KVTransferParams("tcp://127.0.0.1:9", "lost", 0)  # nobody listens
    prefill.engine.add_request(lost)
    prefill.engine.add_request(_request("local", max_tokens=3))
    outputs = []
    while prefill.engine.has_unfinished():
        outputs += prefill.engine.step()
    errors = {o.request_id: o.error for o in outputs if o.error}
    assert list(errors) == ["lost"] and "did not take KV" in errors["lost"]
    local = [t for o in outputs if o.request_id == "local" for t in o.new_token_ids]
    assert len(local) == 3
    prefill.engine.step()
    _no_blocks_held(prefill)
