"""The HTTP side's handle on the engine, wherever it runs.

The engine's side is one ``EngineCore`` (engine_core.py), run either in a process of its
own (engine_client.py, the default) or on a thread of this process (engine_loop.py). Both
speak the same messages (ipc.py); ``EngineHandle`` is everything on this side that does not
depend on where the engine runs: the live request streams, admitting and aborting requests,
the engine's named calls, delivering each step's outputs, text made on this side
(text_outputs.py), failing every waiter when the engine ends, and the hang watchdog
(liveness.py). A subclass supplies the transport (``_send``), starts and stops the engine,
and says how a hung engine is ended (``_end_hung``).

Messages from the engine reach ``_dispatch`` on the event loop, in engine order; the end of
the engine reaches ``_gone`` once. Not thread-safe: call it from the event loop only.

Invariants:
- each request id has at most one live RequestStream, fed in engine order, then removed;
- a request the engine admits for a caller cancelled before the reply is aborted: the
  engine never runs a request that no stream reads;
- when the engine ends for any reason but ``stop``, every live stream and pending call gets
  EngineDeadError, ``dead`` is set and ``on_death(exitcode)`` runs once: the daemon exits
  non-zero instead of serving errors forever;
- when it has work but sends nothing for ``config.engine_hang_timeout_s``, it is hung:
  ``hung_reason`` is set, ``alive`` turns false (/health fails) and ``_end_hung`` ends it,
  which ends it as above.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagefleet.daemon import ipc
from pagefleet.daemon.engine_protocol import EngineStatsLike
from pagefleet.daemon.liveness import SilenceClock, check_period
from pagefleet.daemon.text_outputs import RequestText, decodable_here, engine_params
from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def killed_by(signum: int) -> str:
    """What a process's death by ``signum`` most likely means, and what to do about it."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = "an unknown signal"
    what = f"killed by signal {signum} ({name})"
    if signum != signal.SIGKILL:
        return what
    # Nobody on the pod sends SIGKILL but the kernel's out-of-memory killer (the kubelet's
    # would end the whole container, this process with it): the model, its activations
    # and the KV pool did not fit the memory limit.
    return (
        f"{what}, probably out of memory (the kernel's OOM killer): lower --max-model-len "
        "and the KV pool (--kv-cache-memory-mb, --num-gpu-blocks or "
        "--gpu-memory-utilization), raise the memory limit, or pick a smaller model"
    )


class EngineDeadError(RuntimeError):
    """The engine stopped (crash, hang or shutdown); the request cannot complete."""


@dataclass(slots=True)
class StreamItem:
    """One engine output for a request, stamped when the engine handed it over."""

    output: RequestOutput
    t: float  # time.monotonic() at hand-over, for inter-token latency


