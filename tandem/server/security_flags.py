"""The security flags `tandem serve`, `tandem router` and `tandem proxy` share (vLLM's names
where vLLM has one), and what they become: a KeyRing, uvicorn's TLS settings, the context
a front end checks its workers' certificates with. Bad values are ValueErrors naming the
flag, raised before anything listens."""

from __future__ import annotations

import argparse
import os
import ssl

from tandem.server.security import MAX_REQUEST_BYTES, KeyRing


def add_security_args(p: argparse.ArgumentParser, key_help: str) -> None:
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"require `Authorization: Bearer KEY` on {key_help}; repeat it for several keys "
        "(default: $TANDEM_API_KEY)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="keys one a line: `KEY [name=NAME] [role=user|admin] [rpm=N] [tpm=N] "
        "[concurrency=N]` "
        "(the name is what logs and /metrics show; limits override --rate-limit)",
    )
    p.add_argument(
        "--admin-api-key",
        default=os.environ.get("TANDEM_ADMIN_API_KEY"),
        help="the key for endpoints that change the server (LoRA load/unload, the router's "
        "/workers); without one they are off (default: $TANDEM_ADMIN_API_KEY)",
    )
    p.add_argument(
        "--rate-limit",
        default=None,
        metavar="rpm=N,tpm=N,concurrency=N",
        help="per key (per client address without keys): requests per minute, tokens per "
        "minute (prompt plus max_tokens, charged by `tandem serve`) and requests in flight; "
        "past any, 429 with Retry-After (default: no limit)",
    )
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="a larger request body is refused with 413")  # fmt: skip
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle connection is kept open (uvicorn's flag)")  # fmt: skip
    p.add_argument("--ssl-keyfile", default=None, help="TLS: the server's private key (PEM)")
    p.add_argument("--ssl-certfile", default=None, help="TLS: the server's certificate (PEM)")
    p.add_argument("--ssl-ca-certs", default=None,
                   help="TLS: CA certificates that client certificates are checked against")  # fmt: skip
    p.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="client certificates: 0 none, 1 optional, 2 required (mutual TLS)")  # fmt: skip


def key_ring(args: argparse.Namespace) -> KeyRing:
    api_keys = args.api_key or (
        [os.environ["TANDEM_API_KEY"]] if os.environ.get("TANDEM_API_KEY") else []
    )
    if args.max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {args.max_request_bytes}")
    return KeyRing.from_flags(api_keys, args.api_key_file, args.admin_api_key, args.rate_limit)


def uvicorn_tls(args: argparse.Namespace) -> dict:
    """uvicorn.Config's TLS arguments, checked by loading them once here (and the idle
    timeout checked)."""
    if not args.timeout_keep_alive > 0:
        raise ValueError(f"timeout_keep_alive must be > 0, got {args.timeout_keep_alive}")
    if not args.ssl_certfile and not args.ssl_keyfile:
        if args.ssl_ca_certs or args.ssl_cert_reqs:
            raise ValueError(
                "ssl_ca_certs: client certificates need TLS (--ssl-certfile, --ssl-keyfile)"
            )
        return {}
    if not (args.ssl_certfile and args.ssl_keyfile):
        raise ValueError("ssl_certfile: give both --ssl-certfile and --ssl-keyfile")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ValueError("ssl_cert_reqs: checking client certificates needs --ssl-ca-certs")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"ssl_certfile: cannot load the certificate and key: {e}") from None
    if args.ssl_ca_certs:
        _load_ca(context, args.ssl_ca_certs, "ssl_ca_certs")
    return {
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": [ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED][args.ssl_cert_reqs],
    }


def client_tls(
    ca_certs: str | None, certfile: str | None = None, keyfile: str | None = None
) -> ssl.SSLContext | None:
    """The context a front end reaches https:// workers with: the system's CAs plus `ca_certs`
    (a private CA), and its own certificate for workers that require one; None for defaults."""
    if not (ca_certs or certfile or keyfile):
        return None
    if bool(certfile) != bool(keyfile):
        raise ValueError(
            "worker_ssl_certfile: give both --worker-ssl-certfile and --worker-ssl-keyfile"
        )
    context = ssl.create_default_context()
    if ca_certs:
        _load_ca(context, ca_certs, "worker_ca_certs")
    if certfile:
        try:
            context.load_cert_chain(certfile, keyfile)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(
                f"worker_ssl_certfile: cannot load the certificate and key: {e}"
            ) from None
    return context


def _load_ca(context: ssl.SSLContext, path: str, field: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"{field}: cannot load CA certificates from {path}: {e}") from None
