"""SLO classes over HTTP: requests pick a class, the scheduler sheds what cannot meet its SLO
with a 503 naming it, and /metrics reports attainment per class."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import Server

CLASSES = [
    {"name": "interactive", "priority": 0, "ttft_ms": 60_000, "tpot_ms": 60_000},
    {"name": "batch", "priority": 1, "on_overload": "demote"},
    {"name": "hopeless", "priority": 0, "ttft_ms": 0.001, "on_overload": "shed"},
]


@pytest.fixture(scope="module")
def slo_server(llama_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slo")
    (tmp / "classes.json").write_text(json.dumps(CLASSES))
    args = ["--scheduling-policy", "slo", "--slo-classes", str(tmp / "classes.json")]
    server = Server(llama_path, args, tmp, "slo").wait_ready()
    yield server
    server.stop()


def _post(server, **body):
    return httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "The quick", **body}, timeout=60
    )


def _series(server, name: str, cls: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(f"tandem:{name}") and f'class="{cls}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_requests_pick_their_class_and_attainment_is_reported_by_class(slo_server):
    for cls in ("interactive", "batch"):
        r = _post(slo_server, max_tokens=4, slo_class=cls)
        assert r.status_code == 200, r.text
    assert _series(slo_server, "slo_requests_total", "interactive") >= 1
    assert _series(slo_server, "slo_met_total", "interactive") >= 1  # a minute is plenty
    assert _series(slo_server, "slo_ttft_met_total", "batch") >= 1  # no target: met
    text = httpx.get(f"{slo_server.url}/metrics").text
    assert "tandem:step_time_predicted_seconds" in text and "tandem:step_time_seconds" in text


def test_a_request_that_cannot_meet_its_slo_is_shed_with_a_503_naming_it(slo_server):
    before = _series(slo_server, "requests_shed_total", "hopeless")
    for stream in (False, True):
        r = _post(slo_server, max_tokens=4, slo_class="hopeless", stream=stream)
        if not stream:
            assert r.status_code == 503
            message = r.json()["error"]["message"]
        else:  # the stream started: the error comes as an event
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
            message = events[-1]["error"]["message"]
        assert "TTFT target of 0.001 ms" in message and "hopeless" in message
    assert _series(slo_server, "requests_shed_total", "hopeless") == before + 2
    m = httpx.get(f"{slo_server.url}/metrics").text
    assert 'tandem:kv_cache_usage_perc{engine="0"' in m
    assert _post(slo_server, max_tokens=2).status_code == 200  # the default class: served


def test_own_targets_and_unknown_classes(slo_server):
    assert _post(slo_server, max_tokens=2, ttft_ms=30_000, tpot_ms=5_000).status_code == 200
    r = _post(slo_server, max_tokens=2, slo_class="gold")
    assert r.status_code == 400 and r.json()["error"]["param"] == "slo_class"
    assert "interactive" in r.json()["error"]["message"]
    r = _post(slo_server, max_tokens=2, ttft_ms=-5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttft_ms"


def test_a_bad_cost_model_file_fails_at_startup(llama_path, tmp_path):
    import subprocess
    import sys

    from tests.server.conftest import ROOT

    (tmp_path / "cost.json").write_text("{}")
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", str(llama_path), "--port", "0",
         "--cost-model", str(tmp_path / "cost.json"), "--kv-cache-memory", "0.01"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "cost_model: cannot read" in done.stderr
