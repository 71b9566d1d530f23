"""The access gate alone (security.py): keys and roles, limits on a fake clock, the body cap,
allowed paths. In process, in milliseconds; tests/server/test_security_e2e.py runs the same
through real servers over TLS."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tandem.server.errors import APIError
from tandem.server.security import (
    ADMIN,
    Access,
    AccessGate,
    AccessPolicy,
    APIKey,
    KeyLimits,
    KeyRing,
    Limiter,
    check_allowed_path,
    parse_key_file,
)

KEYS = """
# name and limits per key
sk-alice name=alice rpm=2  # a comment after the key
sk-bob   name=bob concurrency=1
sk-root  name=ops role=admin
"""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _app(access: Access, limiter: Limiter | None = None, registry=None) -> Starlette:
    async def echo(request: Request) -> Response:
        body = await request.body()
        return Response(f"{request.scope.get('tandem.key')}:{len(body)}")

    routes = [Route(p, echo, methods=["GET", "POST", "DELETE"])
              for p in ("/v1/completions", "/v1/load_lora_adapter", "/health", "/workers", "/role")]  # fmt: skip
    app = Starlette(routes=routes)
    return AccessGate(app, access, registry or CollectorRegistry(), limiter)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _run(coro):
    return asyncio.run(coro)


def test_a_key_file_gives_each_key_a_name_a_role_and_limits():
    alice, bob, ops = parse_key_file(KEYS)
    assert (alice.name, alice.role, alice.limits) == ("alice", "user", KeyLimits(rpm=2))
    assert bob.limits == KeyLimits(concurrency=1) and ops.role == ADMIN
    assert "sk-" not in repr(alice)  # the secret never shows in a repr or a log line


@pytest.mark.parametrize(
    "line, message",
    [
        ("sk-x rpm=0", "line 1: rpm must be >= 1"),
        ("sk-x role=root", "line 1: role must be user or admin"),
        ("sk-x speed=3", "line 1: 'speed=3' is not rpm=N, tpm=N or concurrency=N"),
        ("name=x sk-x", "line 1: the key comes first"),
    ],
)
def test_a_bad_key_file_line_is_named_without_echoing_the_key(line, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_key_file(line)
    assert "sk-x" not in str(e.value)


def test_a_key_may_hold_a_hash_sign_and_a_shared_key_file_is_warned_about(tmp_path, caplog):
    (keys := tmp_path / "keys").write_text("sk-a#b name=hashed\n")
    keys.chmod(0o644)
    with caplog.at_level("WARNING", logger="tandem"):
        ring = KeyRing.from_flags(api_key_file=str(keys))
    assert ring.identify(b"Bearer sk-a#b").name == "hashed"
    assert "readable by other users: chmod 600" in caplog.text
    keys.chmod(0o600)
    caplog.clear()
    KeyRing.from_flags(api_key_file=str(keys))
    assert "readable" not in caplog.text


def test_the_same_key_twice_is_refused():
    with pytest.raises(ValueError, match="the same key is given twice"):
        KeyRing.from_flags(["k1"], admin_api_key="k1")


def test_user_keys_open_v1_and_nothing_else_needs_a_key():
    ring = KeyRing(parse_key_file(KEYS))

    async def go():
        async with _client(_app(Access(ring))) as c:
            assert (await c.post("/v1/completions", headers=_bearer("sk-bob"))).text == "bob:0"
            assert (await c.post("/v1/completions")).status_code == 401
            assert (await c.post("/v1/completions", headers=_bearer("sk-eve"))).status_code == 401
            assert (await c.get("/health")).status_code == 200

    _run(go())


def test_the_admin_key_opens_admin_endpoints_only_and_reads_as_a_wrong_key_elsewhere():
    ring = KeyRing(parse_key_file(KEYS))

    async def go():
        async with _client(_app(Access(ring))) as c:
            load = "/v1/load_lora_adapter"
            assert (await c.post(load, headers=_bearer("sk-root"))).text == "ops:0"
            user = await c.post(load, headers=_bearer("sk-bob"))
            assert user.status_code == 403 and user.json()["error"]["code"] == "forbidden"
            assert (await c.post(load)).status_code == 401
            admin_on_user = await c.post("/v1/completions", headers=_bearer("sk-root"))
            wrong = await c.post("/v1/completions", headers=_bearer("sk-nope"))
            assert admin_on_user.status_code == wrong.status_code == 401
            assert admin_on_user.content == wrong.content  # no oracle for the admin key

    _run(go())


def test_without_an_admin_key_admin_endpoints_are_off_unless_opened_by_flag():
    ring = KeyRing.from_flags(["sk-user"])

    async def go(policy):
        async with _client(_app(Access(ring, policy))) as c:
            return await c.post("/v1/load_lora_adapter", headers=_bearer("sk-user"))

    off = _run(go(AccessPolicy()))
    assert off.status_code == 403 and "--admin-api-key" in off.json()["error"]["message"]
    assert _run(go(AccessPolicy(admin_open=True))).status_code == 200


def test_a_flagged_admin_path_is_opened_by_its_own_flag_only():
    ring = KeyRing.from_flags(["sk-user"])
    flag = "--enable-role-switching"

    async def go(policy, path):
        async with _client(_app(Access(ring, policy))) as c:
            return await c.post(path, headers=_bearer("sk-user"))

    off = _run(go(AccessPolicy(flagged=(("/role", flag, False),)), "/role"))
    assert off.status_code == 403 and flag in off.json()["error"]["message"]
    opened = AccessPolicy(flagged=(("/role", flag, True),))
    assert _run(go(opened, "/role")).status_code == 200
    lora = _run(go(opened, "/v1/load_lora_adapter"))  # the LoRA paths keep their own flag
    assert lora.status_code == 403 and "--enable-runtime-lora-updating" in lora.text
    admin = KeyRing.from_flags(["sk-user"], admin_api_key="sk-admin")

    async def with_admin():
        async with _client(_app(Access(admin, opened))) as c:
            assert (await c.post("/role", headers=_bearer("sk-user"))).status_code == 403
            assert (await c.post("/role", headers=_bearer("sk-admin"))).status_code == 200

    _run(with_admin())


def test_admin_methods_limit_which_calls_on_a_path_are_admin():
    ring = KeyRing.from_flags(["sk-user"], admin_api_key="sk-admin")
    policy = AccessPolicy(user=("/v1", "/workers"), admin=("/workers",), admin_methods=("POST",))

    async def go():
        async with _client(_app(Access(ring, policy))) as c:
            assert (await c.get("/workers", headers=_bearer("sk-user"))).status_code == 200
            assert (await c.post("/workers", headers=_bearer("sk-user"))).status_code == 403
            assert (await c.post("/workers", headers=_bearer("sk-admin"))).status_code == 200

    _run(go())


def test_requests_per_minute_refill_continuously_and_say_when_to_retry():
    clock, limiter = Clock(), None
    limiter = Limiter(clock)
    limits = KeyLimits(rpm=2)
    assert limiter.admit("a", limits) is None and limiter.admit("a", limits) is None
    wait = limiter.admit("a", limits)
    assert wait == pytest.approx(30.0)  # one request's worth of a 2-per-minute bucket
    assert limiter.admit("b", limits) is None  # another key has its own bucket
    clock.now = 29.0
    assert limiter.admit("a", limits) is not None
    clock.now = 30.0
    assert limiter.admit("a", limits) is None


def test_tokens_per_minute_are_charged_up_front_and_refill_continuously():
    clock = Clock()
    limiter, limits = Limiter(clock), KeyLimits(tpm=600)
    assert limiter.charge("a", limits, 400) is None
    assert limiter.charge("a", limits, 400) == pytest.approx(20.0)  # 200 short, 10 a second
    clock.now = 20.0
    assert limiter.charge("a", limits, 400) is None
    assert limiter.charge("a", limits, 601) == float("inf")  # never fits: say so, not "wait"
    assert limiter.charge("a", KeyLimits(), 10**9) is None  # no tpm: no charge


def test_concurrency_counts_until_release():
    limiter = Limiter(Clock())
    one = KeyLimits(concurrency=1)
    assert limiter.admit("a", one) is None
    assert limiter.admit("a", one) == 1.0
    limiter.release("a")
    assert limiter.admit("a", one) is None
    limiter.release("a")
    assert limiter.in_flight == {}


def test_a_limited_key_gets_429_with_retry_after_while_another_key_is_served():
    clock = Clock()
    ring = KeyRing(parse_key_file(KEYS))
    registry = CollectorRegistry()

    async def go():
        async with _client(_app(Access(ring), Limiter(clock), registry)) as c:
            alice = [await c.post("/v1/completions", headers=_bearer("sk-alice")) for _ in range(3)]
            assert [r.status_code for r in alice] == [200, 200, 429]
            assert alice[2].headers["Retry-After"] == "30"
            assert alice[2].json()["error"]["type"] == "rate_limit_error"
            assert (await c.post("/v1/completions", headers=_bearer("sk-bob"))).status_code == 200

    _run(go())
    text = generate_latest(registry).decode()
    assert 'tandem:api_requests_total{key="alice",outcome="rate_limited"} 1.0' in text
    assert 'tandem:api_requests_total{key="alice",outcome="admitted"} 2.0' in text
    assert "sk-alice" not in text


def test_without_keys_the_default_limit_applies_per_client_address():
    ring = KeyRing.from_flags(rate_limit="rpm=1")

    async def go():
        async with _client(_app(Access(ring), Limiter(Clock()))) as c:
            return [(await c.post("/v1/completions")).status_code for _ in range(2)]

    assert _run(go()) == [200, 429]


def test_a_body_over_the_cap_is_413_declared_or_chunked_and_the_slot_is_freed():
    limiter = Limiter(Clock())
    ring = KeyRing.from_flags(rate_limit="concurrency=1")
    app = _app(Access(ring, max_request_bytes=1000), limiter)

    async def chunks():
        for _ in range(5):
            yield b"x" * 400

    async def go():
        async with _client(app) as c:
            declared = await c.post("/v1/completions", content=b"x" * 1001)
            chunked = await c.post("/v1/completions", content=chunks())
            fits = await c.post("/v1/completions", content=b"x" * 1000)
            return declared, chunked, fits

    declared, chunked, fits = _run(go())
    assert declared.status_code == chunked.status_code == 413
    assert "--max-request-bytes" in declared.json()["error"]["message"]
    assert fits.text == "anonymous:1000"
    assert limiter.in_flight == {}


def test_a_path_outside_the_allowed_roots_is_403_alike_for_existing_and_missing(tmp_path):
    allowed, other = tmp_path / "adapters", tmp_path / "secret"
    allowed.mkdir()
    other.mkdir()
    (allowed / "a").mkdir()
    (allowed / "escape").symlink_to(other)
    assert check_allowed_path(str(allowed / "a"), [str(allowed)], "lora_path") == str(allowed / "a")
    refusals = []
    for path in (other, tmp_path / "missing", allowed / "escape", allowed / ".." / "secret"):
        with pytest.raises(APIError) as e:
            check_allowed_path(str(path), [str(allowed)], "lora_path")
        refusals.append((e.value.status, e.value.message))
    assert refusals == [refusals[0]] * 4 and refusals[0][0] == 403
    assert str(tmp_path) not in refusals[0][1]


def test_keys_compare_against_every_key():
    ring = KeyRing([APIKey("a", b"Bearer a"), APIKey("b", b"Bearer b")])
    assert ring.identify(b"Bearer b").name == "b"
    assert ring.identify(b"Bearer c") is None and ring.identify(b"") is None


def _flags(tmp_path, *argv: str):
    import argparse

    from tandem.server.security_flags import add_security_args

    p = argparse.ArgumentParser()
    add_security_args(p, "/v1")
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ssl-certfile", "c.pem"], "ssl_certfile: give both"),
        (["--ssl-cert-reqs", "2"], "ssl_ca_certs: client certificates need TLS"),
        (["--ssl-certfile", "nope.pem", "--ssl-keyfile", "nope.key"], "ssl_certfile: cannot load"),
        (["--timeout-keep-alive", "0"], "timeout_keep_alive must be > 0"),
    ],
)
def test_bad_tls_flags_fail_before_anything_listens_naming_the_flag(tmp_path, argv, message):
    from tandem.server.security_flags import uvicorn_tls

    with pytest.raises(ValueError, match=message):
        uvicorn_tls(_flags(tmp_path, *argv))


def test_tls_flags_become_uvicorns_settings(tmp_path):
    import ssl

    import trustme

    from tandem.server.security_flags import client_tls, uvicorn_tls

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(tmp_path / "k.pem")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "c.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    tls = uvicorn_tls(_flags(tmp_path, "--ssl-certfile", str(tmp_path / "c.pem"), "--ssl-keyfile",
                             str(tmp_path / "k.pem"), "--ssl-ca-certs", str(tmp_path / "ca.pem"),
                             "--ssl-cert-reqs", "2"))  # fmt: skip
    assert tls["ssl_cert_reqs"] == ssl.CERT_REQUIRED and tls["ssl_ca_certs"].endswith("ca.pem")
    assert client_tls(str(tmp_path / "ca.pem")).verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ValueError, match="worker_ca_certs: cannot load"):
        client_tls(str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="worker_ssl_certfile: give both"):
        client_tls(None, str(tmp_path / "c.pem"))
    assert client_tls(None, str(tmp_path / "c.pem"), str(tmp_path / "k.pem")) is not None


def test_key_flags_and_the_environment_make_one_ring(tmp_path, monkeypatch):
    from tandem.server.security_flags import key_ring

    (tmp_path / "keys").write_text("sk-f name=filed rpm=5\n")
    monkeypatch.setenv("TANDEM_API_KEY", "sk-env")
    ring = key_ring(_flags(tmp_path, "--api-key-file", str(tmp_path / "keys"), "--admin-api-key",
                           "sk-a", "--rate-limit", "concurrency=3"))  # fmt: skip
    names = {k.name: k for k in ring.keys}
    assert set(names) == {"default", "filed", "admin"}  # $TANDEM_API_KEY when no --api-key
    assert names["filed"].limits == KeyLimits(rpm=5, concurrency=3)
    assert ring.identify(b"Bearer sk-env").name == "default"
    with pytest.raises(ValueError, match="api_key_file: cannot read"):
        key_ring(_flags(tmp_path, "--api-key-file", str(tmp_path / "none")))
