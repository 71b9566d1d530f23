"""Who may call what: API keys with roles and per-key limits, checked in one ASGI layer in
front of the server, the router and the PD proxy. Handlers and the engine core never see a
key; they see the key's name in `scope["tandem.key"]` at most.

- A user key opens the user endpoints (/v1/...); an admin key opens only the endpoints that
  change the server (LoRA load and unload, the router's /workers). The admin key on a user
  endpoint is answered as any wrong key is (401), so no endpoint says which string is the
  admin key.
- Without an admin key the admin endpoints are off (403 naming the flag that turns them on),
  unless the operator opens them to user keys (`--enable-runtime-lora-updating`).
- Keys are compared in constant time, every key every time; a key is never logged or echoed.
- Limits per key (or per client address when no key is asked for): requests per minute, a
  token bucket refilled continuously, and requests in flight (a stream counts until its last
  byte). Past either: 429 with Retry-After. A body over --max-request-bytes: 413.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.server.errors import APIError, unauthorized

log = logging.getLogger("tandem")
USER, ADMIN = "user", "admin"
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a 128k-token prompt as JSON is ~1 MiB


@dataclass(frozen=True)
class KeyLimits:
    rpm: int | None = None  # requests per minute
    concurrency: int | None = None  # requests in flight
    # tokens per minute, charged at admission as OpenAI counts them: prompt tokens plus
    # max_tokens for each completion asked for
    tpm: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "concurrency", "tpm"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def over(self, other: KeyLimits) -> KeyLimits:
        """These limits, falling back to `other`'s where unset."""
        return KeyLimits(
            self.rpm if self.rpm is not None else other.rpm,
            self.concurrency if self.concurrency is not None else other.concurrency,
            self.tpm if self.tpm is not None else other.tpm,
        )


@dataclass(frozen=True)
class APIKey:
    name: str
    token: bytes = field(repr=False)  # the Authorization header's whole value
    role: str = USER
    limits: KeyLimits = KeyLimits()


def parse_limits(spec: str, where: str) -> KeyLimits:
    """'rpm=60,tpm=20000,concurrency=4' (commas or spaces) -> KeyLimits; ValueError naming
    `where`."""
    values: dict[str, int] = {}
    for item in spec.replace(",", " ").split():
        name, _, value = item.partition("=")
        if name not in ("rpm", "tpm", "concurrency") or not value.isdigit():
            raise ValueError(f"{where}: {item!r} is not rpm=N, tpm=N or concurrency=N")
        values[name] = int(value)
    try:
        return KeyLimits(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def parse_key_file(text: str, where: str = "api_key_file") -> list[APIKey]:
    """One key a line: `KEY [name=NAME] [role=user|admin] [rpm=N] [tpm=N] [concurrency=N]`; blank
    lines and comments (a word starting with #, and what follows) skipped, so a key may hold a
    # itself. Errors name the line, never the key."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        comment = next((i for i, w in enumerate(words) if w.startswith("#")), len(words))
        words = words[:comment]
        if not words:
            continue
        secret, options = words[0], dict(w.partition("=")[::2] for w in words[1:])
        at = f"{where} line {number}"
        if "=" in secret:
            raise ValueError(
                f"{at}: the key comes first, then name=, role=, rpm=, tpm=, concurrency="
            )
        name = options.pop("name", f"key{number}")
        role = options.pop("role", USER)
        if role not in (USER, ADMIN):
            raise ValueError(f"{at}: role must be user or admin, got {role!r}")
        limits = parse_limits(" ".join(f"{k}={v}" for k, v in options.items()), at)
        keys.append(APIKey(name, _bearer(secret), role, limits))
    return keys


def _bearer(secret: str) -> bytes:
    return f"Bearer {secret}".encode()


class KeyRing:
    """The keys a front end accepts, and the limits of requests that bring none."""

    def __init__(self, keys: list[APIKey], defaults: KeyLimits = KeyLimits()) -> None:
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"api_key: key names must differ, got {sorted(names)}")
        tokens = [k.token for k in keys]
        if len(set(tokens)) != len(tokens):
            raise ValueError("api_key: the same key is given twice")
        self.keys = keys
        self.defaults = defaults

    @classmethod
    def from_flags(
        cls,
        api_keys: list[str] | None = None,
        api_key_file: str | None = None,
        admin_api_key: str | None = None,
        rate_limit: str | None = None,
    ) -> KeyRing:
        defaults = parse_limits(rate_limit or "", "rate_limit")
        keys = [
            APIKey(f"key{i}" if i else "default", _bearer(k)) for i, k in enumerate(api_keys or [])
        ]
        if api_key_file:
            try:
                text = open(api_key_file).read()
                shared = os.stat(api_key_file).st_mode & 0o077
            except OSError as e:
                raise ValueError(
                    f"api_key_file: cannot read {api_key_file}: {e.strerror}"
                ) from None
            if shared:
                log.warning("%s is readable by other users: chmod 600 it", api_key_file)
            keys += parse_key_file(text)
        if admin_api_key:
            keys.append(APIKey("admin", _bearer(admin_api_key), ADMIN))
        return cls(
            [APIKey(k.name, k.token, k.role, k.limits.over(defaults)) for k in keys], defaults
        )

    @property
    def requires_key(self) -> bool:
        return any(k.role == USER for k in self.keys)

    @property
    def has_admin(self) -> bool:
        return any(k.role == ADMIN for k in self.keys)

    def identify(self, authorization: bytes) -> APIKey | None:
        """The key this header carries, comparing against every key in constant time."""
        found = None
        for key in self.keys:
            if hmac.compare_digest(authorization, key.token):
                found = key
        return found


class Limiter:
    """Per identity: token buckets of requests and of tokens per minute, refilled
    continuously, and a count of requests in flight."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.buckets: dict[
            tuple[str, str], tuple[float, float]
        ] = {}  # (who, unit) -> (level, when)
        self.in_flight: dict[str, int] = {}

    def admit(self, who: str, limits: KeyLimits) -> float | None:
        """None if admitted (release it later), else seconds to wait before trying again."""
        if limits.concurrency is not None and self.in_flight.get(who, 0) >= limits.concurrency:
            return 1.0
        if limits.rpm is not None:
            wait = self._take((who, "requests"), limits.rpm, 1)
            if wait is not None:
                return wait
        self.in_flight[who] = self.in_flight.get(who, 0) + 1
        return None

    def charge(self, who: str, limits: KeyLimits, tokens: int) -> float | None:
        """Take `tokens` from the key's tokens-per-minute bucket: None if they fit, else
        seconds until they would (math.inf: more than a whole minute's worth)."""
        if limits.tpm is None:
            return None
        if tokens > limits.tpm:
            return math.inf
        return self._take((who, "tokens"), limits.tpm, tokens)

    def _take(self, bucket: tuple[str, str], per_minute: int, amount: int) -> float | None:
        now = self.clock()
        level, then = self.buckets.get(bucket, (float(per_minute), now))
        level = min(float(per_minute), level + (now - then) * per_minute / 60)
        if level < amount:
            self.buckets[bucket] = (level, now)
            return (amount - level) * 60 / per_minute
        self.buckets[bucket] = (level - amount, now)
        return None

    def release(self, who: str) -> None:
        left = self.in_flight[who] - 1
        if left:
            self.in_flight[who] = left
        else:
            del self.in_flight[who]


