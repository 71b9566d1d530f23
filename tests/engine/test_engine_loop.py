"""The real EngineCore loop with a scripted runner and a fake clock: the loop the simulator
will drive. No torch, no model."""

from __future__ import annotations

import json
import subprocess
import sys

from tandem.core.clock import FakeClock
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.engine.core import EngineCore
from tandem.engine.messages import EngineCoreRequest
from tests.engine.scripted_runner import ScriptedRunner

EOS = 2


def _engine(scripts, step_seconds, max_num_batched_tokens=8):
    clock = FakeClock()
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(SchedulerConfig(16, max_num_batched_tokens, 1024), kv, clock)
    runner = ScriptedRunner(clock, scripts, step_seconds)
    return EngineCore(scheduler, runner, clock, eos_token_ids=(EOS,)), runner, clock


def _request(rid, num_prompt, first_token=100, **params) -> EngineCoreRequest:
    prompt = list(range(first_token, first_token + num_prompt))
    return EngineCoreRequest(rid, prompt, SamplingParams(**params), arrival_time=0.0)


def _run(core: EngineCore, clock: FakeClock):
    """Step until done; per step: (clock after it, what each output said)."""
    steps = []
    while core.has_unfinished():
        outputs = core.step()
        core.scheduler.check_invariants()
        summary = [
            (o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason, o.first_scheduled_time)
            for o in outputs
        ]
        steps.append((clock(), summary))
    return steps


def _cost(plan) -> float:
    # step seconds = 0.5 + 0.125 per token: exact in binary, so times compare with ==
    return 0.5 + 0.125 * plan.total_num_tokens


def test_engine_core_imports_no_torch_and_the_server_no_model_or_runner():
    code = (
        "import sys, tandem.engine.core; assert 'torch' not in sys.modules, 'torch';"
        "import tandem.server.app;"
        "bad = [m for m in sys.modules if m.startswith(('tandem.model', 'tandem.runner'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_proxy_imports_no_torch():
    code = "import sys, tandem.disagg.proxy_cli, tandem.disagg.proxy; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loop_matches_a_hand_computed_schedule():
    scripts = {"a": [7, 8, 9], "b": [11, 42, 13]}
    core, runner, clock = _engine(scripts, _cost)
    core.add_request(_request("a", 6, max_tokens=3))
    core.add_request(_request("b", 10, first_token=200, max_tokens=5, stop_token_ids=[42]))

    steps = _run(core, clock)

    # budget 8: a's prompt (6) + 2 of b's; then a decodes while b's prefill takes the rest
    assert runner.plans == [
        [("a", 0, 6, True), ("b", 0, 2, False)],  # 8 tokens: 0.5 + 1.0 = 1.5 s
        [("a", 6, 1, True), ("b", 2, 7, False)],  # 8 tokens: 1.5 s
        [("a", 7, 1, True), ("b", 9, 1, True)],  # 2 tokens: 0.75 s
        [("b", 10, 1, True)],  # 1 token: 0.625 s
    ]
    assert steps == [
        (1.5, [("a", [7], None, None, 0.0)]),
        (3.0, [("a", [8], None, None, None)]),
        (3.75, [("a", [9], "length", None, None), ("b", [11], None, None, 0.0)]),
        (4.375, [("b", [42], "stop", 42, None)]),
    ]
    assert core.scheduler.kv.usage == 0
    assert runner.released == ["a"]  # b finished in the last step: released by the next one
    assert (core.num_steps, core.execute_seconds) == (4, 4.375)  # the steps, on the clock


def test_finished_request_state_is_released_when_the_next_step_schedules_nothing():
    core, runner, clock = _engine({"a": [EOS]}, _cost)
    core.add_request(_request("a", 3, max_tokens=4))
    assert core.step()[0].finish_reason == "stop"
    assert runner.state == {"a"} and not core.has_unfinished()

    assert core.step() == []  # nothing to schedule; the runner still hears that "a" ended
    assert runner.state == set() and runner.released == ["a"]
    assert core.num_steps == 1  # releasing state is not a step that ran the model
    assert runner.plans[-1] == []


def test_aborted_waiting_request_is_released_and_the_core_idles():
    core, runner, clock = _engine({"a": [5] * 8}, _cost)
    core.add_request(_request("a", 3, max_tokens=8))
    core.step()
    core.abort_requests(["a"])
    assert not core.has_unfinished()
    core.step()
    assert runner.released == ["a"] and runner.state == set()
    assert core.scheduler.kv.usage == 0
    assert core.stalled  # nothing was scheduled or preempted


def test_step_timings_are_read_on_the_engine_clock():
    core, runner, clock = _engine({"a": [5, 6]}, _cost)
    core.add_request(_request("a", 4, max_tokens=2))
    core.step()
    assert core.last_step_timings == {"schedule": 0.0, "execute": 1.0, "update": 0.0}


def test_a_step_log_holds_each_model_step_shape_and_seconds(tmp_path, monkeypatch):
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("TANDEM_STEP_LOG", str(log))
    core, runner, clock = _engine({"a": [7, 8], "b": [9]}, _cost)
    core.add_request(_request("a", 6, max_tokens=2))
    core.add_request(_request("b", 5, first_token=200, max_tokens=1))
    _run(core, clock)
    core.step()  # schedules nothing: no line

    # [prefill_tokens, decode_rows, kv_tokens, chunk_kv, prefill_rows, chunk_own, start,
    # seconds]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s[:3] + s[4:5] + s[-2:] for s in steps] == [
        [8, 0, 0, 2, 0.0, 1.5],  # a's prompt, 2 of b's: 8 tokens
        [3, 1, 6, 1, 1.5, 1.0],  # b's other 3 beside a's decode at 6 tokens of context
    ]
    assert len(steps) == core.num_steps


def test_a_request_that_breaks_the_runner_fails_alone_and_the_others_go_on():
    core, runner, clock = _engine({"ok": [5, 6, 7], "bad": [5, 6, 7]}, _cost, 64)
    runner.poison = {"bad"}
    core.add_request(_request("ok", 8, max_tokens=3))
    core.add_request(_request("bad", 8, first_token=300, max_tokens=3))

    steps = _run(core, clock)

    first = steps[0][1]
    assert ("bad", [], "error", None, None) in first and ("ok", [5], None, None, 0.0) in first
    assert [o for _, outs in steps for o in outs if o[0] == "ok"][-1][2] == "length"
    kv = core.scheduler.kv
    assert kv.usage == 0
    # bad's prompt blocks were published when scheduled but never written: not cached
    assert kv.match_prefix(_as_request(300, 8)) == []
    assert len(kv.match_prefix(_as_request(100, 8))) == 1  # ok's first full block is


def test_the_error_reaches_the_output():
    core, runner, clock = _engine({"bad": [5]}, _cost)
    runner.poison = {"bad"}
    core.add_request(_request("bad", 4, max_tokens=3))
    (out,) = core.step()
    assert out.finish_reason == "error" and "poisoned input" in out.error
    assert not core.has_unfinished()


def _as_request(first_token: int, n: int) -> Request:
    return Request("probe", list(range(first_token, first_token + n)), SamplingParams())
