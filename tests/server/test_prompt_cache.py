"""What the prefix cache did, as a client sees it (OpenAI's
usage.prompt_tokens_details.cached_tokens), and who may share it (vLLM's cache_salt; every
API key its own tenant with --cache-salt-per-api-key): real servers on loopback, the openai
client."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

from tests.server.conftest import ALICE, BOB

BLOCK = 16  # the servers' KV block size (the default)
_unique = itertools.count()


def prompt_ids(n: int = 50) -> list[int]:
    """A prompt no other test sends: n token ids starting at a fresh offset."""
    start = 20 + 7 * next(_unique)
    return [(start + 3 * i) % 250 + 5 for i in range(n)]


def cached(client: openai.OpenAI, prompt: list[int], **extra) -> int:
    out = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=2, temperature=0,
        extra_body=extra or None,
    )  # fmt: skip
    return out.usage.prompt_tokens_details.cached_tokens


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0)


def test_usage_says_how_many_prompt_tokens_came_from_the_cache(client):
    prompt = prompt_ids(50)
    assert cached(client, prompt) == 0
    # every full block but the one holding the last token, which is computed again
    assert cached(client, prompt) == (len(prompt) - 1) // BLOCK * BLOCK == 48
    assert cached(client, prompt[:40] + [7, 8, 9]) == 32  # the blocks the prompts share


def test_chat_and_its_streamed_usage_report_cached_tokens(client, server):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Tell me everything about paged attention. " * 4}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens > 2 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1
    assert usage[0].prompt_tokens_details.cached_tokens == (
        (first.usage.prompt_tokens - 1) // BLOCK * BLOCK
    )


def test_requests_share_cached_kv_only_under_the_same_cache_salt(client):
    prompt = prompt_ids(40)
    assert cached(client, prompt, cache_salt="tenant-a") == 0
    assert cached(client, prompt, cache_salt="tenant-b") == 0
    assert cached(client, prompt) == 0  # no salt: not a salted tenant's either
    assert cached(client, prompt, cache_salt="tenant-a") == 32
    assert cached(client, prompt, cache_salt="tenant-b") == 32
    assert cached(client, prompt) == 32


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400_naming_it(server, salt):
    body = {"prompt": [5, 6, 7], "max_tokens": 1, "cache_salt": salt}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "cache_salt" in r.json()["error"]["message"]


def test_with_a_tenant_per_api_key_one_key_never_hits_what_another_cached(salted_server):
    alice, bob = (
        openai.OpenAI(api_key=k, base_url=f"{salted_server.url}/v1", max_retries=0)
        for k in (ALICE, BOB)
    )
    prompt = prompt_ids(40)
    assert cached(alice, prompt) == 0
    assert cached(bob, prompt) == 0  # alice's blocks are invisible to bob
    assert cached(alice, prompt) == 32
    assert cached(bob, prompt) == 32
    # a salt of a key's own splits it further, never into another key's namespace
    assert cached(bob, prompt, cache_salt="key:alice") == 0
