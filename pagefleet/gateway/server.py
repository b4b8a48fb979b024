"""The gateway's OpenAI-compatible front door (aiohttp): route, then proxy byte for byte.

Invariants:
- A request is retried on the next-ranked pod only while nothing has reached the client:
  connection refused/reset, a 503 or 429 from the pod (draining, or its queue is full:
  nothing was computed), or a stream that dies before its first body byte. After the
  first byte the stream is passed through as is.
- Upstream error responses (other 4xx and 5xx, and 429/503 once no other pod is left)
  reach the client with
  their status and body unchanged.
- Every response names the pod that served it in ``x-pagefleet-pod``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pagefleet.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestValidationError,
    parse_body,
)
from pagefleet.gateway.discovery import Endpoint
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.prompts import PromptTokenizer
from pagefleet.gateway.router import Router, RoutingDecision

logger = logging.getLogger(__name__)

POD_HEADER = "x-pagefleet-pod"
POLICY_HEADER = "x-pagefleet-policy"
HIT_HEADER = "x-pagefleet-predicted-hit-tokens"
SESSION_HEADER = "x-session-id"

# Hop-by-hop headers (RFC 9110 §7.6.1) and ones aiohttp recomputes.
_DROP_REQUEST_HEADERS = {
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "accept-encoding",
}
_DROP_RESPONSE_HEADERS = _DROP_REQUEST_HEADERS | {"content-encoding", "date", "server"}

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router", Router)


def error_response(
    status: int, message: str, err_type: str, code: str | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return web.json_response(body, status=status)


@dataclass(slots=True)
class ProxySettings:
    max_attempts: int = 3
    connect_timeout_s: float = 3.0
    # A pod that accepted the request but sends nothing for this long counts as failed
    # before the first byte (only while nothing reached the client yet).
    first_byte_timeout_s: float = 300.0
    read_timeout_s: float = 600.0


@dataclass(slots=True)
class Gateway:
    """One gateway: the router, the tokenizer for block keys, metrics, the upstream client."""

    router: Router
    tokenizer: PromptTokenizer | None
    served_model_name: str
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    _session: aiohttp.ClientSession | None = None
    _started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.router.metrics = self.metrics

    # -- app ------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app[ROUTER_KEY] = self.router
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.proxy.connect_timeout_s,
            sock_read=self.proxy.read_timeout_s,
        )
        # limit=0: the gateway must not queue requests on its own connection pool.
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=connector, auto_decompress=False
        )
        await self.router.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        await self.router.close()

    # -- plain endpoints ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        n = len(self.router.discovery.endpoints())
        if n == 0:
            return web.json_response({"status": "no ready endpoints", "endpoints": 0}, status=503)
        return web.json_response({"status": "ready", "endpoints": n})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served_model_name,
                        "object": "model",
                        "created": int(self._started),
                        "owned_by": "pagefleet",
                    }
                ],
            }
        )

    # -- proxied endpoints ----------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, CompletionRequest, "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, ChatCompletionRequest, "/v1/chat/completions")

    def _prompt_ids(self, parsed: CompletionRequest | ChatCompletionRequest) -> list[int] | None:
        if self.tokenizer is None:
            # Token-id prompts need no tokenizer; text prompts then route on load only.
            if isinstance(parsed, CompletionRequest):
                first = parsed.prompts()[0]
                if isinstance(first, list):
                    return list(first)
            return None
        try:
            if isinstance(parsed, ChatCompletionRequest):
                return self.tokenizer.chat_ids(parsed)
            return self.tokenizer.completion_ids(parsed)
        except Exception as exc:  # the daemon owns the verdict on bad prompts; route on load
            logger.debug("could not tokenize for routing (%s); routing on load only", exc)
            return None

    async def _handle(
        self,
        request: web.Request,
        model: type[CompletionRequest | ChatCompletionRequest],
        path: str,
    ) -> web.StreamResponse:
        t_arrival = time.perf_counter()
        body = await request.read()
        try:
            parsed = parse_body(model, body)
        except RequestValidationError as exc:
            return error_response(400, exc.message, "invalid_request_error")
        token_ids = self._prompt_ids(parsed)
        session_key = request.headers.get(SESSION_HEADER) or _session_from_body(parsed)
        decision = await self.router.route(token_ids, session_key=session_key)
        self.metrics.decision_seconds.labels(policy=decision.policy).observe(decision.decision_s)
        if not decision.ranked:
            return error_response(
                503,
                "no ready model endpoints behind this gateway; check the daemons and "
                "the gateway's --endpoints/--service",
                "service_unavailable",
                code="no_endpoints",
            )
        if decision.prompt_tokens:
            self.metrics.prompt_tokens_total.inc(decision.prompt_tokens)
        return await self._forward(request, body, path, parsed.stream, decision, t_arrival)

    async def _forward(
        self,
        request: web.Request,
        body: bytes,
        path: str,
        stream: bool,
        decision: RoutingDecision,
        t_arrival: float,
    ) -> web.StreamResponse:
        assert self._session is not None, "gateway used before startup"
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST_HEADERS
        }
        attempts = decision.ranked[: max(1, self.proxy.max_attempts)]
        last_error = "no attempt made"
        for i, scored in enumerate(attempts):
            ep = scored.endpoint
            more_left = i + 1 < len(attempts)
            self.router.acquire(ep, decision.keys)
            self.metrics.inflight.labels(pod=ep.pod).inc()
            try:
                result = await self._try_pod(
                    request,
                    ep,
                    path,
                    body,
                    headers,
                    stream,
                    decision,
                    scored.matched_tokens,
                    more_left,
                    time.perf_counter() - t_arrival,
                )
            finally:
                self.router.release(ep, decision.keys)
                self.metrics.inflight.labels(pod=ep.pod).dec()
            if isinstance(result, web.StreamResponse):
                self.router.mark_ok(ep)
                return result
            last_error = result
            self.router.mark_failed(ep)
            self.metrics.retries.labels(pod=ep.pod).inc()
            logger.info(
                "pod %s failed before the first byte (%s); %s",
                ep.pod,
                result,
                "trying the next one" if more_left else "no pod left",
            )
        return error_response(
            502,
            f"every candidate pod failed before responding (last: {last_error}); "
            "the daemons may be restarting, retry shortly",
            "upstream_error",
            code="upstream_unavailable",
        )

    async def _try_pod(
        self,
        request: web.Request,
        ep: Endpoint,
        path: str,
        body: bytes,
        headers: dict[str, str],
        stream: bool,
        decision: RoutingDecision,
        predicted_hit: int,
        more_left: bool,
        pre_s: float,
    ) -> web.StreamResponse | str:
        """Serve the request from ``ep``; a string says why to move on to the next pod.

        ``pre_s``: the gateway's own time before this attempt (parse, tokenize, route)."""
        assert self._session is not None
        t0 = time.perf_counter()
        try:
            upstream = await self._session.post(ep.url + path, data=body, headers=headers)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            out_headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS
            }
            out_headers[POD_HEADER] = ep.pod
            out_headers[POLICY_HEADER] = decision.policy
            out_headers[HIT_HEADER] = str(predicted_hit)
            if upstream.status in (429, 503) and more_left:
                return f"HTTP {upstream.status} from pod: {(await upstream.read())[:200]!r}"
            if upstream.status >= 400 or not stream:
                try:
                    payload = await upstream.read()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    return f"{type(exc).__name__} while reading the body: {exc}"
                self._count(ep, decision, predicted_hit, upstream.status)
                self.metrics.upstream_latency_seconds.labels(pod=ep.pod).observe(
                    time.perf_counter() - t0
                )
                self.metrics.overhead_seconds.observe(pre_s)
                return web.Response(status=upstream.status, body=payload, headers=out_headers)
            try:
                first = await asyncio.wait_for(
                    upstream.content.readany(), self.proxy.first_byte_timeout_s
                )
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                return f"{type(exc).__name__} before the first byte: {exc}"
            if not first:
                return "stream closed before the first byte"
            t_first = time.perf_counter()
            self.metrics.upstream_ttft_seconds.labels(pod=ep.pod).observe(t_first - t0)
            self._count(ep, decision, predicted_hit, upstream.status)
            resp = web.StreamResponse(status=upstream.status, headers=out_headers)
            await resp.prepare(request)
            await resp.write(first)
            self.metrics.overhead_seconds.observe(pre_s + time.perf_counter() - t_first)
            try:
                async for chunk in upstream.content.iter_any():
                    try:
                        await resp.write(chunk)
                    except (ConnectionResetError, RuntimeError) as exc:
                        # The client hung up; leaving here closes the upstream connection,
                        # which makes the daemon abort the request and free its blocks.
                        logger.debug("client went away while streaming from %s: %s", ep.pod, exc)
                        return resp
            except (TimeoutError, aiohttp.ClientError) as exc:
                # Bytes already reached the client: nothing to retry; end the stream.
                logger.warning(
                    "stream from pod %s broke after %.2fs: %s",
                    ep.pod,
                    time.perf_counter() - t0,
                    exc,
                )
            self.metrics.upstream_latency_seconds.labels(pod=ep.pod).observe(
                time.perf_counter() - t0
            )
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await resp.write_eof()
            return resp
        finally:
            upstream.release()
            if not upstream.closed:
                upstream.close()

    def _count(
        self, ep: Endpoint, decision: RoutingDecision, predicted_hit: int, status: int
    ) -> None:
        self.metrics.requests.labels(policy=decision.policy, pod=ep.pod).inc()
        self.metrics.responses.labels(pod=ep.pod, code=str(status)).inc()
        self.metrics.predicted_hit_tokens.observe(predicted_hit)


def _session_from_body(parsed: CompletionRequest | ChatCompletionRequest) -> str | None:
    value = (parsed.model_extra or {}).get("session_id") or parsed.user
    return value if isinstance(value, str) and value else None


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
