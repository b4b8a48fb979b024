"""The engine's side of the daemon: owns the LLMEngine, steps it, answers the HTTP side.

As vLLM v1's EngineCore: the model, the scheduler, structured-output bitmasks (computed by
the engine's sampler), detokenization of outputs that need it (stop strings) and the KV
pool live here; HTTP, JSON, SSE, tokenization of prompts, metrics and the Redis publisher
live on the HTTP side (engine_handle.py). The same core serves both ways the daemon runs
its engine:
- in a process of its own (``run``, the default): messages cross a pipe (ipc.py), so a
  busy web layer never holds the GIL this process's model needs;
- on a thread of the HTTP process (``--no-engine-process``): the same messages are handed
  over in memory (engine_loop.py).

Threads here:
- the engine thread (the process's main thread, or the daemon's engine thread) drains
  queued calls, steps, and sends one message per step;
- ``receive`` queues "call"s for it and runs "side" calls (reads of exported KV blocks,
  thread-safe by design: kv_export.py) at once on a thread of their own;
sends go through one lock in the channel, so each message leaves whole.

Lifetime of the process: it exits 0 on "stop", 1 when the engine fails to load or
crashes, and on its own when the HTTP process goes away (the pipe closes): it never
outlives its daemon. SIGINT/SIGTERM are ignored: the HTTP process drains first and then
stops the engine.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from pagefleet.daemon import ipc
from pagefleet.daemon.kv_stage import StageMaps
from pagefleet.daemon.step_trace import StepTrace

logger = logging.getLogger(__name__)

# A side-thread import write needs the reservation to live at least this long when it
# starts (a pull that slow is better retried than copied).
_WRITE_MARGIN_S = 5.0

# Engine methods the HTTP side may call on the engine thread (by name: nothing else).
_CALLS = frozenset(
    {
        "add_request", "abort", "stats", "reset_prefix_cache", "cached_block_hashes",
        "collect_transfers", "check_integrity", "release_export",
    }
)  # fmt: skip


class Channel(Protocol):
    """Where the core's messages go: the pipe, or the event loop of its own process."""

    # True when messages are pickled: outputs go packed (ipc.pack_outputs), errors as data.
    remote: bool

    def send(self, msg: tuple[Any, ...]) -> bool:
        """Hand ``msg`` over whole (thread-safe); False when nobody listens any more."""
        ...


class PipeChannel:
    """The engine process's end of the pipe to its HTTP process."""

    remote = True

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: tuple[Any, ...]) -> bool:
        data = ipc.dumps(msg)
        with self._lock:
            try:
                self.conn.send_bytes(data)
            except OSError:
                return False  # the daemon is gone; the core's loop exits
        return True


