"""The engine thread and its bridge to asyncio.

The engine is single-threaded (docs/internals.md): only the thread that calls ``step()`` may
touch it. So every call from the event loop (add a request, abort one, read a snapshot) is a
command on a thread-safe queue that the engine thread drains between steps, and every result
travels back with ``loop.call_soon_threadsafe``. The engine thread steps while there is work
and blocks on a condition variable when idle; the event loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagefleet.daemon.engine_protocol import EngineLike, EngineStatsLike
from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (crash or shutdown); the request cannot complete."""


@dataclass(slots=True)
class StreamItem:
    """One engine output for a request, stamped when the engine thread handed it over."""

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


@dataclass(slots=True)
class _Command:
    fn: Callable[[EngineLike], Any]
    future: asyncio.Future[Any] | None  # None: fire and forget (abort)


class EngineLoop:
    """Runs an engine in a dedicated thread; the asyncio API is safe from the event loop only.

    Invariant: each request id has at most one live RequestStream, which receives every
    output of its request in engine order and is then removed; if the engine thread dies,
    every live stream receives EngineDeadError (no waiter hangs).
    """

    def __init__(
        self,
        engine_factory: Callable[[], EngineLike],
        loop: asyncio.AbstractEventLoop,
        on_step: Callable[[EngineStatsLike], None] | None = None,
        name: str = "pagefleet-engine",
    ) -> None:
        self._factory = engine_factory
        self._loop = loop
        self._on_step = on_step
        self._cv = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # touched on the event loop only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.engine: EngineLike | None = None  # set once loaded; read-only outside the thread
        self.loaded = asyncio.Event()
        self.load_error: BaseException | None = None
        self.dead = False

    # -- event-loop side ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.dead

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def loaded_engine(self) -> EngineLike:
        """The engine, for its fixed attributes (tokenizer, max_model_len) only; every call
        that reads or changes its state goes through ``call``. Raises before it loaded."""
        if self.engine is None:
            raise RuntimeError("the engine has not loaded yet; await wait_loaded() first")
        return self.engine

    async def wait_loaded(self) -> None:
        """Wait for the engine to finish loading; re-raise the load error if it failed."""
        await self.loaded.wait()
        if self.load_error is not None:
            raise self.load_error

    async def call(self, fn: Callable[[EngineLike], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        fut: asyncio.Future[T] = self._loop.create_future()
        self._push(_Command(fn, fut))
        return await fut

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_id: str | None = None,
        queue: asyncio.Queue[StreamItem | BaseException] | None = None,
        admit: Callable[[Any], None] | None = None,
        kv_export: bool = False,
    ) -> RequestStream:
        """Admit a request; its outputs flow into the returned stream.

        Several requests may share one ``queue`` (an HTTP request with many prompts reads
        them merged). Raises ValueError (from the engine: prompt too long, empty, duplicate
        id) without admitting anything. ``admit(engine)``, when given, admits the request
        instead of ``add_request`` (P/D: a committed import), under the same id.
        ``kv_export``: keep the prompt's KV for a decode pod to pull (P/D prefill).
        """
        if admit is None and kv_export:

            def admit(eng: Any) -> None:
                eng.add_request(request_id, prompt, params, lora_id=lora_id, kv_export=True)

        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        stream = RequestStream(request_id) if queue is None else RequestStream(request_id, queue)
        # Register before the engine can emit, so no output is ever orphaned.
        self._streams[request_id] = stream
        if admit is None:

            def admit(eng: Any) -> None:
                eng.add_request(request_id, prompt, params, lora_id=lora_id)

        try:
            await self.call(admit)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    # -- named calls: the surface EngineClient (engine in its own process) shares --------

    async def stats(self) -> EngineStatsLike:
        return await self.call(lambda eng: eng.stats())

    async def reset_prefix_cache(self) -> None:
        await self.call(lambda eng: eng.reset_prefix_cache())

    async def cached_block_hashes(self) -> set[int]:
        return await self.call(lambda eng: set(eng.cached_block_hashes()))

    async def invoke(self, method: str, *args: Any) -> Any:
        """``engine.method(*args)`` on the engine thread (tests, debugging)."""
        return await self.call(lambda eng: getattr(eng, method)(*args))

    async def snapshot_cached_blocks(self, deliver: Callable[[set[int]], None]) -> None:
        """Call ``deliver(cached block set)`` on the engine thread, between two steps: it
        lands after every KV event the engine emitted before it, before any after it."""
        await self.call(lambda eng: deliver(set(eng.cached_block_hashes())))

    async def reserve_import(self, request_id: str, prompt: list[int], lora_id: str | None) -> Any:
        return await self.call(lambda eng: eng.reserve_import(request_id, prompt, lora_id))

    async def add_import(
        self,
        request_id: str,
        plan: Any,
        kv: Any,
        params: SamplingParams,
        queue: asyncio.Queue[StreamItem | BaseException],
        stage: Any = None,
    ) -> RequestStream:
        """Commit a pulled KV reservation (``kv``: a PulledKV, None when nothing was pulled)
        and start its request (P/D decode). ``stage`` is for an engine in another process;
        this one reads ``kv``'s buffer directly."""
        tensors = None if kv is None else kv.tensors()
        return await self.add_request(
            request_id, plan.token_ids, params, queue=queue,
            admit=lambda eng: eng.commit_import(plan, tensors, params),
        )  # fmt: skip

    def post_cancel_import(self, plan: Any) -> None:
        self.post(lambda eng: eng.cancel_import(plan))

    def new_stage(self, nbytes: int) -> None:
        """No shared-memory stage: the engine is in this process and reads the tensors."""
        return None

    def post_collect_transfers(self) -> None:
        if self.engine is not None and hasattr(self.engine, "collect_transfers"):
            self.post(lambda eng: eng.collect_transfers())

    def kv_layout(self) -> Any:
        return self.loaded_engine.runner.kv_layout()  # type: ignore[attr-defined]

    def kv_source(self) -> Any:
        """The loaded engine: the KV export server reads it in this process."""
        return self.engine

    def exports_expired_total(self) -> float:
        exports = getattr(self.engine, "exports", None)  # engines without P/D: none
        return float(exports.expired_total) if exports is not None else 0.0

    def exports_live(self) -> float:
        exports = getattr(self.engine, "exports", None)
        return float(len(exports)) if exports is not None else 0.0

    async def export_block_ids(self, handle: str) -> list[int]:
        """The blocks a transfer handle pins (empty if gone), read without consuming it."""
        exports = getattr(self.engine, "exports", None)
        entry = None if exports is None else exports.acquire(handle, float("-inf"))
        if entry is None:
            return []
        try:
            return list(entry.block_ids)
        finally:
            exports.release(handle, consumed=False)

    async def export_handles(self) -> list[str]:
        """Live transfer handles (P/D prefill), for tests and debugging."""
        exports = getattr(self.engine, "exports", None)
        return [] if exports is None else exports.handles()

    @property
    def pid(self) -> int:
        return os.getpid()

    def post(self, fn: Callable[[Any], Any]) -> None:
        """Run ``fn(engine)`` on the engine thread, fire and forget (also from cleanup
        paths that cannot await, e.g. a cancelled handler releasing a KV reservation)."""
        self._push(_Command(fn, None))

    def abort(self, request_id: str) -> None:
        """Abort a request if still live; its blocks return to the pool on the next step."""
        if self._streams.pop(request_id, None) is None:
            return
        self._push(_Command(lambda eng: eng.abort(request_id), None))

    def abort_all(self) -> int:
        """Abort every live request (shutdown past its grace); returns how many.

        Unlike ``abort``, the streams stay registered: the engine's final "abort" outputs
        reach their handlers, which then end their responses properly.
        """
        rids = list(self._streams)
        for rid in rids:
            self._push(_Command(lambda eng, rid=rid: eng.abort(rid), None))
        return len(rids)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread after its current step; live streams get EngineDeadError."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._fail_all(EngineDeadError("the engine stopped"))

    def _push(self, cmd: _Command) -> None:
        # ``dead`` is read and set under the condition's lock: a command appended after the
        # thread's last drain would otherwise never be answered and its caller would hang.
        with self._cv:
            if not self.dead:
                self._commands.append(cmd)
                self._cv.notify()
                return
        err = EngineDeadError("the engine is not running; retry on another replica")
        if cmd.future is not None:
            cmd.future.set_exception(err)

    def _deliver(self, items: list[tuple[str, StreamItem]]) -> None:
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is None:
                continue  # aborted by the caller; late outputs are dropped
            stream.queue.put_nowait(item)
            if item.output.finished:
                del self._streams[rid]

    def _fail_all(self, err: BaseException) -> None:
        def fail() -> None:
            for stream in self._streams.values():
                stream.queue.put_nowait(err)
            self._streams.clear()

        if self._loop.is_closed():
            return
        try:
            if _running_loop() is self._loop:
                fail()
            else:
                self._loop.call_soon_threadsafe(fail)
        except RuntimeError:
            pass  # the loop closed meanwhile; nobody is waiting any more

    # -- engine-thread side ---------------------------------------------------------------

    def _resolve(self, fut: asyncio.Future[Any] | None, result: Any, exc: BaseException | None):
        if fut is None:
            return

        def settle() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(settle)

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:  # loading failed: report it, do not hang waiters
            logger.exception("engine failed to load")
            self.load_error = exc
            self._drain_commands_with(EngineDeadError(f"the engine failed to load: {exc}"))
            self._loop.call_soon_threadsafe(self.loaded.set)
            return
        self.engine = engine
        self._loop.call_soon_threadsafe(self.loaded.set)
        try:
            self._serve(engine)
        except BaseException as exc:
            logger.exception("engine thread crashed; failing all in-flight requests")
            self._drain_commands_with(EngineDeadError(f"the engine crashed: {exc}"))
            self._fail_all(EngineDeadError(f"the engine crashed: {exc}"))
            return
        self._drain_commands_with(EngineDeadError("the engine stopped"))

    def _drain_commands_with(self, err: BaseException) -> None:
        """Mark the loop dead and answer every queued command with ``err``; one lock hold,
        so no command can slip in between (``_push`` checks ``dead`` under it)."""
        with self._cv:
            self.dead = True
            pending = list(self._commands)
            self._commands.clear()
        for cmd in pending:
            self._resolve(cmd.future, None, err)

    def _serve(self, engine: EngineLike) -> None:
        while True:
            with self._cv:
                # Block only when there is nothing to step and nothing to do: no busy spin.
                while not self._commands and not self._stopping and not engine.has_unfinished():
                    self._cv.wait()
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for cmd in commands:
                try:
                    result = cmd.fn(engine)
                except Exception as exc:  # the caller's error (e.g. ValueError): hand it back
                    self._resolve(cmd.future, None, exc)
                else:
                    self._resolve(cmd.future, result, None)
            if not engine.has_unfinished():
                if commands:  # e.g. an abort emptied the engine: publish the new load
                    self._loop.call_soon_threadsafe(self._after_step, [], engine.stats())
                continue
            outputs = engine.step()
            now = time.monotonic()
            stats = engine.stats()
            items = [(o.request_id, StreamItem(o, now)) for o in outputs]
            # One hop per step keeps cross-thread wakeups at one per step, not per request.
            self._loop.call_soon_threadsafe(self._after_step, items, stats)

    def _after_step(self, items: list[tuple[str, StreamItem]], stats: EngineStatsLike) -> None:
        self._deliver(items)
        if self._on_step is not None:
            try:
                self._on_step(stats)
            except Exception:
                logger.exception("on_step callback failed")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
