"""The daemon's OpenAI serving: completions, chat completions, models, tokenize/detokenize.

Completions and chat differ only in how the prompt is built and how results are shaped
(responses.py); validation, admission, the engine round trip and streaming are one path
(``_generate``). Handlers never touch the engine directly: requests go in through the
engine loop's command queue, outputs come back through an asyncio queue per job.

Invariants:
- the caller's mistakes are 4xx in OpenAI's error shape, naming the field;
- every engine request a handler started is finished or aborted when the handler returns,
  however it returns (client gone, error, shutdown), so its blocks go back;
- admission (admission.py) bounds the requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import ClientConnectionResetError, web
from pydantic import BaseModel

from pagefleet.api import chat_prompt
from pagefleet.api.limits import context_length_error
from pagefleet.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    NamedToolChoice,
    TokenizeRequest,
    TokenizeResponse,
    parse_body,
    template_messages,
    unsupported_fields,
)
from pagefleet.daemon.admission import Admission
from pagefleet.daemon.config import DaemonConfig
from pagefleet.daemon.engine_handle import EngineDeadError, EngineHandle, StreamItem
from pagefleet.daemon.engine_protocol import ServingTokenizer
from pagefleet.daemon.errors import APIError, json_model
from pagefleet.daemon.job import Job
from pagefleet.daemon.metrics import DaemonMetrics
from pagefleet.daemon.pd import PDSide, TransferParamsError
from pagefleet.daemon.request_log import RequestLog
from pagefleet.daemon.responses import ChatShape, CompletionShape, ResponseShape
from pagefleet.daemon.token_bytes import token_bytes_of
from pagefleet.engine.guided_spec import GuidedSpec
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.httpauth import ClientWriteTimeout, write_within
from pagefleet.ratelog import EveryInterval

logger = logging.getLogger(__name__)

_COMPLETION = CompletionShape()

# Up to this many characters a prompt is tokenized on the event loop; longer ones on a
# worker thread: a megabyte prompt takes long enough to stall every other stream.
_INLINE_TOKENIZE_CHARS = 16_384
# Where a generation handler stamps its start (monotonic) on the request, for --request-log.
_T_HTTP: web.RequestKey[float] = web.RequestKey("pagefleet_t_http", float)
# At most one warning per this many seconds about clients cut for not reading: a client
# can make one per request (pagefleet:client_cuts_total has the exact count).
CUT_LOG_INTERVAL_S = 10.0


class OpenAIServing:
    """The OpenAI-compatible endpoints of one daemon.

    ``live_loop`` returns the running engine loop or raises the caller's 503; the daemon
    (app.py) owns the loop, its lifecycle and ``admission``.
    """

    def __init__(
        self,
        config: DaemonConfig,
        metrics: DaemonMetrics,
        admission: Admission,
        live_loop: Callable[[], EngineHandle],
        started_at: float,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.admission = admission
        self._live_loop = live_loop
        self._started_at = started_at
        # P/D (pd.py): honours kv_transfer_params; set by the daemon (app.py)
        self.pd: PDSide | None = None
        self.request_log = (
            RequestLog(config.request_log, config.pod) if config.request_log else None
        )
        self._cut_log = EveryInterval(logger, CUT_LOG_INTERVAL_S)

    def client_cut(self, reason: str, what: str) -> None:
        """A client was cut for not reading (``reason``: ``write_timeout`` or ``backlog``;
        ``what``: who and why, for the log): counted once per cut, and warned about at most
        once per CUT_LOG_INTERVAL_S, so that a flood of stalled clients cannot flood the log.
        """
        self.metrics.client_cut(reason)
        self._cut_log.warning("%s", what)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/completions", self.completions)
        router.add_post("/v1/chat/completions", self.chat_completions)
        router.add_get("/v1/models", self.models)
        router.add_post("/tokenize", self.tokenize)
        # As vLLM's: the prompts the engine would see, without generating (vllm-router).
        router.add_post("/v1/completions/render", self.render_completion)
        router.add_post("/v1/chat/completions/render", self.render_chat)
        router.add_post("/detokenize", self.detokenize)

    # -- the engine's fixed attributes ----------------------------------------------------

    def _tokenizer(self) -> ServingTokenizer:
        return self._live_loop().loaded_engine.tokenizer

    def max_model_len(self) -> int:
        return int(self._live_loop().loaded_engine.max_model_len)

    # -- models and tokenizer endpoints ---------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        card = ModelCard(
            id=self.config.model_name,
            root=self.config.model,
            max_model_len=self.max_model_len() if self.admission.ready else None,
            created=int(self._started_at),
        )
        return json_model(ModelList(data=[card]))

    async def tokenize(self, request: web.Request) -> web.Response:
        req = parse_body(TokenizeRequest, await request.read())
        self._check_model(req.model)
        tok = self._tokenizer()
        if req.messages is not None:
            # The prompt chat completions would build from these messages (the raw dump
            # failed on content parts and null content, which chat accepts).
            _check_text_only(req)
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
            ids = self._chat_prompt_ids(req, tools)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tok.encode(req.prompt or "", add_special_tokens=add)
        return json_model(
            TokenizeResponse(count=len(ids), max_model_len=self.max_model_len(), tokens=ids)
        )

    async def render_completion(self, request: web.Request) -> web.Response:
        """``[{"prompt": text, "prompt_token_ids": ids}, ...]``, one per prompt, as vLLM."""
        req = parse_body(CompletionRequest, await request.read())
        self._check_model(req.model)
        tok = self._tokenizer()
        out = []
        for p in req.prompts():
            if isinstance(p, list):
                self._check_token_ids(p, tok.vocab_size, "prompt")
                out.append(
                    {"prompt": tok.decode(p, skip_special_tokens=False), "prompt_token_ids": p}
                )
            else:
                ids = tok.encode(p, add_special_tokens=req.add_special_tokens)
                out.append({"prompt": p, "prompt_token_ids": ids})
        return web.json_response(out)

    async def render_chat(self, request: web.Request) -> web.Response:
        """``[conversation, [{"prompt": rendered, "prompt_token_ids": ids}]]``, as vLLM."""
        req = parse_body(ChatCompletionRequest, await request.read())
        self._check_model(req.model)
        tok = self._tokenizer()
        _check_text_only(req)  # as the chat endpoint: an image part is refused, not dropped
        tools: list[dict[str, Any]] = []
        self._tools(req, tools)  # the template shows the tools, as in chat
        ids = self._chat_prompt_ids(req, tools)
        text = tok.decode(ids, skip_special_tokens=False)
        messages = template_messages(req.messages, chat_prompt.content_format(tok))
        return web.json_response([messages, [{"prompt": text, "prompt_token_ids": ids}]])

    async def detokenize(self, request: web.Request) -> web.Response:
        req = parse_body(DetokenizeRequest, await request.read())
        self._check_model(req.model)
        tok = self._tokenizer()
        self._check_token_ids(req.tokens, tok.vocab_size, "tokens")
        return json_model(
            DetokenizeResponse(prompt=tok.decode(req.tokens, skip_special_tokens=False))
        )

    # -- generation: the two endpoints build prompts, then share one path -----------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        request[_T_HTTP] = time.monotonic()
        req = parse_body(CompletionRequest, await request.read())
        self._reject_unsupported(req)
        self._check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported by this model", param="suffix")
        # max_tokens 0 with echo scores the prompt (lm-eval's loglikelihood requests): the
        # engine samples one token, as vLLM, which the job drops.
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise APIError(
                400,
                "max_tokens 0 generates nothing: it is for scoring the prompt with echo=true "
                "(and logprobs); set echo or a max_tokens of at least 1",
                param="max_tokens",
            )
        tok = self._tokenizer()
        raw = req.prompts()
        size = sum(len(p) for p in raw if isinstance(p, str))
        add = req.add_special_tokens
        prompts = await _offload(
            lambda: [p if isinstance(p, list) else tok.encode(p, add) for p in raw], size
        )
        return await self._generate(
            request,
            req,
            prompts,
            1 if echo_only else req.max_tokens,
            req.logprobs,
            _COMPLETION,
            echo=req.echo,
            echo_only=echo_only,
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        request[_T_HTTP] = time.monotonic()
        req = parse_body(ChatCompletionRequest, await request.read())
        self._reject_unsupported(req)
        self._check_model(req.model)
        _check_text_only(req)
        tools: list[dict[str, Any]] = []
        tool_schema = self._tools(req, tools)
        prompt = await _offload(
            lambda: self._chat_prompt_ids(req, tools),
            sum(len(m.text()) for m in req.messages),
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.echo and req.logprobs and req.prompt_logprobs is None and not req.stream:
            # vLLM's chat: echo asks for the prompt's logprobs, top_logprobs of each, in the
            # response's prompt_logprobs (the echoed text has none in the content's). vLLM
            # asks for them with echo alone too; here only with logprobs, so an echo that
            # wants no logprobs does not pay for scoring its whole prompt.
            req = req.model_copy(update={"prompt_logprobs": req.top_logprobs or 0})
        return await self._generate(
            request,
            req,
            [prompt],
            req.effective_max_tokens(),
            logprobs,
            self._chat_shape(req, tool_schema),
            echo=False,
            tool_schema=tool_schema,
        )

    def _chat_shape(self, req: ChatCompletionRequest, tool_schema: str | None) -> ChatShape:
        """The chat response shape; it reads calls out of the text (--tool-call-parser)
        when the request has tools and leaves the choice to the model ("auto")."""
        parser = self.config.tool_call_parser
        auto = req.tools and tool_schema is None and req.tool_choice in (None, "auto")
        echo = chat_prompt.echo_text(req.messages, req.add_generation_prompt) if req.echo else ""
        role = chat_prompt.reply_role(req.messages, req.add_generation_prompt)
        if parser == "none" or not auto:
            named = tool_schema is not None and isinstance(req.tool_choice, NamedToolChoice)
            return ChatShape(
                token_bytes_of(self._tokenizer()), echo=echo, role=role, named_tool=named
            )
        names = frozenset(t.function.name for t in req.tools or [])
        one = 1 if req.parallel_tool_calls is False else None
        return ChatShape(
            token_bytes_of(self._tokenizer()), parser, names, one, echo=echo, role=role
        )

    def _tools(self, req: ChatCompletionRequest, tools: list[dict[str, Any]]) -> str | None:
        """Fill ``tools`` with what the template shows of the request's tools; return the
        JSON schema the output is held to when ``tool_choice`` forces a call. 400 when the
        template cannot show the model its tools (it would be asked to call functions it
        never saw)."""
        if not req.tools:
            if req.tool_choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        template = getattr(self._tokenizer(), "chat_template", None) or ""
        if "tools" not in template:
            raise APIError(
                400,
                "this model's chat template does not support tools; send the request "
                "without 'tools' or serve a model whose template renders them",
                param="tools",
            )
        tools[:] = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            schema = req.forced_tool_schema()
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from None
        try:
            guided = req.guided()
        except ValueError as exc:  # two constraints at once: the same 400 as without tools
            param = getattr(exc, "param", "response_format")
            raise APIError(400, str(exc), param=param) from None
        if schema is not None and guided is not None:
            raise APIError(
                400,
                "a forced tool call cannot be combined with response_format",
                param="tool_choice",
            )
        return None if schema is None else json.dumps(schema)

    async def _generate(
        self,
        request: web.Request,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        shape: ResponseShape,
        *,
        echo: bool,
        tool_schema: str | None = None,
        echo_only: bool = False,
    ) -> web.StreamResponse:
        """Validate, admit, run on the engine and answer (whole or streamed) in ``shape``."""
        max_tokens_param = "max_tokens"
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            max_tokens_param = "max_completion_tokens"  # the field the caller set
        self._check_lengths(prompts, max_tokens, shape.prompt_param, max_tokens_param)
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(
                400,
                "prompt_logprobs cannot stream (as in vLLM); send stream=false, or on "
                "/v1/completions use echo with logprobs, which streams",
                param="prompt_logprobs",
            )
        # Echo with logprobs lists the prompt tokens' logprobs first (OpenAI's answer).
        echo_k = logprobs if echo and isinstance(req, CompletionRequest) else None
        asked = [k for k in (echo_k, req.prompt_logprobs) if k is not None]
        params = self._sampling_params(req, max_tokens, logprobs, max(asked, default=None))
        if tool_schema is not None:
            # Built from the tools' parameters: a schema that fails to compile is theirs.
            params.guided = GuidedSpec("json", tool_schema, source="tools")
        if isinstance(shape, ChatShape) and shape.keeps_special_tokens:
            # Mistral's [TOOL_CALLS] is a special token: skipped (the default), the parser
            # would never see a call. vLLM's mistral parser does the same.
            params.skip_special_tokens = False
        self.admission.check(len(prompts))
        texts = None
        if echo and isinstance(req, CompletionRequest):  # echo is a completions field
            # The prompt as sent: a text prompt is its own echo (a re-encode and decode
            # dropped its special tokens), token ids decode with their special tokens.
            tok = self._tokenizer()
            texts = [
                p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False)
                for p in req.prompts()
            ]
        job = Job(
            f"{shape.id_prefix}-{uuid.uuid4().hex}",
            prompts,
            params,
            echo=texts,
            forced_tool_call=tool_schema is not None,
            t_http=request.get(_T_HTTP, 0.0),
            trace=self.request_log,
            echo_only=echo_only,
            prompt_logprobs_k=req.prompt_logprobs,
        )
        if job.echo_logprobs:
            tok = self._tokenizer()
            job.first_token_texts = [tok.decode(p[:1], skip_special_tokens=False) for p in prompts]
        if self.pd is not None:
            try:
                job.transfer = self.pd.parse(req.kv_transfer_params, params.n, len(prompts))
            except TransferParamsError as exc:
                raise APIError(400, str(exc), param="kv_transfer_params") from None
            if job.transfer is not None and job.transfer.do_remote_decode:
                job.handle = job.transfer.remote_request_id  # None: the pod names it
                if not self.pd.claim(job.rid(0)):
                    raise APIError(
                        409,
                        f"transfer handle {job.rid(0)!r} is already in use on this pod; "
                        "name a fresh kv_transfer_params.remote_request_id",
                        param="kv_transfer_params",
                    )
                try:
                    return await self._run(request, job, shape, req)
                finally:  # a decode pod waiting for the handle learns if it never comes
                    self.pd.export_ended(job.rid(0))
        return await self._run(request, job, shape, req)

    async def _run(
        self, request: web.Request, job: Job, shape: ResponseShape, req: Any
    ) -> web.StreamResponse:
        """Admit ``job``, run it and answer, whole or streamed."""
        if req.stream:
            opts = req.stream_options
            include_usage = bool(opts and opts.include_usage)
            # vLLM's continuous_usage_stats: every chunk carries the usage so far.
            continuous = include_usage and bool(opts and opts.continuous_usage_stats)
            return await self._stream(request, job, shape, include_usage, continuous)
        async with self._admitted(job, shape.prompt_param):
            while job.live:
                for item in await _next_outputs(job):
                    job.absorb(item, self.metrics)
        resp = shape.response(job, self.config.model_name)
        if self.pd is not None and job.transfer is not None and job.transfer.do_remote_decode:
            # The prefill pod's answer says where its KV waits (vLLM's response field).
            data = resp.model_dump(mode="json")
            data["kv_transfer_params"] = await self.pd.response_params(
                job.rid(0), len(job.prompts[0])
            )
            return web.json_response(data)
        return json_model(resp)

    async def _stream(
        self,
        request: web.Request,
        job: Job,
        shape: ResponseShape,
        include_usage: bool,
        continuous: bool = False,
    ) -> web.StreamResponse:
        def usage() -> bytes | None:
            if continuous:
                return job.usage().model_dump_json().encode()
            return b"null" if include_usage else None

        created = int(time.time())
        model = self.config.model_name
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        out = _StreamSender(
            request, resp, job.base_id, self.config.client_write_timeout_s,
            self.config.max_stream_backlog_mb << 20, self.client_cut,
        )  # fmt: skip
        try:
            async with self._admitted(job, shape.prompt_param):
                await resp.prepare(request)
                try:
                    for chunk in shape.opening_chunks(job, created, model):
                        body = chunk.model_dump_json(exclude_none=True).encode()
                        out.send(_event(body, usage()))
                    while job.live:
                        # Every chunk of the outputs that queued up while this stream was
                        # behind leaves in one write: one syscall and one HTTP chunk, not
                        # one per token (each is still its own SSE event).
                        # The usage is read as each chunk is made: with continuous usage
                        # stats each carries the count as of its own tokens.
                        events = [
                            _event(body, usage())
                            for item in await _next_outputs(job)
                            for ch, delta in job.absorb(item, self.metrics)
                            if delta.new_text or delta.finish_reason is not None or delta.logprobs
                            for body in (shape.chunk_json(job, created, model, ch, delta),)
                            if body  # b"": a chunk that would say nothing is not sent
                        ]
                        if events:
                            out.send(b"".join(events))
                    if include_usage:
                        final = shape.usage_chunk(job, created, model)
                        out.send(f"data: {final.model_dump_json()}\n\n".encode())
                except APIError as exc:
                    # Headers are gone already: report in-band, as OpenAI-style servers do.
                    body = ErrorResponse(error=exc.detail).model_dump_json()
                    out.send(f"data: {body}\n\n".encode())
                out.send(b"data: [DONE]\n\n")
            # The engine is done with this job (its slot is free): what is left is the
            # client's to take, within the write timeout.
            await out.flush()
            await write_within(request, resp, None, self.config.client_write_timeout_s)
        except CLIENT_GONE as exc:
            # The client hung up, stopped reading (write timeout) or fell too far behind
            # (backlog): leaving _admitted above aborted the request and freed its blocks.
            # A cut for a stalled or lagging reader is reported where it happened
            # (_StreamSender), but for the last write's, here; a hang-up is routine.
            if isinstance(exc, ClientWriteTimeout) and exc is not out.failure:
                self.client_cut("write_timeout", f"stream {job.base_id}: {exc}; its end dropped")
            else:
                logger.debug("client of %s went away mid-stream: %s", job.base_id, exc)
        finally:
            out.close()
        return resp

    @contextlib.asynccontextmanager
    async def _admitted(self, job: Job, prompt_param: str) -> AsyncIterator[None]:
        """Hold the job's in-flight slots; abort whatever is unfinished on the way out.
        ``prompt_param``: the field an error about the prompt names ("prompt", "messages")."""
        with self.admission.hold(len(job.prompts)):
            loop = self._live_loop()
            try:
                for i, ids in enumerate(job.prompts):
                    rid = job.rid(i)
                    try:
                        if self.pd is not None and job.transfer is not None:
                            await self.pd.admit(loop, rid, ids, job.params, job.queue, job.transfer)
                        else:
                            await loop.add_request(rid, ids, job.params, queue=job.queue)
                    except ValueError as exc:  # the engine refused it (InvalidRequestError)
                        # A plain ValueError is about the prompt (too long, empty).
                        param = getattr(exc, "param", None) or "prompt"
                        if param == "prompt":
                            param = prompt_param
                        raise APIError(400, str(exc), param=param) from None
                    except EngineDeadError as exc:
                        raise APIError(503, str(exc), type="server_error") from None
                    job.live.add(rid)
                yield
            finally:
                for rid in job.live:
                    loop.abort(rid)  # client gone or error: the blocks go back now
                    self.metrics.finished("abort")
                job.live.clear()

    # -- validation -----------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this daemon serves "
                f"`{self.config.model_name}` (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def _reject_unsupported(self, req: BaseModel) -> None:
        """A field this server would otherwise ignore while it changes the answer is a 400
        naming it: a client asking for JSON must not silently get free text."""
        fields = unsupported_fields(req)
        if fields:
            name = fields[0]
            raise APIError(
                400,
                f"'{name}' is not supported by this server (value "
                f"{json.dumps((req.model_extra or {})[name])[:80]}); remove it from the request",
                param=name,
            )

    def _chat_prompt_ids(
        self, req: ChatCompletionRequest | TokenizeRequest, tools: list[dict[str, Any]]
    ) -> list[int]:
        """The prompt ``req`` makes, built as the gateway builds it (api/chat_prompt.py)."""
        tok = self._tokenizer()
        documents = req.documents
        try:
            text = chat_prompt.render_chat(
                tok,
                req.messages or [],
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template_kwargs=req.chat_template_kwargs,
                tools=tools,
                documents=documents,
            )
        except chat_prompt.ChatPromptError as exc:
            raise APIError(400, exc.message, param=exc.param) from None
        except Exception as exc:  # the template rejected these messages (e.g. role order)
            raise APIError(400, f"chat template failed: {exc}", param="messages") from None
        add = chat_prompt.add_special_tokens(req.add_special_tokens)
        return tok.encode(text, add_special_tokens=add)

    def _sampling_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        try:
            guided = req.guided()
        except ValueError as exc:
            param = getattr(exc, "param", "response_format")
            raise APIError(400, str(exc), param=param) from None
        spec = None if guided is None else GuidedSpec(guided[0], guided[1], guided[2])  # type: ignore[arg-type]
        beam = req.use_beam_search
        self._check_beam_fields(req)
        temperature = req.temperature
        if temperature is None:
            temperature = 0.0 if beam else 1.0  # beam search is deterministic
        try:
            return SamplingParams(
                guided=spec,
                use_beam_search=beam,
                best_of=req.best_of,
                length_penalty=req.length_penalty,
                early_stopping=req.early_stopping,
                n=req.n,
                temperature=temperature,
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
                prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                logit_bias=req.logit_bias_ids(),
                bad_words=list(req.bad_words or []),
            )
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=param) from None

    @staticmethod
    def _check_beam_fields(req: CompletionRequest | ChatCompletionRequest) -> None:
        """Beam-search fields that would be silently meaningless are a 400 naming them."""
        if req.use_beam_search:
            if req.stream:
                raise APIError(
                    400,
                    "use_beam_search cannot stream: the best beams are known only at the "
                    "end; send stream=false",
                    param="stream",
                )
            return
        for name, default in (("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(req, name) != default:
                raise APIError(
                    400,
                    f"{name} applies to beam search only; set use_beam_search=true or drop it",
                    param=name,
                )

    @staticmethod
    def _check_token_ids(ids: list[int], vocab: int, param: str) -> None:
        """Every id names a token of the model (else the tokenizer would drop or choke on it)."""
        if any(t >= vocab for t in ids):
            what = "prompt token ids" if param == "prompt" else "token ids"
            raise APIError(400, f"{what} must be < vocab size {vocab}", param=param)

    def _check_lengths(
        self,
        prompts: list[list[int]],
        max_tokens: int | None,
        prompt_param: str = "prompt",
        max_tokens_param: str = "max_tokens",
    ) -> None:
        """Each prompt fits the context with room for its output. The errors name the
        fields the caller sent: chat's prompt is its ``messages``, and its output length
        may be ``max_completion_tokens``."""
        limit = self.max_model_len()
        vocab = self._tokenizer().vocab_size
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt is empty after tokenization", param=prompt_param)
            self._check_token_ids(ids, vocab, prompt_param)
            # The gateway refuses with the same words (limits.py).
            err = context_length_error(
                len(ids), max_tokens, limit,
                prompt_param=prompt_param, max_tokens_param=max_tokens_param,
            )  # fmt: skip
            if err is not None:
                raise APIError(400, err[0], param=err[1], code="context_length_exceeded")


async def _next_outputs(job: Job) -> list[StreamItem]:
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


async def _offload(fn: Callable[[], Any], size: int) -> Any:
    """Run tokenization inline when small, on a worker thread when large."""
    if size <= _INLINE_TOKENIZE_CHARS:
        return fn()
    return await asyncio.get_running_loop().run_in_executor(None, fn)


# Raised by a write to a connection the client already closed, one it did not read within
# --client-write-timeout, or whose stream fell --max-stream-backlog-mb behind.
CLIENT_GONE = (ConnectionError, ClientConnectionResetError)


class _StreamSender:
    """Writes one stream's SSE to its client while the handler goes on reading the engine.

    Invariants: at most one write is in flight, and it ends within ``timeout_s`` or the
    connection is cut (``write_within``); the bytes made but not yet taken by the socket
    (``backlog``) never exceed ``max_backlog``: the send that would pass it cuts the
    connection and raises ConnectionResetError, so the handler's way out aborts the
    sequences. A batch engine cannot pause one sequence for a slow reader, and without this
    bound its whole output (n choices x top logprobs: tens of MB) waited in the daemon.
    """

    __slots__ = ("_limit", "_max", "_on_cut", "_pending", "_request", "_resp", "_rid",
                 "_task", "backlog", "failure")  # fmt: skip

    def __init__(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        rid: str,
        timeout_s: float,
        max_backlog: int,
        on_cut: Callable[[str, str], None],
    ) -> None:
        """``on_cut(reason, what)``: called once when this sender cuts its client
        (``write_timeout`` or ``backlog``), to count and log it."""
        self._request = request
        self._on_cut = on_cut
        self._resp = resp
        self._rid = rid
        self._limit = timeout_s
        self._max = max_backlog
        self._pending: list[bytes] = []
        self._task: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None  # what ended the connection, if anything
        self.backlog = 0  # bytes sent here and not yet taken by the connection's transport

    def send(self, data: bytes) -> None:
        """Queue ``data`` for the client; raise what ended the connection, if anything did."""
        if self.failure is not None:
            raise self.failure
        self._pending.append(data)
        self.backlog += len(data)
        if self.backlog > self._max:
            self._on_cut(
                "backlog",
                f"stream {self._rid}: its client is {self.backlog} bytes behind (the limit is "
                f"{self._max}, --max-stream-backlog-mb): cutting it and aborting the request",
            )
            self._cut()
            self.failure = ConnectionResetError(
                f"the client fell {self.backlog} bytes behind (--max-stream-backlog-mb)"
            )
            raise self.failure
        if self._task is None:
            self._task = asyncio.create_task(self._drain())

    async def flush(self) -> None:
        """Wait until everything sent so far is written (or the connection ended)."""
        if self._task is not None:
            await asyncio.shield(self._task)
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Stop writing (the handler is leaving): a pending write is cancelled."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _drain(self) -> None:
        try:
            while self._pending:
                data = b"".join(self._pending)
                self._pending.clear()
                await write_within(self._request, self._resp, data, self._limit)
                self.backlog -= len(data)
        except CLIENT_GONE as exc:
            if isinstance(exc, ClientWriteTimeout):
                self._on_cut("write_timeout", f"stream {self._rid}: {exc}; aborting its request")
            self.failure = exc
            self._cut()  # the handler may be waiting on the engine: wake it (cancellation)
        finally:
            self._task = None

    def _cut(self) -> None:
        if self._request.transport is not None:
            self._request.transport.abort()


def _check_text_only(req: ChatCompletionRequest | TokenizeRequest) -> None:
    """The model reads text: a message with another kind of content part is a 400."""
    for i, m in enumerate(req.messages or []):
        if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
            raise APIError(
                400, "only text content parts are supported", param=f"messages.{i}.content"
            )


def _event(body: bytes, usage: bytes | None) -> bytes:
    """One SSE event carrying the chunk ``body`` (compact JSON, null fields left out) and,
    when given, ``usage``: with include_usage, OpenAI sends "usage": null on every chunk
    but the last; with continuous_usage_stats, vLLM sends the usage so far."""
    if usage is not None:
        body = body[:-1] + b',"usage":' + usage + b"}"
    return b"data: " + body + b"\n\n"
