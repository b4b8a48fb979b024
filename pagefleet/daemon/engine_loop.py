"""The engine on a thread of the daemon's HTTP process (``--no-engine-process``).

The engine is single-threaded (docs/internals.md): only the thread that calls ``step()`` may
touch it. The thread runs the same ``EngineCore`` as the engine process (engine_core.py);
its messages are handed to the event loop in memory (``loop.call_soon_threadsafe``) instead
of crossing a pipe, and calls reach it through ``EngineCore.receive``. Everything else
(streams, calls, aborts, the hang watchdog) is ``EngineHandle``'s, shared with the engine
process (engine_client.py). The event loop never waits on the model, but the two share the
GIL: the engine process is the default for that reason.

A hung engine thread cannot be killed: it is declared dead (every waiter fails, /health
fails, the daemon exits non-zero and takes the thread with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import Any

from pagefleet.daemon.engine_core import EngineCore
from pagefleet.daemon.engine_handle import EngineDeadError as EngineDeadError
from pagefleet.daemon.engine_handle import EngineHandle
from pagefleet.daemon.engine_handle import RequestStream as RequestStream
from pagefleet.daemon.engine_handle import StreamItem as StreamItem
from pagefleet.daemon.kv_stage import KVStage
from pagefleet.engine.sampling_params import SamplingParams


class _LoopChannel:
    """The engine thread's messages, handed to the event loop in order."""

    remote = False

    def __init__(self, handle: EngineLoop) -> None:
        self._handle = handle
        self._lock = threading.Lock()  # side-call threads send too: keep one order

    def send(self, msg: tuple[Any, ...]) -> bool:
        self._handle._heard(msg)
        with self._lock:
            try:
                self._handle._loop.call_soon_threadsafe(self._handle._dispatch, msg)
            except RuntimeError:
                return False  # the event loop closed: nobody is listening any more
        return True


class EngineLoop(EngineHandle):
    """An engine on a dedicated thread of this process, driven from the event loop."""

    what = "the engine thread"

    _core: EngineCore | None = None  # the engine's side, once started
    _thread: threading.Thread | None = None

    @property
    def engine(self) -> Any:
        """The engine object (None until loaded): for its fixed attributes and the KV export
        server; calls that read or change its state go through the handle's calls."""
        return None if self._core is None else self._core.engine

    def start(self) -> None:
        self._core = core = EngineCore(None, _LoopChannel(self))
        self._thread = threading.Thread(
            target=self._run, args=(core,), name="pagefleet-engine", daemon=True
        )
        self._thread.start()
        self._schedule_watch()

    def _run(self, core: EngineCore) -> None:
        self.exitcode = core.run(self._config, self._factory)
        with contextlib.suppress(RuntimeError):  # the event loop closed: nobody listens
            self._loop.call_soon_threadsafe(self._gone)

    @property
    def pid(self) -> int:
        return os.getpid()

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self.dead or self._core is None or not self._running():
            raise EngineDeadError("the engine is not running; retry on another replica")
        self._core.receive(msg)

    def _end_hung(self) -> None:
        # A thread cannot be killed: fail everything now; the daemon exits and ends it.
        self._gone()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread after its current step; live streams get EngineDeadError.
        Blocks (the daemon calls it from a worker thread)."""
        self._stopping = True
        if self._core is None or self._thread is None:
            return
        self._core.receive(("stop",))
        hung = self.hung_reason is not None  # a hung step never returns: do not wait on it
        if not hung and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._gone)

    # -- P/D: the engine is in this process, so KV moves as tensors -----------------------

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
        """Commit a pulled KV reservation (``kv``: a PulledKV, None when nothing was pulled)
        and start its request (P/D decode). ``stage`` and ``write_first`` are for an engine
        in another process; this one reads ``kv``'s buffer directly."""
        payload = None if kv is None else ("tensors", kv.tensors())
        return await self._admit(request_id, queue, "commit_import", (plan.key, payload, params))

    def new_stage(self, nbytes: int) -> None:
        """No shared-memory stage: the engine is in this process and reads the tensors."""
        return None

    def kv_layout(self) -> Any:
        return self.engine.runner.kv_layout()

    def kv_source(self) -> Any:
        """The loaded engine: the KV export server reads it in this process."""
        return self.engine
