"""The daemon process's app: engine thread lifecycle, probes, metrics and admin endpoints.

One ``Daemon`` owns an engine thread (EngineLoop), its metrics, admission, an optional
KV-event publisher and the aiohttp app; the OpenAI endpoints live in serving.py.

Lifecycle: ``start`` loads the engine and starts publishing (then ready); ``drain`` stops
admitting and waits for in-flight requests (aborting them after the grace); ``stop`` takes
the pod out of the index and stops the engine thread.

Invariants:
- every error leaves as a 4xx/5xx in OpenAI's shape (errors.py); 500 only for ours;
- /health fails only when the engine died, /ready only while loading, draining or dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

import pagefleet
from pagefleet.api.body_budget import BodyBudget
from pagefleet.api.limits import body_not_decoded
from pagefleet.api.openai import RequestValidationError
from pagefleet.api.openapi import daemon_openapi
from pagefleet.daemon import quiet_preface
from pagefleet.daemon.admission import Admission
from pagefleet.daemon.config import DaemonConfig
from pagefleet.daemon.engine_client import EngineClient
from pagefleet.daemon.engine_handle import EngineHandle
from pagefleet.daemon.engine_loop import EngineLoop
from pagefleet.daemon.engine_protocol import EngineLike
from pagefleet.daemon.errors import APIError, http_error
from pagefleet.daemon.metrics import LABELS, DaemonMetrics
from pagefleet.daemon.pd import PDSide
from pagefleet.daemon.publisher import KVEventPublisher
from pagefleet.daemon.serving import CLIENT_GONE, OpenAIServing
from pagefleet.httpauth import (
    AuthPolicy,
    ClientWriteTimeout,
    Credentials,
    upstream_key_from_env,
    write_within,
)
from pagefleet.kvindex.events import KVEventBatch
from pagefleet.kvindex.index import KVIndex, PodLoad

if TYPE_CHECKING:
    from pagefleet.kvindex.zmq_events import ZmqKVEventPublisher

logger = logging.getLogger(__name__)

EventSink = Callable[[KVEventBatch], None]
EngineFactory = Callable[[DaemonConfig, EventSink | None], EngineLike]


def default_engine_factory(config: DaemonConfig, event_sink: EventSink | None) -> EngineLike:
    # Imported here: building the app (and its tests of the HTTP layer) must not load torch.
    from pagefleet.engine.engine import LLMEngine

    return LLMEngine(config.engine_config(), event_sink=event_sink)


class Daemon:
    """One inference daemon: engine (thread or process) + HTTP app (+ KV-event publisher)."""

    def __init__(
        self,
        config: DaemonConfig,
        engine_factory: EngineFactory | None = None,
        index: KVIndex | None = None,
        credentials: Credentials | None = None,
        engine_process: bool | None = None,
        upstream_key: str | None = None,
    ) -> None:
        """``credentials``: API keys and admin token (default: from the PAGEFLEET_* env).

        ``upstream_key``: the key this daemon presents to other daemons' ``/v1/kv/*`` (a
        decode pod's wait, pull and release on a prefill pod with API keys); default: the
        gateway's setting, PAGEFLEET_UPSTREAM_API_KEY(_FILE), so one Secret serves both;
        "": none.

        ``engine_process``: run the engine in its own process (EngineClient) rather than a
        thread of this one (EngineLoop). None: ``config.engine_process``, except with a
        custom ``engine_factory`` (a test's fake engine lives in this process); a factory
        for a process must be a module-level function (it is pickled by reference).
        """
        self.config = config
        if engine_process is None:
            engine_process = config.engine_process and engine_factory is None
        self.engine_process = engine_process
        self._engine_factory = engine_factory  # None: default_engine_factory
        # Set when the engine dies or hangs: `pagefleet daemon` then exits non-zero.
        self.engine_died = asyncio.Event()
        self._index = index
        self.metrics = DaemonMetrics(
            config.model_name,
            config.role,
            config.pod,
            config.block_size,
            cost_per_hour=config.cost_per_hour,
        )
        self.admission = Admission(config.max_inflight, self.metrics)
        self.bodies = BodyBudget.of(config.max_inflight_body_mb, config.max_body_bytes)
        self.engine_loop: EngineHandle | None = None
        self.publisher: KVEventPublisher | None = None
        self.zmq_events: ZmqKVEventPublisher | None = None  # --kv-events-zmq
        self.serving = OpenAIServing(
            config, self.metrics, self.admission, self.live_loop, started_at=time.time()
        )
        self.auth = AuthPolicy(
            Credentials.from_env() if credentials is None else credentials, component="daemon"
        )
        # Every role honours kv_transfer_params (a unified pod can export or import too);
        # the role says which side the operator and the gateway use it for.
        self.pd = PDSide(
            config, self.metrics.registry, LABELS, self.metrics.label_values,
            lambda: self.engine_loop,
            upstream_key=upstream_key_from_env() if upstream_key is None else upstream_key or None,
        )  # fmt: skip
        self.serving.pd = self.pd
        self.app = self._build_app()

    @property
    def ready(self) -> bool:
        return self.admission.ready

    @property
    def draining(self) -> bool:
        return self.admission.draining

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the engine (on its thread) and start publishing; ready afterwards."""
        self.auth.warn_if_open()
        loop = asyncio.get_running_loop()
        index = self._index
        if index is None and self.config.redis_url:
            index = _redis_index(self.config.redis_url, self.config.namespace)
        sink = None
        if index is not None:
            self.publisher = KVEventPublisher(
                index,
                self.config.pod,
                loop,
                load_fn=self._pod_load,
                snapshot=lambda deliver: self.live_loop().snapshot_cached_blocks(deliver),
                metrics=self.metrics,
                heartbeat_s=self.config.heartbeat_s,
                ttl_s=self.config.heartbeat_ttl_s,
            )
            sink = self.publisher.sink
        cfg = self.config
        if cfg.kv_events_zmq:
            from pagefleet.kvindex.zmq_events import ZmqKVEventPublisher

            self.zmq_events = ZmqKVEventPublisher(
                cfg.kv_events_zmq, replay_endpoint=cfg.kv_events_zmq_replay
            )
            self.zmq_events.start()
            sink = _fan_out(sink, self.zmq_events.sink)
        hooks: dict[str, Any] = dict(
            on_step=self.metrics.update_stats, on_events=sink,
            on_death=lambda code: self.engine_died.set(),
        )  # fmt: skip
        # A factory for a process is pickled by reference (a module-level function).
        kind = EngineClient if self.engine_process else EngineLoop
        self.engine_loop = kind(cfg, loop, factory=self._engine_factory, **hooks)
        self.engine_loop.start()
        await self.engine_loop.wait_loaded()
        self.metrics.update_stats(await self.engine_loop.stats())
        if self.publisher is not None:
            await self.publisher.start()
        await self.pd.start()
        self.admission.ready = True
        logger.info("daemon ready: model %s, pod %s", cfg.model_name, cfg.pod)

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop admitting (ready=false), let in-flight requests finish, abort after grace."""
        self.admission.ready = False
        self.admission.draining = True
        grace = self.config.drain_timeout_s if grace_s is None else grace_s
        idle = self.admission.idle
        try:
            async with asyncio.timeout(grace):
                await idle.wait()
        except TimeoutError:
            logger.warning(
                "drain grace (%.1fs) over: aborting %d requests", grace, self.admission.inflight
            )
            if self.engine_loop is not None:
                self.engine_loop.abort_all()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await idle.wait()

    async def stop(self) -> None:
        """Remove the pod from the index and stop the engine thread."""
        self.admission.ready = False
        await self.pd.stop()
        if self.publisher is not None:
            await self.publisher.close()
        if self.zmq_events is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.zmq_events.close)
        if self.engine_loop is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.stop)

    def live_loop(self) -> EngineHandle:
        """The loaded, running engine loop; otherwise the caller's 503."""
        if self.engine_loop is None or not self.engine_loop.loaded.is_set():
            raise APIError(
                503, "the model is still loading; retry shortly", type="server_error",
                code="model_loading", headers={"Retry-After": "1"},
            )  # fmt: skip
        if not self.engine_loop.alive:
            raise APIError(
                503, "the engine is not running; retry on another replica",
                type="server_error", code="engine_dead",
            )  # fmt: skip
        return self.engine_loop

    def _pod_load(self) -> PodLoad:
        s = self.metrics.latest_stats
        if s is None:
            return PodLoad(role=self.config.role)
        return PodLoad(
            running=s.num_running,
            waiting=s.num_waiting,
            kv_usage=float(s.kv_usage),
            num_blocks=s.num_blocks,
            num_cached_blocks=s.num_cached_blocks,
            role=self.config.role,
        )

    # -- app ------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        quiet_preface.install()
        app = web.Application(
            middlewares=[
                self._send_middleware,
                self._errors_middleware,
                self.auth.middleware,
                self._body_middleware,
            ],
            client_max_size=self.config.max_body_bytes,
        )
        r = app.router
        self.serving.add_routes(r)
        self.pd.add_routes(app)
        r.add_get("/health", self.health)
        r.add_get("/ready", self.readiness)
        r.add_get("/metrics", self.metrics_handler)
        r.add_get("/version", self.version)
        r.add_get("/openapi.json", self.openapi)
        # What sglang-router / vllm-router probe when a worker registers.
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_load", self.load)
        # As vLLM's: benchmarks start cold without a restart. Not exposed by the gateway.
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        return app

    @web.middleware
    async def _send_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        """Send a whole answer (non-streamed, or an error) here, within the write timeout:
        aiohttp's own send waits without a bound for a client that does not read, which
        held the connection and the answer (MBs with n and logprobs) for as long as the
        client kept its socket open."""
        resp = await handler(request)
        if not resp.prepared:
            try:
                await write_within(request, resp, None, self.config.client_write_timeout_s)
            except ClientWriteTimeout as exc:
                what = f"{request.method} {request.path}: {exc}; answer dropped"
                self.serving.client_cut("write_timeout", what)
            except CLIENT_GONE as exc:
                logger.debug("client went away before its answer: %s", exc)
        return resp

    @web.middleware
    async def _body_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        """Read a request's body whole within ``body_timeout_s`` of its headers (handlers
        then get it from aiohttp's cache): a client trickling a body held a handler and its
        connection for as long as it kept sending, a byte now and then.

        Before reading, the body must fit the body budget (``--max-inflight-body-mb``), else
        a 503 with Retry-After: admission counts requests only once their bodies are read
        and parsed, so a flood of large bodies was held whole, however many. A length not
        declared, or compressed, reserves the cap until the body is read (aiohttp's
        ``read`` cannot be counted as it goes)."""
        if not request.body_exists:
            return await handler(request)
        cap = self.config.max_body_bytes
        declared = request.content_length
        exact = declared is not None and "Content-Encoding" not in request.headers
        hold = self.bodies.hold()
        # Over the cap: no reservation, request.read() raises aiohttp's 413 at once.
        if not hold.grow_to(min(declared, cap) if exact and declared is not None else cap):
            self.metrics.rejected("body_budget")
            # The unread body is drained and dropped by aiohttp after this answer (its
            # lingering close): the client, still sending, reads the 503, not a reset.
            return APIError(
                503,
                self.bodies.refusal("daemon"),
                type="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            ).response()
        try:
            try:
                async with asyncio.timeout(self.config.body_timeout_s):
                    body = await request.read()
            except TimeoutError:
                self.metrics.rejected("body_timeout")
                resp = APIError(
                    408,
                    f"the request body did not arrive within {self.config.body_timeout_s:.0f}s "
                    "(the daemon's --body-timeout); send it whole, without pauses",
                    code="request_timeout",
                ).response()
                resp.force_close()  # the rest may still trickle in: no next request here
                return resp
            hold.shrink_to(len(body))
            # Held until the handler returns: the request keeps its body (aiohttp's cache)
            # and the handler its parsed copy for as long.
            return await handler(request)
        finally:
            hold.release()

    @web.middleware
    async def _errors_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response()
        except RequestValidationError as exc:
            self.metrics.rejected("invalid")
            return APIError(400, exc.message, param=exc.param).response()
        except RequestPayloadError as exc:
            self.metrics.rejected("invalid")
            return APIError(400, body_not_decoded(exc)).response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return http_error(request, exc).response()
        except asyncio.CancelledError:
            raise
        except CLIENT_GONE as exc:
            # The client closed its connection while we wrote: a disconnect, logged quietly
            # (aiohttp would log an escaping error with its stack trace at ERROR).
            logger.debug("client went away during %s %s: %s", request.method, request.path, exc)
            return web.Response(status=499)
        except Exception:
            logger.exception("unhandled error serving %s %s", request.method, request.path)
            return APIError(
                500, "internal server error; see the daemon's log", type="server_error"
            ).response()

    # -- probes ---------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        loop = self.engine_loop
        if loop is not None and loop.loaded.is_set() and not loop.alive:
            return web.json_response({"status": "engine dead"}, status=503)
        return web.json_response({"status": "ok"})

    async def readiness(self, request: web.Request) -> web.Response:
        ok = self.ready and self.engine_loop is not None and self.engine_loop.alive
        reason = "ready" if ok else ("draining" if self.draining else "not ready")
        return web.json_response({"status": reason}, status=200 if ok else 503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.metrics.inflight.set(self.admission.inflight)
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(daemon_openapi())

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": pagefleet.__version__})

    # -- admin endpoints (router registration, benchmarks) --------------------------------

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.config.model,
                "tokenizer_path": self.config.model,
                "served_model_name": self.config.model_name,
                "is_generation": True,
                "max_model_len": self.serving.max_model_len() if self.ready else None,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.config.model_dump(exclude={"redis_url"})
        info.update(
            version=pagefleet.__version__,
            model_path=self.config.model,
            tokenizer_path=self.config.model,
            served_model_name=self.config.model_name,
            pod=self.config.pod,
            ready=self.ready,
            max_total_num_tokens=None,
            engine_pid=None if self.engine_loop is None else self.engine_loop.pid,
        )
        s = self.metrics.latest_stats
        if s is not None:
            info["num_blocks"] = s.num_blocks
            info["max_total_num_tokens"] = s.num_blocks * self.config.block_size
        return web.json_response(info)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        await self.live_loop().reset_prefix_cache()
        return web.json_response({"reset": True})

    async def load(self, request: web.Request) -> web.Response:
        load = self._pod_load()
        return web.json_response(
            {
                "num_reqs": load.running + load.waiting,
                "num_running_reqs": load.running,
                "num_waiting_reqs": load.waiting,
                "kv_usage": load.kv_usage,
                "inflight": self.admission.inflight,
            }
        )


def _fan_out(first: EventSink | None, second: EventSink) -> EventSink:
    """One sink that hands each batch to both (the Redis publisher's, then ZeroMQ's)."""
    if first is None:
        return second

    def both(batch: KVEventBatch) -> None:
        first(batch)
        second(batch)

    return both


def _redis_index(url: str, namespace: str) -> KVIndex:
    from pagefleet.kvindex.redis_auth import warn_if_password_in_url
    from pagefleet.kvindex.redis_index import RedisKVIndex

    warn_if_password_in_url(url)
    return RedisKVIndex.from_url(url, namespace=namespace)  # type: ignore[attr-defined]
