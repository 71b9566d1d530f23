"""The real server as a subprocess on a free loopback port, serving a tiny checkpoint.

Servers start in parallel (each takes seconds: two processes import torch) and are waited on
only when a test first needs them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-key"
# A small KV pool (the default 2 GiB would be allocated and zeroed for nothing).
ALICE, BOB = "sk-alice-salted", "sk-bob-salted"  # salted_server's keys
COMMON = ["--kv-cache-memory", "0.01", "--dtype", "float32", "--disable-uvicorn-access-log"]


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports are handed out from below the kernel's ephemeral range: the kernel gives ports in that
# range to every bind to port 0 (a ZMQ KV receiver's, say) and every outgoing connection, so a
# port found free there can be taken before the server binds it (seen: "Address already in
# use" while a PD deployment started). Below it only our own picks compete; each pytest
# process starts at its own offset and never hands out a port twice.
_EPHEMERAL_FLOOR = _ephemeral_floor()
_next_port = 10_000 + (os.getpid() * 7919) % max(1, _EPHEMERAL_FLOOR - 11_000)


def free_port() -> int:
    """A loopback port that is free now and that the kernel will not hand to anyone else."""
    global _next_port
    for _ in range(_EPHEMERAL_FLOOR):
        port, _next_port = _next_port, _next_port + 1
        if _next_port >= _EPHEMERAL_FLOOR:
            _next_port = 10_000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def child_pids(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return children


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def metrics(url: str, label: str) -> dict[str, float]:
    """`name{labels}` lines of /metrics, summed over labels except `label` (kept as
    `name:value`)."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("tandem:"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            if f'{label}="' in name:
                key += ":" + name.split(f'{label}="')[1].split('"')[0]
            values[key] = values.get(key, 0.0) + float(value)
    return values


def settled(server, name: str, want: float, timeout: float = 10.0) -> float:
    """Poll a metric until it reads `want` (stats arrive after the core's next step or idle
    tick)."""
    deadline = time.monotonic() + timeout
    value = server.metrics().get(name, 0.0)
    while value != want and time.monotonic() < deadline:
        time.sleep(0.1)
        value = server.metrics().get(name, 0.0)
    return value


def streamed_text(url: str, body: dict, path: str = "/v1/completions") -> str:
    """The text of a streamed completion, its SSE chunks joined."""
    text = ""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


