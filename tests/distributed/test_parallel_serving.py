"""`tandem serve` with a split model, as real processes on loopback: a rank killed mid-stream
fails the request, /health turns 503 and the server exits non-zero within 10 s, leaving no
rank behind; a rank that never joins fails the start naming it; two nodes (a server and a
`--headless` node) serve what one rank serves; the default model's 9 heads refuse 2 ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tandem.core.sampling_params import SamplingParams
from tandem.engine.llm import LLM
from tests.conftest import build_checkpoint
from tests.server.conftest import COMMON, ROOT, Server, free_port, pid_alive

pytestmark = pytest.mark.slow

PROMPTS = [[5 + (i * 37 + j * 11) % 390 for j in range(3 + i % 29)] for i in range(64)]


@pytest.fixture(scope="module")
def eight_heads(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp-serve")
    return build_checkpoint(root / "llama", "llama", num_attention_heads=8, num_key_value_heads=2)


def rank_pids(root_pid: int) -> dict[int, int]:
    """rank -> pid of the worker ranks under a process (its children's children too)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if b"tandem.distributed.worker" in cmd and _descends(ppid, root_pid):
            found[int(cmd[cmd.index(b"--rank") + 1])] = int(proc.name)
    return found


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def test_a_rank_killed_mid_stream_fails_the_request_and_the_server_exits(eight_heads, tmp_path):
    server = Server(eight_heads, ["-tp", "2"], tmp_path, "tp2").wait_ready()
    try:
        ranks = rank_pids(server.proc.pid)
        assert list(ranks) == [1]
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "The quick", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        t.join(10)
        assert not t.is_alive(), "the stream hung after its rank died"
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]["message"]
        assert "rank 1" in error and "killed by signal 9" in error
        try:
            health = httpx.get(f"{server.url}/health", timeout=2)
            assert health.status_code == 503
        except httpx.TransportError:
            pass  # already gone: it lingers 1 s answering 503
        assert server.proc.wait(10) == 1
        assert time.monotonic() - killed < 10
        assert "RankFailed" in server.log()
    finally:
        server.stop()


def test_a_rank_that_stops_answering_fails_the_server_within_its_timeout(eight_heads, tmp_path):
    server = Server(eight_heads, ["-tp", "2", "--distributed-timeout", "3"], tmp_path, "stop")
    server.wait_ready()
    try:
        (pid,) = rank_pids(server.proc.pid).values()
        os.kill(pid, signal.SIGSTOP)  # alive, but never reaches the next all-reduce
        stopped = time.monotonic()
        body = {"prompt": "The quick", "max_tokens": 8}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code >= 500 and "a rank did not take it within 3 s" in r.text
        assert server.proc.wait(10) == 1
        assert time.monotonic() - stopped < 10
        deadline = time.monotonic() + 5
        while pid_alive(pid):  # killed with its parent, stopped or not
            assert time.monotonic() < deadline, "the stopped rank outlived the server"
            time.sleep(0.1)
    finally:
        server.stop()


def test_a_rank_that_never_joins_fails_the_start_naming_it(eight_heads, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", str(eight_heads), *COMMON, "--port",
           str(free_port()), "-tp", "2", "--nnodes", "2", "--master-port", str(port),
           "--distributed-start-timeout", "3"]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and time.monotonic() - t0 < 60
    assert "ranks [1] (node 1) did not join within 3 s" in done.stderr


def test_two_nodes_on_loopback_serve_what_one_rank_serves_and_fail_together(eight_heads, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with LLM(str(eight_heads), dtype="float32", num_kv_blocks=512) as llm:
        want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    port = free_port()
    nodes = ["-tp", "2", "--nnodes", "2", "--master-port", str(port)]
    head = Server(eight_heads, [*nodes, "--node-rank", "0", "--num-kv-blocks", "512"], tmp_path, "node0")  # fmt: skip
    log = open(tmp_path / "node1.log", "w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", str(eight_heads), *COMMON, *nodes,
         "--node-rank", "1", "--headless", "--num-kv-blocks", "512"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        head.wait_ready()
        body = {"prompt": PROMPTS, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{head.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        got = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in got] == want
        assert "2 ranks (tensor parallel 2 x pipeline parallel 1) on 2 node(s)" in head.log()
        # the other node's rank dies while the server idles: no process check reaches it,
        # the idle server's ping does
        (rank1,) = rank_pids(worker.pid).values()
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        assert head.proc.wait(10) == 1 and time.monotonic() - killed < 10
        assert "RankFailed" in head.log()
        assert worker.wait(10) != 0  # the headless node reports its rank's death
    finally:
        head.stop()
        if worker.poll() is None:
            worker.kill()
        log.close()


@pytest.mark.default_model
def test_the_default_model_refuses_two_ranks_naming_the_sizes_that_split(tmp_path):
    cmd = [sys.executable, "-m", "tandem.cli", "serve", *COMMON, "--port", str(free_port()),
           "-tp", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "tensor_parallel_size 2 does not split this model: 9 attention heads" in done.stderr
    assert "sizes that would: 1, 3" in done.stderr
    assert not any(pid_alive(p) for p in rank_pids(os.getpid()).values())
