"""Multi-LoRA over HTTP, as vLLM: --lora-modules at start, adapters in /v1/models and chosen
by `model`, POST /v1/load_lora_adapter and /v1/unload_lora_adapter while other requests
stream; an unknown adapter is a 404, a bad one a 400 naming the problem; nothing leaks."""

from __future__ import annotations

import threading

import httpx
import pytest

from tandem import LLM, LoRARequest, SamplingParams
from tests.server.conftest import Server, metrics, streamed_text

PROMPT = [11, 52, 33, 74, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def lora_server(checkpoints, adapters, tmp_path_factory):
    # --enable-runtime-lora-updating: vLLM's way, the endpoints open without an admin key
    args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
            "--lora-modules", f"all={adapters['all']}", "--enable-runtime-lora-updating"]  # fmt: skip
    server = Server(checkpoints["llama"], args, tmp_path_factory.mktemp("logs"), "lora")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def expected(checkpoints, adapters):
    """Each adapter's greedy text offline (held to HF + peft in test_lora_engine.py)."""
    llm = LLM(str(checkpoints["llama"]), dtype="float32", enable_lora=True, max_lora_rank=16,
              kv_cache_memory=0.01)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = {None: llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text}
    for i, name in enumerate(("all", "attn"), start=1):
        req = LoRARequest(name, i, str(adapters[name]))
        out[name] = llm.generate([PROMPT], params, use_tqdm=False, lora_request=req)[0]
        out[name] = out[name].outputs[0].text
    return out


def complete(url, model, stream=False, max_tokens=24):
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if not stream:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    return streamed_text(url, body)


def post(url, path, body):
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_an_adapter_from_lora_modules_is_a_model_and_answers_as_offline(
    lora_server, checkpoints, expected
):
    models = httpx.get(f"{lora_server.url}/v1/models").json()["data"]
    by_id = {m["id"]: m for m in models}
    assert by_id["all"]["parent"] == str(checkpoints["llama"]) and by_id["all"]["root"]
    r = complete(lora_server.url, "all")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["all"]
    assert (
        complete(lora_server.url, str(checkpoints["llama"])).json()["choices"][0]["text"]
        == (expected[None])
    )
    assert expected["all"] != expected[None]


def test_adapters_load_and_unload_while_other_requests_stream(lora_server, adapters, expected):
    url = lora_server.url
    streamed = []
    threads = [threading.Thread(target=lambda: streamed.append(complete(url, "all", True)))
               for _ in range(3)]  # fmt: skip
    for t in threads:
        t.start()
    r = post(
        url, "/v1/load_lora_adapter", {"lora_name": "attn", "lora_path": str(adapters["attn"])}
    )
    assert r.status_code == 200 and "added successfully" in r.text
    assert complete(url, "attn").json()["choices"][0]["text"] == expected["attn"]
    for t in threads:
        t.join()
    assert streamed == [expected["all"]] * 3
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "attn"})
    assert r.status_code == 200 and "removed successfully" in r.text
    r = complete(url, "attn")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "attn" not in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert metrics(url, "x")["tandem:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"lora_name": "all", "lora_path": "/x"}, 400, "has already been loaded"),
        ({"lora_name": "nope", "lora_path": "/does/not/exist"}, 400, "has no adapter_config.json"),
        ({"lora_name": "nope"}, 400, "lora_path"),
        ({"lora_name": "", "lora_path": "/x"}, 400, "lora_name"),
    ],
)
def test_a_bad_load_is_a_400_naming_the_problem(lora_server, body, status, fragment):
    r = post(lora_server.url, "/v1/load_lora_adapter", body)
    assert r.status_code == status and fragment in r.text
    assert "nope" not in {m["id"] for m in httpx.get(f"{lora_server.url}/v1/models").json()["data"]}


def test_unloading_an_unknown_adapter_is_a_404(lora_server):
    r = post(lora_server.url, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
