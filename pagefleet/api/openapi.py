"""OpenAPI 3.1 descriptions of the daemon's and the gateway's HTTP APIs (``GET /openapi.json``).

Built from the same pydantic request models the servers validate with, so the description
cannot drift from what they accept. Every error response is declared with OpenAI's error
shape, which lets a property-based fuzzer (schemathesis) check that each 4xx/5xx body has it.
"""

from __future__ import annotations

import functools
from typing import Any

import pagefleet
from pagefleet.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)

_REF = "#/components/schemas/{model}"


def _schemas(*models: type) -> dict[str, Any]:
    """Component schemas of ``models``, nested definitions hoisted beside them."""
    out: dict[str, Any] = {}
    for m in models:
        schema = m.model_json_schema(ref_template=_REF)  # type: ignore[attr-defined]
        out.update(schema.pop("$defs", {}))
        out[m.__name__] = schema
    return out


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(model=name)}


_ERRORS = {
    "4XX": {
        "description": "The caller's mistake, or overload (429), in OpenAI's error shape.",
        "content": {"application/json": {"schema": _ref("ErrorResponse")}},
    },
    "5XX": {
        "description": "Unavailable or upstream failure, in OpenAI's error shape.",
        "content": {"application/json": {"schema": _ref("ErrorResponse")}},
    },
}


def _get(summary: str, content_type: str = "application/json") -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": {content_type: {"schema": {}}}},
                **_ERRORS,
            },
        }
    }


def _post(summary: str, body: str | None, streams: bool = False) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {}}}
    if streams:
        # Each event's data is a chunk object, an in-band error, or the [DONE] marker.
        ok["text/event-stream"] = {"schema": {}}
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "OK", "content": ok}, **_ERRORS},
    }
    if body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    return {"post": op}


def _document(title: str, paths: dict[str, Any], models: tuple[type, ...]) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": pagefleet.__version__},
        "paths": paths,
        "components": {
            "schemas": _schemas(ErrorResponse, *models),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _serving_paths() -> dict[str, Any]:
    return {
        "/health": _get("Liveness"),
        "/ready": _get("Readiness: 200 when taking requests"),
        "/metrics": _get("Prometheus metrics", "text/plain"),
        "/v1/models": _get("Served models"),
        "/v1/completions": _post("Text completion", "CompletionRequest", streams=True),
        "/v1/chat/completions": _post("Chat completion", "ChatCompletionRequest", streams=True),
    }


@functools.cache
def gateway_openapi() -> dict[str, Any]:
    """The gateway's API (cached: it never changes within a process)."""
    return _document(
        "pagefleet gateway", _serving_paths(), (CompletionRequest, ChatCompletionRequest)
    )


@functools.cache
def daemon_openapi() -> dict[str, Any]:
    """The daemon's API, including its tokenizer and admin endpoints."""
    paths = _serving_paths()
    paths.update(
        {
            "/version": _get("Version"),
            "/tokenize": _post("Tokenize", "TokenizeRequest"),
            "/detokenize": _post("Detokenize", "DetokenizeRequest"),
            "/get_model_info": _get("Model info"),
            "/get_load": _get("Current load"),
            "/get_server_info": _get("Server configuration (admin)"),
            "/reset_prefix_cache": _post("Drop the prefix cache (admin)", None),
        }
    )
    return _document(
        "pagefleet daemon",
        paths,
        (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest),
    )
