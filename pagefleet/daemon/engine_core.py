"""The engine process: owns the LLMEngine, steps it, and talks to the HTTP process (ipc.py).

As vLLM v1's EngineCore: the model, the scheduler, structured-output bitmasks (computed by
the engine's sampler), detokenization of outputs (the engine's incremental detokenizer,
needed for stop strings) and the KV pool live here; HTTP, JSON, SSE, tokenization of
prompts, metrics and the Redis publisher live in the daemon's HTTP process. So a busy web
layer never holds the GIL this process's model needs.

Threads here:
- the main thread runs the engine: drains queued calls, steps, sends one message per step;
- a receiver thread reads the pipe: "call"s are queued for the main thread, "side" calls
  (reads of exported KV blocks, thread-safe by design: kv_export.py) run at once;
sends from both go through one lock, so each message is written whole.

Lifetime: the process exits 0 on "stop", 1 when the engine fails to load or crashes, and on
its own when the HTTP process goes away (the pipe closes): it never outlives its daemon.
SIGINT/SIGTERM are ignored: the HTTP process drains first and then stops the engine.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from pagefleet.daemon import ipc

logger = logging.getLogger(__name__)

# Engine methods the HTTP process may call on the engine thread (by name: nothing else).
_CALLS = frozenset(
    {
        "add_request", "abort", "stats", "reset_prefix_cache", "cached_block_hashes",
        "collect_transfers", "check_integrity",
    }
)  # fmt: skip


class EngineCore:
    """One engine behind one pipe. ``serve`` returns the process's exit status."""

    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self._send_lock = threading.Lock()
        self._cv = threading.Condition()
        self._calls: deque[tuple[Any, ...]] = deque()
        self._stopping = False
        self._gone = False  # the HTTP process closed the pipe
        self._events: list[Any] = []  # KV event batches not sent yet (engine thread only)
        self._plans: dict[str, Any] = {}  # P/D import reservations by key (engine thread)

    # -- sending ---------------------------------------------------------------------------

    def send(self, msg: tuple[Any, ...]) -> None:
        data = ipc.dumps(msg)
        with self._send_lock:
            try:
                self.conn.send_bytes(data)
            except OSError:
                self._gone = True  # the daemon is gone; the main loop exits

    def event_sink(self, batch: Any) -> None:
        """The engine's event_sink (engine thread): batches leave with the next message."""
        self._events.append(batch)

    def _flush_events(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self.send(("events", events))

    def _reply(self, call_id: int | None, ok: bool, value: Any) -> None:
        # Events first: a reply (e.g. a cached-block snapshot) must follow every event the
        # engine emitted before it, so the publisher sees them in engine order.
        self._flush_events()
        if call_id is not None:
            self.send(("reply", call_id, ok, value))

    # -- receiving -------------------------------------------------------------------------

    def _receive(self) -> None:
        while True:
            try:
                msg = ipc.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                msg = ("gone",)
            kind = msg[0]
            if kind == "side":
                threading.Thread(target=self._side, args=msg[1:], daemon=True).start()
                continue
            with self._cv:
                if kind == "call":
                    self._calls.append(msg[1:])
                elif kind == "calls":  # one event-loop turn's calls, in order
                    self._calls.extend(msg[1])
                elif kind == "stop":
                    self._stopping = True
                else:  # "gone"
                    self._gone = True
                self._cv.notify()
            if kind not in ("call", "calls"):
                return

    def _side(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            value = getattr(self, "side_" + method)(*args)
        except Exception as exc:
            self.send(("reply", call_id, False, ipc.RemoteError.of(exc)))
        else:
            self.send(("reply", call_id, True, value))

    # -- side calls: exported KV, read while the engine steps ------------------------------

    def side_acquire(self, handle: str) -> Any:
        return self.engine.exports.acquire(handle, time.monotonic())

    def side_release(self, handle: str, consumed: bool) -> None:
        self.engine.exports.release(handle, consumed=consumed)

    def side_read_layer(self, block_ids: list[int], layer: int) -> tuple[bytes, bytes]:
        import torch

        ((k, v),) = self.engine.runner.read_kv_blocks(block_ids, range(layer, layer + 1))
        return tuple(  # type: ignore[return-value]
            t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in (k, v)
        )

    def side_export_to_stage(self, block_ids: list[int], path: str) -> int:
        """K and V of ``block_ids``, every layer, gathered straight into the HTTP process's
        shared-memory stage at ``path`` (kv_stage.py); returns the bytes written."""
        from pagefleet.daemon.kv_stage import stage_bytes, stage_tensors

        runner = self.engine.runner
        layout = runner.kv_layout()
        views = stage_tensors(path, layout, len(block_ids))
        runner.read_kv_blocks(block_ids, range(layout.num_layers), out=views)
        return stage_bytes(layout, len(block_ids))

    def side_export_handles(self) -> list[str]:
        exports = getattr(self.engine, "exports", None)
        return [] if exports is None else exports.handles()

    def side_export_block_ids(self, handle: str) -> list[int]:
        entry = self.engine.exports.acquire(handle, float("-inf"))
        if entry is None:
            return []
        try:
            return list(entry.block_ids)
        finally:
            self.engine.exports.release(handle, consumed=False)

    # -- engine-thread calls beyond the engine's own methods -------------------------------

    def _call(self, method: str, args: tuple[Any, ...]) -> Any:
        eng = self.engine
        if method in _CALLS:
            fn = getattr(eng, method, None)
            if fn is None:
                return None  # e.g. collect_transfers on an engine without P/D
            return fn(*args)
        if method == "add_export":
            rid, prompt, params, lora_id = args
            return eng.add_request(rid, prompt, params, lora_id=lora_id, kv_export=True)
        if method == "reserve_import":
            plan = eng.reserve_import(*args)
            if plan is not None:
                self._plans[plan.key] = plan
            return plan
        if method == "commit_import":
            key, kv, params = args
            plan = self._plans.pop(key, None)
            if plan is None:
                raise ValueError("the KV reservation is unknown or already ended")
            return eng.commit_import(plan, _tensors(kv, getattr(eng, "runner", None)), params)
        if method == "cancel_import":
            plan = self._plans.pop(args[0], None)
            if plan is not None:
                eng.cancel_import(plan)
            return None
        if method == "snapshot":
            return set(eng.cached_block_hashes())
        raise ValueError(f"unknown engine call {method!r}")

    # -- the loop --------------------------------------------------------------------------

    def serve(self) -> int:
        threading.Thread(target=self._receive, name="engine-core-recv", daemon=True).start()
        eng = self.engine
        while True:
            with self._cv:
                while not (self._calls or self._stopping or self._gone or eng.has_unfinished()):
                    self._cv.wait()
                if self._stopping or self._gone:
                    self._flush_events()
                    return 0
                calls = list(self._calls)
                self._calls.clear()
            for call_id, method, args in calls:
                try:
                    value = self._call(method, args)
                except Exception as exc:  # the caller's error: hand it back
                    self._reply(call_id, False, ipc.RemoteError.of(exc))
                else:
                    self._reply(call_id, True, value)
            if not eng.has_unfinished():
                if calls:  # e.g. an abort emptied the engine: publish the new load
                    self._flush_events()
                    self.send(("step", [], time.monotonic(), eng.stats()))
                continue
            outputs = eng.step()
            now = time.monotonic()
            stats = eng.stats()
            self._flush_events()
            self.send(("step", ipc.pack_outputs(outputs), now, stats))


def _tensors(kv: Any, runner: Any) -> Any:
    """Pulled KV arrives as (dtype, shape, [(k bytes, v bytes)]), or as ("stage", path,
    num_blocks) for a shared-memory stage (kv_stage.py); the engine wants tensors."""
    if kv is None:
        return None
    import torch

    if kv[0] == "stage":
        from pagefleet.daemon.kv_stage import stage_tensors

        _, path, num_blocks = kv
        return stage_tensors(path, runner.kv_layout(), num_blocks)

    dtype, shape, layers = kv
    dt = getattr(torch, dtype)
    return [
        tuple(torch.frombuffer(bytearray(b), dtype=dt).view(shape) for b in pair) for pair in layers
    ]


def run(conn: Connection, config: Any, factory: Callable[..., Any] | None = None) -> None:
    """Process entry point: load the engine, say so, serve until stopped; exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=str(getattr(config, "log_level", "warning")).upper(),
        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s",
        stream=sys.stderr,
    )
    core = EngineCore(None, conn)
    try:
        if factory is None:
            from pagefleet.daemon.app import default_engine_factory

            factory = default_engine_factory
        engine = factory(config, core.event_sink)
        core.engine = engine
        runner = getattr(engine, "runner", None)
        exports = getattr(engine, "exports", None)
        info = ipc.EngineInfo(
            pid=os.getpid(),
            tokenizer=engine.tokenizer,
            max_model_len=int(engine.max_model_len),
            kv_layout=runner.kv_layout() if exports is not None and runner is not None else None,
            has_exports=exports is not None,
        )
    except BaseException as exc:
        logger.exception("engine failed to load")
        core.send(("load_error", str(exc) or type(exc).__name__))
        conn.close()
        sys.exit(1)
    core.send(("ready", info))
    try:
        status = core.serve()
    except BaseException as exc:
        logger.exception("engine loop crashed")
        core.send(("crashed", f"{type(exc).__name__}: {exc}"))
        status = 1
    conn.close()
    # Skip interpreter teardown (torch's thread pools, atexit handlers of the parent's
    # modules inherited through the fork server): the engine's state dies with us anyway.
    sys.stderr.flush()
    os._exit(status)
