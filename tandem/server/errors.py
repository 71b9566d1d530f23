"""Errors as OpenAI sends them: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import re

import msgspec
from starlette.responses import Response

_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*)(?::| must| is)")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> Response:
        return error_response(
            self.status, self.message, self.type, self.param, self.code, self.headers
        )


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return msgspec.json.encode(
        {"error": {"message": message, "type": type, "param": param, "code": code}}
    )


def error_response(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        error_body(message, type, param, code),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def bad_request(message: str, param: str | None = None) -> APIError:
    """400. Without `param`, the field is read off the message ("top_p must be ...")."""
    if param is None:
        match = _FIELD.match(message)
        param = match.group(1) if match else None
    return APIError(400, message, param=param)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect API key provided: pass it as `Authorization: Bearer <key>`.",
        code="invalid_api_key",
    )


def unavailable(message: str, retry_after: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return APIError(503, message, type="server_error", code="service_unavailable", headers=headers)


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")
