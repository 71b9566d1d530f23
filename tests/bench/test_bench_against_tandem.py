"""`tandem bench serve` as a new user runs it: right after `tandem serve` starts, against a
server with --api-key, and with a clear failure (non-zero exit, the first errors) when the
server is down or refuses every request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import main
from tests.bench.scripted_server import ScriptedServer
from tests.bench.test_cli import workload_args
from tests.server.conftest import free_port

KEY = "sk-bench"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def keyed_server(llama_path, tmp_path_factory):
    """Started, not waited for: the benchmark must do the waiting."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("keyed") / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", str(llama_path), "--host", "127.0.0.1",
         "--port", str(port), "--api-key", KEY, "--kv-cache-memory", "0.01",
         "--disable-uvicorn-access-log"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(30)
    log.close()


def test_bench_waits_for_a_starting_server_and_sends_the_api_key(
    keyed_server, llama_path, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # as vLLM's bench reads it
    rc = main(["bench", "serve", "--base-url", keyed_server, "--ready-timeout", "600",
               "--save-result", "--result-filename", "keyed.json",
               *workload_args(llama_path, tmp_path, n=3)])  # fmt: skip
    assert rc == 0, capsys.readouterr().out
    doc = json.loads((tmp_path / "keyed.json").read_text())
    assert doc["completed"] == 3 and doc["failed"] == 0


def test_every_request_failing_exits_nonzero_with_the_errors(
    keyed_server, llama_path, tmp_path, capsys
):
    rc = main(["bench", "serve", "--base-url", keyed_server, "--ready-timeout", "0",
               "--api-key", "sk-wrong", "--model", "tiny",
               *workload_args(llama_path, tmp_path, n=3)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1
    assert "error: all 3 requests failed" in out and "HTTP 401" in out


def test_a_server_that_is_down_is_an_error_not_a_table_of_zeros(llama_path, tmp_path, capsys):
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}",
               "--ready-timeout", "1", *workload_args(llama_path, tmp_path, n=2)])  # fmt: skip
    assert rc != 0
    assert "did not answer" in capsys.readouterr().err


def test_result_filename_is_the_file_itself(llama_path, tmp_path):
    target = tmp_path / "elsewhere" / "exact-name.json"
    with ScriptedServer({"ttft": 0.0, "itl": 0.0}) as server:
        rc = main(["bench", "serve", "--base-url", server.url, "--save-result",
                   "--result-filename", str(target), *workload_args(llama_path, tmp_path, n=2)])  # fmt: skip
    assert rc == 0
    assert json.loads(target.read_text())["completed"] == 2
    assert not list(tmp_path.glob("**/*.json.json"))
