"""`tandem router --autoscale` over real `tandem serve` workers it starts itself, on loopback:
one at start, a second under a queue, drained and stopped when the load ends, no request
lost; a worker command that cannot start is retried with backoff and counted, the router
staying up."""

from __future__ import annotations

import sys
import threading
import time

import httpx
import pytest

from tests.router.conftest import FrontEnd
from tests.server.conftest import metrics

pytestmark = pytest.mark.slow


def worker_command(model) -> str:
    return (f"{sys.executable} -m tandem.cli serve {model} --host 127.0.0.1 --port {{port}} "
            "--kv-cache-memory 0.01 --dtype float32 --max-num-seqs 4 --disable-uvicorn-access-log")  # fmt: skip


def workers(router) -> list[dict]:
    return httpx.get(f"{router.url}/workers", timeout=5).json()


def serving(router) -> list[dict]:
    return [w for w in workers(router) if w["healthy"] and not w["draining"]]


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return result


def test_a_queue_starts_a_second_worker_and_its_end_drains_one_losing_no_request(llama_path, tmp_path):  # fmt: skip
    router = FrontEnd(
        ["router", "--autoscale", "--worker-command", worker_command(llama_path),
         "--min-workers", "1", "--max-workers", "2", "--target-queue-per-worker", "1",
         "--scale-sustain", "0.5", "--scale-up-cooldown", "1", "--scale-down-cooldown", "2",
         "--probe-interval", "0.2"],
        tmp_path, "autoscale",
    )  # fmt: skip
    try:
        router.wait_ready(timeout=120)
        assert len(workers(router)) == 1  # min_workers, ready and warm before /health said 200
        results: list[str] = []

        def stream(i: int) -> None:
            # long enough that the queue outlasts the probes and the sustain on a loaded CI
            # machine (300 tokens once ran out before the router saw it held)
            body = {"prompt": f"story {i}", "max_tokens": 900, "ignore_eos": True, "stream": True}
            text = ""
            with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    text += line + "\n"
            results.append(text if r.status_code == 200 else f"HTTP {r.status_code}: {text}")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()  # 12 streams on a worker running 4: 8 queued
        wait_for(lambda: len(serving(router)) == 2, 90, "a second worker")
        two = serving(router)
        late = [threading.Thread(target=stream, args=(i,)) for i in range(12, 16)]
        for t in late:
            t.start()  # the busy first worker's queue is full: these go to the new one
        for t in threads + late:
            t.join(120)
        assert len(results) == 16 and all(r.rstrip().endswith("data: [DONE]") and '"error"' not in r for r in results), results  # fmt: skip
        assert min(w["requests"] for w in workers(router)) > 0  # both served
        counts = metrics(router.url, "action")
        assert counts["tandem:router_scale_actions_total:up"] == 2
        # idle: back to one within sustain + cooldown (+ the drain), the other process gone
        wait_for(lambda: len(workers(router)) == 1, 30, "the scale-down")
        counts = metrics(router.url, "action")
        assert counts["tandem:router_scale_actions_total:down"] == 1
        assert counts["tandem:router_desired_workers"] == 1
        wait_for(lambda: "drained and stopped" in router.log_path.read_text(), 30, "the stop")
        gone = {w["url"] for w in two} - {w["url"] for w in workers(router)}
        (url,) = gone
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)  # fmt: skip
        assert r.status_code == 200
    finally:
        router.stop()
    log = router.log_path.read_text()
    assert "scaling up to 2 workers (queue" in log and "load fits one worker fewer" in log


def test_a_worker_that_cannot_start_is_retried_with_backoff_and_counted(tmp_path):
    command = f"{sys.executable} -c 'import sys; sys.exit(3)' {{port}}"
    router = FrontEnd(["router", "--autoscale", "--worker-command", command, "--min-workers", "1",
                       "--max-workers", "1"], tmp_path, "broken")  # fmt: skip
    try:
        wait_for(lambda: "failed to start: exited with 3" in router.log_path.read_text(), 30, "the failure")  # fmt: skip
        assert router.proc.poll() is None  # the router stays up, answering 503 meanwhile
        assert httpx.get(f"{router.url}/health", timeout=5).status_code == 503
        time.sleep(3)
        counts = metrics(router.url, "action")
        assert counts["tandem:router_scale_actions_total:failed_start"] == 1  # next try in 5 s
        wait_for(lambda: metrics(router.url, "action").get("tandem:router_scale_actions_total:failed_start", 0) >= 2, 30, "the retry")  # fmt: skip
    finally:
        router.stop()
    assert "next start in 5 s" in router.log_path.read_text()


def test_workers_that_take_a_key_are_warmed_with_it_and_refused_without(llama_path, tmp_path):
    command = worker_command(llama_path) + " --api-key sk-worker"
    keyless = FrontEnd(["router", "--autoscale", "--worker-command", command, "--min-workers",
                        "1", "--max-workers", "1"], tmp_path, "keyless")  # fmt: skip
    try:  # the warm-up gets a 401: the worker never takes traffic, and the log says why
        wait_for(lambda: "its warm-up request was refused: /v1/models 401" in keyless.log_path.read_text(), 120, "the refusal")  # fmt: skip
        assert httpx.get(f"{keyless.url}/health", timeout=5).status_code == 503
        assert metrics(keyless.url, "action")["tandem:router_scale_actions_total:failed_start"] >= 1  # fmt: skip
    finally:
        keyless.stop()
    keyed = FrontEnd(["router", "--autoscale", "--worker-command", command, "--min-workers", "1",
                      "--max-workers", "1", "--worker-api-key", "sk-worker"], tmp_path, "keyed")  # fmt: skip
    try:
        keyed.wait_ready(timeout=120)
        r = httpx.post(f"{keyed.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": "Bearer sk-worker"}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        assert "refused" not in keyed.log_path.read_text()
    finally:
        keyed.stop()
