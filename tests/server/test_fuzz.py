"""The whole HTTP surface, fuzzed from its own /openapi.json (schemathesis strategies: bodies
that fit the schema and bodies that break it): no request gets a 5xx or a stream error, the
server stays healthy throughout, and afterwards nothing waits and no KV block is held."""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow  # schemathesis over every endpoint

CASES_PER_OPERATION = 100  # per mode: ~1100 requests over the 10 operations


def _operations(url: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


def _fuzz(url: str, mode: GenerationMode) -> list[str]:
    """Every operation fuzzed in `mode`; -> the failures (one per operation at most)."""
    operations = _operations(url)
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    if mode is GenerationMode.NEGATIVE:  # a GET without parameters has nothing to break
        operations = [op for op in operations if op.method.lower() == "post"]
    failures = []
    for op in operations:

        @given(case=op.as_strategy(mode))
        @settings(
            max_examples=CASES_PER_OPERATION,
            deadline=None,
            derandomize=True,  # the same cases every run
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def call(case):
            response = case.call(base_url=url, timeout=60)
            where = f"{case.method} {case.path} {case.body!r:.300}"
            assert response.status_code < 500, (response.status_code, response.text[:300], where)
            content_type = (response.headers.get("content-type") or [""])[0]  # a list here
            if content_type.startswith("text/event-stream"):
                assert '"server_error"' not in response.text, (response.text[-300:], where)

        try:
            call()
        except AssertionError as e:
            failures.append(f"{op.method.upper()} {op.path}: {e}")
        if httpx.get(f"{url}/health", timeout=10).status_code != 200:
            failures.append(f"unhealthy after {op.method.upper()} {op.path}")
    return failures


@pytest.fixture(scope="module")
def fuzzed(fuzz_server) -> dict[GenerationMode, list[str]]:
    """The fuzzing, run once for the module whichever of its tests runs first (or alone)."""
    return {mode: _fuzz(fuzz_server.url, mode) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_no_request_gets_a_server_error(fuzzed, mode):
    assert fuzzed[mode] == []


def test_after_the_fuzzing_nothing_is_held(fuzz_server, fuzzed):
    """Once the fuzzing has run (its fixture, in any test order): every request has ended
    and freed its KV."""
    deadline = time.monotonic() + 30
    while True:
        m = fuzz_server.metrics()
        idle = m["tandem:num_requests_running"] == 0 and m["tandem:num_requests_waiting"] == 0
        if (idle and m["tandem:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle and m["tandem:kv_cache_usage_perc"] == 0, m
    finished = sum(v for k, v in m.items() if k.startswith("tandem:request_success_total"))
    assert finished > 20, "the fuzzer hardly got a completion through"
