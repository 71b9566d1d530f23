"""Agent sessions through a real server on loopback (SGLang's /open_session and
/close_session; a turn joins with extra_body={"session_id": ...}, the x-session-id header or
session_params): a session's KV survives a tool pause under pressure that evicts everything
else, shown by usage.prompt_tokens_details.cached_tokens; close and TTL expiry unpin it (the
pool returns to empty); bad input is a 4xx naming the field."""

from __future__ import annotations

import itertools
import time

import httpx
import openai
import pytest

from tests.server.conftest import ALICE, BOB, settled

BLOCK = 16
_fresh = itertools.count()


def ids(n: int) -> list[int]:
    """n token ids no other prompt of this module starts with."""
    start = 11 * next(_fresh)
    return [(start + 5 * i) % 240 + 10 for i in range(n)]


def open_session(url: str, key: str | None = None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/open_session", json=body, headers=headers, timeout=30)


def close_session(url: str, sid: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/close_session", json={"session_id": sid}, headers=headers, timeout=30)


@pytest.fixture
def client(sessions_server) -> openai.OpenAI:
    return openai.OpenAI(api_key="x", base_url=f"{sessions_server.url}/v1", max_retries=0)


def complete(client: openai.OpenAI, prompt: list[int], max_tokens: int = 8, **extra):
    return client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens,
        temperature=0, extra_body=extra or None,
    )  # fmt: skip


def pressure(client: openai.OpenAI) -> None:
    """Distinct prompts that together need more than the 40-block pool: LRU evicts every
    unpinned block."""
    for _ in range(3):
        complete(client, ids(300), max_tokens=4)


def test_a_sessions_context_survives_tool_pauses_that_evict_everything_else(
    client, sessions_server
):
    sid = open_session(sessions_server.url, ttl_s=60).json()
    assert isinstance(sid, str) and sid
    # each turn sends the conversation so far and the tool's output (the model's answer is
    # left out: the client would send it as text, whose ids need not be the sampled ones)
    cached, lengths, context = [], [], ids(100)
    for _ in range(3):
        out = complete(client, context, session_id=sid)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        lengths.append(len(context))
        context = context + ids(40)
        pressure(client)  # other agents run while the tool does
    # turn one finds nothing; each later one every full block of the turn before's prompt
    assert cached == [0, *(n // BLOCK * BLOCK for n in lengths[:-1])] == [0, 96, 128]
    assert sessions_server.metrics()["tandem:kv_pinned_blocks"] > 0
    # the same conversation outside a session is computed again every turn
    plain, context = [], ids(100)
    for _ in range(3):
        out = complete(client, context)
        plain.append(out.usage.prompt_tokens_details.cached_tokens)
        context = context + ids(40)
        pressure(client)
    assert plain == [0, 0, 0]
    assert close_session(sessions_server.url, sid).status_code == 200
    assert settled(sessions_server, "tandem:kv_pinned_blocks", 0.0) == 0.0
    assert settled(sessions_server, "tandem:kv_cache_usage_perc", 0.0) == 0.0


def test_a_turn_joins_by_header_or_session_params_and_a_closed_session_is_a_404(
    client, sessions_server
):
    sid = open_session(sessions_server.url, session_id="agent-7", ttl_s=60).json()
    assert sid == "agent-7"
    prompt = ids(60)
    complete(client, prompt)
    headed = openai.OpenAI(
        api_key="x", base_url=f"{sessions_server.url}/v1", max_retries=0,
        default_headers={"x-session-id": sid},
    )  # fmt: skip
    assert complete(headed, prompt).usage.prompt_tokens_details.cached_tokens == 48
    assert complete(client, prompt, session_params={"id": sid}).usage is not None
    assert close_session(sessions_server.url, sid).status_code == 200
    for extra in ({"session_id": sid}, {"session_params": {"id": sid}}):
        with pytest.raises(openai.NotFoundError) as e:
            complete(client, prompt, **extra)
        assert e.value.body["code"] == "session_not_found"
        assert e.value.body["param"] == "session_id"
    assert close_session(sessions_server.url, sid).status_code == 404
    assert settled(sessions_server, "tandem:kv_pinned_blocks", 0.0) == 0.0


def test_the_ttl_counts_from_the_last_turns_end_and_expiry_unpins(client, sessions_server):
    sid = open_session(sessions_server.url, ttl_s=1.5).json()
    prompt = ids(80)
    for _ in range(3):  # turns 1 s apart: each restarts the clock, so the session lives on
        complete(client, prompt, session_id=sid)
        time.sleep(1.0)
    assert sessions_server.metrics()["tandem:kv_pinned_blocks"] > 0
    time.sleep(1.0)  # now 2 s after the last turn's end
    assert settled(sessions_server, "tandem:kv_pinned_blocks", 0.0) == 0.0
    with pytest.raises(openai.NotFoundError):
        complete(client, prompt, session_id=sid)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"ttl_s": 0}, 400, "ttl_s"),
        ({"ttl_s": "long"}, 400, "ttl_s"),
        ({"session_id": "has space"}, 400, "session_id"),
        ({"capacity_tokens": 0}, 400, "capacity_tokens"),
    ],
)
def test_opening_a_session_with_a_bad_field_is_a_400_naming_it(
    sessions_server, body, status, param
):
    r = open_session(sessions_server.url, **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_session_misuse_is_a_4xx_naming_the_field(client, sessions_server):
    with pytest.raises(openai.NotFoundError):
        complete(client, ids(10), session_id="never-opened")
    sid = open_session(sessions_server.url, session_id="dup", capacity_tokens=20).json()
    assert open_session(sessions_server.url, session_id="dup").status_code == 409
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, ids(30), session_id=sid)  # past its capacity_tokens
    assert "capacity_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, ids(10), session_params={"id": sid, "offset": 3})
    assert e.value.body["param"] == "session_params.offset"
    assert close_session(sessions_server.url, sid).status_code == 200


def test_pins_past_max_pinned_fraction_make_opening_another_session_a_429(client, sessions_server):
    big = open_session(sessions_server.url, ttl_s=60).json()
    complete(client, ids(400), session_id=big, max_tokens=2)  # 25 blocks: 20 may be pinned
    assert settled(sessions_server, "tandem:kv_pinned_blocks", 20.0) == 20.0
    r = open_session(sessions_server.url)
    assert r.status_code == 429 and "--max-pinned-fraction" in r.json()["error"]["message"]
    pressure(client)  # ordinary traffic still runs in the other half of the pool
    assert close_session(sessions_server.url, big).status_code == 200
    assert settled(sessions_server, "tandem:kv_pinned_blocks", 0.0) == 0.0
    sid = open_session(sessions_server.url).json()
    assert close_session(sessions_server.url, sid).status_code == 200


def test_another_api_keys_session_reads_as_not_found(salted_server):
    sid = open_session(salted_server.url, key=ALICE).json()
    bob = openai.OpenAI(api_key=BOB, base_url=f"{salted_server.url}/v1", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        complete(bob, ids(10), session_id=sid)
    assert close_session(salted_server.url, sid, key=BOB).status_code == 404
    assert close_session(salted_server.url, sid, key=ALICE).status_code == 200
    assert open_session(salted_server.url).status_code == 401  # sessions need a key too
