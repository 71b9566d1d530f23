"""Start a server as a child process, wait until it answers, and stop it with its whole
process group (a peer's recipe script execs into its server, which may fork workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = REPO_ROOT / "benchmarks" / "peers"
PEERS = {"vllm": "vllm.sh", "llamacpp": "llamacpp.sh"}


class ManagedServer:
    def __init__(self, name: str, cmd: list[str], base_url: str, log_path: Path, env=None):
        self.name, self.cmd, self.base_url, self.log_path = name, cmd, base_url, log_path
        self.env = env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        print(f"[{self.name}] starting: {' '.join(self.cmd)}  (log: {self.log_path})", flush=True)
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=self.env,
        )
        log.close()

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /v1/models answered 200; raises if the process died or timed out."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name}: server exited with code {self.proc.returncode}; "
                    f"last lines of {self.log_path}:\n{self.tail()}"
                )
            try:
                if (
                    httpx.get(f"{self.base_url}/v1/models", timeout=5, trust_env=False).status_code
                    == 200
                ):
                    took = time.monotonic() - start
                    print(f"[{self.name}] ready after {took:.0f} s", flush=True)
                    return took
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name}: not ready after {timeout:.0f} s; see {self.log_path}")

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        _reap_group(pgid)
        print(f"[{self.name}] stopped", flush=True)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _reap_group(pgid: int) -> None:
    """Children left in the group after the leader exited (workers) get SIGKILL."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tandem_server(port: int, model: str | None, extra: list[str], log_path: Path) -> ManagedServer:
    cmd = [sys.executable, "-m", "tandem.cli", "serve"]
    if model:
        cmd.append(model)
    cmd += ["--host", "127.0.0.1", "--port", str(port), *extra]
    return ManagedServer("tandem", cmd, f"http://127.0.0.1:{port}", log_path)


def peer_server(peer: str, port: int, log_path: Path, recipe: str | None = None) -> ManagedServer:
    script = Path(recipe) if recipe else PEERS_DIR / PEERS[peer]
    if not script.exists():
        raise ValueError(f"peer: no recipe at {script}")
    env = dict(os.environ, TANDEM_PYTHON=sys.executable)
    cmd = ["bash", str(script), "serve", str(port)]
    return ManagedServer(peer, cmd, f"http://127.0.0.1:{port}", log_path, env=env)


def install_peer(peer: str, recipe: str | None = None) -> None:
    """Run the recipe's idempotent install step in the foreground (minutes the first time)."""
    script = Path(recipe) if recipe else PEERS_DIR / PEERS[peer]
    env = dict(os.environ, TANDEM_PYTHON=sys.executable)
    print(f"[{peer}] installing (idempotent): bash {script} install", flush=True)
    subprocess.run(["bash", str(script), "install"], check=True, env=env)
