"""Security through real processes on loopback: `tandem serve` and `tandem router` over TLS
(a test CA made by trustme), the official openai client, keys from a key file with roles and
limits, the admin key, allowed local paths, the body cap, mutual TLS."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest
import trustme

from tests.router.conftest import FrontEnd
from tests.server.conftest import Server

pytestmark = pytest.mark.slow  # three processes; the gate's logic is test_security.py's

KEYS = "sk-alice name=alice rpm=2\nsk-bob name=bob\nsk-carol name=carol tpm=40\n"
ADMIN = "sk-admin-secret"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    """A CA, a certificate for 127.0.0.1 signed by it, and a client certificate."""
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("client@tandem")
    ca.cert_pem.write_to_path(root / "ca.pem")
    server.private_key_pem.write_to_path(root / "server.key")
    (root / "server.pem").write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    client.private_key_pem.write_to_path(root / "client.key")
    (root / "client.pem").write_bytes(b"".join(b.bytes() for b in client.cert_chain_pems))
    (root / "keys").write_text(KEYS)
    (root / "keys").chmod(0o600)
    (root / "adapters").mkdir()
    (root / "private").mkdir()
    return {name: str(root / name) for name in
            ("ca.pem", "server.key", "server.pem", "client.key", "client.pem", "keys",
             "adapters", "private")}  # fmt: skip


def _tls_args(pki) -> list[str]:
    return ["--ssl-keyfile", pki["server.key"], "--ssl-certfile", pki["server.pem"]]


@pytest.fixture(scope="module")
def secured(llama_path, pki, tmp_path_factory):
    """A TLS server with a key file, an admin key and an allowed LoRA root; a router in front
    of it over TLS both ways; a server that requires client certificates."""
    logs = tmp_path_factory.mktemp("security-logs")
    verify = {"verify": pki["ca.pem"]}
    mutual = {"verify": _with_client_cert(pki)}
    server = Server(llama_path, [*_tls_args(pki), "--api-key-file", pki["keys"],
                                 "--admin-api-key", ADMIN, "--allowed-local-path",
                                 pki["adapters"]], logs, "tls", tls=verify)  # fmt: skip
    mtls = Server(llama_path, [*_tls_args(pki), "--ssl-ca-certs", pki["ca.pem"],
                               "--ssl-cert-reqs", "2"], logs, "mtls", tls=mutual)  # fmt: skip
    server.wait_ready()
    router = FrontEnd(["router", "--worker", server.url, "--worker-ca-certs", pki["ca.pem"],
                       "--api-key-file", pki["keys"], *_tls_args(pki)], logs, "router",
                      tls=verify)  # fmt: skip
    mtls.wait_ready()
    mutual_router = FrontEnd(["router", "--worker", mtls.url, "--worker-ca-certs", pki["ca.pem"],
                              "--worker-ssl-certfile", pki["client.pem"], "--worker-ssl-keyfile",
                              pki["client.key"]], logs, "mutual-router")  # fmt: skip
    try:
        yield {"server": server, "router": router.wait_ready(), "mtls": mtls,
               "mutual_router": mutual_router.wait_ready()}  # fmt: skip
    finally:
        mutual_router.stop()
        router.stop()
        for s in (server, mtls):
            s.stop()


def _with_client_cert(pki: dict) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki["ca.pem"])
    context.load_cert_chain(pki["client.pem"], pki["client.key"])
    return context


def _client(url: str, key: str, pki: dict, verify=None) -> openai.OpenAI:
    http = httpx.Client(verify=verify or pki["ca.pem"])
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, http_client=http, max_retries=0)


def _ask(client: openai.OpenAI) -> str:
    reply = client.completions.create(model=client.models.list().data[0].id, prompt="Hello",
                                      max_tokens=4, temperature=0)  # fmt: skip
    return reply.choices[0].text


def test_the_openai_client_works_over_https_to_the_server_and_through_the_router(secured, pki):
    direct = _ask(_client(secured["server"].url, "sk-bob", pki))
    assert direct and _ask(_client(secured["router"].url, "sk-bob", pki)) == direct


def test_a_client_that_does_not_trust_the_ca_is_refused(secured):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{secured['server'].url}/health")


def test_mutual_tls_refuses_a_client_without_a_certificate(secured, pki):
    url = secured["mtls"].url
    with pytest.raises(httpx.TransportError):  # TLS 1.3: the server hangs up after the handshake
        httpx.get(f"{url}/health", verify=pki["ca.pem"])
    assert _ask(_client(url, "EMPTY", pki, verify=_with_client_cert(pki)))


def test_a_router_presents_its_client_certificate_to_workers_that_require_one(secured, pki):
    front = secured["mutual_router"]
    reply = httpx.post(f"{front.url}/v1/completions", json={"model": _model(front.url), "prompt": "Hi",
                       "max_tokens": 3, "temperature": 0}, timeout=60)  # fmt: skip
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_wrong_or_missing_keys_are_401_in_openais_shape(secured, pki):
    url = secured["server"].url
    with pytest.raises(openai.AuthenticationError):
        _ask(_client(url, "sk-eve", pki))
    r = httpx.get(f"{url}/v1/models", verify=pki["ca.pem"])
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health", verify=pki["ca.pem"]).status_code == 200


def _load(url: str, key: str, path: str, pki: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path},
                      headers={"Authorization": f"Bearer {key}"}, verify=pki["ca.pem"])  # fmt: skip


def test_a_user_key_on_an_admin_endpoint_is_403_and_the_admin_key_on_a_user_one_401(secured, pki):
    url = secured["server"].url
    user = _load(url, "sk-bob", pki["adapters"], pki)
    assert user.status_code == 403 and user.json()["error"]["code"] == "forbidden"
    admin_as_user = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {ADMIN}"},
                              verify=pki["ca.pem"])  # fmt: skip
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-x"},
                      verify=pki["ca.pem"])  # fmt: skip
    assert admin_as_user.status_code == 401 and admin_as_user.content == wrong.content


def test_a_lora_path_outside_the_allowed_root_is_403_alike_whether_it_exists_or_not(secured, pki):
    url = secured["server"].url
    existing = _load(url, ADMIN, pki["private"], pki)
    missing = _load(url, ADMIN, pki["private"] + "/no-such-adapter", pki)
    assert existing.status_code == missing.status_code == 403
    assert existing.content == missing.content and pki["private"] not in existing.text
    inside = _load(url, ADMIN, pki["adapters"], pki)  # past the gate: the server says why not
    assert inside.status_code == 400 and "--enable-lora" in inside.json()["error"]["message"]


def test_a_rate_limited_key_gets_429_with_retry_after_while_another_key_is_served(secured, pki):
    url = secured["server"].url

    def models(key: str) -> httpx.Response:
        return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                         verify=pki["ca.pem"])  # fmt: skip

    alice = [models("sk-alice").status_code for _ in range(3)]
    assert alice[:2] == [200, 200] and alice[2] == 429  # rpm=2
    refused = models("sk-alice")
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert all(models("sk-bob").status_code == 200 for _ in range(5))
    counted = httpx.get(f"{url}/metrics", verify=pki["ca.pem"]).text
    assert 'tandem:api_requests_total{key="alice",outcome="rate_limited"}' in counted
    assert "sk-alice" not in counted and ADMIN not in counted


def test_a_10_mb_body_is_413_and_the_server_keeps_serving(secured, pki):
    url = secured["server"].url
    r = httpx.post(f"{url}/v1/completions", content=b"{" + b" " * 10_000_000 + b"}",
                   headers={"Authorization": "Bearer sk-bob", "Content-Type": "application/json"},
                   verify=pki["ca.pem"], timeout=60)  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    assert _ask(_client(url, "sk-bob", pki))
    counted = httpx.get(f"{url}/metrics", verify=pki["ca.pem"]).text
    assert 'tandem:api_requests_total{key="bob",outcome="refused_413"} 1.0' in counted


def test_a_key_past_its_tokens_per_minute_gets_429_counting_prompt_and_max_tokens(secured, pki):
    client = _client(secured["server"].url, "sk-carol", pki)
    model = client.models.list().data[0].id
    with pytest.raises(openai.RateLimitError, match="more than this key's 40 tokens per minute"):
        client.completions.create(model=model, prompt="Hello", max_tokens=64)
    first = client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=16)
    assert first.usage.prompt_tokens == 4  # 20 of 40 charged
    client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=16)  # 40 of 40
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=16)
    assert int(refused.value.response.headers["Retry-After"]) >= 1
