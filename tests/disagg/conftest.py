"""Prefill/decode deployments as real processes on loopback: `tandem serve --role prefill`,
`tandem serve --role decode`, and `tandem proxy` in front, next to a colocated reference.

All of a module's instances start at once (each takes seconds) and are waited on when a test
first needs them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tandem.kv_transfer.curve import generate
from tests.router.conftest import FrontEnd
from tests.server.conftest import Server, metrics


class ProxyProcess(FrontEnd):
    def __init__(self, prefill: list[Server], decode: list[Server], log_dir: Path, name: str,
                 args: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.prefill, self.decode = prefill, decode
        super().__init__(["proxy", "--prefill", *[s.url for s in prefill],
                          "--decode", *[s.url for s in decode], *args], log_dir, name)  # fmt: skip

    def wait_ready(self, timeout: float = 180.0) -> ProxyProcess:
        """Every instance up, and the proxy's prober seeing each of them healthy: the proxy
        answers /health once a decode instance is, and a request sent before its prober
        readmits the prefill instances (probed while still starting) would run colocated."""
        for s in (*self.prefill, *self.decode):
            s.wait_ready(timeout)
        super().wait_ready(timeout)
        deadline = time.monotonic() + timeout
        want = {"prefill": len(self.prefill), "decode": len(self.decode)}
        while (seen := self.healthy_instances()) != want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"proxy sees {seen} healthy instances, not {want}")
            time.sleep(0.2)
        return self

    def metrics(self) -> dict[str, float]:
        return metrics(self.url, "served")

    def healthy_instances(self) -> dict[str, float | None]:
        """role -> instances the proxy's prober sees healthy."""
        seen = metrics(self.url, "role")
        return {r: seen.get(f"tandem:pd_instances_healthy:{r}") for r in ("prefill", "decode")}


BF16_8 = ["--dtype", "bfloat16", "--block-size", "8"]


@pytest.fixture(scope="module")
def deployments(llama_path, tmp_path_factory):
    """name -> (colocated reference or None, prefill, decode, proxy), all started now."""
    logs = tmp_path_factory.mktemp("pd-logs")
    started: dict[str, tuple] = {}

    def deployment(name, prefill_args=(), decode_args=(), proxy_args=(), reference_args=None,
                   prefill=None):  # fmt: skip
        ref = None
        if reference_args is not None:
            ref = Server(llama_path, list(reference_args), logs, f"{name}-ref")
        p = prefill or Server(llama_path, ["--role", "prefill", *prefill_args], logs, f"{name}-prefill")  # fmt: skip
        d = Server(llama_path, ["--role", "decode", *decode_args], logs, f"{name}-decode")
        started[name] = (ref, p, d, ProxyProcess([p], [d], logs, f"{name}-proxy", proxy_args))

    keys = tmp_path_factory.mktemp("kv-keys")
    decode_key, decode_secret = generate(str(keys / "decode"), "decode")
    _, prefill_secret = generate(str(keys / "prefill"), "p0")
    deployment(  # float32, blocks of 16 everywhere; the KV link authenticated (CURVE)
        "same",
        prefill_args=("--kv-secret-key", str(prefill_secret), "--kv-peer-keys", str(decode_key)),
        decode_args=(
            "--kv-secret-key",
            str(decode_secret),
            "--kv-peer-keys",
            str(keys / "prefill"),
        ),
        reference_args=(),
    )
    p2 = Server(llama_path, ["--role", "prefill"], logs, "two-prefill")  # also "mixed"'s
    deployment("mixed", decode_args=BF16_8, reference_args=BF16_8, prefill=p2)  # f32/16 -> bf16/8
    deployment("dies", proxy_args=("--stream-timeout", "5"))
    deployment(
        "stalls",
        decode_args=("--kv-transfer-timeout", "3"),
        proxy_args=("--prefill-timeout", "1.5"),
    )
    started["stalls"] = (started["same"][0], *started["stalls"][1:])  # one colocated reference
    ds = [Server(llama_path, ["--role", "decode"], logs, f"two-decode-{i}") for i in range(2)]
    started["two"] = (None, p2, ds, ProxyProcess([p2], ds, logs, "two-proxy"))
    yield started
    every = list({id(s): s for ref, p, d, _ in started.values()
                  for s in (ref, p, *(d if isinstance(d, list) else [d])) if s is not None}.values())  # fmt: skip
    for *_, proxy in started.values():
        proxy.stop()
    for s in every:
        s.terminate()
    for s in every:
        s.stop()


def ready(deployments, name: str):
    ref, p, d, proxy = deployments[name]
    proxy.wait_ready()  # and its instances
    if ref is not None:
        ref.wait_ready()
    return ref, p, d, proxy
