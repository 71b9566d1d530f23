"""`tandem router` over real `tandem serve` workers on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.server.conftest import ROOT, free_port


class FrontEnd:
    """`tandem router` or `tandem proxy` as a process: ready once its /health answers 200."""

    def __init__(self, args: list[str], log_dir: Path, name: str, tls: dict | None = None) -> None:
        self.port = free_port()
        self.tls = tls or {}  # httpx's verify= and cert=
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "tandem.cli", args[0], "--host", "127.0.0.1",
               "--port", str(self.port), *args[1:]]  # fmt: skip
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path.stem} exited:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, **self.tls).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.log_path.stem} not ready:\n{self.log_path.read_text()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


class RouterProcess(FrontEnd):
    def __init__(self, workers: list[str], log_dir: Path, name: str, args=()) -> None:
        super().__init__(["router", "--worker", *workers, *args], log_dir, name)

    def workers(self) -> dict[str, dict]:
        return {w["url"]: w for w in httpx.get(f"{self.url}/workers", timeout=5).json()}

    def wait_healthy(self, urls: list[str], timeout: float = 90.0) -> RouterProcess:
        """Until the router routes to every one of `urls`. A worker still loading when the
        router started fails its probes and is ejected; it is readmitted only at its next
        backoff probe (up to the router's 30 s max_backoff), not when it comes up."""
        deadline = time.monotonic() + timeout
        while not all(self.workers().get(u, {}).get("healthy") for u in urls):
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not readmitted: {self.workers()}")
            time.sleep(0.2)
        return self


class StalledWorker:
    """Accepts connections and never answers (a hung process, as the router sees it)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        code = (
            "import socket, time\n"
            f"s = socket.socket(); s.bind(('127.0.0.1', {self.port})); s.listen(64)\n"
            "held = []\n"
            "while True:\n"
            "    held.append(s.accept())\n"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
