"""The HTTP process's handle on an engine running in its own process (engine_core.py).

``EngineClient`` is an ``EngineHandle`` (engine_handle.py: streams, calls, aborts, the hang
watchdog, shared with the engine thread of engine_loop.py) whose messages cross a pipe:
pickled by ipc.py, read here on a reader thread that hands each one to the event loop in
order. The pipe closing (the process exited, crashed or was killed) is the engine's end.

The engine process is started with the ``forkserver`` method: a fork of a clean server
process that preloaded torch and the engine (fast to start, and never a fork of this
process's threads and event loop). The server is started with this process's ``sys.path``
minus the working directory, so a stray module there cannot shadow ours in the engine.

A hung engine process (liveness.py) is killed: SIGKILL works on a stopped process too, and
closes the pipe, which takes the death path.

Writes to the pipe go through a writer thread, never the event loop: an engine process that
stops reading (stopped, deadlocked) would otherwise block the loop in a send once the
socket buffer filled, and with it the watchdog that kills such a process, /health and the
SIGTERM handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from pagefleet.daemon import engine_core, ipc
from pagefleet.daemon.engine_handle import EngineDeadError, EngineHandle, RequestStream, StreamItem
from pagefleet.daemon.kv_stage import KVStage, StagePool, stage_bytes
from pagefleet.daemon.kv_transfer import KVSource
from pagefleet.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Imported by the fork server once, so each engine process starts without importing torch.
_PRELOAD = ["pagefleet.daemon.engine_core", "pagefleet.engine.engine"]


class EngineClient(EngineHandle):
    """An engine in a child process, driven from the event loop (not thread-safe)."""

    what = "the engine process"
    decodes_text = True
    packed = True

    _conn: Any = None  # the pipe, once started
    _proc: Any = None  # the engine process, once started
    engine = None  # no engine object in this process
    wire_error: str | None = None  # set when a message from it could not be read

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        # Encoded messages for the writer thread, in send order; None ends it.
        self._out: queue.SimpleQueue[bytes | threading.Event | None] = queue.SimpleQueue()
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=engine_core.run,
            args=(child, self._config, self._factory),
            name="pagefleet-engine",
            daemon=True,
        )
        with _without_cwd_on_path():
            self._proc.start()
        child.close()  # only the child holds its end: its death closes the pipe
        self._conn = parent
        threading.Thread(target=self._read, name="engine-client-recv", daemon=True).start()
        threading.Thread(target=self._write, name="engine-client-send", daemon=True).start()
        self._schedule_watch()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _running(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def _end_hung(self) -> None:
        # SIGKILL works on a stopped process too; the pipe closes and _gone follows.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._proc.kill()

    def end_reason(self) -> str:
        why = super().end_reason()
        return f"{why}; {self.wire_error}" if self.wire_error else why

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the engine process to exit after its current step; kill it past ``timeout``.
        Blocks (the daemon calls it from a worker thread)."""
        self._stopping = True
        if self._proc is None:
            return
        t0 = time.monotonic()
        with contextlib.suppress(EngineDeadError):
            self._send(("stop",))
        # The stop must have left before the join: a process started by a fork server
        # that is itself gone (SIGTERM to the whole group) reads as ended at once, and the
        # engine would then never see the stop (the pipe closes below).
        written = threading.Event()
        self._out.put(written)
        written.wait(timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        self._proc.join(left)
        self._out.put(None)  # the writer ends
        if self._proc.is_alive():
            logger.warning("engine process %d did not stop in %ss; killing it", self.pid, timeout)
            self._proc.kill()
            self._proc.join(5)
        with contextlib.suppress(OSError):
            self._conn.close()

    # -- P/D: KV crosses as bytes or through a shared-memory stage -------------------------

    async def add_import(
        self,
        request_id: str,
        plan: Any,
        kv: Any,
        params: SamplingParams,
        queue: asyncio.Queue[StreamItem | BaseException],
        stage: KVStage | None = None,
        write_first: bool = False,
    ) -> RequestStream:
        """Commit a pulled reservation; with ``stage`` (the pull landed in shared memory,
        ``new_stage``) only its path crosses the pipe, else the bytes of ``kv`` do. With
        ``write_first`` (and a stage) the engine process copies the stage into the blocks
        on a side thread as the call arrives and commits at the first step boundary after
        the copy (engine_core ``write_commit_import``): no step waits for the copy."""
        if stage is not None and write_first:
            payload = ("stage", stage.path, plan.num_pull_blocks)
            args = (plan.key, payload, params)
            return await self._admit(request_id, queue, "write_commit_import", args)
        payload = (
            ("stage", stage.path, plan.num_pull_blocks) if stage is not None else _kv_bytes(kv)
        )
        return await self._admit(request_id, queue, "commit_import", (plan.key, payload, params))

    def new_stage(self, nbytes: int) -> KVStage | None:
        """A shared-memory stage for ``nbytes`` of pulled KV (None: use the pipe)."""
        where = getattr(self._config, "kv_stage_dir", "")
        return KVStage.create(nbytes, where) if where else None

    def kv_layout(self) -> Any:
        return self.loaded_engine.kv_layout

    def kv_source(self) -> KVSource | None:
        if self.info is None or not self.info.has_exports:
            return None
        return ClientKVSource(self)

    # -- the wire --------------------------------------------------------------------------

    def _send(self, msg: tuple[Any, ...]) -> None:
        """Queue ``msg`` for the writer thread (any thread; never blocks on the pipe)."""
        if self.dead or self._conn is None:
            raise EngineDeadError("the engine is not running; retry on another replica")
        self._out.put(ipc.dumps(msg))

    def _write(self) -> None:
        """Writer thread: every queued message to the pipe, in order; an Event is set once
        everything queued before it was written (or could not be). A failed write means
        the process is gone: the reader's end of the pipe takes the death path."""
        broken = False
        while (item := self._out.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
            elif not broken:
                try:
                    self._conn.send_bytes(item)
                except (OSError, ValueError):  # ValueError: the pipe was closed here
                    broken = True

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
            self._heard(msg)
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


class ClientKVSource(KVSource):
    """Exported KV read in the engine process, off its engine thread (``side`` calls)."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def layout(self) -> Any:
        return self._client.kv_layout()

    async def acquire(self, handle: str) -> Any:
        """Start reading ``handle`` (an ExportedKV) or None. Cancel-safe: the engine process
        counts the reader as the call arrives, and a handle with readers never expires, so
        an entry whose reply comes after this await was cancelled is released here."""
        call = self._client._start_call("acquire", (handle,), kind="side")
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(functools.partial(self._release_late, handle))
            raise

    def _release_late(self, handle: str, call: asyncio.Future[Any]) -> None:
        """End the read a cancelled ``acquire`` started, if it found the handle (not
        consumed: nobody has the bytes)."""
        if not call.cancelled() and call.exception() is None and call.result() is not None:
            self.release(handle, consumed=False)

    async def read_layer(self, block_ids: list[int], layer: int) -> tuple[Any, Any]:
        return await self._client.side("read_layer", block_ids, layer)

    async def read_stage(
        self, block_ids: list[int], pool: StagePool | None = None
    ) -> KVStage | None:
        """Every layer's K and V of ``block_ids`` in one shared-memory stage, filled by the
        engine process in one call (None: no shared memory here; use ``read_layer``), taken
        from ``pool`` when given. The caller closes it or gives it back; one whose fill
        failed or was cancelled (the engine may still write it) is closed here."""
        nbytes = stage_bytes(self.layout(), len(block_ids))
        create = self._client.new_stage
        stage = create(nbytes) if pool is None else pool.take(nbytes, create)
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


@contextlib.contextmanager
def _without_cwd_on_path() -> Iterator[None]:
    """``python -m`` and ``-c`` put the working directory first on ``sys.path``: a stray
    local module there named like one of ours (or torch's) would shadow it in the engine
    process. Two ways in, both closed while the process starts: the fork server is itself
    a ``python -c`` (PYTHONSAFEPATH=1 keeps the directory off its path; Python 3.11's fork
    server ignores the path it is handed), and each child takes this process's ``sys.path``
    (left out there, unless PYTHONPATH names it)."""
    saved, saved_env = list(sys.path), os.environ.get("PYTHONSAFEPATH")
    keep = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    cwds = {os.getcwd(), multiprocessing.process.ORIGINAL_DIR}
    sys.path[:] = [
        p for p in saved
        if os.path.abspath(p) in keep or not (p in ("", ".") or os.path.abspath(p) in cwds)
    ]  # fmt: skip
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        sys.path[:] = saved
        if saved_env is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = saved_env
