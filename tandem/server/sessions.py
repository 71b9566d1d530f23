"""Agent sessions, in SGLang's shape: `POST /open_session`, `POST /close_session`, and
requests that join one (`session_id` in the body, the `x-session-id` header, or SGLang's
`session_params: {"id": ...}`).

A session lives here, in the server process, with its TTL clock; the engine core only learns
"pin this request's prefix for ttl_s after it ends" (EngineCoreRequest.session_id and
session_ttl) and "unpin this session" (close). The TTL counts from the end of the session's
last response, never while a turn is running, so a tool call shorter than the TTL never
loses the session's KV. An unknown, closed or expired session, or one another API key
opened, is a 404 (`session_not_found`): never a silent recompute billed as a hit.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import Field

from tandem.server.errors import APIError, bad_request
from tandem.server.protocol import _Model

DEFAULT_TTL_S = 300.0
MAX_TTL_S = 86_400.0
MAX_SESSIONS = 4096  # open at once: each is a few hundred bytes here and a pin in the core
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


class OpenSessionRequest(_Model):
    session_id: str | None = None  # default: a fresh one
    ttl_s: float = DEFAULT_TTL_S
    capacity_tokens: int | None = Field(None, ge=1)  # the longest prompt a turn may send


class CloseSessionRequest(_Model):
    session_id: str


@dataclass
class Session:
    id: str
    ttl_s: float
    owner: str | None  # the API key's name that opened it (None: the server has no keys)
    capacity_tokens: int | None
    idle_since: float  # when its last turn ended (or it opened)
    running: int = 0  # turns in flight: the TTL does not run while one is

    def expired(self, now: float) -> bool:
        return self.running == 0 and now - self.idle_since > self.ttl_s


def session_not_found(session_id: str) -> APIError:
    return APIError(
        404,
        f"session_id: no open session {session_id!r} (never opened, closed, or idle past "
        "its ttl_s)",
        "invalid_request_error",
        "session_id",
        "session_not_found",
    )


class Sessions:
    def __init__(self, close_in_core: Callable[[str], None], clock=time.monotonic) -> None:
        self.close_in_core = close_in_core  # unpins a session's prefix in the engine core
        self.clock = clock
        self.open_sessions: dict[str, Session] = {}

    def open(self, req: OpenSessionRequest, owner: str | None) -> Session:
        self.sweep()
        if not 0 < req.ttl_s <= MAX_TTL_S:
            raise bad_request(f"ttl_s: must be in (0, {MAX_TTL_S:g}] seconds", "ttl_s")
        sid = req.session_id if req.session_id is not None else uuid.uuid4().hex
        if not _ID.fullmatch(sid):
            raise bad_request(
                "session_id: 1-128 characters of letters, digits, '_', '.', ':' or '-'",
                "session_id",
            )
        if sid in self.open_sessions:
            raise APIError(409, f"session_id: {sid!r} is already open", "invalid_request_error",
                           "session_id", "session_exists")  # fmt: skip
        if len(self.open_sessions) >= MAX_SESSIONS:
            raise APIError(429, f"sessions: {MAX_SESSIONS} are open; close one first",
                           "rate_limit_error", "session_id", "too_many_sessions")  # fmt: skip
        session = Session(sid, req.ttl_s, owner, req.capacity_tokens, self.clock())
        self.open_sessions[sid] = session
        return session

    def get(self, session_id: str, owner: str | None) -> Session:
        """The open session a request joins; a 404 for anything else (another key's session
        reads the same as none, so ids cannot be probed)."""
        session = self.open_sessions.get(session_id)
        if session is not None and session.expired(self.clock()):
            self._drop(session)
            session = None
        if session is None or session.owner != owner:
            raise session_not_found(session_id)
        return session

    def close(self, session_id: str, owner: str | None) -> None:
        self._drop(self.get(session_id, owner))

    def begin(self, session: Session) -> Callable[[], None]:
        """A turn starts; -> what to call once when it ends (its stream's on_end)."""
        session.running += 1

        def end() -> None:
            session.running -= 1
            session.idle_since = self.clock()

        return end

    def sweep(self) -> None:
        """Forget the sessions idle past their TTL (the core's pins expire on their own)."""
        now = self.clock()
        for session in [s for s in self.open_sessions.values() if s.expired(now)]:
            self._drop(session)

    def _drop(self, session: Session) -> None:
        del self.open_sessions[session.id]
        self.close_in_core(session.id)