@dataclass(frozen=True)
class AccessPolicy:
    """Which paths are whose. Paths under `user` need a user key (when any is set); paths
    under `admin` an admin key; `admin_open` lets user keys (or anyone, with no keys) use the
    admin paths when no admin key is set. Others are public (/health, /metrics)."""

    user: tuple[str, ...] = ("/v1",)
    admin: tuple[str, ...] = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
    admin_methods: tuple[str, ...] = ()  # () for every method
    admin_open: bool = False
    admin_flag: str = "--enable-runtime-lora-updating"
    # admin paths a flag of their own opens, for POST (reading them is public): (path, flag, opened)
    flagged: tuple[tuple[str, str, bool], ...] = ()

    def kind(self, method: str, path: str) -> str | None:
        if path.startswith(self.admin) and (not self.admin_methods or method in self.admin_methods):
            return ADMIN
        if method == "POST" and any(path == p for p, _, _ in self.flagged):
            return ADMIN
        return USER if path.startswith(self.user) else None

    def opening(self, path: str) -> tuple[str, bool]:
        """The flag that opens an admin path to API keys (or to anyone, with none), and
        whether it was given."""
        for p, flag, opened in self.flagged:
            if path == p:
                return flag, opened
        return self.admin_flag, self.admin_open


def runtime_lora_updating(flag: bool) -> bool:
    """The flag, or vLLM's environment variable for the same thing."""
    return flag or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")


@dataclass(frozen=True)
class Access:
    """A front end's security settings, from its flags (security_flags.py)."""

    ring: KeyRing = field(default_factory=lambda: KeyRing([]))
    policy: AccessPolicy = AccessPolicy()
    max_request_bytes: int = MAX_REQUEST_BYTES
    allowed_local_paths: list[str] | None = None  # roots runtime loads may read under


