"""How a job's results are shaped for each OpenAI endpoint: whole responses and SSE chunks.

The generation path (serving.py) is one for both endpoints; only these shapes differ. A
shape never touches the engine or the queue: it reads the job's choices and one delta.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Protocol

from pydantic import BaseModel

from pagefleet.api.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    Logprob,
    PromptLogprobs,
    ReplyRole,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    new_tool_call_id,
)
from pagefleet.daemon.job import Choice, Job
from pagefleet.daemon.token_bytes import TokenBytesFn, utf8_bytes
from pagefleet.daemon.tool_calls import (
    CallStream,
    Parsed,
    ParsedCall,
    keeps_special_tokens,
    parse_calls,
    read_call,
)
from pagefleet.engine.outputs import CompletionDelta, PromptLogprob, TokenLogprob


class ResponseShape(Protocol):
    """One endpoint's response format."""

    id_prefix: str  # "cmpl" / "chatcmpl"
    prompt_param: str  # the request field the prompt comes from, for errors

    def response(self, job: Job, model: str) -> BaseModel:
        """The whole response of a finished job (non-streaming)."""
        ...

    def opening_chunks(self, job: Job, created: int, model: str) -> list[BaseModel]:
        """Chunks sent before any generated text (completions: the echoed prompts)."""
        ...

    def chunk(
        self, job: Job, created: int, model: str, ch: Choice, delta: CompletionDelta
    ) -> BaseModel:
        """The chunk for one delta that carries text, logprobs or a finish reason."""
        ...

    def chunk_json(
        self, job: Job, created: int, model: str, ch: Choice, delta: CompletionDelta
    ) -> bytes:
        """``chunk(...)`` as compact JSON without null fields, byte for byte; b"" when
        the chunk would say nothing (a forced call's text that adds no piece of the call),
        which is not sent."""
        ...

    def usage_chunk(self, job: Job, created: int, model: str) -> BaseModel:
        """The final chunk with no choices and the job's usage (``include_usage``)."""
        ...


# A stream sends one chunk per token. Building the pydantic chunk and dumping it costs
# ~12 us a token on this VM, a fifth of the HTTP process's CPU per streamed token; the
# common chunk (text and maybe a finish reason, no logprobs, no tool call) is written out
# here from a template in ~0.7 us. Invariant: the bytes equal
# ``chunk(...).model_dump_json(exclude_none=True)`` (tests/daemon/test_sse_chunks.py
# compares them on many texts and finish reasons); any other chunk goes through pydantic.


def _chunk_head(obj: str, job: Job, created: int, model: str, index: int) -> str:
    return (
        f'{{"id":{encode_basestring(job.base_id)},"object":"{obj}","created":{created},'
        f'"model":{encode_basestring(model)},"choices":[{{"index":{index},'
    )


def _finish_json(finish_reason: str | None, stop_reason: str | int | None) -> str:
    out = "" if finish_reason is None else f',"finish_reason":{encode_basestring(finish_reason)}'
    if stop_reason is None:
        return out
    if isinstance(stop_reason, str):
        return f'{out},"stop_reason":{encode_basestring(stop_reason)}'
    return f'{out},"stop_reason":{int(stop_reason)}'


