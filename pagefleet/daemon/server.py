"""The daemon's HTTP server: OpenAI-compatible API, health, metrics, tokenizer endpoints.

One ``Daemon`` owns an engine thread (EngineLoop), its metrics, an optional KV-event
publisher, and an aiohttp app. Handlers never touch the engine directly: requests go in
through the loop's command queue, outputs come back through asyncio queues.

Invariants:
- the caller's mistakes are 4xx in OpenAI's error shape, naming the field; 500 only for
  ours;
- every engine request an HTTP request started is finished or aborted when the handler
  returns, however it returns (client gone, error, shutdown), so its blocks go back;
- at most ``max_num_seqs + max_queue`` requests are in flight; past that, 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

import pagefleet
from pagefleet.api.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    RequestValidationError,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    Usage,
    parse_body,
)
from pagefleet.daemon.config import DaemonConfig
from pagefleet.daemon.engine_loop import EngineDeadError, EngineLike, EngineLoop, StreamItem
from pagefleet.daemon.metrics import DaemonMetrics
from pagefleet.daemon.publisher import KVEventPublisher
from pagefleet.engine.outputs import CompletionDelta, RequestOutput, TokenLogprob
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.kvindex.index import KVIndex, PodLoad

logger = logging.getLogger(__name__)

EngineFactory = Callable[[DaemonConfig, Callable[[Any], None] | None], EngineLike]


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


def default_engine_factory(config: DaemonConfig, event_sink: Callable[[Any], None] | None):
    # Imported here: building the app (and its tests of the HTTP layer) must not load torch.
    from pagefleet.engine.engine import LLMEngine

    return LLMEngine(config.engine_config(), event_sink=event_sink)


@dataclass(slots=True)
class _Choice:
    """What one of the n sequences of one prompt has produced so far."""

    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    last_token_t: float | None = None
    sent_role: bool = False


@dataclass(slots=True)
class _Job:
    """One HTTP generation request: one engine request per prompt, read from one queue."""

    base_id: str
    prompts: list[list[int]]
    params: SamplingParams
    queue: asyncio.Queue[StreamItem | BaseException] = field(default_factory=asyncio.Queue)
    live: set[str] = field(default_factory=set)  # engine request ids not finished yet
    choices: dict[int, _Choice] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    echo: list[str] | None = None  # prompt texts returned before the output (completions)

    def rid(self, i: int) -> str:
        return f"{self.base_id}-{i}"

    def text_base(self, choice_index: int) -> int:
        """Where a choice's generated text starts in the text returned (after any echo)."""
        return len(self.echo[choice_index // self.params.n]) if self.echo else 0

    def prompt_index(self, rid: str) -> int:
        return int(rid.rsplit("-", 1)[1])

    def choice(self, rid: str, delta: CompletionDelta) -> _Choice:
        idx = self.prompt_index(rid) * self.params.n + delta.index
        ch = self.choices.get(idx)
        if ch is None:
            ch = self.choices[idx] = _Choice(idx)
        return ch

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.num_tokens for c in self.choices.values())
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(self.cached_tokens.values())
            ),
        )


def _json(model: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status, text=model.model_dump_json(), content_type="application/json"
    )