@dataclass(slots=True)
class RequestStream:
    """The asyncio side of one engine request: outputs arrive in order, then it finishes."""

    request_id: str
    queue: asyncio.Queue[StreamItem | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False

    async def get(self) -> StreamItem:
        """Next output; raises EngineDeadError if the engine died before this request ended."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.output.finished:
            self.finished = True
        return item


class EngineHandle:
    """The engine as the event loop sees it; subclasses bring the transport."""

    # What the engine is called in messages to operators ("the engine process died").
    what = "the engine"
    # Whether text of requests without stop strings is made here (text_outputs.py): worth
    # it only when the engine runs in another process (the GIL is not shared).
    decodes_text = False
    # Whether step outputs arrive packed as tuples (ipc.pack_outputs: across a pipe).
    packed = False

    def __init__(
        self,
        config: Any,
        loop: asyncio.AbstractEventLoop,
        factory: Callable[..., Any] | None = None,
        on_step: Callable[[EngineStatsLike], None] | None = None,
        on_events: Callable[[Any], None] | None = None,
        on_death: Callable[[int | None], None] | None = None,
    ) -> None:
        """``factory(config, event_sink)`` builds the engine where it runs (None: the
        daemon's default engine); ``on_step(stats)`` after each step, ``on_events(batch)``
        for each KV event batch, ``on_death(exitcode)`` once if the engine ends unasked;
        all on the event loop."""
        self._config = config
        self._loop = loop
        self._factory = factory
        self._on_step = on_step
        self._on_events = on_events
        self._on_death = on_death
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[int, tuple[asyncio.Future[Any], Callable[[Any], None] | None]] = {}
        # "side" calls: answered on threads of their own, so neither their being outstanding
        # nor their replies say anything of the engine thread (the hang watchdog's subject).
        self._side_pending: dict[int, tuple[asyncio.Future[Any], Callable[[Any], None] | None]] = {}
        self._ids = itertools.count()
        self._texts: dict[str, RequestText] = {}  # requests whose text is made here
        self._outbox: list[tuple[Any, ...]] = []  # calls of this event-loop turn, unsent
        self._silence = SilenceClock()
        self._stopping = False
        self._crash: str | None = None  # what the engine said when its loop raised
        self.info: ipc.EngineInfo | None = None
        self.loaded = asyncio.Event()
        self.load_error: BaseException | None = None
        self.dead = False
        self.exitcode: int | None = None
        self.latest_stats: Any = None
        self.hung_reason: str | None = None  # set when the watchdog found it hung

    # -- what subclasses provide -----------------------------------------------------------

    def _send(self, msg: tuple[Any, ...]) -> None:
        """Hand ``msg`` to the engine; EngineDeadError when it cannot be."""
        raise NotImplementedError

    def _running(self) -> bool:
        """Whether the engine's process or thread still runs."""
        raise NotImplementedError

    def _end_hung(self) -> None:
        """End an engine found hung, so that ``_gone`` follows."""
        raise NotImplementedError

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self.dead and self.hung_reason is None and self._running()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def loaded_engine(self) -> ipc.EngineInfo:
        """The engine's fixed attributes (tokenizer, max_model_len); raises before loaded."""
        if self.info is None:
            raise RuntimeError("the engine has not loaded yet; await wait_loaded() first")
        return self.info

    async def wait_loaded(self) -> None:
        """Wait for the engine to finish loading; raise the load error if it failed."""
        await self.loaded.wait()
        if self.load_error is not None:
            raise self.load_error

    # -- hang watchdog (liveness.py) ------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Work handed to the engine thread and not answered yet: live streams or calls
        (side calls are not its work)."""
        return bool(self._streams or self._pending)

    def _note_work(self) -> None:
        """Call before registering new work: starts the silence clock of a busy spell."""
        if not self.busy:
            self._silence.work_started(time.monotonic())

    def _schedule_watch(self) -> None:
        timeout = float(getattr(self._config, "engine_hang_timeout_s", 0.0) or 0.0)
        if timeout > 0 and not (self.dead or self._stopping):
            self._loop.call_later(check_period(timeout), self._watch, timeout)

    def _watch(self, timeout: float) -> None:
        if self.dead or self._stopping or self.hung_reason is not None:
            return
        if self.loaded.is_set():  # loading may take minutes: only a loaded engine can hang
            silent = self._silence.silent_for(time.monotonic(), self.busy)
            if silent > timeout:
                self._declare_hung(silent)
                return
        self._schedule_watch()

    def _declare_hung(self, silent: float) -> None:
        self.hung_reason = (
            f"no step or reply for {silent:.1f}s with {len(self._streams)} requests and "
            f"{len(self._pending)} calls outstanding; limit --engine-hang-timeout"
        )
        logger.error("%s (pid %s) is hung (%s): ending it", self.what, self.pid, self.hung_reason)
        self._end_hung()

    @property
    def pid(self) -> int | None:
        return None if self.info is None else self.info.pid

    # -- requests --------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_id: str | None = None,
        queue: asyncio.Queue[StreamItem | BaseException] | None = None,
        kv_export: bool = False,
        export_stage: str | None = None,
    ) -> RequestStream:
        """Admit a request; its outputs flow into the returned stream.

        Several requests may share one ``queue`` (an HTTP request with many prompts reads
        them merged). Raises ValueError (from the engine: prompt too long, empty, duplicate
        id) without admitting anything. ``kv_export``: keep the prompt's KV for a decode pod
        to pull (P/D prefill).
        """
        if kv_export:
            # ``export_stage``: a shared-memory stage (kv_stage.py) the engine fills with the
            # prompt's KV as it finishes, so that a pull only streams it out.
            args = (request_id, prompt, params, lora_id, export_stage)
            return await self._admit(request_id, queue, "add_export", args)
        text = None
        if self.decodes_text and self.info is not None and decodable_here(prompt, params):
            # Decoded here: the engine's core never spends a step on text.
            text = RequestText(self.info.tokenizer, prompt, params)  # type: ignore[arg-type]
            params = engine_params(params)
        return await self._admit(
            request_id, queue, "add_request", (request_id, prompt, params, None, lora_id), text
        )

    async def _admit(
        self,
        request_id: str,
        queue: asyncio.Queue[StreamItem | BaseException] | None,
        method: str,
        args: tuple[Any, ...],
        text: RequestText | None = None,
    ) -> RequestStream:
        """Register ``request_id``'s stream and admit it with the engine's ``method``. A
        caller cancelled before the engine's reply leaves nothing running: the request is
        aborted once admitted."""
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        stream = RequestStream(request_id) if queue is None else RequestStream(request_id, queue)
        self._note_work()
        self._streams[request_id] = stream  # before the engine can emit: nothing orphaned
        if text is not None:
            self._texts[request_id] = text
        try:
            call = self._start_call(method, args)
        except BaseException:
            self._streams.pop(request_id, None)
            self._texts.pop(request_id, None)
            raise
        try:
            # Shielded: once sent, the engine admits the request whatever becomes of this
            # await. A caller cancelled meanwhile (its client went away) never gets the
            # stream to abort, so the request is aborted here once the engine has admitted
            # it. Not before: an abort that arrives first finds nothing, and an import's
            # deferred write-and-commit would then start the request anyway.
            await asyncio.shield(call)
        except BaseException as exc:
            self._streams.pop(request_id, None)
            self._texts.pop(request_id, None)
            if isinstance(exc, asyncio.CancelledError):
                call.add_done_callback(functools.partial(self._abort_admitted, request_id))
            raise
        return stream

    def _abort_admitted(self, request_id: str, call: asyncio.Future[Any]) -> None:
        """``call`` admitted ``request_id`` for a caller that was cancelled meanwhile: abort
        the request, which nobody reads (no-op if the engine refused it or ended)."""
        if not call.cancelled() and call.exception() is None:
            self._post("abort", (request_id,))

    def abort(self, request_id: str) -> None:
        """Abort a request if still live; its blocks return to the pool on the next step."""
        self._texts.pop(request_id, None)
        if self._streams.pop(request_id, None) is None:
            return
        self._post("abort", (request_id,))

    def abort_all(self) -> int:
        """Abort every live request (shutdown past its grace); returns how many.

        Unlike ``abort``, the streams stay registered: the engine's final "abort" outputs
        reach their handlers, which then end their responses properly.
        """
        rids = list(self._streams)
        for rid in rids:
            self._post("abort", (rid,))
        return len(rids)

    # -- named calls -----------------------------------------------------------------------

    async def stats(self) -> EngineStatsLike:
        return await self._call("stats", ())

    async def reset_prefix_cache(self) -> None:
        await self._call("reset_prefix_cache", ())

    async def cached_block_hashes(self) -> set[int]:
        return await self._call("snapshot", ())

    async def invoke(self, method: str, *args: Any) -> Any:
        """``engine.method(*args)`` on the engine thread, for the methods it allows."""
        return await self._call(method, args)

    async def snapshot_cached_blocks(self, deliver: Callable[[set[int]], None]) -> None:
        """``deliver(cached block set)``, called on the event loop in order with the KV
        events (those emitted before the snapshot were handed on before it)."""
        await self._call("snapshot", (), on_reply=deliver)

    async def reserve_import(self, request_id: str, prompt: list[int], lora_id: str | None) -> Any:
        """Reserve blocks for a pulled prompt (None: none free). A caller cancelled before
        the reply leaves no reservation: the plan the late reply brings is cancelled (it
        would hold its blocks to the deadline and stay in the engine's plan table)."""
        call = self._start_call("reserve_import", (request_id, prompt, lora_id))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._cancel_late_plan)
            raise

    def _cancel_late_plan(self, call: asyncio.Future[Any]) -> None:
        if not call.cancelled() and call.exception() is None and call.result() is not None:
            self.post_cancel_import(call.result())

    def post_cancel_import(self, plan: Any) -> None:
        self._post("cancel_import", (plan.key,))

    def post_release_export(self, handle: str) -> None:
        """Free transfer handle ``handle`` (no-op if gone; a running read keeps it to its end)."""
        self._post("release_export", (handle,))

    def post_collect_transfers(self) -> None:
        self._post("collect_transfers", ())

    def exports_expired_total(self) -> float:
        s = self.latest_stats
        return float(getattr(s, "kv_exports_expired_total", 0)) if s is not None else 0.0

    def exports_live(self) -> float:
        s = self.latest_stats
        return float(getattr(s, "kv_exports_live", 0)) if s is not None else 0.0

    async def export_block_ids(self, handle: str) -> list[int]:
        """The blocks a transfer handle pins (empty if gone), read without consuming it."""
        return await self.side("export_block_ids", handle)

    async def export_handles(self) -> list[str]:
        """Live transfer handles (P/D prefill), for tests and debugging."""
        return await self.side("export_handles")

    async def side(self, method: str, *args: Any) -> Any:
        """A call the engine's side answers off its engine thread (exported KV reads)."""
        return await self._call(method, args, kind="side")

    # -- the wire --------------------------------------------------------------------------

    def _post(self, method: str, args: tuple[Any, ...]) -> None:
        if not self.dead:
            self._queue_call((None, method, args))

    # Calls made in one turn of the event loop leave as one message ("calls"): a burst of
    # requests (64 arriving at once) costs the engine one wake-up and one read, not 64, and
    # they all join the same step, as they would offline.

    def _queue_call(self, call: tuple[Any, ...]) -> None:
        self._outbox.append(call)
        if len(self._outbox) == 1:
            self._loop.call_soon(self._flush_calls)

    def _flush_calls(self) -> None:
        calls, self._outbox = self._outbox, []
        if not calls:
            return
        try:
            self._send(("call", *calls[0]) if len(calls) == 1 else ("calls", calls))
        except EngineDeadError as exc:
            for call_id, _method, _args in calls:
                fut, _cb = self._pending.pop(call_id, (None, None))
                if fut is not None and not fut.done():
                    fut.set_exception(exc)

    async def _call(
        self,
        method: str,
        args: tuple[Any, ...],
        on_reply: Callable[[Any], None] | None = None,
        kind: str = "call",
    ) -> Any:
        return await self._start_call(method, args, on_reply, kind)

    def _start_call(
        self,
        method: str,
        args: tuple[Any, ...],
        on_reply: Callable[[Any], None] | None = None,
        kind: str = "call",
    ) -> asyncio.Future[Any]:
        """Send a call ("call": with this turn's others; "side": now); the future gets its
        reply. Cancelling the future does not unsend the call: a caller whose call has
        effects to undo (``_admit``, ``acquire``) awaits it shielded."""
        if self.dead:
            raise EngineDeadError("the engine is not running; retry on another replica")
        call_id = next(self._ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
        if kind == "call":
            self._note_work()
            self._pending[call_id] = (fut, on_reply)
            self._queue_call((call_id, method, args))
            return fut
        self._side_pending[call_id] = (fut, on_reply)
        try:
            self._send((kind, call_id, method, args))
        except BaseException:
            self._side_pending.pop(call_id, None)
            raise
        return fut

    def _heard(self, msg: tuple[Any, ...]) -> None:
        """A message arrived from the engine (any thread: a float store). A side call's
        reply comes from a thread of its own and says nothing of the engine thread: a
        steady trickle of KV pulls must not keep a hung step looking alive."""
        if msg[0] != "side_reply":
            self._silence.heard(time.monotonic())

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        """One message from the engine, on the event loop, in engine order."""
        kind = msg[0]
        if kind == "step":
            _, outputs, t, stats = msg
            self.latest_stats = stats
            self._deliver(ipc.unpack_outputs(outputs) if self.packed else outputs, t)
            if self._on_step is not None:
                try:
                    self._on_step(stats)
                except Exception:
                    logger.exception("on_step callback failed")
        elif kind == "events":
            if self._on_events is not None:
                for batch in msg[1]:
                    self._on_events(batch)
        elif kind == "reply" or kind == "side_reply":
            _, call_id, ok, value = msg
            table = self._pending if kind == "reply" else self._side_pending
            fut, on_reply = table.pop(call_id, (None, None))
            if fut is None or fut.done():
                return
            if not ok:
                fut.set_exception(
                    value.exception() if isinstance(value, ipc.RemoteError) else value
                )
                return
            if on_reply is not None:
                on_reply(value)
            fut.set_result(value)
        elif kind == "ready":
            self.info = msg[1]
            self.loaded.set()
        elif kind == "load_error":
            self.load_error = RuntimeError(msg[1])
            self.dead = True
            self.loaded.set()
        elif kind == "crashed":
            self._crash = msg[1]
            logger.error("%s crashed: %s", self.what, msg[1])

    def _deliver(self, outputs: list[RequestOutput], t: float) -> None:
        streams, texts = self._streams, self._texts
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue  # aborted by the caller; late outputs are dropped
            text = texts.get(out.request_id)
            if text is not None:
                text.fill(out)
            stream.queue.put_nowait(StreamItem(out, t))
            if out.finished:
                del streams[out.request_id]
                if text is not None:
                    del texts[out.request_id]

    def end_reason(self) -> str:
        """Why the engine ended, for errors and the daemon's exit message."""
        if self.hung_reason is not None:
            return f"{self.what} hung ({self.hung_reason})"
        if self._crash is not None:
            return f"{self.what} crashed: {self._crash}"
        model = getattr(self._config, "model", "the model")
        when = "" if self.loaded.is_set() else f" while loading {model}"
        if self.exitcode is not None and self.exitcode < 0:
            return f"{self.what} died{when}: {killed_by(-self.exitcode)}"
        return f"{self.what} died{when} (exit code {self.exitcode})"

    def _gone(self, _: Any = None) -> None:
        """The engine ended (stopped, crashed, killed, or found hung): fail every waiter."""
        was_dead = self.dead
        self.dead = True
        err = EngineDeadError("the engine stopped" if self._stopping else self.end_reason())
        for stream in self._streams.values():
            stream.queue.put_nowait(err)
        self._streams.clear()
        self._texts.clear()
        for fut, _cb in [*self._pending.values(), *self._side_pending.values()]:
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._side_pending.clear()
        if not self.loaded.is_set():
            self.load_error = err
            self.loaded.set()
        if self._stopping or was_dead:
            return
        logger.error("%s (pid %s) ended: %s", self.what, self.pid, self.end_reason())
        if self._on_death is not None:
            self._on_death(self.exitcode)
