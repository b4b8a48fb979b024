"""The gateway's OpenAI-compatible front door (aiohttp): route, then proxy byte for byte.

Invariants:
- A request is retried on the next-ranked pod only while nothing has reached the client:
  connection refused/reset, a 503 or 429 from the pod (draining, or its queue is full:
  nothing was computed), a stream's timeout before its first byte, or a stream that dies
  before its first body byte. After the first byte the stream is passed through as is.
- A non-streamed request that runs out of ``request_timeout_s`` is a 504, never re-sent:
  its pod took it and may still be generating, so another pod would compute it again and
  the client would wait that long once more.
- A stream that breaks after its first byte (pod killed, hung past the inter-chunk
  timeout) ends with an SSE ``error`` event in OpenAI's shape and no ``[DONE]``; a
  non-streamed answer is either complete or an error status with an error body. A
  client never gets a 200 that looks complete but is not.
- Upstream error responses (other 4xx and 5xx, and 429/503 once no other pod is left)
  reach the client with their status and body unchanged.
- A pod's 401 is about the gateway's upstream key: a final 502 ``upstream_auth_failed``
  that says so, never passed on as a 401, which clients read as their own key being wrong.
- A non-streamed answer or error body is held whole before it is sent, at most
  ``max_response_bytes`` of it: a larger one is a final 502 (any pod would send the same).
- Bodies over ``max_body_bytes`` (the daemon's limit) are refused before being read; a
  body that has not fully arrived ``body_timeout_s`` after its headers is a 408 and the
  connection is closed, so a client trickling bytes cannot hold an admission slot;
- A write to the client that cannot complete within ``client_write_timeout_s`` (it stopped
  reading) cuts its connection and the pod's request with it: the pod's sequence and the
  gateway's slot are never held by a client that reads nothing;
  large bodies are parsed and tokenized in worker processes, so ``/health`` and other
  streams never wait for them; at most ``max_concurrency`` requests are open at once.
- The bodies held by open requests add up to at most ``max_inflight_body_mb``: a request
  that would pass it is a 503 with Retry-After, decided from its Content-Length before its
  body is read (an undeclared length counts as it arrives), so a flood of large bodies
  costs bounded memory; nothing admitted is affected.
- Every proxied response names the pod that served it in ``x-pagefleet-pod``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_urldispatcher import _default_expect_handler as _continue

from pagefleet.api.body_budget import DEFAULT_MAX_INFLIGHT_BODY_MB, BodyBudget, BodyHold
from pagefleet.api.limits import DEFAULT_MAX_BODY_BYTES, body_not_decoded
from pagefleet.api.openapi import gateway_openapi
from pagefleet.gateway.discovery import Endpoint
from pagefleet.gateway.intake import Intake, IntakePool
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.pd import PDOrchestrator
from pagefleet.gateway.prompts import PromptTokenizer
from pagefleet.gateway.router import Router, RoutingDecision, Ticket
from pagefleet.httpauth import (
    AuthPolicy,
    ClientWriteTimeout,
    Credentials,
    bearer_header,
    upstream_refused_hint,
    write_within,
)
from pagefleet.ratelog import EveryInterval

logger = logging.getLogger(__name__)

POD_HEADER = "x-pagefleet-pod"
POLICY_HEADER = "x-pagefleet-policy"
HIT_HEADER = "x-pagefleet-predicted-hit-tokens"
# "placement/reason" of the pod that answered, as the placements counter labels it
# (bench/routing.py's per-request dump: which requests a rule moved off their holder)
ROUTE_HEADER = "x-pagefleet-route"
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
    # request.read() has already decoded a compressed body: forward it as what it now is.
    "content-encoding",
}
_DROP_RESPONSE_HEADERS = _DROP_REQUEST_HEADERS | {"date", "server"}
_DONE = b"data: [DONE]"
_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# A 429/503's body is read, for the log only, at most this long: it is a few hundred bytes
# sent with the headers, and the client session has no read timeout of its own.
_REFUSAL_BODY_WAIT_S = 1.0
# At most one warning per this many seconds about clients cut for not reading: a client
# can make one per request (pagefleet_gateway_client_cuts_total has the exact count).
CUT_LOG_INTERVAL_S = 10.0
# Errors that mean the client is gone while we write to it.
_CLIENT_GONE = (ConnectionError, RuntimeError, aiohttp.ClientConnectionResetError)

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router", Router)


def error_body(message: str, err_type: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}}


def error_response(
    status: int,
    message: str,
    err_type: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = error_body(message, err_type, code)
    body["error"]["param"] = param
    return web.json_response(body, status=status, headers=headers)


@dataclass(slots=True)
class ProxySettings:
    max_attempts: int = 3
    connect_timeout_s: float = 3.0
    # Streams: from forwarding to the first body byte. Past it the pod is ranked last for
    # new requests and this request moves to the next pod (nothing reached the client);
    # the pod's other requests go on (it may be busy, not frozen: the probe judges that).
    first_byte_timeout_s: float = 60.0
    # Streams: the longest silence between two chunks; past it the client gets an error
    # event and the pod is ranked last for new requests.
    inter_chunk_timeout_s: float = 30.0
    # Non-streamed answers arrive whole at the end: only a total limit applies (a hung
    # pod is caught sooner by the discovery probe, which releases its requests). Past it
    # the request ends with a 504 and is not re-sent: the pod may still be generating it.
    request_timeout_s: float = 600.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # From the request's headers to the last byte of its body. A client uploading a
    # maximal body (4 MiB) needs ~140 KB/s to make it; one trickling bytes to hold a slot
    # gets a 408 instead.
    body_timeout_s: float = 30.0
    # The longest one write to the client may wait for it to take the bytes (its socket
    # buffers are full: it stopped reading). Past it the client is cut and so is the pod's
    # request, whose daemon then aborts the sequence and frees its blocks.
    client_write_timeout_s: float = 30.0
    max_concurrency: int = 1024
    # The bodies of open requests together (api/body_budget.py): past it, a 503 decided
    # from the Content-Length before the body is read (undeclared ones count as they come).
    max_inflight_body_mb: int = DEFAULT_MAX_INFLIGHT_BODY_MB
    # A non-streamed answer is held whole before it is sent (a cut one must not go out as a
    # 200): past this size it is a 502 instead. 64x the request cap: n=128 choices of 4k
    # tokens with top logprobs still fit; more is for streaming, which is not held.
    max_response_bytes: int = 256 << 20
    # Context length the gateway checks prompts against (None: leave it to the daemons).
    max_model_len: int | None = None
    # Worker processes for large bodies (``pagefleet gateway`` starts 2); 0: all inline.
    intake_workers: int = 0


class _Attempt:
    """One try on one pod; the discovery probe's verdict that the pod is unreachable (the
    router's watch signal) cuts its waits short. Another request's timeout on the same
    pod does not: that is no sign this one is stuck."""

    __slots__ = ("down", "upstream")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.down: asyncio.Future[None] = loop.create_future()
        self.upstream: aiohttp.ClientResponse | None = None

    def pod_down(self) -> None:
        if not self.down.done():
            self.down.set_result(None)
        if self.upstream is not None:
            self.upstream.close()  # a pending read raises at once


class _Failed(Exception):
    """An attempt failed before anything reached the client; the message says why."""


class _TooLarge(Exception):
    """The pod's answer exceeds ``max_response_bytes``."""


