"""Request intake: body -> validated request, routing ids and the context-length verdict,
off the gateway's event loop when the body is large.

Parsing a 4 MiB body and tokenizing its prompt hold the GIL for up to a second, which
would stall every stream and probe the gateway serves. Bodies above ``inline_bytes`` are
therefore handled in worker *processes* (a thread would still hold the GIL), small ones
inline where the hop would cost more than the work.

Invariants:
- ``inspect`` refuses what the daemon would refuse for length, with the daemon's
  ``context_length_exceeded`` error (the shared ``context_length_error``), and lets through
  everything the daemon would accept;
- a prompt is never tokenized when a bound already decides: ``len(utf-8) + specials`` tokens
  at most (every token covers at least one byte), ``chars / max_token_chars`` at least;
- the result is small (the first prompt's ids, capped at the context length), so the hop
  back from a worker is cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import multiprocessing
import os
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from pagefleet.api.limits import context_length_error
from pagefleet.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestValidationError,
    parse_body,
)
from pagefleet.gateway.prompts import PromptTokenizer

logger = logging.getLogger(__name__)

# Longer session keys (``session_id``, ``user``) are routed on their digest.
MAX_SESSION_KEY_CHARS = 256
# Special tokens a tokenizer adds around one text (BOS, EOS, ...), as an upper bound.
_SPECIALS = 4


@dataclass(slots=True, frozen=True)
class IntakeError:
    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(slots=True)
class Intake:
    """What the gateway needs of a body: routing inputs, or why it is refused."""

    stream: bool = False
    model: str | None = None  # as the client named it (None: not sent)
    session_key: str | None = None
    token_ids: list[int] | None = None  # the first prompt's ids (None: route on load)
    error: IntakeError | None = None


# No vocabulary is this large, and the prefix index's block hashes take 32-bit ids.
_ID_LIMIT = 2**32


def _too_long(
    tok: PromptTokenizer | None,
    text: str | None,
    ids: list[int] | None,
    max_tokens: int | None,
    limit: int | None,
    encode: functools.partial[list[int]] | None,
    params: tuple[str, str] = ("prompt", "max_tokens"),
) -> tuple[list[int] | None, IntakeError | None]:
    """Ids of one prompt (when computed) and a context-length error (when it cannot fit).
    ``params``: the fields the caller sent for the prompt and the output bound (chat:
    "messages", and "max_completion_tokens" when set), named in the error as the daemon
    names them."""
    names = {"prompt_param": params[0], "max_tokens_param": params[1]}
    if ids is not None:
        # Ids the model cannot have are the daemon's 400 too; refused here before they reach
        # the block hashes (which pack each id in 32 bits) without a tokenizer as well.
        vocab = tok.tokenizer.vocab_size if tok is not None else _ID_LIMIT
        if any(t >= vocab for t in ids):
            msg = f"prompt token ids must be < vocab size {vocab}"
            return None, IntakeError(400, msg, "prompt")
        err = context_length_error(len(ids), max_tokens, limit, **names) if limit else None
        return ids, _ctx(err)
    if tok is None or text is None or encode is None:
        return None, None
    if limit:
        at_least = -(-len(text) // tok.tokenizer.max_token_chars)
        if at_least >= limit or (max_tokens is not None and at_least + max_tokens > limit):
            err = context_length_error(at_least, max_tokens, limit, at_least=True, **names)
            return None, _ctx(err)
    try:
        ids = encode(text)
    except Exception as exc:  # the daemon owns the verdict on odd prompts; route on load
        logger.debug("could not tokenize for routing (%s); routing on load only", exc)
        return None, None
    err = context_length_error(len(ids), max_tokens, limit, **names) if limit else None
    return ids, _ctx(err)


def _ctx(err: tuple[str, str] | None) -> IntakeError | None:
    if err is None:
        return None
    return IntakeError(400, err[0], err[1], "context_length_exceeded")


_CLIENT_KV_PARAMS = (
    "kv_transfer_params is set by the gateway for its prefill/decode hand-over and is not "
    "accepted from clients; send the request without it"
)


def _surely_fits(text: str, max_tokens: int | None, limit: int) -> bool:
    upper = len(text.encode("utf-8", "surrogatepass")) + _SPECIALS
    return upper < limit and (max_tokens is None or upper + max_tokens <= limit)


def inspect(
    kind: str, body: bytes, tok: PromptTokenizer | None, max_model_len: int | None
) -> Intake:
    """Validate ``body`` (``kind``: "completion" or "chat") and compute its routing ids."""
    out = _inspect(kind, body, tok, max_model_len)
    if out.error is not None:
        out.token_ids = None  # refused: nothing to route, nothing to ship back
    elif out.token_ids is not None and max_model_len:
        out.token_ids = out.token_ids[:max_model_len]
    return out


def _inspect(
    kind: str, body: bytes, tok: PromptTokenizer | None, max_model_len: int | None
) -> Intake:
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        parsed = parse_body(model, body)
    except RequestValidationError as exc:
        return Intake(error=IntakeError(400, exc.message, exc.param))
    if parsed.kv_transfer_params is not None:
        # The P/D hand-over is between this gateway and its daemons. Passed on, a client's
        # params would make a decode pod pull KV from a host the client names: a request
        # from inside the fleet to any address, with the fleet's upstream key, and forged
        # K/V entering a prefix cache that other clients' requests then decode from.
        return Intake(error=IntakeError(400, _CLIENT_KV_PARAMS, "kv_transfer_params"))
    out = Intake(stream=parsed.stream, model=parsed.model, session_key=_session_from_body(parsed))
    limit = max_model_len
    if isinstance(parsed, ChatCompletionRequest):
        if tok is None:
            return out
        try:
            text = tok.chat_text(parsed)
        except Exception as exc:  # the daemon answers template errors with its own 400
            logger.debug("chat template failed at the gateway (%s)", exc)
            return out
        set_completion = parsed.max_completion_tokens is not None
        bound = "max_completion_tokens" if set_completion else "max_tokens"
        ids, err = _too_long(
            tok, text, None, parsed.effective_max_tokens(), limit,
            functools.partial(_chat_encode, tok, parsed.add_special_tokens), ("messages", bound),
        )  # fmt: skip
        out.token_ids, out.error = ids, err
        return out
    prompts = parsed.prompts()
    add = parsed.add_special_tokens
    encode = functools.partial(_completion_encode, tok, add) if tok is not None else None
    for i, p in enumerate(prompts):
        text = p if isinstance(p, str) else None
        ids = list(p) if isinstance(p, list) else None
        if (
            i > 0
            and text is not None
            and (not limit or _surely_fits(text, parsed.max_tokens, limit))
        ):
            continue  # only the first prompt's ids are needed for routing
        ids, err = _too_long(tok, text, ids, parsed.max_tokens, limit, encode)
        if i == 0:
            out.token_ids = ids
        if err is not None:
            out.error = err
            return out
    return out


def _completion_encode(tok: PromptTokenizer, add_special_tokens: bool, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _chat_encode(tok: PromptTokenizer, add_special_tokens: bool | None, text: str) -> list[int]:
    return tok.chat_text_ids(text, add_special_tokens)


def _session_from_body(parsed: CompletionRequest | ChatCompletionRequest) -> str | None:
    value = (parsed.model_extra or {}).get("session_id") or parsed.user
    if not isinstance(value, str) or not value:
        return None
    if len(value) > MAX_SESSION_KEY_CHARS:
        # Its digest routes it the same way on every replica; the string itself came back
        # from the worker and stayed with the request: a body that is one large ``user``
        # field cost the gateway twice its size (RSS 2.6x the body budget in a flood).
        return "sha256:" + hashlib.sha256(value.encode()).hexdigest()
    return value


@functools.cache
def _worker_tokenizer(spec: str) -> PromptTokenizer:
    # Loaded once per worker process (the cache lives only in the worker).
    return PromptTokenizer.from_spec(spec)


def _worker_inspect(kind: str, body: bytes, path: str | None, max_model_len: int | None) -> Intake:
    return inspect(kind, body, _worker_tokenizer(path) if path else None, max_model_len)


def _noop() -> None:
    return None


def _worker_init(path: str | None) -> None:
    # Batch work: on a busy machine the gateway's event loop must win the CPU over it.
    with contextlib.suppress(OSError):
        os.nice(5)
    if path:
        _worker_tokenizer(path)


@dataclass(slots=True)
class IntakePool:
    """Runs ``inspect`` inline for small bodies and in worker processes for large ones."""

    tokenizer: PromptTokenizer | None
    max_model_len: int | None = None
    workers: int = 2
    inline_bytes: int = 8192
    _executor: Executor | None = None

    def start(self) -> None:
        if self.workers <= 0:
            return
        path = self.tokenizer.spec if self.tokenizer is not None else None
        if self.tokenizer is not None and path is None:
            # A tokenizer built in memory cannot be reloaded elsewhere: use threads.
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="intake")
            return
        # spawn, not fork: this process runs an event loop and threads.
        self._executor = ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(path,),
        )
        # Start every worker now: spawning one later would stall the loop of the request
        # that needed it.
        for _ in range(self.workers):
            self._executor.submit(_noop)

    def warm(self) -> None:
        """Run one chat and one completion through ``inspect`` inline, before the first
        client: compiling the chat template and the first tokenizer calls cost ~0.1 s,
        which the first burst of requests would otherwise queue behind (measured in
        bench/routing.py's breakdown: the cold gateway's first 8 requests each waited
        140-190 ms before reaching a daemon, sglang-router's 20-40 ms)."""
        chat = b'{"model":"m","messages":[{"role":"system","content":"warm"},'
        chat += b'{"role":"user","content":"up"}],"max_tokens":1}'
        try:
            inspect("chat", chat, self.tokenizer, self.max_model_len)
            inspect("completion", b'{"model":"m","prompt":"warm up"}', self.tokenizer, None)
        except Exception as exc:  # a template that cannot render this is the daemon's 400
            logger.debug("intake warm-up failed (%s); the first request pays it", exc)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def inspect(self, kind: str, body: bytes) -> Intake:
        """The body's Intake; raises RuntimeError when a worker died (the caller answers 503)."""
        if self._executor is None or len(body) <= self.inline_bytes:
            return inspect(kind, body, self.tokenizer, self.max_model_len)
        loop = asyncio.get_running_loop()
        if isinstance(self._executor, ThreadPoolExecutor):
            fn = functools.partial(inspect, kind, body, self.tokenizer, self.max_model_len)
            return await loop.run_in_executor(self._executor, fn)
        path = self.tokenizer.spec if self.tokenizer is not None else None
        try:
            return await loop.run_in_executor(
                self._executor, _worker_inspect, kind, body, path, self.max_model_len
            )
        except BrokenProcessPool as exc:
            # A worker died (killed, out of memory): replace the pool for the next request.
            logger.warning("intake worker died (%s); restarting the worker pool", exc)
            self.close()
            self.start()
            raise RuntimeError("the gateway's request worker died; retry the request") from exc