class Daemon:
    """One inference daemon: engine thread + HTTP app (+ KV-event publisher with an index)."""

    def __init__(
        self,
        config: DaemonConfig,
        engine_factory: EngineFactory = default_engine_factory,
        index: KVIndex | None = None,
    ) -> None:
        if config.role != "unified":
            raise ValueError(
                f"--role {config.role} is not available yet: prefill/decode disaggregation "
                "is not implemented in this build; run with --role unified"
            )
        self.config = config
        self._engine_factory = engine_factory
        self._index = index
        self.metrics = DaemonMetrics(config.model_name, config.role, config.pod, config.block_size)
        self.engine_loop: EngineLoop | None = None
        self.publisher: KVEventPublisher | None = None
        self.ready = False
        self.draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._logged_unknown: set[str] = set()
        self._started_at = time.time()
        self.app = self._build_app()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the engine (on its thread) and start publishing; ready afterwards."""
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
                run_on_engine=lambda fn: self._loop().call(fn),
                metrics=self.metrics,
                heartbeat_s=self.config.heartbeat_s,
                ttl_s=self.config.heartbeat_ttl_s,
            )
            sink = self.publisher.sink
        cfg = self.config
        self.engine_loop = EngineLoop(
            lambda: self._engine_factory(cfg, sink), loop, on_step=self.metrics.update_stats
        )
        self.engine_loop.start()
        await self.engine_loop.wait_loaded()
        self.metrics.update_stats(await self.engine_loop.call(lambda eng: eng.stats()))
        if self.publisher is not None:
            await self.publisher.start()
        self.ready = True
        logger.info("daemon ready: model %s, pod %s", cfg.model_name, cfg.pod)

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop admitting (ready=false), let in-flight requests finish, abort after grace."""
        self.ready = False
        self.draining = True
        grace = self.config.drain_timeout_s if grace_s is None else grace_s
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            logger.warning("drain grace (%.1fs) over: aborting %d requests", grace, self._inflight)
            if self.engine_loop is not None:
                self.engine_loop.abort_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 5.0)

    async def stop(self) -> None:
        """Remove the pod from the index and stop the engine thread."""
        self.ready = False
        if self.publisher is not None:
            await self.publisher.close()
        if self.engine_loop is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.stop)

    def _loop(self) -> EngineLoop:
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
        app = web.Application(
            middlewares=[self._errors_middleware], client_max_size=self.config.max_body_bytes
        )
        r = app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/ready", self.readiness)
        r.add_get("/metrics", self.metrics_handler)
        r.add_get("/version", self.version)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        # What sglang-router / vllm-router probe when a worker registers.
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_load", self.load)
        # As vLLM's: benchmarks start cold without a restart. Not exposed by the gateway.
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        return app

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
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _http_error(request, exc).response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
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
        self.metrics.inflight.set(self._inflight)
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": pagefleet.__version__})

    def _max_model_len(self) -> int:
        return int(self._loop().engine.max_model_len)  # type: ignore[union-attr]

    async def models(self, request: web.Request) -> web.Response:
        card = ModelCard(
            id=self.config.model_name,
            root=self.config.model,
            max_model_len=self._max_model_len() if self.ready else None,
            created=int(self._started_at),
        )
        return _json(ModelList(data=[card]))

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.config.model,
                "tokenizer_path": self.config.model,
                "served_model_name": self.config.model_name,
                "is_generation": True,
                "max_model_len": self._max_model_len() if self.ready else None,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.config.model_dump(exclude={"redis_url"})
        info.update(
            version=pagefleet.__version__,
            served_model_name=self.config.model_name,
            pod=self.config.pod,
            ready=self.ready,
            max_total_num_tokens=None,
        )
        s = self.metrics.latest_stats
        if s is not None:
            info["num_blocks"] = s.num_blocks
            info["max_total_num_tokens"] = s.num_blocks * self.config.block_size
        return web.json_response(info)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        await self._loop().call(lambda engine: engine.reset_prefix_cache())
        return web.json_response({"reset": True})

    async def load(self, request: web.Request) -> web.Response:
        load = self._pod_load()
        return web.json_response(
            {
                "num_reqs": load.running + load.waiting,
                "num_running_reqs": load.running,
                "num_waiting_reqs": load.waiting,
                "kv_usage": load.kv_usage,
                "inflight": self._inflight,
            }
        )

    # -- tokenizer endpoints --------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        req = parse_body(TokenizeRequest, await request.read())
        self._check_model(req.model)
        engine = self._loop().engine
        tok = engine.tokenizer  # type: ignore[union-attr]
        if req.messages is not None:
            ids = self._chat_prompt_ids(
                [m.model_dump(exclude_none=True) for m in req.messages],
                req.add_generation_prompt,
                None,
            )
        else:
            ids = tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return _json(
            TokenizeResponse(count=len(ids), max_model_len=self._max_model_len(), tokens=ids)
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        req = parse_body(DetokenizeRequest, await request.read())
        self._check_model(req.model)
        tok = self._loop().engine.tokenizer  # type: ignore[union-attr]
        if any(t >= tok.vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be < vocab size {tok.vocab_size}", param="tokens")
        return _json(DetokenizeResponse(prompt=tok.decode(req.tokens, skip_special_tokens=False)))

    # -- generation -----------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this daemon serves "
                f"`{self.config.model_name}` (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def _log_unknown(self, fields: list[str]) -> None:
        for name in fields:
            if name not in self._logged_unknown:
                self._logged_unknown.add(name)
                logger.info("ignoring unknown request field %r (logged once)", name)

    def _admission_check(self, n_requests: int) -> None:
        if self.draining or not self.ready:
            self.metrics.rejected("draining" if self.draining else "not_ready")
            raise APIError(
                503,
                "the daemon is shutting down or not ready; retry on another replica",
                type="server_error",
                code="unavailable",
                headers={"Retry-After": "1"},
            )
        if self._inflight + n_requests > self.config.max_inflight:
            self.metrics.rejected("queue_full")
            raise APIError(
                429,
                f"server busy: {self._inflight} requests in flight, the limit is "
                f"{self.config.max_inflight} (max_num_seqs + max_queue); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    def _sampling_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None or req.top_k == 0 else req.top_k,
                min_p=req.min_p or 0.0,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop_list(),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
            )
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=param) from None

    def _check_lengths(self, prompts: list[list[int]], max_tokens: int | None) -> None:
        limit = self._max_model_len()
        vocab = self._loop().engine.tokenizer.vocab_size  # type: ignore[union-attr]
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt is empty after tokenization", param="prompt")
            if any(t >= vocab for t in ids):
                raise APIError(
                    400, f"prompt token ids must be < vocab size {vocab}", param="prompt"
                )
            if len(ids) >= limit:
                raise APIError(
                    400,
                    f"prompt has {len(ids)} tokens; this model's maximum context length is "
                    f"{limit} tokens including the output; shorten the prompt",
                    param="prompt",
                    code="context_length_exceeded",
                )
            if max_tokens is not None and len(ids) + max_tokens > limit:
                raise APIError(
                    400,
                    f"max_tokens={max_tokens} plus the prompt's {len(ids)} tokens exceeds the "
                    f"maximum context length {limit}; lower max_tokens to at most "
                    f"{limit - len(ids)}",
                    param="max_tokens",
                    code="context_length_exceeded",
                )

    def _chat_prompt_ids(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict | None
    ) -> list[int]:
        tok = self._loop().engine.tokenizer  # type: ignore[union-attr]
        try:
            text = tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **(kwargs or {})
            )
        except Exception as exc:  # the template rejected these messages (e.g. role order)
            raise APIError(400, f"chat template failed: {exc}", param="messages") from None
        return tok.encode(text, add_special_tokens=not tok.template_adds_bos)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_body(CompletionRequest, await request.read())
        self._log_unknown(req.unknown_fields())
        self._check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported by this model", param="suffix")
        tok = self._loop().engine.tokenizer  # type: ignore[union-attr]
        raw = req.prompts()
        size = sum(len(p) for p in raw if isinstance(p, str))
        prompts = await _offload(
            lambda: [p if isinstance(p, list) else tok.encode(p) for p in raw], size
        )
        self._check_lengths(prompts, req.max_tokens)
        params = self._sampling_params(req, req.max_tokens, req.logprobs)
        self._admission_check(len(prompts))
        echo = [tok.decode(p) for p in prompts] if req.echo else None
        job = _Job(f"cmpl-{uuid.uuid4().hex}", prompts, params, echo=echo)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await self._stream(request, job, "completion", include_usage)
        await self._run_to_end(request, job)
        resp = CompletionResponse(
            id=job.base_id,
            model=self.config.model_name,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=(echo[c.index // params.n] if echo else "") + c.text,
                    logprobs=_completion_logprobs(c.logprobs, job.text_base(c.index))
                    if params.logprobs is not None
                    else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in sorted(job.choices.values(), key=lambda c: c.index)
            ],
            usage=job.usage(),
        )
        return _json(resp)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_body(ChatCompletionRequest, await request.read())
        self._log_unknown(req.unknown_fields())
        self._check_model(req.model)
        for i, m in enumerate(req.messages):
            if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
                raise APIError(
                    400, "only text content parts are supported", param=f"messages.{i}.content"
                )
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt = await _offload(
            lambda: self._chat_prompt_ids(
                messages, req.add_generation_prompt, req.chat_template_kwargs
            ),
            sum(len(m["content"]) for m in messages),
        )
        max_tokens = req.effective_max_tokens()
        self._check_lengths([prompt], max_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, max_tokens, logprobs)
        self._admission_check(1)
        job = _Job(f"chatcmpl-{uuid.uuid4().hex}", [prompt], params)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await self._stream(request, job, "chat", include_usage)
        await self._run_to_end(request, job)
        resp = ChatCompletionResponse(
            id=job.base_id,
            model=self.config.model_name,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=c.text),
                    logprobs=_chat_logprobs(c.logprobs) if req.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in sorted(job.choices.values(), key=lambda c: c.index)
            ],
            usage=job.usage(),
        )
        return _json(resp)

    @contextlib.asynccontextmanager
    async def _admitted(self, job: _Job) -> AsyncIterator[None]:
        """Hold the job's in-flight slots; abort whatever is unfinished on the way out."""
        n = len(job.prompts)
        self._inflight += n
        self._idle.clear()
        loop = self._loop()
        try:
            for i, ids in enumerate(job.prompts):
                rid = job.rid(i)
                try:
                    await loop.add_request(rid, ids, job.params, queue=job.queue)
                except ValueError as exc:
                    raise APIError(400, str(exc), param="prompt") from None
                except EngineDeadError as exc:
                    raise APIError(503, str(exc), type="server_error") from None
                job.live.add(rid)
            yield
        finally:
            for rid in job.live:
                loop.abort(rid)  # client gone or error: the blocks go back now
                self.metrics.finished("abort")
            job.live.clear()
            self._inflight -= n
            if self._inflight == 0:
                self._idle.set()

    async def _next_outputs(self, job: _Job) -> list[StreamItem]:
        """Wait for at least one output, then take whatever else is already queued."""
        first = await job.queue.get()
        items = [first]
        while not job.queue.empty():
            items.append(job.queue.get_nowait())
        out: list[StreamItem] = []
        for item in items:
            if isinstance(item, BaseException):
                raise APIError(
                    503, f"generation failed: {item}", type="server_error", code="engine_error"
                )
            out.append(item)
        return out

    def _absorb(self, job: _Job, item: StreamItem) -> list[tuple[_Choice, CompletionDelta]]:
        """Fold one output into the job's choices; record metrics for finished requests."""
        out: RequestOutput = item.output
        job.cached_tokens[out.request_id] = out.metrics.num_cached_tokens
        touched = []
        for delta in out.deltas:
            ch = job.choice(out.request_id, delta)
            k = len(delta.new_token_ids)
            if k:
                if ch.last_token_t is not None:
                    gap = (item.t - ch.last_token_t) / k
                    for _ in range(k):
                        self.metrics.itl.observe(gap)
                ch.last_token_t = item.t
            ch.num_tokens += k
            ch.text += delta.new_text
            if delta.logprobs:
                ch.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                ch.finish_reason = delta.finish_reason
                ch.stop_reason = delta.stop_reason
                self.metrics.finished(delta.finish_reason)
            touched.append((ch, delta))
        if out.finished:
            job.live.discard(out.request_id)
            self.metrics.observe_request(out.metrics, out.num_generated_tokens // job.params.n)
        return touched

    async def _run_to_end(self, request: web.Request, job: _Job) -> None:
        async with self._admitted(job):
            while job.live:
                for item in await self._next_outputs(job):
                    self._absorb(job, item)

    async def _stream(
        self,
        request: web.Request,
        job: _Job,
        kind: str,
        include_usage: bool,
    ) -> web.StreamResponse:
        created = int(time.time())
        model = self.config.model_name
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        async with self._admitted(job):
            await resp.prepare(request)
            try:
                if job.echo is not None:
                    for i, text in enumerate(job.echo):
                        for j in range(job.params.n):
                            chunk = CompletionStreamResponse(
                                id=job.base_id, created=created, model=model,
                                choices=[CompletionChoice(index=i * job.params.n + j, text=text)],
                            )  # fmt: skip
                            await _send(resp, chunk, include_usage)
                while job.live:
                    for item in await self._next_outputs(job):
                        for ch, delta in self._absorb(job, item):
                            chunk = self._chunk(job, kind, created, ch, delta)
                            if chunk is not None:
                                await _send(resp, chunk, include_usage)
                if include_usage:
                    final: Any = (
                        ChatCompletionChunk(
                            id=job.base_id, created=created, model=model, choices=[],
                            usage=job.usage(),
                        )
                        if kind == "chat"
                        else CompletionStreamResponse(
                            id=job.base_id, created=created, model=model, choices=[],
                            usage=job.usage(),
                        )
                    )  # fmt: skip
                    await resp.write(f"data: {final.model_dump_json()}\n\n".encode())
            except APIError as exc:
                # Headers are gone already: report in-band, as OpenAI-style servers do.
                body = ErrorResponse(error=exc.detail).model_dump_json()
                await resp.write(f"data: {body}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _chunk(
        self, job: _Job, kind: str, created: int, ch: _Choice, delta: CompletionDelta
    ) -> Any:
        if not delta.new_text and delta.finish_reason is None and not delta.logprobs:
            return None
        model = self.config.model_name
        if kind == "completion":
            lp = None
            if job.params.logprobs is not None and delta.logprobs:
                start = job.text_base(ch.index) + len(ch.text) - len(delta.new_text)
                lp = _completion_logprobs(delta.logprobs, start)
            return CompletionStreamResponse(
                id=job.base_id, created=created, model=model,
                choices=[CompletionChoice(
                    index=ch.index, text=delta.new_text, logprobs=lp,
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                )],
            )  # fmt: skip
        msg = DeltaMessage(content=delta.new_text)
        if not ch.sent_role:
            msg.role = "assistant"
            ch.sent_role = True
        lp = None
        if job.params.logprobs is not None and delta.logprobs:
            lp = _chat_logprobs(delta.logprobs)
        return ChatCompletionChunk(
            id=job.base_id, created=created, model=model,
            choices=[ChatChunkChoice(
                index=ch.index, delta=msg, logprobs=lp,
                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            )],
        )  # fmt: skip


_INLINE_TOKENIZE_CHARS = 16_384


async def _offload(fn: Callable[[], Any], size: int) -> Any:
    """Run tokenization inline when small, on a worker thread when large.

    A megabyte prompt takes long enough to stall every other stream on the event loop.
    """
    if size <= _INLINE_TOKENIZE_CHARS:
        return fn()
    return await asyncio.get_running_loop().run_in_executor(None, fn)


async def _send(resp: web.StreamResponse, chunk: Any, include_usage: bool) -> None:
    # With include_usage, OpenAI sends "usage": null on every chunk but the last.
    data = chunk.model_dump(exclude_none=True)
    if include_usage:
        data["usage"] = None
    await resp.write(f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode())


def _completion_logprobs(lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for lp in lps:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({t: v for _, t, v in lp.top})
        out.text_offset.append(offset)
        offset += len(lp.token)
    return out


def _chat_logprobs(lps: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=lp.token,
                logprob=lp.logprob,
                bytes=list(lp.token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=t, logprob=v, bytes=list(t.encode("utf-8")))
                    for _, t, v in lp.top
                ],
            )
            for lp in lps
        ]
    )


def _http_error(request: web.Request, exc: web.HTTPException) -> APIError:
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


def _redis_index(url: str, namespace: str) -> KVIndex:
    from pagefleet.kvindex.redis_index import RedisKVIndex

    return RedisKVIndex.from_url(url, namespace=namespace)  # type: ignore[attr-defined]
