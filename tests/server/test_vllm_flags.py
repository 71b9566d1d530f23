"""vLLM launch scripts work unchanged: its flag names parse and have their effect here, a
taken port fails before the model loads, and every flag's help shows its default."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import ROOT, Server, free_port

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[bot]"


@pytest.fixture(scope="module")
def vllm_style(llama_path, tmp_path_factory):
    """A server launched the way a vLLM script launches one."""
    tmp = tmp_path_factory.mktemp("vllm-flags")
    (tmp / "template.jinja").write_text(TEMPLATE)
    (tmp / "gen").mkdir()
    (tmp / "gen" / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    args = ["--model", str(llama_path), "--dtype", "float", "--enable-prefix-caching",
            "--kv-cache-memory-bytes", str(8 << 20), "--chat-template", str(tmp / "template.jinja"),
            "--max-logprobs", "3", "--generation-config", str(tmp / "gen"),
            "--enable-log-requests", "--trust-remote-code", "--enforce-eager",
            "--gpu-memory-utilization", "0.5", "--quantization", "int8"]  # fmt: skip
    server = Server(None, args, tmp, "vllm-style").wait_ready()
    yield server
    server.stop()


def test_the_flags_parse_and_the_server_serves(vllm_style):
    log = vllm_style.log()
    assert "torch.float32" in log  # --dtype float
    assert "KV cache pool: 0.01 GiB, sized by --kv-cache-memory-bytes" in log
    r = httpx.get(f"{vllm_style.url}/v1/models").json()
    assert r["data"][0]["root"]
    # --quantization int8: said in the engine-ready line and in the model's metadata
    assert r["data"][0]["quantization"].startswith("int8 (per channel) projections")
    assert "weights int8 (per channel) projections" in log


def test_max_logprobs_bounds_requests(vllm_style):
    url = f"{vllm_style.url}/v1/completions"
    assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "logprobs": 3}).status_code == 200
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "logprobs": 4})
    assert r.status_code == 400 and "max_logprobs" in r.json()["error"]["message"]


def test_chat_template_flag_replaces_the_tokenizers(vllm_style, tokenizer):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    ids = httpx.post(f"{vllm_style.url}/tokenize", json=body).json()["tokens"]
    assert tokenizer.decode(ids) == "[user] hi\n[bot]"


def test_generation_config_supplies_the_default_temperature(vllm_style):
    """Its generation_config.json says temperature 0: unseeded requests without a temperature
    are greedy, so they all agree with an explicit temperature=0."""
    url = f"{vllm_style.url}/v1/completions"
    body = {"prompt": "The quick", "max_tokens": 12, "ignore_eos": True}
    texts = {httpx.post(url, json=body).json()["choices"][0]["text"] for _ in range(3)}
    greedy = httpx.post(url, json={**body, "temperature": 0}).json()["choices"][0]["text"]
    assert texts == {greedy}


def test_enable_log_requests_logs_them(vllm_style):
    httpx.post(f"{vllm_style.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert "prompt tokens" in vllm_style.log()


def test_a_taken_port_fails_at_once_before_the_model_loads(llama_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "serve", str(llama_path), "--host", "127.0.0.1",
             "--port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2
    assert f"port: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "engine ready" not in done.stderr  # no model was loaded
    assert time.monotonic() - start < 30


def test_serve_and_router_listen_on_this_machine_only_unless_told():
    from tandem.cli import build_parser

    parser, _ = build_parser()
    assert parser.parse_args(["serve"]).host == "127.0.0.1"
    assert parser.parse_args(["router", "--worker", "http://127.0.0.1:1"]).host == "127.0.0.1"


@pytest.mark.parametrize(
    "host, key, tls, says",
    [
        ("127.0.0.1", False, False, "listens on 127.0.0.1 only (this machine)"),
        ("localhost", False, False, "listens on localhost only"),
        ("::1", False, False, "listens on ::1 only"),
        ("0.0.0.0", False, True, "reachable from other machines, and requires no API key"),
        ("0.0.0.0", True, False, "without TLS: keys and prompts cross the network in clear"),
        ("0.0.0.0", True, True, None),
    ],
)
def test_a_server_open_to_other_machines_without_a_key_or_tls_is_warned_about(
    caplog, host, key, tls, says
):
    from tandem.server.cli import warn_if_exposed

    with caplog.at_level("INFO", logger="tandem"):
        warn_if_exposed(host, key, tls, "tandem serve")
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    if says is None:
        assert not caplog.records  # an open server with a key: nothing to say
    else:
        assert says in caplog.text
        assert bool(warned) == (host == "0.0.0.0")


def test_a_host_this_machine_does_not_have_fails_at_once(llama_path):
    # 192.0.2.1 is TEST-NET-1: resolvable without a lookup, assigned to no interface here
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", str(llama_path), "--host", "192.0.2.1",
         "--port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "host: cannot listen on 192.0.2.1:" in done.stderr
