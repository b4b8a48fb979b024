"""The daemon's errors for callers, in OpenAI's error shape.

Invariant: the caller's mistakes are 4xx naming the field (``param``); 500 only for ours.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pagefleet.api.openai import ErrorDetail, ErrorResponse


class APIError(Exception):
    """An error for the caller, rendered in OpenAI's shape with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            text=ErrorResponse(error=self.detail).model_dump_json(),
            content_type="application/json",
            headers=self.headers,
        )


def json_model(model: Any, status: int = 200) -> web.Response:
    """A pydantic model as a JSON response."""
    return web.Response(
        status=status, text=model.model_dump_json(), content_type="application/json"
    )


def http_error(request: web.Request, exc: web.HTTPException) -> APIError:
    """aiohttp's own 4xx (no route, wrong method, body too large) in OpenAI's shape."""
    status = exc.status
    if status == 404:
        return APIError(404, f"no route {request.method} {request.path}", code="not_found")
    if status == 405:
        return APIError(405, f"method {request.method} not allowed on {request.path}")
    if status == 413:
        return APIError(
            413,
            f"request body too large: the limit is {request.app._client_max_size} bytes",
            code="request_too_large",
        )
    return APIError(status, exc.reason or "bad request")