class CompletionShape:
    id_prefix = "cmpl"
    prompt_param = "prompt"

    def response(self, job: Job, model: str) -> CompletionResponse:
        want_lp = job.params.logprobs is not None
        choices = []
        for c in job.sorted_choices():
            lp = None
            if want_lp:
                lp = completion_logprobs(c.logprobs, job.text_base(c.index))
                if job.echo_logprobs:
                    lp = _joined(_echo_logprobs(job, c.index), lp)
            choices.append(
                CompletionChoice(
                    index=c.index,
                    text=job.echo_text(c.index) + c.text,
                    logprobs=lp,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=vllm_prompt_logprobs(
                        job.choice_prompt_logprobs(c.index), job.prompt_logprobs_k
                    ),
                )
            )
        return CompletionResponse(id=job.base_id, model=model, choices=choices, usage=job.usage())

    def opening_chunks(self, job: Job, created: int, model: str) -> list[BaseModel]:
        if job.echo is None or job.echo_logprobs:
            return []  # with logprobs the echo goes with each choice's first chunk
        n = job.params.n
        return [
            CompletionStreamResponse(
                id=job.base_id,
                created=created,
                model=model,
                choices=[CompletionChoice(index=i * n + j, text=text)],
            )
            for i, text in enumerate(job.echo)
            for j in range(n)
        ]

    def chunk(
        self, job: Job, created: int, model: str, ch: Choice, delta: CompletionDelta
    ) -> CompletionStreamResponse:
        lp = None
        text = delta.new_text
        echo_now = job.echo_logprobs and not ch.sent_echo
        if job.params.logprobs is not None and (delta.logprobs or echo_now):
            out_lps = delta.logprobs or []
            lp = completion_logprobs(out_lps, job.text_base(ch.index) + ch.logprob_chars_sent)
            ch.logprob_chars_sent += sum(len(t.token) for t in out_lps)
            if echo_now:
                lp = _joined(_echo_logprobs(job, ch.index), lp)
        if echo_now:
            # The echo and its logprobs, known once the request's first output came.
            text = job.echo_text(ch.index) + text
            ch.sent_echo = True
        return CompletionStreamResponse(
            id=job.base_id, created=created, model=model,
            choices=[CompletionChoice(
                index=ch.index, text=text, logprobs=lp,
                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            )],
        )  # fmt: skip

    def chunk_json(
        self, job: Job, created: int, model: str, ch: Choice, delta: CompletionDelta
    ) -> bytes:
        if (
            delta.logprobs
            or type(delta.stop_reason) not in (str, int, type(None))
            or (job.echo_logprobs and not ch.sent_echo)
        ):
            return (
                self.chunk(job, created, model, ch, delta)
                .model_dump_json(exclude_none=True)
                .encode()
            )
        return (
            f"{_chunk_head('text_completion', job, created, model, ch.index)}"
            f'"text":{encode_basestring(delta.new_text)}'
            f"{_finish_json(delta.finish_reason, delta.stop_reason)}}}]}}"
        ).encode()

    def usage_chunk(self, job: Job, created: int, model: str) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=job.base_id, created=created, model=model, choices=[], usage=job.usage()
        )