class _TimedOut(_Failed):
    """The pod's response headers did not come within the attempt's budget."""


@dataclass(slots=True)
class Gateway:
    """One gateway: the router, the tokenizer for block keys, metrics, the upstream client."""

    router: Router
    tokenizer: PromptTokenizer | None
    served_model_name: str
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    credentials: Credentials = field(default_factory=Credentials)
    upstream_key: str | None = None  # presented to daemons that require an API key
    intake: IntakePool | None = None
    # P/D (gateway/pd.py): remote prefill on the prefill pool; ``router`` is the decode pool
    pd: PDOrchestrator | None = None
    _session: aiohttp.ClientSession | None = None
    _started: float = field(default_factory=time.time)
    _active: int = 0
    _bodies: BodyBudget = field(init=False)
    _auth: AuthPolicy | None = None
    _upstream_auth_logged: bool = False
    _cut_log: EveryInterval = field(
        default_factory=lambda: EveryInterval(logger, CUT_LOG_INTERVAL_S)
    )

    def __post_init__(self) -> None:
        self.router.metrics = self.metrics
        # The policy is known now: its decision series exists (at zero) from the first
        # scrape, so a burst that falls between two scrapes still shows as a rate.
        self.metrics.decision_seconds.labels(policy=self.router.policy.name)
        if self.intake is None:
            self.intake = IntakePool(
                self.tokenizer, self.proxy.max_model_len, workers=self.proxy.intake_workers
            )
        self._auth = AuthPolicy(self.credentials, component="gateway")
        self._bodies = BodyBudget.of(self.proxy.max_inflight_body_mb, self.proxy.max_body_bytes)
        bodies = self._bodies
        self.metrics.inflight_body_bytes.set_function(lambda: bodies.held)

    # -- app ------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        assert self._auth is not None
        # The body cap is enforced in _read_body (OpenAI-shaped 413), aiohttp's is a backstop.
        app = web.Application(
            client_max_size=self.proxy.max_body_bytes,
            middlewares=[self._errors_middleware, self._auth.middleware],
        )
        app[ROUTER_KEY] = self.router
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions, expect_handler=self._expect)
        app.router.add_post(
            "/v1/chat/completions", self.chat_completions, expect_handler=self._expect
        )
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.proxy.connect_timeout_s, sock_read=None
        )
        # limit=0: the gateway must not queue requests on its own connection pool.
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=connector, auto_decompress=False
        )
        assert self.intake is not None and self._auth is not None
        self.intake.start()
        self.intake.warm()
        self._auth.warn_if_open()
        await self.router.start()
        if self.pd is not None:
            await self.pd.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        if self.pd is not None:
            await self.pd.close()  # its handle releases in flight use the session
        if self._session is not None:
            await self._session.close()
        if self.intake is not None:
            self.intake.close()
        await self.router.close()

    @web.middleware
    async def _errors_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]
    ) -> web.StreamResponse:
        """aiohttp's own errors (404, 405, 413), an undecodable body and any bug in
        OpenAI's shape, like the daemon's."""
        try:
            return await handler(request)
        except RequestPayloadError as exc:
            return error_response(400, body_not_decoded(exc), "invalid_request_error")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if exc.status == 404:
                msg, code = f"no route {request.method} {request.path}", "not_found"
            elif exc.status == 405:
                msg, code = f"method {request.method} not allowed on {request.path}", None
            elif exc.status == 413:
                return self._too_large()
            else:
                msg, code = exc.reason or "bad request", None
            return error_response(exc.status, msg, "invalid_request_error", code)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("unhandled error serving %s %s", request.method, request.path)
            return error_response(
                500,
                "internal error in the gateway; see its log (the request was not answered)",
                "server_error",
            )

    def _too_large(self) -> web.Response:
        return error_response(
            413,
            f"request body too large: the limit is {self.proxy.max_body_bytes} bytes",
            "invalid_request_error",
            code="request_too_large",
        )

    # -- plain endpoints ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _readiness(self) -> tuple[int, dict[str, Any]]:
        n = len(self.router.discovery.endpoints())
        if n == 0:
            return 503, {"status": "no ready endpoints", "endpoints": 0}
        return 200, {"status": "ready", "endpoints": n}

    async def ready(self, request: web.Request) -> web.Response:
        status, body = self._readiness()
        return web.json_response(body, status=status)

    def probe_answers(self) -> dict[str, Callable[[], tuple[int, str, bytes]]]:
        """``/health``, ``/ready`` and ``/metrics`` as their handlers answer them, for the
        connections past ``--max-connections`` (connections.py answers those itself)."""

        def health() -> tuple[int, str, bytes]:
            return 200, "application/json", dumps({"status": "ok"})

        def ready() -> tuple[int, str, bytes]:
            status, body = self._readiness()
            return status, "application/json", dumps(body)

        def metrics() -> tuple[int, str, bytes]:
            return 200, _METRICS_TYPE, self.metrics.render()

        return {"/health": health, "/ready": ready, "/metrics": metrics}

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": _METRICS_TYPE},
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(gateway_openapi())

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
        return await self._handle(request, "completion", "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", "/v1/chat/completions")

    async def _read_body(self, request: web.Request, hold: BodyHold) -> bytes | web.Response:
        """The body, or the refusal to send: 413 when it exceeds the cap (checked before
        reading when declared), 408 when it has not arrived within ``body_timeout_s``, 503
        when a body of undeclared length (chunked, or compressed) grows past what the body
        budget has left. ``hold`` counts the bytes read; the caller releases it."""
        limit = self.proxy.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return self._refused_too_large()
        # Read here rather than by request.read(): its bytes count against the budget as
        # they arrive (decoded: a compressed body grows past its Content-Length).
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.proxy.body_timeout_s):
                while chunk := await request.content.readany():
                    size += len(chunk)
                    if size > limit:
                        return self._refused_too_large()
                    if not hold.grow_to(size):
                        return self._over_budget()
                    parts.append(chunk)
        except TimeoutError:
            self.metrics.rejected.labels(reason="body_timeout").inc()
            resp = error_response(
                408,
                f"the request body did not arrive within {self.proxy.body_timeout_s:.0f}s "
                "(the gateway's --body-timeout); send it whole, without pauses",
                "invalid_request_error",
                code="request_timeout",
            )
            # The rest of the body may still trickle in: this connection cannot carry
            # another request.
            resp.force_close()
            return resp
        hold.shrink_to(size)  # a declared length the body did not reach
        return b"".join(parts)

    def _over_budget(self) -> web.Response:
        """The 503 of a request whose body does not fit the body budget now. The body is
        not read: aiohttp drains and discards it after the answer (its lingering close),
        so the client, still sending, gets this answer rather than a reset."""
        self.metrics.rejected.labels(reason="body_budget").inc()
        return error_response(
            503,
            self._bodies.refusal("gateway"),
            "server_error",
            code="overloaded",
            headers={"Retry-After": "1"},
        )

    def _refused_too_large(self) -> web.Response:
        self.metrics.rejected.labels(reason="too_large").inc()
        return self._too_large()

    async def _to_client(
        self, request: web.Request, resp: web.StreamResponse, data: bytes | None
    ) -> None:
        """Write ``data`` to the client within ``client_write_timeout_s`` (``write_within``:
        None ends the response; a client that does not take it is cut and
        ConnectionResetError, one of ``_CLIENT_GONE``, is raised).

        A cut is counted here, once: it aborts the connection, so no later write to this
        client can time out again (they fail at once, as for a client that hung up)."""
        try:
            await write_within(request, resp, data, self.proxy.client_write_timeout_s)
        except ClientWriteTimeout as exc:
            self.metrics.client_cuts.labels(reason="write_timeout").inc()
            self._cut_log.warning("%s %s: %s; connection cut", request.method, request.path, exc)
            raise

    def _busy(self) -> web.Response:
        self.metrics.rejected.labels(reason="concurrency").inc()
        return error_response(
            429,
            f"gateway busy: {self._active} requests open, the limit is "
            f"{self.proxy.max_concurrency} (--max-concurrency); retry after a second",
            "rate_limit_error",
            code="gateway_busy",
            headers={"Retry-After": "1"},
        )

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: a request the headers already condemn (a body over the
        cap, no admission slot, no room in the body budget) gets its refusal instead of
        the 100, so its client never sends the body. aiohttp's own handler sent the 100
        first, whatever followed. The connection then closes: a client may send the body
        anyway, and it is not read."""
        declared = request.content_length
        refusal: web.Response | None = None
        if declared is not None and declared > self.proxy.max_body_bytes:
            refusal = self._refused_too_large()
        elif self._active >= self.proxy.max_concurrency:
            refusal = self._busy()
        elif declared is not None and self._bodies.held + declared > self._bodies.limit:
            refusal = self._over_budget()
        if refusal is None:
            # aiohttp's own answer: the 100 (or a 417 for another expectation)
            return await _continue(request)
        refusal.force_close()
        return refusal

    async def _handle(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        t_arrival = time.perf_counter()
        if self._active >= self.proxy.max_concurrency:
            return self._busy()
        # Decided before a byte of the body is read: a flood of large bodies is refused
        # here rather than held (1024 of 4 MiB each made the gateway hold ~4 GiB).
        hold = self._bodies.hold()
        declared = request.content_length
        fits = declared is None or declared > self.proxy.max_body_bytes or hold.grow_to(declared)
        if not fits:  # (an undeclared length counts as it arrives; an oversized one is a 413)
            return self._over_budget()
        self._active += 1
        try:
            resp = await self._admitted(request, kind, path, t_arrival, hold)
        finally:
            self._active -= 1
            # The body is kept until here (a retry re-sends it); a whole answer still
            # being written below is not counted, it is bounded by its write timeout.
            hold.release()
        if not resp.prepared:
            # A whole answer (non-streamed, or an error), sent here rather than by aiohttp,
            # whose write waits without a bound for a client that does not read: that held
            # the connection and the answer, megabytes of it, in memory indefinitely. The
            # admission slot is already free: this wait ends within the write timeout.
            with contextlib.suppress(*_CLIENT_GONE):
                await self._to_client(request, resp, None)
        return resp

    async def _admitted(
        self, request: web.Request, kind: str, path: str, t_arrival: float, hold: BodyHold
    ) -> web.StreamResponse:
        body = await self._read_body(request, hold)
        if isinstance(body, web.Response):
            return body
        assert self.intake is not None
        try:
            intake: Intake = await self.intake.inspect(kind, body)
        except RuntimeError as exc:
            self.metrics.rejected.labels(reason="intake_failed").inc()
            return error_response(
                503, str(exc), "server_error", code="intake_failed", headers={"Retry-After": "1"}
            )
        if intake.model is not None and intake.model != self.served_model_name:
            # The daemon's own 404, without a pod round trip: every daemon behind this
            # gateway serves this one name.
            self.metrics.rejected.labels(reason="model_not_found").inc()
            return error_response(
                404,
                f"The model `{intake.model}` does not exist; this gateway serves "
                f"`{self.served_model_name}` (GET /v1/models)",
                "invalid_request_error",
                code="model_not_found",
                param="model",
            )
        if intake.error is not None:
            err = intake.error
            self.metrics.rejected.labels(
                reason="context_length" if err.code == "context_length_exceeded" else "invalid"
            ).inc()
            return error_response(
                err.status, err.message, "invalid_request_error", err.code, err.param
            )
        session_key = request.headers.get(SESSION_HEADER) or intake.session_key
        decision = await self.router.route(intake.token_ids, session_key=session_key)
        self.metrics.decision_seconds.labels(policy=decision.policy).observe(decision.decision_s)
        if not decision.ranked:
            self.metrics.rejected.labels(reason="no_endpoints").inc()
            return error_response(
                503,
                "no ready model endpoints behind this gateway; check the daemons and "
                "the gateway's --endpoints/--service",
                "service_unavailable",
                code="no_endpoints",
                headers={"Retry-After": "1"},
            )
        if decision.prompt_tokens:
            self.metrics.prompt_tokens_total.inc(decision.prompt_tokens)
        self.metrics.arrivals.inc()
        uncached = decision.prompt_tokens - decision.predicted_hit_tokens
        self.metrics.arrival_prompt_tokens.inc(max(0, uncached))
        if self.pd is not None:
            assert self._session is not None, "gateway used before startup"
            prepared = await self.pd.prepare(
                self._session, path, body, intake.token_ids, decision,
                self._upstream_headers(request),
            )  # fmt: skip
            if prepared.params is not None:
                return await self._forward_handle(
                    request, prepared.body, prepared.params, path, intake.stream, decision,
                    t_arrival,
                )  # fmt: skip
            body = prepared.body
        return await self._forward(request, body, path, intake.stream, decision, t_arrival)

    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        """The headers of every request this gateway sends a daemon for ``request`` (the
        proxied one, and on the P/D path the prefill and the handle's release): the
        client's, less hop-by-hop ones and its credentials -- the gateway's key is not the
        daemon's, never forward it -- plus the upstream key when one is configured."""
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _DROP_REQUEST_HEADERS and k.lower() != "authorization"
        }
        headers.update(bearer_header(self.upstream_key))
        return headers

    async def _forward_handle(
        self,
        request: web.Request,
        body: bytes,
        params: dict[str, Any],
        path: str,
        stream: bool,
        decision: RoutingDecision,
        t_arrival: float,
    ) -> web.StreamResponse:
        """``_forward`` of a body that carries a prefill handle: unless a decode pod took
        the request (a 2xx), release the handle on the prefill pod -- every decode pod
        failed, one answered an error, or the client went away -- so its blocks do not
        stay pinned until the handle's deadline."""
        assert self.pd is not None and self._session is not None
        served = False
        gone = True  # until _forward returns: an exception here means the client left
        try:
            resp = await self._forward(request, body, path, stream, decision, t_arrival)
            gone = False
            served = resp.status < 300
            return resp
        finally:
            if not served:
                self.pd.release_later(
                    self._session, params, self._upstream_headers(request), cancel_prefill=gone
                )

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
        headers = self._upstream_headers(request)
        attempts = decision.ranked[: max(1, self.proxy.max_attempts)]
        last_error = "no attempt made"
        hung = False
        for i, scored in enumerate(attempts):
            ep = scored.endpoint
            more_left = i + 1 < len(attempts)
            ticket = self.router.acquire(
                ep, decision.keys, work=decision.prompt_tokens - scored.matched_tokens
            )
            self.metrics.inflight.labels(pod=ep.pod).inc()
            attempt = _Attempt(asyncio.get_running_loop())
            unwatch = self.router.watch(ep.pod, attempt.pod_down)
            result: web.StreamResponse | str | None = None
            try:
                result = await self._try_pod(
                    request, ep, path, body, headers, stream, decision,
                    scored.matched_tokens, more_left, attempt,
                    time.perf_counter() - t_arrival,
                    ticket, f"{decision.placement(scored)}/{scored.reason}",
                )  # fmt: skip
            except _Failed as exc:
                result = str(exc)
            finally:
                unwatch()
                # The pod's series before the release: a release may drop them for good
                # (the pod left discovery) and nothing may bring them back after it.
                self.metrics.inflight.labels(pod=ep.pod).dec()
                if isinstance(result, str):
                    self.metrics.retries.labels(pod=ep.pod).inc()
                self.router.release(ep, decision.keys, ticket)
            if isinstance(result, web.StreamResponse):
                self.metrics.placements.labels(
                    placement=decision.placement(scored), reason=scored.reason
                ).inc()
                return result
            assert result is not None
            last_error = result
            hung = hung or "timed out" in result
            logger.info(
                "pod %s failed before the first byte (%s); %s",
                ep.pod,
                result,
                "trying the next one" if more_left else "no pod left",
            )
        # No pod answered: nothing counted it in responses (by pod) -- an outage of every
        # pod would otherwise show as silence on the dashboards and alerts.
        code = "upstream_timeout" if hung else "upstream_unavailable"
        self.metrics.rejected.labels(reason=code).inc()
        return error_response(
            504 if hung else 502,
            f"every candidate pod failed before responding (last: {last_error}); "
            "the daemons may be restarting, retry shortly",
            "upstream_error",
            code=code,
            headers={"Retry-After": "1"},
        )

    async def _send(
        self, ep: Endpoint, path: str, body: bytes, headers: dict[str, str],
        timeout: float, attempt: _Attempt,
    ) -> aiohttp.ClientResponse:  # fmt: skip
        """POST to the pod; wait for its response headers at most ``timeout`` seconds.

        The POST runs in this request's own task, not a new one: a new task's first step
        waits one more turn of the event loop, behind every stream being relayed, before
        the request leaves (bench/routing.py, session 8: measured hop by hop). A hang
        signal for the pod (``attempt.down``) cancels this task while it waits here only."""
        assert self._session is not None
        if attempt.down.done():
            raise _Failed("pod marked unhealthy before the request was sent")
        task = asyncio.current_task()
        assert task is not None
        waiting = True
        interrupted = False

        def on_down(_: asyncio.Future[None]) -> None:
            nonlocal interrupted
            # The callback runs a loop turn after the signal: by then the POST may be done
            # and this task elsewhere, where a cancel would hit the wrong await.
            if waiting:
                interrupted = True
                task.cancel()

        attempt.down.add_done_callback(on_down)
        try:
            async with asyncio.timeout(timeout):
                upstream = await self._session.post(ep.url + path, data=body, headers=headers)
        except TimeoutError:
            self.router.mark_hung(ep)
            msg = f"timed out after {timeout:.1f}s waiting for the pod's response"
            raise _TimedOut(msg) from None
        except asyncio.CancelledError:
            if interrupted and task.uncancel() == 0:
                raise _Failed("pod marked unhealthy while waiting for its response") from None
            raise
        except (aiohttp.ClientError, OSError) as exc:
            self.router.mark_failed(ep)
            raise _Failed(f"{type(exc).__name__}: {exc}") from None
        finally:
            waiting = False
            attempt.down.remove_done_callback(on_down)
        attempt.upstream = upstream
        return upstream

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
        attempt: _Attempt,
        pre_s: float,
        ticket: Ticket,
        route: str = "",
    ) -> web.StreamResponse | str:
        """Serve the request from ``ep``; a string says why to move on to the next pod.

        ``pre_s``: the gateway's own time before this attempt (parse, tokenize, route)."""
        t0 = time.perf_counter()
        budget = self.proxy.first_byte_timeout_s if stream else self.proxy.request_timeout_s
        try:
            upstream = await self._send(ep, path, body, headers, budget, attempt)
        except _TimedOut:
            if stream:
                raise  # no first byte yet: the next pod may answer in time
            return self._not_answered(ep, budget)
        try:
            out_headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS
            }
            out_headers[POD_HEADER] = ep.pod
            out_headers[POLICY_HEADER] = decision.policy
            out_headers[HIT_HEADER] = str(predicted_hit)
            if route:
                out_headers[ROUTE_HEADER] = route
            left = max(0.001, budget - (time.perf_counter() - t0))
            if upstream.status == 401:
                return self._upstream_refused_key(ep)
            if upstream.status in (429, 503) and more_left:
                self.router.mark_failed(ep)
                # A bounded start of the body: a pod that sends the headers and then
                # stalls must not hold the request (it waited forever here).
                try:
                    async with asyncio.timeout(min(left, _REFUSAL_BODY_WAIT_S)):
                        head = await upstream.content.read(200)
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    head = f"(body not read: {type(exc).__name__})".encode()
                return f"HTTP {upstream.status} from pod: {head!r}"
            if upstream.status >= 400 or not stream:
                try:
                    async with asyncio.timeout(left):
                        payload = await self._read_whole(upstream)
                except _TooLarge:
                    return self._answer_too_large(ep, stream)
                except TimeoutError:
                    self.router.mark_hung(ep)
                    if not stream:
                        return self._not_answered(ep, budget)
                    return f"timed out after {budget:.1f}s reading the pod's answer"
                except (aiohttp.ClientError, OSError) as exc:
                    self.router.mark_failed(ep)
                    return f"{type(exc).__name__} while reading the body: {exc}"
                self.router.mark_ok(ep)
                self.router.first_token(ticket)
                self._count(ep, decision, predicted_hit, upstream.status)
                self.metrics.upstream_latency_seconds.labels(pod=ep.pod).observe(
                    time.perf_counter() - t0
                )
                self.metrics.overhead_seconds.observe(pre_s)
                return web.Response(status=upstream.status, body=payload, headers=out_headers)
            try:
                async with asyncio.timeout(left):
                    first = await upstream.content.readany()
            except TimeoutError:
                self.router.mark_hung(ep)
                return f"timed out after {budget:.1f}s before the first byte"
            except (aiohttp.ClientError, OSError) as exc:
                self.router.mark_failed(ep)
                return f"{type(exc).__name__} before the first byte: {exc}"
            if not first:
                self.router.mark_failed(ep)
                return "stream closed before the first byte"
            self.router.mark_ok(ep)
            t_first = time.perf_counter()
            self.router.first_token(ticket)
            self.metrics.upstream_ttft_seconds.labels(pod=ep.pod).observe(t_first - t0)
            self._count(ep, decision, predicted_hit, upstream.status)
            resp = web.StreamResponse(status=upstream.status, headers=out_headers)
            try:
                await self._to_client(request, resp, first)
            except _CLIENT_GONE as exc:
                logger.debug("client went away before its stream from %s began: %s", ep.pod, exc)
                return resp
            self.metrics.overhead_seconds.observe(pre_s + time.perf_counter() - t_first)
            await self._pump(request, resp, upstream, ep, first, t0)
            return resp
        finally:
            upstream.release()
            if not upstream.closed:
                upstream.close()

    async def _read_whole(self, upstream: aiohttp.ClientResponse) -> bytes:
        """The pod's whole body; raises _TooLarge, having read no more than the cap, as
        soon as it (or its declared length) exceeds ``max_response_bytes``."""
        cap = self.proxy.max_response_bytes
        if upstream.content_length is not None and upstream.content_length > cap:
            raise _TooLarge
        parts: list[bytes] = []
        size = 0
        while chunk := await upstream.content.readany():
            size += len(chunk)
            if size > cap:
                raise _TooLarge
            parts.append(chunk)
        return b"".join(parts)

    def _answer_too_large(self, ep: Endpoint, stream: bool) -> web.Response:
        """The final 502 of an answer over ``max_response_bytes``: not retried, since any
        pod would compute the same answer; the pod is not marked (it is not unhealthy)."""
        cap = self.proxy.max_response_bytes
        what = "error body" if stream else "answer"
        self.metrics.responses.labels(pod=ep.pod, code="502").inc()
        return error_response(
            502,
            f"model pod {ep.pod} sent an {what} over {cap} bytes (the gateway's "
            "--max-response-bytes); ask for fewer tokens, choices or logprobs, or stream it "
            "(streams are passed through, not held)",
            "upstream_error",
            code="upstream_response_too_large",
            headers={POD_HEADER: ep.pod},
        )

    def _upstream_refused_key(self, ep: Endpoint) -> web.Response:
        """A pod's 401 is about the gateway's key, never the client's (already accepted,
        and never forwarded): a 502, since a 401 makes clients (the openai client's
        AuthenticationError) blame and rotate their own good key; the body says whose
        credentials failed, and the fix is logged once. Not retried: every pod takes the
        same keys."""
        if not self._upstream_auth_logged:
            self._upstream_auth_logged = True
            hint = upstream_refused_hint("gateway", self.upstream_key is not None)
            logger.error("model pod %s refused the gateway's credentials: %s", ep.pod, hint)
        self.metrics.responses.labels(pod=ep.pod, code="502").inc()
        return error_response(
            502,
            f"model pod {ep.pod} refused the gateway's own credentials (not the client's); "
            "the gateway is misconfigured, tell its operator (details in its log)",
            "upstream_error",
            code="upstream_auth_failed",
            headers={POD_HEADER: ep.pod},
        )

    def _not_answered(self, ep: Endpoint, budget: float) -> web.Response:
        """The 504 of a non-streamed request whose pod did not answer within ``budget``
        (``request_timeout_s``). Final: the pod took the request and may still be
        generating, so re-sending it would compute it again, for as long again."""
        self.metrics.responses.labels(pod=ep.pod, code="504").inc()
        return error_response(
            504,
            f"model pod {ep.pod} did not answer within {budget:.1f}s (the gateway's "
            "--request-timeout); the request was not re-sent to another pod, which would "
            "compute it again",
            "upstream_error",
            code="upstream_timeout",
            headers={POD_HEADER: ep.pod},
        )

    async def _pump(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        ep: Endpoint,
        first: bytes,
        t0: float,
    ) -> None:
        """Copy the stream to the client; end a broken one with an error event, no [DONE]."""
        tail = first[-64:]
        broken: str | None = None
        while True:
            try:
                async with asyncio.timeout(self.proxy.inter_chunk_timeout_s):
                    chunk = await upstream.content.readany()
            except TimeoutError:
                self.router.mark_hung(ep)
                broken = (
                    f"the model pod {ep.pod} sent nothing for "
                    f"{self.proxy.inter_chunk_timeout_s:.1f}s"
                )
                break
            except (aiohttp.ClientError, OSError) as exc:
                self.router.mark_failed(ep)
                broken = f"the connection to model pod {ep.pod} broke ({type(exc).__name__})"
                break
            if not chunk:
                if _DONE not in tail:
                    self.router.mark_failed(ep)
                    broken = f"model pod {ep.pod} closed the stream before it was complete"
                break
            tail = (tail + chunk)[-64:]
            try:
                await self._to_client(request, resp, chunk)
            except _CLIENT_GONE as exc:
                # The client hung up or stopped reading; leaving closes the upstream
                # connection, which makes the daemon abort the request and free its blocks.
                logger.debug("client went away while streaming from %s: %s", ep.pod, exc)
                return
        self.metrics.upstream_latency_seconds.labels(pod=ep.pod).observe(time.perf_counter() - t0)
        with contextlib.suppress(*_CLIENT_GONE):
            if broken is not None:
                self.metrics.broken_streams.labels(pod=ep.pod).inc()
                logger.warning("stream broke after %.2fs: %s", time.perf_counter() - t0, broken)
                body = error_body(
                    f"{broken}; the output is incomplete, retry the request",
                    "server_error",
                    "upstream_stream_broken",
                )
                await self._to_client(request, resp, b"data: " + dumps(body) + b"\n\n")
            await self._to_client(request, resp, None)

    def _count(
        self, ep: Endpoint, decision: RoutingDecision, predicted_hit: int, status: int
    ) -> None:
        self.metrics.requests.labels(policy=decision.policy, pod=ep.pod).inc()
        self.metrics.responses.labels(pod=ep.pod, code=str(status)).inc()
        self.metrics.predicted_hit_tokens.observe(predicted_hit)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