class EngineCore:
    """One engine behind one channel. ``serve`` returns the exit status."""

    def __init__(self, engine: Any, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self._cv = threading.Condition()
        self._calls: deque[tuple[Any, ...]] = deque()
        self._stopping = False
        self._gone = False  # the HTTP side went away
        self._events: list[Any] = []  # KV event batches not sent yet (engine thread only)
        self._plans: dict[str, Any] = {}  # P/D import reservations by key (engine thread)
        # P/D prefill: request id -> the stage to gather its exported KV into as it finishes
        # (engine thread), and the handles whose stage is filled (read by side threads).
        self._export_stages: dict[str, str] = {}
        self._staged_exports: set[str] = set()
        # P/D decode: reservation key -> set when its side-thread write has ended.
        self._writing: dict[str, threading.Event] = {}
        self._write_lock = threading.Lock()
        # P/D decode: "write_commit_import" calls waiting for their write (engine thread),
        # each with the event its side-thread write sets.
        self._deferred: list[tuple[threading.Event, tuple[Any, ...]]] = []
        # P/D: the stage files' mappings, kept across the HTTP side's reused stages (a new
        # mapping faulted in every page of each 29 MB copy again: 15-20 ms, kept 5-6 ms).
        self._stage_maps = StageMaps()

    # -- sending ---------------------------------------------------------------------------

    def send(self, msg: tuple[Any, ...]) -> None:
        if not self.channel.send(msg):
            self._gone = True

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

    def _error(self, exc: BaseException) -> Any:
        """An exception as the reply carries it: as data across a pipe, else itself."""
        return ipc.RemoteError.of(exc) if self.channel.remote else exc

    # -- receiving -------------------------------------------------------------------------

    def receive(self, msg: tuple[Any, ...]) -> bool:
        """Take one message from the HTTP side (any thread); False after the last one."""
        kind = msg[0]
        if kind == "side":
            threading.Thread(target=self._side, args=msg[1:], daemon=True).start()
            return True
        with self._cv:
            if kind == "call":
                self._begin_writes((msg[1:],))
                self._calls.append(msg[1:])
            elif kind == "calls":  # one event-loop turn's calls, in order
                self._begin_writes(msg[1])
                self._calls.extend(msg[1])
            elif kind == "stop":
                self._stopping = True
            else:  # "gone"
                self._gone = True
            self._cv.notify()
        return kind in ("call", "calls")

    def receive_from(self, conn: Connection) -> None:
        """Receiver thread of the engine process: the pipe's messages until it closes."""
        while True:
            try:
                msg = ipc.loads(conn.recv_bytes())
            except (EOFError, OSError):
                msg = ("gone",)
            if not self.receive(msg):
                return

    def _side(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            value = getattr(self, "side_" + method)(*args)
        except Exception as exc:
            self.send(("side_reply", call_id, False, self._error(exc)))
        else:
            self.send(("side_reply", call_id, True, value))

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
        views = stage_tensors(path, layout, len(block_ids), self._stage_maps)
        runner.read_kv_blocks(block_ids, range(layout.num_layers), out=views)
        return stage_bytes(layout, len(block_ids))

    def side_export_info(self, handle: str) -> tuple[list[int], bool]:
        """The blocks ``handle`` pins (empty if gone) and whether the engine filled the
        stage given with ``add_export`` with them."""
        return self.side_export_block_ids(handle), handle in self._staged_exports

    def _begin_writes(self, calls: Any) -> None:
        """Start the side-thread write of each "write_commit_import" among ``calls`` as it
        arrives (receiving thread), registered before the call is queued: the engine thread
        then commits it at the first step boundary after the copy, with no round trip to
        the HTTP side in between. A write that cannot start (reservation ended or about to)
        leaves the commit to fail, which releases the reservation."""
        for _call_id, method, args in calls:
            if method != "write_commit_import":
                continue
            key, kv, _params = args
            try:
                plan, done, deadline = self._begin_write(key)
            except ValueError:
                continue
            threading.Thread(
                target=self._write_then_wake, args=(plan, kv, done, deadline), daemon=True
            ).start()

    def _write_then_wake(self, plan: Any, kv: Any, done: threading.Event, deadline: float) -> None:
        try:
            self._write(plan, kv, done, deadline)
        except Exception:  # the commit finds the KV missing and releases the reservation
            logger.warning("writing the pulled KV of %s failed", plan.request_id, exc_info=True)
        finally:
            with self._cv:  # a deferred commit may go now
                self._cv.notify()

    def _begin_write(self, key: str) -> tuple[Any, threading.Event, float]:
        with self._write_lock:  # a cancel either sees this write or ran before it
            plan = self._plans.get(key)
            if plan is None or plan.deadline - time.monotonic() < _WRITE_MARGIN_S:
                raise ValueError("the KV reservation is unknown, ended or about to expire")
            done = self._writing[key] = threading.Event()
            # Set before the lock is released and >= _WRITE_MARGIN_S ahead of expiry, so
            # no collect_transfers on the engine thread can free these blocks mid-copy.
            deadline, plan.deadline = plan.deadline, math.inf
        return plan, done, deadline

    def _write(self, plan: Any, kv: Any, done: threading.Event, deadline: float) -> None:
        try:
            eng = self.engine
            runner = getattr(eng, "runner", None)
            eng.write_import(plan, _tensors(kv, runner, self._stage_maps), 0)
        finally:
            plan.deadline = deadline  # expired meanwhile: the next collect frees it
            done.set()

    def side_write_import(self, key: str, kv: Any) -> None:
        """Every layer of a pulled KV (a ``("stage", path, num_blocks)``) into the blocks
        reserved under ``key``, on this side thread while the engine steps: the reserved
        blocks belong to no sequence, so no step reads or writes them, and no step waits
        for the copy. ``cancel_import`` / ``commit_import`` of ``key`` wait for it to end,
        so its blocks are never freed under it, and the engine's own expiry skips the
        reservation while the copy runs (its deadline is held at infinity, then restored);
        it refuses a reservation with under ``_WRITE_MARGIN_S`` to live."""
        plan, done, deadline = self._begin_write(key)
        self._write(plan, kv, done, deadline)

    def _ready_deferred(self) -> list[tuple[Any, ...]]:
        """The deferred commits whose write has ended, taken out in arrival order."""
        ready: list[tuple[Any, ...]] = []
        waiting = []
        for pair in self._deferred:
            if pair[0].is_set():
                ready.append(pair[1])
            else:
                waiting.append(pair)
        self._deferred = waiting
        return ready

    def _wait_written(self, key: str, end: bool = False) -> Any:
        """Wait for a side-thread write into ``key``'s blocks to end; with ``end``, also
        take the reservation out of ``_plans`` (no new write can start then)."""
        with self._write_lock:
            done = self._writing.pop(key, None)
            plan = self._plans.pop(key, None) if end else None
        if done is not None:
            done.wait()  # a memory copy: it ends, and its blocks must not be freed before
        return plan

    def _fill_export_stages(self, outputs: list[Any]) -> None:
        """Gather each finished exported prompt's blocks into its stage (engine thread,
        right after the step that finished it: no forward runs meanwhile, and the HTTP side
        learns of the finish only after this)."""
        for out in outputs:
            if not out.finished:
                continue
            path = self._export_stages.pop(out.request_id, None)
            if path is None:
                continue
            try:
                ids = self.side_export_block_ids(out.request_id)
                if ids:
                    self.side_export_to_stage(ids, path)
                    self._staged_exports.add(out.request_id)
            except Exception:  # the pull gathers on demand instead
                logger.warning("gathering the exported KV of %s failed", out.request_id,
                               exc_info=True)  # fmt: skip

    def side_export_handles(self) -> list[str]:
        exports = getattr(self.engine, "exports", None)
        return [] if exports is None else exports.handles()

    def side_export_block_ids(self, handle: str) -> list[int]:
        exports = getattr(self.engine, "exports", None)
        entry = None if exports is None else exports.acquire(handle, float("-inf"))
        if entry is None:
            return []
        try:
            return list(entry.block_ids)
        finally:
            exports.release(handle, consumed=False)

    # -- engine-thread calls beyond the engine's own methods -------------------------------

    def _call(self, method: str, args: tuple[Any, ...]) -> Any:
        eng = self.engine
        if method == "collect_transfers":  # periodic: unmap stages the HTTP side closed
            self._stage_maps.prune()
        if method in _CALLS:
            fn = getattr(eng, method, None)
            if fn is None:
                return None  # e.g. collect_transfers on an engine without P/D
            return fn(*args)
        if method == "add_export":
            rid, prompt, params, lora_id, *stage = args
            eng.add_request(rid, prompt, params, lora_id=lora_id, kv_export=True)
            if stage and stage[0]:
                self._export_stages[rid] = stage[0]
            return None
        if method == "reserve_import":
            plan = eng.reserve_import(*args)
            if plan is not None:
                self._plans[plan.key] = plan
            return plan
        if method == "commit_import":
            key, kv, params = args
            plan = self._wait_written(key, end=True)
            if plan is None:
                raise ValueError("the KV reservation is unknown or already ended")
            kv = _tensors(kv, getattr(eng, "runner", None), self._stage_maps)
            return eng.commit_import(plan, kv, params)
        if method == "write_commit_import":  # the write began as the call arrived
            key, _kv, params = args
            with self._write_lock:
                done = self._writing.get(key)
            if done is not None and not done.is_set():
                return _Deferred(done)
            return self._call("commit_import", (key, None, params))
        if method == "cancel_import":
            plan = self._wait_written(args[0], end=True)  # never free blocks being written
            if plan is not None:
                eng.cancel_import(plan)
            return None
        if method == "snapshot":
            return set(eng.cached_block_hashes())
        raise ValueError(f"unknown engine call {method!r}")

    # -- the loop --------------------------------------------------------------------------

    def load(self, config: Any, factory: Callable[..., Any] | None) -> bool:
        """Build the engine with ``factory(config, event_sink)`` (None: the daemon's default
        engine); send "ready" with what the HTTP side needs, or "load_error"; True when
        loaded."""
        if factory is None:
            from pagefleet.daemon.app import default_engine_factory

            factory = default_engine_factory
        try:
            engine = factory(config, self.event_sink)
            self.engine = engine
            runner = getattr(engine, "runner", None)
            exports = getattr(engine, "exports", None)
            info = ipc.EngineInfo(
                pid=os.getpid(),
                tokenizer=engine.tokenizer,
                max_model_len=int(engine.max_model_len),
                kv_layout=runner.kv_layout() if exports is not None and runner else None,
                has_exports=exports is not None,
            )
        except (ValueError, OSError) as exc:
            # A checkpoint, flag or file problem: the loaders' messages name the file and
            # the fix, and 20-30 lines of traceback above that line only buried it. The
            # traceback stays one --log-level debug away.
            logger.error("engine failed to load: %s", exc)
            logger.debug("engine load traceback", exc_info=True)
            self.send(("load_error", str(exc) or type(exc).__name__))
            return False
        except BaseException as exc:
            logger.exception("engine failed to load")
            self.send(("load_error", str(exc) or type(exc).__name__))
            return False
        self.send(("ready", info))
        return True

    def run(self, config: Any, factory: Callable[..., Any] | None) -> int:
        """Load, then serve until stopped; the exit status (a crash is reported first)."""
        if not self.load(config, factory):
            return 1
        try:
            return self.serve()
        except BaseException as exc:
            logger.exception("engine loop crashed")
            self.send(("crashed", f"{type(exc).__name__}: {exc}"))
            return 1

    def serve(self) -> int:
        eng = self.engine
        trace = StepTrace.from_env(eng)  # None unless PAGEFLEET_STEP_TRACE is set
        while True:
            with self._cv:
                while not (
                    self._calls or self._stopping or self._gone or eng.has_unfinished()
                    or any(done.is_set() for done, _ in self._deferred)
                ):  # fmt: skip
                    if trace is not None:  # idle: a reader of the trace sees every step so far
                        trace.flush()
                    self._cv.wait()
                if self._stopping or self._gone:
                    self._flush_events()
                    if trace is not None:
                        trace.flush()
                    return 0
                calls = self._ready_deferred() + list(self._calls)
                self._calls.clear()
            if trace is not None and calls:
                trace.calls(time.monotonic(), [c[1] for c in calls])
            for call_id, method, args in calls:
                try:
                    value = self._call(method, args)
                except Exception as exc:  # the caller's error: hand it back
                    self._reply(call_id, False, self._error(exc))
                else:
                    if isinstance(value, _Deferred):  # answered when its write has ended
                        self._deferred.append((value.done, (call_id, method, args)))
                        continue
                    self._reply(call_id, True, value)
            if not eng.has_unfinished():
                if calls:  # e.g. an abort emptied the engine: publish the new load
                    self._flush_events()
                    self.send(("step", [], time.monotonic(), eng.stats()))
                continue
            t1 = time.monotonic() if trace is not None else 0.0
            outputs = eng.step()
            now = time.monotonic()
            gathered = bool(self._export_stages)
            if gathered:
                self._fill_export_stages(outputs)
            if trace is not None:  # t3: after the exported prompts' gather, when one ran
                trace.step(t1, now, time.monotonic() if gathered else None)
            if self._staged_exports:  # forget handles that are gone (pulled, expired)
                self._staged_exports &= set(eng.exports.handles())
            stats = eng.stats()
            self._flush_events()
            packed = ipc.pack_outputs(outputs) if self.channel.remote else outputs
            self.send(("step", packed, now, stats))


class _Deferred:
    """``_call``'s answer for a commit whose KV write is still running."""

    __slots__ = ("done",)

    def __init__(self, done: threading.Event) -> None:
        self.done = done


def _tensors(kv: Any, runner: Any, maps: Any = None) -> Any:
    """Pulled KV arrives as (dtype, shape, [(k bytes, v bytes)]), as ("stage", path,
    num_blocks) for a shared-memory stage (kv_stage.py), or, from the engine's own process,
    as ("tensors", per-layer tensors); the engine wants tensors."""
    if kv is None:
        return None
    if kv[0] == "tensors":
        return kv[1]
    import torch

    if kv[0] == "stage":
        from pagefleet.daemon.kv_stage import stage_tensors

        _, path, num_blocks = kv
        return stage_tensors(path, runner.kv_layout(), num_blocks, maps)

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
    core = EngineCore(None, PipeChannel(conn))
    threading.Thread(target=core.receive_from, args=(conn,), name="engine-core-recv",
                     daemon=True).start()  # fmt: skip
    status = core.run(config, factory)
    conn.close()
    # Skip interpreter teardown (torch's thread pools, atexit handlers of the parent's
    # modules inherited through the fork server): the engine's state dies with us anyway.
    sys.stderr.flush()
    os._exit(status)
