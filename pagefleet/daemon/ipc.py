"""The wire between the daemon's HTTP process and its engine process (engine_core.py).

One duplex pipe (``multiprocessing.Pipe``, a Unix socketpair) carries length-framed pickles
(protocol 5) both ways. Measured against pyzmq + msgspec on this code's messages (a step's
outputs are a handful of small dataclasses) the pipe is as fast and needs no dependency
(docs/benchmarks.md, session 4). Pickles come only from the other process of the same
daemon (the child was started by this process), never from the network.

Messages are plain tuples; the first element says what it is:

HTTP -> engine
    ("call", call_id | None, method, args)   run on the engine thread between steps;
                                            call_id None: fire and forget
    ("calls", [(call_id | None, method, args)])  several calls made in one turn of the
                                            HTTP process's event loop, run in order
    ("side", call_id, method, args)          run off the engine thread at once (reads of
                                            exported KV blocks: a pull never waits a step)
    ("stop",)                                finish the current step and exit 0

engine -> HTTP
    ("ready", EngineInfo)                    loaded; what the HTTP side needs to serve
    ("load_error", message)                  loading failed; the process exits 1
    ("step", outputs, t, stats)              one engine step's outputs (pack_outputs) and
                                            stats
    ("events", [KVEventBatch])               KV events, always before the message that
                                            follows them in engine order
    ("reply", call_id, ok, value)            a call's result, or its error (RemoteError)
    ("side_reply", call_id, ok, value)       the same for a "side" call: answered off the
                                            engine thread, so not a sign that it is alive
    ("crashed", message)                     the engine loop raised; the process exits 1
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from pagefleet.engine.outputs import (
    CompletionDelta,
    PromptLogprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)

# Largest message worth pickling in one piece; a larger one is a bug (a whole KV pool).
MAX_MESSAGE_BYTES = 1 << 31


def dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=5)


def loads(data: bytes) -> Any:
    # Trusted: pickles come from our own child process only (see the module docstring).
    return pickle.loads(data)


@dataclass(slots=True)
class EngineInfo:
    """What the HTTP process learns once the engine loaded: all fixed for its lifetime."""

    pid: int
    tokenizer: Any  # the engine's own tokenizer object, pickled (the Decoder protocol)
    max_model_len: int
    kv_layout: Any | None  # KVLayout when the engine can transfer KV (P/D), else None
    has_exports: bool


@dataclass(slots=True)
class RemoteError:
    """An exception raised in the engine process, as data (any exception type pickles)."""

    kind: str  # "value" (the caller's mistake: ValueError and subclasses) or "internal"
    message: str
    param: str | None = None  # InvalidRequestError.param: the request field at fault

    @classmethod
    def of(cls, exc: BaseException) -> RemoteError:
        kind = "value" if isinstance(exc, ValueError) else "internal"
        return cls(kind, str(exc) or type(exc).__name__, getattr(exc, "param", None))

    def exception(self) -> Exception:
        if self.kind == "value":
            err = ValueError(self.message)
            if self.param is not None:
                err.param = self.param  # type: ignore[attr-defined]
            return err
        return RuntimeError(f"the engine process failed: {self.message}")


# -- step outputs as plain tuples --------------------------------------------------------
# Pickling slotted dataclasses goes through copyreg per object: 64 RequestOutputs cost
# ~0.9 ms a step to encode (bench/engine_ipc.py), a third of a tiny model's step, in the
# engine process. Written out by hand as tuples of builtins they cost ~0.15 ms packed and
# pickled (a loop over dataclasses.fields() with getattr costs 0.37 ms to pack alone).
# ``prompt_token_ids`` is left out: the HTTP process knows each prompt and never reads it.
# tests/daemon/test_engine_process.py fails if a field is added and not carried here.


def pack_outputs(outputs: list[RequestOutput]) -> list[tuple[Any, ...]]:
    """Outputs of one engine step as tuples of builtins (``unpack_outputs`` reverses it)."""
    out = []
    for o in outputs:
        m = o.metrics
        out.append(
            (
                o.request_id,
                o.finished,
                o.num_generated_tokens,
                (
                    m.arrival_time, m.first_scheduled_time, m.first_token_time,
                    m.last_token_time, m.finished_time, m.num_cached_tokens,
                ),
                [
                    (
                        d.index, d.new_token_ids, d.new_text,
                        None if d.logprobs is None
                        else [(lp.token_id, lp.token, lp.logprob, lp.top) for lp in d.logprobs],
                        d.finish_reason, d.stop_reason,
                    )
                    for d in o.deltas
                ],
                None if o.prompt_logprobs is None
                else [None if p is None else (p.token_id, p.token, p.logprob, p.rank, p.top)
                      for p in o.prompt_logprobs],
            )
        )  # fmt: skip
    return out


def unpack_outputs(packed: list[tuple[Any, ...]]) -> list[RequestOutput]:
    out = []
    for rid, finished, num_gen, m, deltas, plps in packed:
        out.append(
            RequestOutput(
                rid,
                [],
                [
                    CompletionDelta(
                        index, ids, text,
                        None if lps is None else [TokenLogprob(*lp) for lp in lps],
                        reason, stop,
                    )
                    for index, ids, text, lps, reason, stop in deltas
                ],
                finished,
                RequestMetrics(*m),
                num_gen,
                None if plps is None
                else [None if p is None else PromptLogprob(*p) for p in plps],
            )
        )  # fmt: skip
    return out


# The fields pack_outputs carries, per dataclass, in order (checked by a test).
PACKED_FIELDS = {
    RequestOutput: ("request_id", "prompt_token_ids", "deltas", "finished", "metrics",
                    "num_generated_tokens", "prompt_logprobs"),
    PromptLogprob: ("token_id", "token", "logprob", "rank", "top"),
    RequestMetrics: ("arrival_time", "first_scheduled_time", "first_token_time",
                     "last_token_time", "finished_time", "num_cached_tokens"),
    CompletionDelta: ("index", "new_token_ids", "new_text", "logprobs", "finish_reason",
                      "stop_reason"),
    TokenLogprob: ("token_id", "token", "logprob", "top"),
}  # fmt: skip