class Server:
    def __init__(
        self,
        model: Path,
        args: list[str],
        log_dir: Path,
        name: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        tls: dict | None = None,
    ) -> None:
        self.port = port or free_port()
        self.tls = tls or {}  # httpx's verify= (a CA file) and cert= (a client certificate)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "tandem.cli", "serve", *([str(model)] if model else [])]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *COMMON, *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self._ready = False

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 180.0) -> Server:
        deadline = time.monotonic() + timeout
        while not self._ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=1, **self.tls)
                self._ready = health.status_code == 200
            except httpx.TransportError:
                pass
            if not self._ready:
                time.sleep(0.2)
        return self

    @property
    def core_pid(self) -> int:
        (pid,) = child_pids(self.proc.pid)
        return pid

    def metrics(self) -> dict[str, float]:
        return metrics(self.url, "finished_reason")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def _launched(request, llama_path, tmp_path_factory):
    """Start the shared servers the collected tests need, all at once (each fixture below
    waits for its own)."""
    logs = tmp_path_factory.mktemp("server-logs")
    wanted = {name for item in request.session.items for name in item.fixturenames}
    servers = {}
    if "server" in wanted:
        debug = {"TANDEM_LOGGING_LEVEL": "DEBUG"}  # startup detail the lifecycle tests read
        servers["main"] = Server(llama_path, [], logs, "main", env=debug)
    if "guarded_server" in wanted:
        servers["guarded"] = Server(
            llama_path,
            ["--api-key", API_KEY, "--max-num-seqs", "2", "--max-waiting", "2",
             "--served-model-name", "tiny", "tiny-alias"],
            logs,
            "guarded",
        )  # fmt: skip
    if "fuzz_server" in wanted:  # short contexts, so whatever the fuzzer asks for is quick
        servers["fuzz"] = Server(
            llama_path, ["--max-model-len", "48", "--max-num-seqs", "16"], logs, "fuzz"
        )
    if "spec_server" in wanted:  # n-gram speculative decoding
        spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
        servers["spec"] = Server(llama_path, ["--speculative-config", spec], logs, "spec")
    if "tools_server" in wanted:
        servers["tools"] = Server(
            llama_path, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], logs, "tools"
        )
    if "salted_server" in wanted:  # two keys, each its own cache tenant
        keys = logs / "salted-keys"
        keys.write_text(f"{ALICE} name=alice\n{BOB} name=bob\n")
        keys.chmod(0o600)
        servers["salted"] = Server(
            llama_path, ["--api-key-file", str(keys), "--cache-salt-per-api-key"], logs, "salted"
        )
    if "sessions_server" in wanted:  # a small pool, so other traffic evicts what is not pinned
        servers["sessions"] = Server(
            llama_path,
            ["--num-kv-blocks", "40", "--max-model-len", "600", "--max-num-seqs", "4"],
            logs,
            "sessions",
        )
    if "events_server" in wanted:  # KV events on ipc sockets (loopback only), a small pool
        pub, replay = f"ipc://{logs}/kv-events", f"ipc://{logs}/kv-replay"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
                  "replay_endpoint": replay, "topic": "kv"}  # fmt: skip
        servers["events"] = Server(
            llama_path,
            ["--num-kv-blocks", "24", "--max-model-len", "300", "--kv-events-config",
             json.dumps(config)],
            logs,
            "events",
        )  # fmt: skip
        servers["events"].kv_events = (pub, replay)
    if "rl_server" in wanted:  # an RL rollout engine's control endpoints
        servers["rl"] = Server(
            llama_path, ["--enable-rl-endpoints", "--max-num-seqs", "4"], logs, "rl"
        )
    if "draining_server" in wanted:
        servers["draining"] = Server(llama_path, ["--shutdown-timeout", "120"], logs, "draining")
    yield servers
    for s in servers.values():
        s.terminate()
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="session")
def server(_launched) -> Server:
    return _launched["main"].wait_ready()


@pytest.fixture(scope="session")
def guarded_server(_launched) -> Server:
    """--api-key, --max-num-seqs 2, --max-waiting 2, two served names. Its last test kills
    its engine core."""
    return _launched["guarded"].wait_ready()


@pytest.fixture(scope="session")
def fuzz_server(_launched) -> Server:
    """--max-model-len 48, for the API fuzzer."""
    return _launched["fuzz"].wait_ready()


@pytest.fixture(scope="session")
def spec_server(_launched) -> Server:
    """--speculative-config with n-gram lookup, 4 tokens a draft."""
    return _launched["spec"].wait_ready()


@pytest.fixture(scope="session")
def tools_server(_launched) -> Server:
    """--enable-auto-tool-choice --tool-call-parser hermes."""
    return _launched["tools"].wait_ready()


@pytest.fixture(scope="session")
def salted_server(_launched) -> Server:
    """--api-key-file with keys ALICE and BOB, --cache-salt-per-api-key."""
    return _launched["salted"].wait_ready()


@pytest.fixture(scope="session")
def sessions_server(_launched) -> Server:
    """--num-kv-blocks 40 (blocks of 16): agent sessions under pressure."""
    return _launched["sessions"].wait_ready()


@pytest.fixture(scope="session")
def events_server(_launched) -> Server:
    """--kv-events-config on ipc sockets (`.kv_events`: the PUB and replay addresses),
    --num-kv-blocks 24."""
    return _launched["events"].wait_ready()


@pytest.fixture(scope="session")
def rl_server(_launched) -> Server:
    """--enable-rl-endpoints, --max-num-seqs 4."""
    return _launched["rl"].wait_ready()


@pytest.fixture(scope="session")
def draining_server(_launched) -> Server:
    """--shutdown-timeout 120, for the one test that shuts it down."""
    return _launched["draining"].wait_ready()


@pytest.fixture(scope="session")
def tokenizer(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_path))


@pytest.fixture(scope="session")
def model_name(llama_path) -> str:
    return str(llama_path)


@pytest.fixture
def client(server):
    import openai

    with openai.OpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0) as c:
        yield c


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
