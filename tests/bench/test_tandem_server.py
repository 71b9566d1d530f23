"""A short run against tandem's real server: every request is accounted for."""

from __future__ import annotations

import asyncio

import pytest

from tandem.bench.client import RequestSpec
from tandem.bench.runner import RunConfig, run_workload
from tandem.bench.servers import tandem_server
from tandem.bench.workloads import (
    LengthRange,
    json_schema_workload,
    multi_turn_workload,
    random_workload,
)
from tests.server.conftest import free_port

pytest.importorskip("tandem.server.cli")


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "tandem.log"
    extra = [
        "--served-model-name",
        "tiny",
        "--kv-cache-memory",
        "0.05",
        "--disable-uvicorn-access-log",
    ]
    srv = tandem_server(free_port(), str(llama_path), extra, log)
    with srv:
        srv.wait_ready(timeout=300)  # the engine core starts in its own process
        yield srv


@pytest.fixture(scope="module")
def tok(llama_path):
    from tandem.engine.tokenizer import load_tokenizer

    return load_tokenizer(llama_path)


def bench(server, sessions, chat=False, **cfg):
    spec = RequestSpec(
        url=server.base_url + ("/v1/chat/completions" if chat else "/v1/completions"),
        model="tiny",
        chat=chat,
        ignore_eos=True,
    )
    return asyncio.run(run_workload(sessions, spec, RunConfig(progress=False, **cfg)))


def test_random_run_completes_every_request(server, tok):
    from tandem.bench import metrics

    sessions = random_workload(tok, 10, LengthRange(8, 24), LengthRange(4, 8), seed=0)
    run = bench(server, sessions, request_rate=50.0, max_concurrency=4)
    s = metrics.summarize(run.results, run.duration)
    assert s["completed"] == 10 and s["failed"] == 0, [r.error for r in run.results]
    wanted = [x.requests[0].output_len for x in sessions]
    assert sorted(r.output_len for r in run.results) == sorted(wanted)  # ignore_eos honoured
    assert s["total_input_tokens"] == sum(x.requests[0].prompt_len for x in sessions)
    assert all(r.ttft > 0 for r in run.results)
    # A gap per chunk after the first; a fast engine may put several tokens in one chunk.
    assert all(len(r.itl) <= r.output_len - 1 for r in run.results)
    assert sum(len(r.itl) for r in run.results) > 0


def test_chat_multi_turn_run_completes(server, tok):
    sessions = multi_turn_workload(tok, 2, 3, LengthRange(6, 10), LengthRange(3, 5), seed=0)
    run = bench(server, sessions, chat=True, max_concurrency=2)
    assert len(run.results) == 6
    assert all(r.success for r in run.results), [r.error for r in run.results]


def test_json_schema_workload_answers_match_the_tools_schemas(server, tok):
    """--dataset-name json-schema: each request carries a tool's schema as response_format."""
    import json

    import jsonschema

    sessions = json_schema_workload(tok, 6, LengthRange(8, 16), LengthRange(200, 200), seed=0)
    spec = RequestSpec(url=server.base_url + "/v1/chat/completions", model="tiny", chat=True)
    run = asyncio.run(run_workload(sessions, spec, RunConfig(progress=False, max_concurrency=3)))
    assert all(r.success for r in run.results), [r.error for r in run.results]
    finished = 0
    for session, r in zip(sessions, run.results):  # results come in the order sent
        fmt = session.requests[0].body["response_format"]["json_schema"]
        if r.output_len < 200:  # ended by the grammar, not cut at max_tokens
            jsonschema.validate(json.loads(r.generated_text), fmt["schema"])
            finished += 1
    assert finished