class AccessGate:
    """Pure ASGI middleware: the key and its role, the body cap, then the key's limits."""

    def __init__(
        self,
        app: ASGIApp,
        access: Access,
        registry: CollectorRegistry | None = None,
        limiter: Limiter | None = None,
    ) -> None:
        self.app, self.ring, self.policy = app, access.ring, access.policy
        self.max_bytes = access.max_request_bytes
        self.limiter = limiter or Limiter()
        self.requests = Counter(
            "tandem:api_requests",
            "Requests at the API gate, by key name (never the key) and outcome",
            ["key", "outcome"],
            registry=registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        kind = self.policy.kind(scope["method"], scope["path"])
        if kind is None:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        key = self.ring.identify(headers.get(b"authorization", b""))
        refusal = self._refusal(kind, key, scope["path"])
        name = key.name if key else "anonymous"
        if refusal is None and _declared_length(headers) > self.max_bytes:
            refusal = _too_large(self.max_bytes)
        if refusal is not None:
            self.requests.labels(name, f"refused_{refusal.status}").inc()
            return await refusal.response()(scope, receive, send)
        who = key.name if key else f"addr:{(scope.get('client') or ('?',))[0]}"
        limits = key.limits if key else self.ring.defaults
        wait = self.limiter.admit(who, limits)
        if wait is not None:
            self.requests.labels(name, "rate_limited").inc()
            return await _too_many(wait).response()(scope, receive, send)
        scope["tandem.key"] = name
        try:
            body = await _read_body(receive, self.max_bytes)
            if body is _GONE:
                return
            if body is None:
                self.requests.labels(name, "refused_413").inc()
                return await _too_large(self.max_bytes).response()(scope, receive, send)
            self.requests.labels(name, "admitted").inc()
            scope["tandem.charge"] = lambda tokens: self._charge(name, who, limits, tokens)
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.limiter.release(who)

    def _charge(self, name: str, who: str, limits: KeyLimits, tokens: int) -> None:
        wait = self.limiter.charge(who, limits, tokens)
        if wait is None:
            return
        self.requests.labels(name, "token_limited").inc()
        if wait == math.inf:
            raise APIError(
                429, f"this request may use {tokens} tokens (prompt plus max_tokens), more than "
                f"this key's {limits.tpm} tokens per minute: lower max_tokens",
                type="rate_limit_error", code="rate_limit_exceeded",
            )  # fmt: skip
        raise _too_many(wait)

    def _refusal(self, kind: str, key: APIKey | None, path: str) -> APIError | None:
        if kind == ADMIN:
            if self.ring.has_admin:
                if key is None:
                    return unauthorized()
                return (
                    None if key.role == ADMIN else _forbidden("this endpoint needs the admin key")
                )
            flag, opened = self.policy.opening(path)
            if not opened:
                return _forbidden(
                    "this endpoint is off: start the server with --admin-api-key, or with "
                    f"{flag} to open it to API keys"
                )
        if self.ring.requires_key and (key is None or key.role != USER):
            return unauthorized()
        return None


_GONE = b"\0gone"  # the client disconnected while sending its body


async def _read_body(receive: Receive, cap: int) -> bytes | None:
    """The whole request body, None past `cap` bytes (a chunked body declares no length, so
    it is counted as it comes), or _GONE. Request bodies here are JSON a handler reads whole
    anyway."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return _GONE
        body += message.get("body", b"")
        if len(body) > cap:
            return None
        if not message.get("more_body", False):
            return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app: the body read already, then the client's own messages (a
    streaming handler listens for the disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _declared_length(headers: dict[bytes, bytes]) -> int:
    try:
        return int(headers.get(b"content-length", b"0"))
    except ValueError:
        return 0


def _forbidden(message: str) -> APIError:
    return APIError(403, message, type="permission_error", code="forbidden")


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is over {limit} bytes (--max-request-bytes)", code="too_large"
    )


def _too_many(wait: float) -> APIError:
    seconds = max(1, math.ceil(wait))
    return APIError(
        429,
        f"rate limit reached for this key: try again in {seconds} s",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


def charge_tokens(scope: Scope, tokens: int) -> None:
    """Charge a request's tokens (prompt plus max_tokens per completion) to its key's
    tokens-per-minute limit; raises a 429 APIError past it. A no-op without the gate."""
    charge = scope.get("tandem.charge")
    if charge is not None:
        charge(tokens)


def check_allowed_path(path: str, roots: list[str] | None, param: str) -> str:
    """`path` resolved, if it lies under one of `roots` (any path, as given, when no roots
    are set); else a 403 that reads the same whether the path exists or not."""
    if roots is None:
        return path
    resolved = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(root)
        if resolved == base or resolved.startswith(base.rstrip(os.sep) + os.sep):
            return resolved
    raise APIError(
        403, f"{param}: not under an allowed local path (--allowed-local-path)", param=param,
        type="permission_error", code="forbidden",
    )  # fmt: skip
