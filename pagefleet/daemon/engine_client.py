"""The HTTP process's handle on an engine running in its own process (engine_core.py).

``EngineClient`` offers what the daemon uses of ``EngineLoop`` (requests in, a stream of
outputs per request, named calls, P/D reservations, the KV export source), so serving,
P/D and the publisher run unchanged over either. Outputs, stats and KV events arrive on a
reader thread, which hands each message to the event loop in order.

The engine process is started with the ``forkserver`` method: a fork of a clean server
process that preloaded torch and the engine (fast to start, and never a fork of this
process's threads and event loop).

Invariants:
- each request id has at most one live RequestStream, fed in engine order, then removed;
- when the engine process ends for any reason but ``stop``, every live stream and pending
  call gets EngineDeadError, ``dead`` is set and ``on_death(exitcode)`` runs once: the
  daemon exits non-zero instead of serving errors forever;
- when it has work but sends nothing for ``config.engine_hang_timeout_s`` (liveness.py),
  it is hung: ``hung_reason`` is set, ``alive`` turns false (/health fails) and the process
  is killed, which ends it as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

from pagefleet.daemon import engine_core, ipc
from pagefleet.daemon.engine_loop import EngineDeadError, EngineLoop, RequestStream, StreamItem
from pagefleet.daemon.engine_protocol import EngineStatsLike
from pagefleet.daemon.kv_stage import KVStage, stage_bytes
from pagefleet.daemon.kv_transfer import KVSource
from pagefleet.daemon.liveness import SilenceClock, check_period
from pagefleet.daemon.text_outputs import RequestText, decodable_here, engine_params
from pagefleet.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Imported by the fork server once, so each engine process starts without importing torch.
_PRELOAD = ["pagefleet.daemon.engine_core", "pagefleet.engine.engine"]


class EngineClient:
    """An engine in a child process, driven from the event loop (not thread-safe)."""

    def __init__(
        self,
        config: Any,
        loop: asyncio.AbstractEventLoop,
        on_step: Callable[[EngineStatsLike], None] | None = None,
        on_events: Callable[[Any], None] | None = None,
        on_death: Callable[[int | None], None] | None = None,
        factory: Callable[..., Any] | None = None,
    ) -> None:
        """``factory(config, event_sink)`` builds the engine in the child; it must pickle by
        reference (a module-level function); None: the daemon's default engine."""
        self._config = config
        self._loop = loop
        self._on_step = on_step
        self._on_events = on_events
        self._on_death = on_death
        self._factory = factory
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[int, tuple[asyncio.Future[Any], Callable[[Any], None] | None]] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()  # stop() sends from an executor thread
        self._conn: Any = None
        self._proc: Any = None
        self._stopping = False
        self.info: ipc.EngineInfo | None = None
        self.loaded = asyncio.Event()
        self.load_error: BaseException | None = None
        self.dead = False
        self.exitcode: int | None = None
        self.engine = None  # no engine object in this process
        self.latest_stats: Any = None
        self._silence = SilenceClock()
        # Requests whose text this process makes (text_outputs.py), by request id.
        self._texts: dict[str, RequestText] = {}
        self._outbox: list[tuple[Any, ...]] = []  # calls of this event-loop turn, unsent
        self.hung_reason: str | None = None  # set when the watchdog found it hung
        self.wire_error: str | None = None  # set when a message from it could not be read

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=engine_core.run,
            args=(child, self._config, self._factory),
            name="pagefleet-engine",
            daemon=True,
        )
        self._proc.start()
        child.close()  # only the child holds its end: its death closes the pipe
        self._conn = parent
        threading.Thread(target=self._read, name="engine-client-recv", daemon=True).start()
        self._schedule_watch()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return (
            not self.dead
            and self.hung_reason is None
            and self._proc is not None
            and self._proc.is_alive()
        )

    # -- hang watchdog (liveness.py) ------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Work handed to the engine process and not answered yet: live streams or calls."""
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
        logger.error("the engine process %s is hung (%s): killing it", self.pid, self.hung_reason)
        # Killing it (SIGKILL works on a stopped process too) closes the pipe: the death path
        # then fails every stream and call and makes the daemon exit non-zero.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._proc.kill()

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
        await self.loaded.wait()
        if self.load_error is not None:
            raise self.load_error

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the engine process to exit after its current step; kill it past ``timeout``.
        Blocks (the daemon calls it from a worker thread)."""
        self._stopping = True
        if self._proc is None:
            return
        with contextlib.suppress(EngineDeadError):
            self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("engine process %d did not stop in %ss; killing it", self.pid, timeout)
            self._proc.kill()
            self._proc.join(5)
        with contextlib.suppress(OSError):
            self._conn.close()

    # -- requests --------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_id: str | None = None,
        queue: asyncio.Queue[StreamItem | BaseException] | None = None,
        admit: Any = None,
        kv_export: bool = False,
    ) -> RequestStream:
        """As ``EngineLoop.add_request``; ``admit`` is not supported across processes."""
        if admit is not None:
            raise TypeError("an engine in another process takes named calls, not callables")
        if kv_export:
            return await self._admit(
                request_id, queue, "add_export", (request_id, prompt, params, lora_id)
            )
        text = None
        if self.info is not None and decodable_here(prompt, params):
            # Decoded in this process: the engine's core never spends a step on text.
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
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        stream = RequestStream(request_id) if queue is None else RequestStream(request_id, queue)
        self._note_work()
        self._streams[request_id] = stream  # before the engine can emit: nothing orphaned
        if text is not None:
            self._texts[request_id] = text
        try:
            await self._call(method, args)
        except BaseException:
            self._streams.pop(request_id, None)
            self._texts.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._texts.pop(request_id, None)
        if self._streams.pop(request_id, None) is None:
            return
        self._post("abort", (request_id,))

    def abort_all(self) -> int:
        """Abort every live request; their final "abort" outputs still reach the handlers."""
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
        """``engine.method(*args)`` in the engine process, for the methods it allows."""
        return await self._call(method, args)

    async def snapshot_cached_blocks(self, deliver: Callable[[set[int]], None]) -> None:
        """``deliver(cached block set)``, called on the event loop in order with the KV
        events (those emitted before the snapshot were handed on before it)."""
        await self._call("snapshot", (), on_reply=deliver)

    async def reserve_import(self, request_id: str, prompt: list[int], lora_id: str | None) -> Any:
        return await self._call("reserve_import", (request_id, prompt, lora_id))

    async def add_import(
        self,
        request_id: str,
        plan: Any,
        kv: Any,
        params: SamplingParams,
        queue: asyncio.Queue[StreamItem | BaseException],
        stage: KVStage | None = None,
    ) -> RequestStream:
        """Commit a pulled reservation; with ``stage`` (the pull landed in shared memory,
        ``new_stage``) only its path crosses the pipe, else the bytes of ``kv`` do."""
        payload = (
            ("stage", stage.path, plan.num_pull_blocks) if stage is not None else _kv_bytes(kv)
        )
        return await self._admit(request_id, queue, "commit_import", (plan.key, payload, params))

    def new_stage(self, nbytes: int) -> KVStage | None:
        """A shared-memory stage for ``nbytes`` of pulled KV (None: use the pipe)."""
        where = getattr(self._config, "kv_stage_dir", "")
        return KVStage.create(nbytes, where) if where else None

    def post_cancel_import(self, plan: Any) -> None:
        self._post("cancel_import", (plan.key,))

    def post_collect_transfers(self) -> None:
        self._post("collect_transfers", ())

    def kv_layout(self) -> Any:
        return self.loaded_engine.kv_layout

    def kv_source(self) -> KVSource | None:
        if self.info is None or not self.info.has_exports:
            return None
        return ClientKVSource(self)

    def exports_expired_total(self) -> float:
        s = self.latest_stats
        return float(getattr(s, "kv_exports_expired_total", 0)) if s is not None else 0.0

    def exports_live(self) -> float:
        s = self.latest_stats
        return float(getattr(s, "kv_exports_live", 0)) if s is not None else 0.0

    async def export_block_ids(self, handle: str) -> list[int]:
        return await self.side("export_block_ids", handle)

    async def export_handles(self) -> list[str]:
        """Live transfer handles (P/D prefill), for tests and debugging."""
        return await self.side("export_handles")

    async def side(self, method: str, *args: Any) -> Any:
        """A call the engine process answers off its engine thread (exported KV reads)."""
        return await self._call(method, args, kind="side")

    # -- the wire --------------------------------------------------------------------------

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self.dead or self._conn is None:
            raise EngineDeadError("the engine is not running; retry on another replica")
        data = ipc.dumps(msg)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError as exc:
            raise EngineDeadError(f"the engine process is gone: {exc}") from None

    def _post(self, method: str, args: tuple[Any, ...]) -> None:
        if not self.dead:
            self._queue_call((None, method, args))

    # Calls made in one turn of the event loop leave as one message ("calls"): a burst of
    # requests (64 arriving at once) costs the engine process one wake-up and one read,
    # not 64, and they all join the same step, as they would offline.

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
        if self.dead or self._conn is None:
            raise EngineDeadError("the engine is not running; retry on another replica")
        call_id = next(self._ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._note_work()
        self._pending[call_id] = (fut, on_reply)
        if kind == "call":
            self._queue_call((call_id, method, args))
            return await fut
        try:
            self._send((kind, call_id, method, args))
        except BaseException:
            self._pending.pop(call_id, None)
            raise
        return await fut

    def _read(self) -> None:
        """Reader thread: every message to the event loop, in order; then the pipe's end."""
        while True:
            try:
                msg = ipc.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            except Exception as exc:
                # A message this process cannot read (e.g. the engine process runs other
                # code than this one, after a partial upgrade): without this thread nothing
                # more arrives, so end the engine and take the death path, loudly.
                logger.error("cannot read the engine process's message (%r); stopping it", exc)
                self.wire_error = f"it sent a message this process cannot read: {exc!r}"
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    self._proc.kill()
                break
            self._silence.heard(time.monotonic())
            if not self._hand_over(self._dispatch, msg):
                return
        if self._proc is not None:
            self._proc.join(5)
            self.exitcode = self._proc.exitcode
        self._hand_over(self._gone, None)

    def _hand_over(self, fn: Callable[[Any], None], arg: Any) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            return False  # the event loop closed: nobody is listening any more
        return True

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "step":
            _, outputs, t, stats = msg
            self.latest_stats = stats
            streams, texts = self._streams, self._texts
            for out in ipc.unpack_outputs(outputs):
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
            if self._on_step is not None:
                try:
                    self._on_step(stats)
                except Exception:
                    logger.exception("on_step callback failed")
        elif kind == "events":
            if self._on_events is not None:
                for batch in msg[1]:
                    self._on_events(batch)
        elif kind == "reply":
            _, call_id, ok, value = msg
            fut, on_reply = self._pending.pop(call_id, (None, None))
            if fut is None or fut.done():
                return
            if not ok:
                fut.set_exception(value.exception())
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
            logger.error("the engine process crashed: %s", msg[1])

    def _gone(self, _: Any) -> None:
        """The pipe closed: the engine process exited (stopped, crashed, or was killed)."""
        was_dead = self.dead
        self.dead = True
        why = f"; {self.wire_error}" if self.wire_error else ""
        err = EngineDeadError(
            "the engine stopped" if self._stopping
            else f"the engine process died (exit code {self.exitcode}){why}"
        )  # fmt: skip
        for stream in self._streams.values():
            stream.queue.put_nowait(err)
        self._streams.clear()
        self._texts.clear()
        for fut, _cb in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        if not self.loaded.is_set():
            self.load_error = err
            self.loaded.set()
        if self._stopping or was_dead:
            return
        logger.error("the engine process %s died (exit code %s)", self.pid, self.exitcode)
        if self._on_death is not None:
            self._on_death(self.exitcode)