class ChatShape:
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def __init__(
        self,
        token_bytes: TokenBytesFn = utf8_bytes,
        tool_parser: str | None = None,
        tool_names: frozenset[str] = frozenset(),
        max_calls: int | None = None,
        echo: str = "",
        role: ReplyRole = "assistant",
        named_tool: bool = False,
    ) -> None:
        # The ``bytes`` of each logprob (token_bytes.py: a partial token's own bytes).
        self.token_bytes = token_bytes
        # vLLM's chat echo (chat_prompt.echo_text): what each reply's content starts with.
        self.echo = echo
        # The role every choice is reported with (chat_prompt.reply_role).
        self.role: ReplyRole = role
        # tool_choice named one function: its forced call finishes with "stop", as OpenAI's
        # and vLLM's do ("tool_calls" is for auto and required).
        self.named_tool = named_tool
        # Auto tool choice (--tool-call-parser): the format calls are read from the text
        # in, and the tools they may call; None: the text is the content, as written.
        self.tool_parser = tool_parser
        self.tool_names = tool_names
        self.max_calls = max_calls  # 1 with parallel_tool_calls false
        self._call_streams: dict[int, CallStream] = {}  # choice index -> its reader

    @property
    def keeps_special_tokens(self) -> bool:
        """The text must keep special tokens: the parser's call marker is one (mistral)."""
        return self.tool_parser is not None and keeps_special_tokens(self.tool_parser)

    def response(self, job: Job, model: str) -> ChatCompletionResponse:
        want_lp = job.params.logprobs is not None
        return ChatCompletionResponse(
            id=job.base_id,
            model=model,
            choices=[self._echoed(self._choice(job, c, want_lp)) for c in job.sorted_choices()],
            usage=job.usage(),
            prompt_logprobs=vllm_prompt_logprobs(job.prompt_logprobs.get(0), job.prompt_logprobs_k),
        )

    def _echoed(self, choice: ChatChoice) -> ChatChoice:
        choice.message.role = self.role
        if self.echo:
            choice.message.content = self.echo + (choice.message.content or "")
        return choice

    def _choice(self, job: Job, c: Choice, want_lp: bool) -> ChatChoice:
        if self.tool_parser is None:
            message = _message(job, c)
            finish = self._forced_finish(job, c.finish_reason)
        else:
            parsed = parse_calls(self.tool_parser, c.text, self.tool_names, self.max_calls)
            message = _parsed_message(parsed) if parsed.calls else _message(job, c)
            finish = _auto_finish_reason(len(parsed.calls), c.finish_reason)
        return ChatChoice(
            index=c.index,
            message=message,
            logprobs=chat_logprobs(c.logprobs, self.token_bytes) if want_lp else None,
            finish_reason=finish,
            stop_reason=c.stop_reason,
        )

    def opening_chunks(self, job: Job, created: int, model: str) -> list[BaseModel]:
        """With echo, each choice's first chunk: its role and the echoed text (as vLLM,
        before anything generated)."""
        if not self.echo:
            return []
        out: list[BaseModel] = []
        for i in range(job.params.n):
            ch = job.choices.setdefault(i, Choice(i))
            ch.sent_role = True
            choice = ChatChunkChoice(index=i, delta=DeltaMessage(role=self.role, content=self.echo))
            out.append(
                ChatCompletionChunk(id=job.base_id, created=created, model=model, choices=[choice])
            )
        return out

    def chunk(
        self, job: Job, created: int, model: str, ch: Choice, delta: CompletionDelta
    ) -> ChatCompletionChunk:
        msg = DeltaMessage(content=delta.new_text)
        finish = self._forced_finish(job, delta.finish_reason)
        if self.tool_parser is not None:
            msg, finish = self._auto_delta(ch, delta)
        elif job.forced_tool_call:
            msg.content = None
            msg.tool_calls = _tool_call_piece(ch, delta.finish_reason is not None)
            if delta.finish_reason is not None and ch.tool_call_id is None:
                msg.content = ch.text  # never became a call (cut short): the text as is
        if not ch.sent_role:
            msg.role = self.role
            ch.sent_role = True
        lp = None
        if job.params.logprobs is not None and delta.logprobs:
            lp = chat_logprobs(delta.logprobs, self.token_bytes)
        return ChatCompletionChunk(
            id=job.base_id, created=created, model=model,
            choices=[ChatChunkChoice(
                index=ch.index, delta=msg, logprobs=lp, finish_reason=finish,
                stop_reason=delta.stop_reason,
            )],
        )  # fmt: skip

    def _forced_finish(self, job: Job, reason: str | None) -> str | None:
        # OpenAI says "tool_calls" when the model stopped after a call it chose to make
        # (required), "stop" after the one a named tool_choice made it make.
        forced = job.forced_tool_call and not self.named_tool
        return "tool_calls" if forced and reason == "stop" else reason

    def _auto_delta(self, ch: Choice, delta: CompletionDelta) -> tuple[DeltaMessage, str | None]:
        """The content and calls a delta completes (auto tool choice), and its finish
        reason: "tool_calls" when the model stopped after calling."""
        stream = self._call_streams.get(ch.index)
        if stream is None:
            stream = self._call_streams[ch.index] = CallStream(
                self.tool_parser or "", self.tool_names, self.max_calls
            )
        before = stream.num_calls
        parsed = stream.feed(delta.new_text, final=delta.finish_reason is not None)
        calls = [
            ToolCallDelta(
                index=before + i,
                id=call.id,
                type="function",
                function=FunctionCallDelta(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for i, call in enumerate(_tool_calls(parsed.calls))
        ]
        msg = DeltaMessage(content=parsed.content or None, tool_calls=calls or None)
        return msg, _auto_finish_reason(stream.num_calls, delta.finish_reason)

    def chunk_json(
        self, job: Job, created: int, model: str, ch: Choice, delta: CompletionDelta
    ) -> bytes:
        held = job.forced_tool_call or self.tool_parser is not None  # text may be held back
        if held or delta.logprobs or type(delta.stop_reason) not in (str, int, type(None)):
            chunk = self.chunk(job, created, model, ch, delta)
            (choice,) = chunk.choices
            if (
                held
                and choice.finish_reason is None
                and choice.logprobs is None
                and not choice.delta.model_dump(exclude_none=True)
            ):
                return b""  # OpenAI sends no empty deltas mid-stream
            return chunk.model_dump_json(exclude_none=True).encode()
        role = ""
        if not ch.sent_role:
            role = f'"role":"{self.role}",'  # a Literal: no escaping needed
            ch.sent_role = True
        return (
            f"{_chunk_head('chat.completion.chunk', job, created, model, ch.index)}"
            f'"delta":{{{role}"content":{encode_basestring(delta.new_text)}}}'
            f"{_finish_json(delta.finish_reason, delta.stop_reason)}}}]}}"
        ).encode()

    def usage_chunk(self, job: Job, created: int, model: str) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=job.base_id, created=created, model=model, choices=[], usage=job.usage()
        )


def completion_logprobs(lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """Completions-style logprobs; ``offset`` is where the first token starts in the text."""
    out = CompletionLogprobs()
    for lp in lps:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        # The sampled token is always there, so up to logprobs + 1 entries (OpenAI's
        # definition, as vLLM). Distinct tokens can show the same text (each partial
        # UTF-8 token is U+FFFD): the sampled one, then the highest-ranked, keeps the key.
        top: dict[str, float] = {lp.token: lp.logprob}
        for _, t, v in lp.top:
            top.setdefault(t, v)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(lp.token)
    return out


def _echo_logprobs(job: Job, choice_index: int) -> CompletionLogprobs:
    """The echoed prompt's part of a choice's logprobs (OpenAI: the first token's logprob
    and top_logprobs are null). Offsets index the echoed text, counted back from its end:
    the tokens' texts can be longer than the prompt as sent (a BOS the tokenizer added), so
    such a leading token sits at 0 and the output's first token at ``len(echo)``, where
    the output's own offsets start."""
    out = CompletionLogprobs()
    plps = job.choice_prompt_logprobs(choice_index)
    if plps is None:  # the request ended before its prompt was scored (aborted)
        return out
    first = job.first_token_texts[choice_index // job.params.n]
    tokens = [first, *(e.token if e is not None else "" for e in plps[1:])]
    pos = len(job.echo_text(choice_index)) - sum(map(len, tokens))
    k = job.params.logprobs or 0
    for token, entry in zip(tokens, plps, strict=True):
        out.tokens.append(token)
        out.text_offset.append(max(pos, 0))
        pos += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry.logprob)
        top: dict[str, float] = {entry.token: entry.logprob}  # as completion_logprobs
        for _, t, v in entry.top[:k]:
            top.setdefault(t, v)
        out.top_logprobs.append(top)
    return out


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def vllm_prompt_logprobs(
    plps: list[PromptLogprob | None] | None, k: int | None
) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` (None unless asked, ``k`` not None): per prompt token,
    None for the first, else token id -> {logprob, rank, decoded_token} of the token itself
    and the ``k`` most likely (ranks 1..k)."""
    if plps is None or k is None:
        return None
    out: PromptLogprobs = []
    for e in plps:
        if e is None:
            out.append(None)
            continue
        entry = {e.token_id: Logprob(logprob=e.logprob, rank=e.rank, decoded_token=e.token)}
        for rank, (tid, text, v) in enumerate(e.top[:k], start=1):
            entry.setdefault(tid, Logprob(logprob=v, rank=rank, decoded_token=text))
        out.append(entry)
    return out


def chat_logprobs(lps: list[TokenLogprob], token_bytes: TokenBytesFn = utf8_bytes) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=lp.token,
                logprob=lp.logprob,
                bytes=token_bytes(lp.token_id, lp.token),
                top_logprobs=[
                    TopLogprob(token=t, logprob=v, bytes=token_bytes(i, t)) for i, t, v in lp.top
                ],
            )
            for lp in lps
        ]
    )


def _tool_call(text: str) -> ToolCall | None:
    """The call in a constrained output; None if it was cut short (max_tokens). The
    arguments are the model's own text of them, as streamed (tool_calls.py)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: past ~1000 nested levels
        return None
    call = read_call(text)
    args = call.arguments if call.complete else json.dumps(obj["arguments"])
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=args))


def _tool_call_piece(ch: Choice, final: bool) -> list[ToolCallDelta] | None:
    """What of ``ch``'s forced call is new since the last chunk, OpenAI-style: the call's
    id, type and name once the name is complete, then each new piece of the arguments.
    A call whose name never showed in the expected place goes out whole at the end."""
    call = read_call(ch.text)
    if call.name is None:
        whole = _tool_call(ch.text) if final else None
        if whole is None:
            return None
        ch.tool_call_id = whole.id
        fn = FunctionCallDelta(name=whole.function.name, arguments=whole.function.arguments)
        return [ToolCallDelta(index=0, id=whole.id, type="function", function=fn)]
    piece = call.arguments[ch.tool_args_sent :]
    ch.tool_args_sent = len(call.arguments)
    if ch.tool_call_id is None:
        ch.tool_call_id = new_tool_call_id()
        fn = FunctionCallDelta(name=call.name, arguments=piece)
        return [ToolCallDelta(index=0, id=ch.tool_call_id, type="function", function=fn)]
    return [ToolCallDelta(index=0, function=FunctionCallDelta(arguments=piece))] if piece else None


def _message(job: Job, c: Choice) -> ChatResponseMessage:
    if job.forced_tool_call:
        call = _tool_call(c.text)
        if call is None:
            # Cut short (max_tokens) after the name: the call with its arguments so far,
            # as a stream of the same tokens sent them (and as OpenAI and vLLM answer).
            so_far = read_call(c.text)
            if so_far.name is not None:
                fn = FunctionCall(name=so_far.name, arguments=so_far.arguments)
                call = ToolCall(function=fn)
        if call is not None:
            return ChatResponseMessage(content=None, tool_calls=[call])
    return ChatResponseMessage(content=c.text)


def _tool_calls(calls: list[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def _parsed_message(parsed: Parsed) -> ChatResponseMessage:
    """Calls read from the text (auto tool choice); content null when there is none."""
    return ChatResponseMessage(content=parsed.content or None, tool_calls=_tool_calls(parsed.calls))


def _auto_finish_reason(num_calls: int, reason: str | None) -> str | None:
    return "tool_calls" if num_calls and reason == "stop" else reason
