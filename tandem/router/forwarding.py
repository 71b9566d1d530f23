"""What a front end (the router, its PD mode) passes on of a client's request."""

from __future__ import annotations

import json

from starlette.requests import Request

FORWARDED = ("authorization", "content-type", "x-session-id")  # headers the workers see


async def read_request(request: Request) -> tuple[bytes, object, dict[str, str]]:
    """(raw body, parsed JSON or None when it is not JSON, headers to pass on). A body the
    front end cannot parse still goes to a worker, which says what is wrong with it."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        body = None
    return raw, body, {k: v for k, v in request.headers.items() if k in FORWARDED}
