"""Client disconnects, SIGTERM drain, startup failure: the server's life beyond one request."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.server.conftest import COMMON, ROOT, free_port, pid_alive

LONG = {"prompt": "The quick", "max_tokens": 1000, "ignore_eos": True}


def _until(condition, timeout: float = 20.0, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(step)


def test_disconnects_abort_and_free_the_kv_cache(server):
    """6 long requests, 3 streamed and 3 not; the clients go away; the engine aborts them
    all: nothing runs, no KV block is held, and none of them counts as a success."""
    before = server.metrics()
    done = threading.Event()

    async def clients():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            streams = []
            for _ in range(3):
                req = client.build_request("POST", "/v1/completions", json={**LONG, "stream": True})
                streams.append(await client.send(req, stream=True))
            posts = [
                asyncio.create_task(client.post("/v1/completions", json=LONG)) for _ in range(3)
            ]
            chunks = [s.aiter_bytes() for s in streams]  # kept: dropping one closes its stream
            for it in chunks:  # a first token arrived on each stream
                await it.__anext__()
            while not done.is_set():
                await asyncio.sleep(0.02)
            for task in posts:
                task.cancel()
            await asyncio.gather(*posts, return_exceptions=True)
            for s in streams:
                await s.aclose()

    thread = threading.Thread(target=asyncio.run, args=(clients(),))
    thread.start()
    try:
        _until(lambda: server.metrics()["tandem:num_requests_running"] == 6)
        assert server.metrics()["tandem:kv_cache_usage_perc"] > 0
    finally:
        done.set()
        thread.join()
    _until(
        lambda: (
            server.metrics()["tandem:num_requests_running"] == 0
            and server.metrics()["tandem:kv_cache_usage_perc"] == 0
        ),
        timeout=5,
    )
    after = server.metrics()
    assert after["tandem:num_requests_waiting"] == 0
    successes = [k for k in after if k.startswith("tandem:request_success_total")]
    assert all(after[k] == before.get(k, 0) for k in successes), "an aborted request finished"
    tokens = after["tandem:generation_tokens_total"]
    time.sleep(0.3)
    assert server.metrics()["tandem:generation_tokens_total"] == tokens  # nothing runs on


def test_sigterm_drains_then_aborts_then_exits_0(draining_server):
    """SIGTERM: new requests get 503 and a short in-flight request finishes; a second
    SIGTERM ends the wait (as the --shutdown-timeout deadline does) and aborts the long
    one; the process exits 0 and its engine core is gone."""
    srv = draining_server
    core = srv.core_pid
    results: dict[str, list] = {}
    started = {"short": threading.Event(), "long": threading.Event()}

    def stream(name: str, max_tokens: int) -> None:
        body = {**LONG, "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
            results[name] = []
            for line in r.iter_lines():
                started[name].set()
                if line:
                    results[name].append(line)

    # The tiny model decodes ~1000 tokens/s here: the long request outlives the short one
    # by about a second, which the signals below need only a fraction of.
    short = threading.Thread(target=stream, args=("short", 24))
    long = threading.Thread(target=stream, args=("long", 1000))
    short.start()
    long.start()
    assert started["short"].wait(20) and started["long"].wait(20)
    srv.proc.send_signal(signal.SIGTERM)
    _until(lambda: httpx.get(f"{srv.url}/health").status_code == 503, timeout=5)
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "The server is shutting down."
    short.join(120)
    assert srv.proc.poll() is None and long.is_alive()  # still draining
    srv.proc.send_signal(signal.SIGTERM)
    long.join(30)
    assert srv.proc.wait(30) == 0
    srv.stop()

    chunks = [json.loads(line[6:]) for line in results["short"][:-1]]
    assert results["short"][-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks)
    lines = results["long"]
    assert lines[-1] == "data: [DONE]"
    assert "shut down" in json.loads(lines[-2][6:])["error"]["message"]
    assert not pid_alive(core), "the engine core outlived the server"


def test_bad_model_path_exits_nonzero_with_the_message(tmp_path):
    """A core that fails at startup makes `tandem serve` exit with its message."""
    cmd = [sys.executable, "-m", "tandem.cli", "serve", str(tmp_path / "missing")]
    cmd += ["--port", str(free_port()), "--host", "127.0.0.1", *COMMON]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"model: path '{tmp_path / 'missing'}' does not exist" in done.stderr


def test_engine_core_dies_with_its_parent(llama_path, tmp_path):
    """No orphan: SIGKILL the process that started a core (nothing of it runs any cleanup)
    and the core exits too, as it does when the server is killed."""
    config = json.dumps({"model": str(llama_path), "kv_cache_memory": 0.01})
    core_cmd = [sys.executable, "-m", "tandem.engine.core_proc", "--config", config,
                "--inbox", f"ipc://{tmp_path}/in", "--outbox", f"ipc://{tmp_path}/out"]  # fmt: skip
    parent_code = (
        "import os, subprocess, sys, time;"
        f"p = subprocess.Popen({core_cmd!r} + ['--parent-pid', str(os.getpid())], cwd={str(ROOT)!r});"
        "print(p.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True
    )
    core = int(parent.stdout.readline())
    time.sleep(0.5)
    assert pid_alive(core)
    parent.kill()
    parent.wait()
    _until(lambda: not pid_alive(core), timeout=20)


def test_the_api_server_and_engine_core_freeze_their_startup_heaps(server):
    """A loaded model, its tokenizer and their libraries are ~300,000 objects a full garbage
    collection would walk (~200 ms on the default model) while every stream waits."""
    for process in ("engine core", "API server"):
        found = re.search(rf"{process}: (\d+) objects built at startup frozen", server.log())
        assert found and int(found[1]) > 10_000, f"{process} did not freeze its heap"
