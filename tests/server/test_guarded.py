"""A server with --api-key, --max-num-seqs 2, --max-waiting 2 and two served names."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_v1_needs_the_api_key(guarded_server):
    url = guarded_server.url
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]:
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["param"] is None
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    # health and metrics stay open
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_openai_client_with_and_without_the_key(guarded_server):
    base = f"{guarded_server.url}/v1"
    with openai.OpenAI(api_key="wrong", base_url=base, max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(api_key=API_KEY, base_url=base, max_retries=0) as good:
        assert [m.id for m in good.models.list().data] == ["tiny", "tiny-alias"]
        out = good.completions.create(model="tiny-alias", prompt="fox", max_tokens=3)
        assert out.model == "tiny"  # the first served name is reported
        with pytest.raises(openai.NotFoundError):
            good.completions.create(model="nope", prompt="fox")


def test_overload_is_503_with_retry_after_and_the_server_stays_up(guarded_server):
    url = guarded_server.url
    long = {"prompt": "The quick", "max_tokens": 900, "ignore_eos": True, "stream": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
            streams = []
            try:
                # 2 run (--max-num-seqs 2), 2 wait: the queue is full
                for _ in range(4):
                    req = client.build_request("POST", "/v1/completions", json=long)
                    streams.append(await client.send(req, stream=True))
                await _until(lambda: _metric(url, "running") == 2 and _metric(url, "waiting") == 2)
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 503, r.text
                assert r.headers["Retry-After"] == "1"
                err = r.json()["error"]
                assert err["type"] == "server_error" and "--max-waiting" in err["message"]
                # everything else still answers
                assert (await client.get("/health")).status_code == 200
                assert (await client.get("/v1/models")).status_code == 200
            finally:
                for s in streams:
                    await s.aclose()
            await _until(lambda: _metric(url, "running") == 0 and _metric(url, "waiting") == 0)
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2

    asyncio.run(scenario())


def test_requests_refused_at_intake_leave_no_ghost_in_the_waiting_count(guarded_server):
    url = guarded_server.url
    for _ in range(5):  # each once registered and never unregistered: 503 forever after
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "seed": 2**70}, headers=AUTH)
        assert r.status_code == 400
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert _metric(url, "waiting") == 0


def test_an_idle_server_admits_more_samples_than_the_waiting_limit(guarded_server):
    """--max-num-seqs 2 --max-waiting 2: n=3 on an idle server runs two and queues one."""
    body = {"prompt": "x", "max_tokens": 2, "n": 3}
    r = httpx.post(f"{guarded_server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    r = httpx.post(
        f"{guarded_server.url}/v1/completions", json={**body, "n": 5}, headers=AUTH, timeout=60
    )
    assert r.status_code == 503  # 3 would wait


def test_a_dead_engine_core_fails_requests_then_the_server_exits_nonzero(guarded_server):
    """kill -9 of the core with a stream and a plain request in flight: both get an error
    within a second or two, /health turns 503, and the server exits non-zero within a few
    seconds so a supervisor restarts it. Runs last: it ends the server."""
    url = guarded_server.url
    lines: list[str] = []
    plain: list[httpx.Response] = []
    body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH
        ) as r:
            lines.extend(line for line in r.iter_lines() if line)

    def post() -> None:
        plain.append(httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60))

    threads = [threading.Thread(target=stream), threading.Thread(target=post)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while _metric(url, "running") != 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(guarded_server.core_pid, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(10)
    assert time.monotonic() - killed < 3, "the in-flight requests were not failed promptly"
    assert lines[-1] == "data: [DONE]"
    assert "engine core" in json.loads(lines[-2][6:])["error"]["message"]
    assert plain[0].status_code == 503 and "engine" in plain[0].json()["error"]["message"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
    assert guarded_server.proc.wait(10) == 1
    assert time.monotonic() - killed < 10


def _metric(url: str, what: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"tandem:num_requests_{what}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(what)


async def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)
