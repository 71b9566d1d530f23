"""`tandem router` end to end, real processes on loopback: outputs equal a worker's own,
prefix-aware routing keeps a conversation on one worker, a worker killed under load costs no
request, a stalled worker is found by its probes, and workers come and go while it runs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.router.conftest import RouterProcess, StalledWorker
from tests.server.conftest import Server

pytestmark = pytest.mark.slow
PROBE = ("--probe-interval", "0.5")
OPS = {"Authorization": "Bearer sk-ops"}  # the steady router's admin key


@pytest.fixture(scope="module")
def cluster(llama_path, tmp_path_factory):
    """Everything the module needs, started at once: three workers behind a prefix-aware
    router, and behind a second one that only the routing test uses (so its view of what
    each worker caches starts empty, whatever the other tests sent); three more behind one
    whose worker gets killed; one behind a router that also has a stalled worker."""
    logs = tmp_path_factory.mktemp("router-logs")
    steady = [Server(llama_path, [], logs, f"steady-{i}") for i in range(3)]
    doomed = [Server(llama_path, [], logs, f"doomed-{i}") for i in range(3)]
    lone = Server(llama_path, [], logs, "lone")
    stalled = StalledWorker()
    routers = {
        "steady": RouterProcess(
            [s.url for s in steady], logs, "router-steady", (*PROBE, "--admin-api-key", "sk-ops")
        ),
        "prefix": RouterProcess([s.url for s in steady], logs, "router-prefix", PROBE),
        "doomed": RouterProcess([s.url for s in doomed], logs, "router-doomed", PROBE),
        "stalled": RouterProcess(
            [stalled.url, lone.url], logs, "router-stalled", (*PROBE, "--policy", "round_robin")
        ),
    }
    state = {"steady": steady, "doomed": doomed, "lone": lone, "routers": routers, "logs": logs}
    yield state
    for r in routers.values():
        r.stop()
    stalled.stop()
    for s in [*steady, *state["doomed"], lone]:
        s.terminate()
    for s in [*steady, *state["doomed"], lone]:
        s.stop()


def _up(servers: list[Server], router: RouterProcess) -> RouterProcess:
    """The servers ready and the router routing to all of them (a test that meant to use
    three workers once ran on the only one readmitted so far)."""
    for s in servers:
        s.wait_ready()
    return router.wait_ready().wait_healthy([s.url for s in servers])


def _greedy(prompt, max_tokens=10, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}  # fmt: skip


def _post(url: str, body: dict, path="/v1/completions", timeout=60) -> dict:
    r = httpx.post(url + path, json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed_text(url: str, body: dict, path="/v1/completions") -> str:
    text = ""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


def test_outputs_through_the_router_equal_a_worker_s_own(cluster):
    router = _up(cluster["steady"], cluster["routers"]["steady"])
    worker = cluster["steady"][0].url
    body = _greedy("The router passes this prompt on unchanged")
    assert _post(router.url, body)["choices"] == _post(worker, body)["choices"]
    assert _streamed_text(router.url, body) == _streamed_text(worker, body)
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    path = "/v1/chat/completions"
    assert _streamed_text(router.url, chat, path) == _streamed_text(worker, chat, path)
    bad = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_client_that_leaves_mid_stream_aborts_the_request_on_its_worker(cluster):
    router = _up(cluster["steady"], cluster["routers"]["steady"])
    body = _greedy("a long answer, abandoned " * 4, max_tokens=950, stream=True)
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break
    deadline = time.monotonic() + 1.0  # well before 950 tokens could have been generated
    busy = lambda: sum(  # noqa: E731
        w.metrics().get("tandem:num_requests_running", 0.0) for w in cluster["steady"]
    )
    while busy() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert busy() == 0
    assert all(w.metrics()["tandem:kv_cache_usage_perc"] == 0 for w in cluster["steady"])
    assert httpx.get(router.url + "/version").json()["version"]


def test_prefix_aware_routing_keeps_a_conversation_on_one_worker(cluster):
    """Each conversation's later turns hit the worker its first turn went to; a new one goes
    to the worker caching least, so three conversations spread out. (Its own router: on one
    that had routed other tests' prompts, "caching least" would depend on what those sent
    where.)"""
    router = _up(cluster["steady"], cluster["routers"]["prefix"])
    workers = cluster["steady"]
    used = []
    for c in range(3):
        history = f"Conversation {c}: " + " ".join(
            f"tool result {c}.{i} is fine." for i in range(40)
        )
        before = [w.metrics().get("tandem:prefix_cache_hits_total", 0.0) for w in workers]
        for turn in range(3):
            answer = _post(router.url, _greedy(history, max_tokens=4))
            history += answer["choices"][0]["text"] + f" Next call {turn}: list the rows again."
        after = [w.metrics().get("tandem:prefix_cache_hits_total", 0.0) for w in workers]
        gained = [i for i, (a, b) in enumerate(zip(after, before)) if a > b]
        assert len(gained) == 1, (before, after)  # every later turn hit on the same worker
        used.append(gained[0])
    assert len(set(used)) >= 2  # distinct conversations spread out


def test_workers_are_added_and_removed_while_the_router_runs(cluster):
    router = _up(cluster["steady"], cluster["routers"]["steady"])
    assert httpx.post(router.url + "/workers", json={"url": "http://x"}).status_code == 401
    added = httpx.post(
        router.url + "/workers", json={"url": "http://127.0.0.1:9"}, headers=OPS, timeout=10
    )
    assert added.status_code == 201
    wid = added.json()["id"]
    deadline = time.monotonic() + 10
    while router.workers()["http://127.0.0.1:9"]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not router.workers()["http://127.0.0.1:9"]["healthy"]  # nobody there: ejected
    for _ in range(3):  # and never chosen meanwhile
        _post(router.url, _greedy("still served"))
    assert httpx.delete(f"{router.url}/workers/{wid}").status_code == 401
    assert httpx.delete(f"{router.url}/workers/{wid}", headers=OPS).status_code == 204
    assert "http://127.0.0.1:9" not in router.workers()
    assert httpx.delete(f"{router.url}/workers/{wid}", headers=OPS).status_code == 404
    bad = httpx.post(router.url + "/workers", json={"url": "ftp://x"}, headers=OPS)
    assert bad.status_code == 400


def test_kill_9_of_one_of_three_workers_under_load_costs_no_request(cluster, llama_path):
    doomed = cluster["doomed"]
    router = _up(doomed, cluster["routers"]["doomed"])
    victim = doomed[1]
    statuses, stop = [], threading.Event()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            r = httpx.post(router.url + "/v1/completions",
                           json=_greedy(f"client {k} request {i} " * 8, max_tokens=24), timeout=60)  # fmt: skip
            statuses.append(r.status_code)
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(2)
    os.kill(victim.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + 10
    while router.workers()[victim.url]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    ejected_after = time.monotonic() - killed
    sent = router.workers()[victim.url]["requests"]
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(60)
    assert statuses and all(s == 200 for s in statuses), statuses  # retried, none lost
    assert ejected_after < 3  # two failed probes 0.5 s apart, plus their timeouts
    assert router.workers()[victim.url]["requests"] == sent  # nothing sent to it since
    # restarted on the same port, it is readmitted
    victim.stop()
    revived = Server(llama_path, [], cluster["logs"], "doomed-1-revived", port=victim.port)
    doomed[1] = revived
    revived.wait_ready()
    deadline = time.monotonic() + 40
    while not router.workers()[victim.url]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert router.workers()[victim.url]["healthy"]


def test_a_stalled_worker_is_found_by_its_probes_and_its_requests_retried(cluster):
    router = _up([cluster["lone"]], cluster["routers"]["stalled"])
    t0 = time.monotonic()
    answers = [_post(router.url, _greedy(f"request {i}"), timeout=30) for i in range(4)]
    took = time.monotonic() - t0
    assert all(a["choices"][0]["text"] for a in answers)
    stalled = next(w for w in router.workers().values() if w["url"] != cluster["lone"].url)
    assert not stalled["healthy"] and stalled["ejections"] >= 1
    assert took < 15  # the probe timeout (2 s) twice, not the request timeout (600 s)
