"""Agent sessions through `tandem router`, real processes on loopback: a session opened
through the router keeps its turns on one worker (its later turns read their context from
that worker's cache); when that worker is killed, the next turn is served by another one,
where the router reopened the session, losing no request; close goes to the session's worker."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.router.conftest import RouterProcess
from tests.server.conftest import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(llama_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-sessions")
    workers = [Server(llama_path, [], logs, f"worker-{i}") for i in range(2)]
    router = RouterProcess([w.url for w in workers], logs, "router",
                           ("--probe-interval", "0.5", "--policy", "least_load"))  # fmt: skip
    for w in workers:
        w.wait_ready()
    router.wait_ready().wait_healthy([w.url for w in workers])
    yield router, workers
    router.stop()
    for w in workers:
        w.terminate()
    for w in workers:
        w.stop()


def cached(client: openai.OpenAI, prompt: list[int], sid: str) -> int:
    out = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=4, temperature=0,
        extra_body={"session_id": sid},
    )  # fmt: skip
    return out.usage.prompt_tokens_details.cached_tokens


def test_a_sessions_turns_stay_on_one_worker_and_move_when_it_dies(fleet):
    router, workers = fleet
    client = openai.OpenAI(api_key="x", base_url=f"{router.url}/v1", max_retries=0)
    sid = httpx.post(f"{router.url}/open_session", json={"ttl_s": 60}, timeout=30).json()
    context = [(3 * i + 7) % 200 + 20 for i in range(60)]
    counts = {u: w["requests"] for u, w in router.workers().items()}
    assert cached(client, context, sid) == 0
    for turn in range(3):  # least load alone would spread these over both workers
        context += [(11 * turn + j) % 200 + 20 for j in range(20)]
        assert cached(client, context, sid) >= 48  # the previous turns' blocks, on one worker
    sent = {u: w["requests"] - counts[u] for u, w in router.workers().items()}
    (home,) = [u for u, n in sent.items() if n]
    assert sent[home] == 4

    victim = next(w for w in workers if w.url == home)
    os.kill(victim.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while router.workers()[home]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    context += [5, 6, 7]
    assert cached(client, context, sid) == 0  # served elsewhere, from a cold cache
    assert cached(client, context + [8], sid) >= 48  # and kept there
    moves = [ln for ln in httpx.get(f"{router.url}/metrics").text.splitlines()
             if ln.startswith("tandem:router_session_moves_total")]  # fmt: skip
    assert moves and float(moves[0].split()[-1]) == 1.0
    close = httpx.post(f"{router.url}/close_session", json={"session_id": sid}, timeout=30)
    assert close.status_code == 200
    with pytest.raises(openai.NotFoundError):
        cached(client, context, sid)