class ClientKVSource(KVSource):
    """Exported KV read in the engine process, off its engine thread (``side`` calls)."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def layout(self) -> Any:
        return self._client.kv_layout()

    async def acquire(self, handle: str) -> Any:
        return await self._client.side("acquire", handle)

    async def read_layer(self, block_ids: list[int], layer: int) -> tuple[Any, Any]:
        return await self._client.side("read_layer", block_ids, layer)

    async def read_stage(self, block_ids: list[int]) -> KVStage | None:
        """Every layer's K and V of ``block_ids`` in one shared-memory stage, filled by the
        engine process in one call (None: no shared memory here; use ``read_layer``). The
        caller closes it."""
        stage = self._client.new_stage(stage_bytes(self.layout(), len(block_ids)))
        if stage is None:
            return None
        try:
            await self._client.side("export_to_stage", block_ids, stage.path)
        except BaseException:
            stage.close()
            raise
        return stage

    def release(self, handle: str, consumed: bool) -> None:
        # Side calls run in arrival order of their threads; a release needs no answer.
        with contextlib.suppress(EngineDeadError):
            self._client._send(("side", next(self._client._ids), "release", (handle, consumed)))


def _kv_bytes(kv: Any) -> Any:
    """A PulledKV as bytes for the pipe (no torch here); engine_core rebuilds tensors."""
    if kv is None:
        return None
    return kv.dtype, kv.shape, [(bytes(k), bytes(v)) for k, v in kv.parts()]


# What the daemon drives: an engine thread in this process, or an engine process.
EngineHandle = EngineLoop | EngineClient
