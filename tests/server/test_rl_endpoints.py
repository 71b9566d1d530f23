"""An RL rollout engine's control endpoints through a real server on loopback
(--enable-rl-endpoints): new weights from disk give exactly that checkpoint's greedy tokens
and carry their version on every response; a bad update is a 400 and the old weights stay;
pause ends (abort), holds (keep) or drains (wait) the requests in flight and holds new ones
until resume; a prefix cache reset while requests hold KV is a 409, never a 200."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tandem import LLM, SamplingParams
from tests.conftest import build_checkpoint

PROMPT = [5, 17, 99, 230, 41, 8, 77, 120, 64, 33]


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """The server's checkpoint's shape (llama) with other weights."""
    return build_checkpoint(tmp_path_factory.mktemp("rl") / "llama-b", "llama", seed=1)


def reference(path, prompt=PROMPT, max_tokens=8) -> str:
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def complete(url: str, prompt=PROMPT, max_tokens=8) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def post(url: str, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kw)


class Stream(threading.Thread):
    """A streamed completion read in the background: its text chunks and finish reason."""

    def __init__(self, url: str, max_tokens: int, prompt=PROMPT) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.prompt = url, max_tokens, prompt
        self.chunks: list[str] = []
        self.finish_reason = None
        self.start()

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                self.chunks.append(choice["text"])
                self.finish_reason = choice["finish_reason"] or self.finish_reason

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.chunks) < n:
            assert time.monotonic() < deadline and self.is_alive(), "the stream stalled"
            time.sleep(0.01)


def test_weights_from_disk_give_that_checkpoints_tokens_and_their_version(rl_server, other_weights, llama_path):  # fmt: skip
    url = rl_server.url
    assert complete(url)["choices"][0]["text"] == reference(llama_path)
    r = post(url, "/update_weights_from_disk", {"model_path": str(other_weights), "weight_version": "b-1"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["weight_version"] == "b-1"
    out = complete(url)
    assert out["choices"][0]["text"] == reference(other_weights)
    assert out["usage"]["weight_version"] == "b-1"
    assert httpx.get(f"{url}/get_weight_version").json() == {"weight_version": "b-1"}
    # and back: nothing computed under b's weights is reused under a's
    r = post(url, "/update_weights_from_disk", {"model_path": str(llama_path), "weight_version": "a-2", "flush_cache": False})  # fmt: skip
    assert r.status_code == 200, r.text
    out = complete(url)
    assert out["choices"][0]["text"] == reference(llama_path)
    assert out["usage"]["weight_version"] == "a-2"


def test_a_bad_update_is_a_400_naming_the_problem_and_the_weights_stay(rl_server, checkpoints):
    url = rl_server.url
    before, version = complete(url), httpx.get(f"{url}/get_weight_version").json()
    cases = [
        ({"model_path": "/nowhere/at/all"}, "model_path"),
        ({"model_path": str(checkpoints["qwen2"])}, None),  # another shape: a tensor named
        ({"weight_version": "x"}, "model_path"),  # the path missing
        ({"model_path": str(checkpoints["llama"]), "timeout_s": -1}, "timeout_s"),
    ]
    for body, param in cases:
        r = post(url, "/update_weights_from_disk", body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        if param:
            assert error["param"] == param, error
        else:
            assert "model." in error["message"] or "lm_head" in error["message"], error
    assert complete(url)["choices"] == before["choices"]
    assert httpx.get(f"{url}/get_weight_version").json() == version


def test_pause_abort_ends_the_streams_and_holds_new_requests_until_continue(rl_server):
    url = rl_server.url
    stream = Stream(url, max_tokens=400)
    stream.wait_for(3)
    r = post(url, "/pause_generation", {"mode": "abort"})
    assert r.status_code == 200 and r.json()["num_aborted"] == 1, r.text
    stream.join(30)
    assert stream.finish_reason == "abort" and len(stream.chunks) < 400
    assert httpx.get(f"{url}/is_paused").json()["is_paused"] is True
    held = Stream(url, max_tokens=4)
    time.sleep(0.5)
    assert held.chunks == [] and held.is_alive()  # held in the server while paused
    assert post(url, "/continue_generation").status_code == 200
    held.join(30)
    assert held.finish_reason == "length" and "".join(held.chunks)
    assert httpx.get(f"{url}/is_paused").json()["is_paused"] is False


def test_pause_keep_holds_a_request_with_its_kv_and_it_finishes_the_same_after_resume(rl_server):  # fmt: skip
    url = rl_server.url
    unpaused = complete(url, max_tokens=40)["choices"][0]["text"]
    stream = Stream(url, max_tokens=40)
    stream.wait_for(2)
    assert post(url, "/pause?mode=keep").status_code == 200
    time.sleep(0.3)  # a step in flight at the pause may still land
    seen = len(stream.chunks)
    time.sleep(0.7)
    assert len(stream.chunks) == seen < 40 and stream.is_alive()
    r = post(url, "/reset_prefix_cache")
    assert r.status_code == 409 and r.json()["error"]["code"] == "requests_running", r.text
    assert post(url, "/resume").status_code == 200
    stream.join(60)
    assert stream.finish_reason == "length" and "".join(stream.chunks) == unpaused
    r = post(url, "/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["freed_blocks"] > 0, r.text


def test_pause_wait_returns_once_the_requests_in_flight_have_finished(rl_server):
    url = rl_server.url
    stream = Stream(url, max_tokens=30)
    stream.wait_for(1)
    r = post(url, "/pause?mode=wait")
    assert r.status_code == 200, r.text
    assert stream.finish_reason == "length" or (stream.join(5) or stream.finish_reason == "length")
    assert post(url, "/resume").status_code == 200
    assert complete(url, max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_the_rl_endpoints_exist_only_with_their_flag(server):
    assert post(server.url, "/pause_generation", {"mode": "abort"}).status_code == 404
    assert httpx.get(f"{server.url}/get_weight_version").status_code == 404
    assert "weight_version" not in complete(server.url, max_tokens=1)["usage"]


def train_and_push(url: str, model, *extra: str) -> dict:
    """Run tests/server/rl_trainer.py against the server; -> its JSON line."""
    import subprocess
    import sys

    from tests.server.conftest import free_port

    cmd = [sys.executable, "-m", "tests.server.rl_trainer", url, str(model), str(free_port()), *extra]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_trainer_pushes_its_weights_over_torch_distributed(rl_server, other_weights, llama_path):  # fmt: skip
    url = rl_server.url
    answer = train_and_push(url, other_weights, "--version", "dist-1")
    assert answer["init"]["status"] == 200, answer
    assert answer["update"]["status"] == 200 and answer["update"]["body"]["weight_version"] == "dist-1", answer  # fmt: skip
    out = complete(url)
    assert out["choices"][0]["text"] == reference(other_weights)
    assert out["usage"]["weight_version"] == "dist-1"
    assert post(url, "/destroy_weights_update_group").status_code == 200
    r = post(url, "/destroy_weights_update_group")  # none open now
    assert r.status_code == 400 and "no weight update group" in r.json()["error"]["message"]
    # back to the server's own weights, in bf16 on the wire this time: cast into float32
    answer = train_and_push(url, llama_path, "--version", "dist-2", "--dtype", "bfloat16")
    assert answer["update"]["status"] == 200, answer
    assert post(url, "/destroy_weights_update_group").status_code == 200


def test_a_trainer_dying_mid_push_leaves_the_old_weights_and_a_server_that_serves(rl_server, other_weights):  # fmt: skip
    url = rl_server.url
    before = complete(url)["choices"]
    version = httpx.get(f"{url}/get_weight_version").json()
    answer = train_and_push(url, other_weights, "--die-after", "3")
    assert answer["init"]["status"] == 200 and answer["died_after"] == 3
    assert complete(url)["choices"] == before
    assert httpx.get(f"{url}/get_weight_version").json() == version
    # the broken group was torn down: a new trainer joins and pushes
    deadline = time.monotonic() + 90
    while True:
        answer = train_and_push(url, other_weights, "--version", "after-death")
        if answer["init"]["status"] == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)  # the core is still noticing the first trainer's death
    assert answer["update"]["status"] == 200, answer
    assert complete(url)["choices"][0]["text"] == reference(other_weights)
    assert post(url, "/destroy_weights_update_group").status_code == 200


def test_a_push_naming_a_tensor_the_model_lacks_is_received_then_refused(rl_server, other_weights):  # fmt: skip
    url = rl_server.url
    before = complete(url)["choices"]
    version = httpx.get(f"{url}/get_weight_version").json()
    answer = train_and_push(url, other_weights, "--bad-name", "--version", "bad")
    update = answer["update"]  # the trainer's broadcast completed: nobody hangs
    assert update["status"] == 400 and "model.nope.weight" in update["body"]["error"]["message"]
    assert complete(url)["choices"] == before
    assert httpx.get(f"{url}/get_weight_version").json() == version
    assert post(url, "/destroy_weights_update_group").status_code == 200


def test_bad_group_and_push_requests_are_400s_naming_the_field(rl_server):
    url = rl_server.url
    cases = [
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 0},
            "master_port",
        ),  # fmt: skip
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 29999, "backend": "mpi"},
            "backend",
        ),  # fmt: skip
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 29999, "world_size": 3},
            "world_size",
        ),  # fmt: skip
        (
            "/update_weights_from_distributed",
            {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]]},
            None,
        ),  # fmt: skip
        ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}, "names"),
    ]
    for path, body, param in cases:
        r = post(url, path, body)
        assert r.status_code == 400, (path, body, r.text)
        if param:
            assert r.json()["error"]["param"] == param, r.json()
    assert complete(url, max_tokens=1)["choices"][0]["finish_reason"] == "length"


def test_sleep_frees_memory_holds_new_requests_and_wake_up_serves_them(rl_server, llama_path):
    url = rl_server.url
    post(url, "/update_weights_from_disk", {"model_path": str(llama_path)})
    expected = reference(llama_path)
    stream = Stream(url, max_tokens=300)
    stream.wait_for(1)
    r = post(url, "/sleep?level=1")
    assert r.status_code == 409 and r.json()["error"]["code"] == "requests_running", r.text
    assert post(url, "/pause?mode=abort").status_code == 200
    for level, path in ((1, "/sleep?level=1"), (2, "/release_memory_occupation")):
        r = post(url, path)
        assert r.status_code == 200 and r.json()["level"] == level, r.text
        assert r.json()["rss_after"] > 0
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True, "level": level}
    assert post(url, "/resume").status_code == 200  # the pause ends; the sleep does not
    held = Stream(url, max_tokens=8)
    time.sleep(0.5)
    assert held.chunks == [] and held.is_alive()
    r = post(url, "/wake_up")
    assert r.status_code == 200 and r.json()["weight_version"] == "default", r.text
    held.join(60)
    assert "".join(held.chunks) == expected  # the checkpoint's weights, loaded again
    assert httpx.get(f"{url}/is_sleeping").json()["is_sleeping"] is False
