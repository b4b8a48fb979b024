"""KV events and heartbeats from one daemon to the global prefix index.

The engine's ``event_sink`` runs on the engine thread (or, with the engine in its own
process, on the event loop as its messages arrive); it hands each ``KVEventBatch`` to the
event loop (``call_soon_threadsafe``), where one task applies batches to the index in order.

Invariant: while the index is reachable, the pod's entry in it equals the engine's cached
block set as of the last applied batch. When the index fails, queued batches are dropped
(replaying a partial history cannot be trusted) and, once it answers again, the whole set is
replaced by a fresh snapshot (``engine.cached_block_hashes()``). The snapshot is taken
between engine steps and enters the same queue as the batches, so batches emitted before it are
skipped (the snapshot contains them) and batches after it are applied on top: no gap, no
double count. An index that answers but no longer knows the pod (flushed, restarted between
two calls, evicted, garbage-collected) says so on the next heartbeat or stored block, and
the set is replaced the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pagefleet.kvindex.events import KVEventBatch
from pagefleet.kvindex.index import KVIndex, PodLoad
from pagefleet.ratelog import EveryInterval

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Snapshot:
    token: object
    block_hashes: set[int]


@dataclass(slots=True)
class _Wake:
    """Nudges the apply task to re-check whether a resync is due."""


_STOP = object()

Item = KVEventBatch | _Snapshot | _Wake | object
# Calls deliver(the engine's cached block set) in order with the engine's KV events
# (EngineLoop.snapshot_cached_blocks, EngineClient.snapshot_cached_blocks).
Snapshot = Callable[[Callable[[set[int]], None]], Awaitable[None]]


class KVEventPublisher:
    """Applies a pod's KV events to an index, heartbeats its load, resyncs after outages."""

    def __init__(
        self,
        index: KVIndex,
        pod: str,
        loop: asyncio.AbstractEventLoop,
        load_fn: Callable[[], PodLoad],
        snapshot: Snapshot,
        metrics: Any | None = None,
        heartbeat_s: float = 1.0,
        ttl_s: float = 5.0,
        resync_interval_s: float = 60.0,
        op_timeout_s: float = 5.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
        snapshot_timeout_s: float = 10.0,
        lost_log_interval_s: float = 60.0,
    ) -> None:
        """``lost_log_interval_s``: at most one warning that the index lost this pod per
        that many seconds (an index that keeps losing it would log one a heartbeat); the
        next one says how many went unlogged."""
        self.index = index
        self.pod = pod
        self._loop = loop
        self._load_fn = load_fn
        self._snapshot = snapshot
        self._metrics = metrics
        self._heartbeat_s = heartbeat_s
        self._ttl_s = ttl_s
        self._resync_interval_s = resync_interval_s
        self._op_timeout_s = op_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._snapshot_timeout_s = snapshot_timeout_s
        self.snapshot_timeouts = 0
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._need_resync = False
        self._asked = 0  # resyncs asked for (failures, resync_now): one clears those before it
        # The index registered the pod (a heartbeat or resync answered): from then on, one
        # that registers it anew has lost it, and its blocks (a flush, a restart, gc).
        self._known = False
        self._last_resync = time.monotonic()
        self._down_logged = False
        # Losses of the pod's entries seen (``_mark_lost``), every one, logged or not; when
        # one was last logged and how many since were not.
        self.losses = 0
        self._lost_log = EveryInterval(logger, lost_log_interval_s)
        self._tasks: list[asyncio.Task[None]] = []
        self.in_sync = asyncio.Event()
        self._back = asyncio.Event()  # a heartbeat succeeded after one failed
        self._ops_in_flight = 0  # index calls awaiting their answer
        self.events_applied = 0
        self.resyncs = 0

    # -- engine thread --------------------------------------------------------------------

    def sink(self, batch: KVEventBatch) -> None:
        """The engine's event_sink: called on the engine thread, never blocks."""
        self._put_threadsafe(batch)

    def _put_threadsafe(self, item: Item) -> None:
        # A closed loop means the daemon is gone, and so is its index entry.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    # -- event loop -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start publishing; the first act clears the pod's stale entries (a previous life's).

        Does not wait for the index: an unreachable Redis must not delay serving.
        """
        self._tasks = [
            asyncio.create_task(self._apply_loop(), name=f"kv-publisher-{self.pod}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"kv-heartbeat-{self.pod}"),
        ]

    async def close(self, timeout_s: float = 5.0) -> None:
        """Apply what is queued, then remove the pod's entries and close the index."""
        if not self._tasks:
            return
        apply_task, heartbeat_task = self._tasks
        heartbeat_task.cancel()
        self._queue.put_nowait(_STOP)
        # asyncio.wait, not wait_for: on a timeout 3.11's wait_for cancels the task and then
        # waits for it without a bound, so a task that swallowed its cancel held close().
        for task in (apply_task, heartbeat_task):
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:  # cancel (the heartbeat: once more) and wait once more, bounded
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:  # left behind rather than awaited forever
                logger.warning("%s did not stop within %.1f s", task.get_name(), 2 * timeout_s)
            elif not task.cancelled() and task.exception() is not None:
                logger.warning("%s ended with %r", task.get_name(), task.exception())
        try:
            await self._op(self.index.clear_pod(self.pod))
        except Exception as exc:
            logger.warning("could not remove pod %s from the prefix index: %s", self.pod, exc)
        with contextlib.suppress(Exception):
            await self.index.close()
        self._tasks = []

    async def resync_now(self) -> None:
        """Ask for a full resync (e.g. after an operator flushed the index)."""
        self._need_resync = True
        self._asked += 1
        self._queue.put_nowait(_Wake())

    async def _op(self, coro: Awaitable[Any]) -> Any:
        # A hung connection must not stall publishing forever; a timeout counts as down.
        # asyncio.timeout, not wait_for: on 3.11 wait_for returns the call's result and
        # drops a cancel that lands in the turn the call completes, so close() cancelled
        # the heartbeat task, which beat on, and waited for it forever.
        self._ops_in_flight += 1
        try:
            async with asyncio.timeout(self._op_timeout_s):
                return await coro
        finally:
            self._ops_in_flight -= 1

    @property
    def idle(self) -> bool:
        """Nothing queued and no index call awaiting its answer: every batch handed to
        ``sink`` before this moment (and already on this loop) has been applied or failed.
        An empty queue alone is not that: the last batch may still be on its way to Redis."""
        return self._queue.empty() and self._ops_in_flight == 0

    def _mark_down(self, what: str, exc: BaseException) -> None:
        self._need_resync = True
        self._asked += 1
        self.in_sync.clear()
        if self._metrics is not None:
            self._metrics.index_up.set(0)
        if not self._down_logged:
            self._down_logged = True
            logger.warning(
                "prefix index unreachable while %s (%s: %s); still serving, retrying with "
                "backoff and resyncing the full block set when it returns",
                what,
                type(exc).__name__,
                exc,
            )

    def _mark_lost(self, what: str) -> None:
        """The index answered, but did not know the pod any more: resync. Warned about
        once per ``lost_log_interval_s`` (a flapping index would flood the log)."""
        self.losses += 1
        self._lost_log.warning(
            "the prefix index lost pod %s's entries (seen while %s: flushed, restarted, "
            "evicted or garbage-collected); resyncing the full block set",
            self.pod,
            what,
        )
        self._need_resync = True
        self._asked += 1
        self.in_sync.clear()

    def _mark_up(self) -> None:
        if self._down_logged:
            logger.warning("prefix index reachable again for pod %s", self.pod)
        self._down_logged = False
        if not self._need_resync:
            self.in_sync.set()
            if self._metrics is not None:
                self._metrics.index_up.set(1)

    async def _apply_loop(self) -> None:
        try:
            await self._op(self.index.clear_pod(self.pod))
            self._mark_up()
        except Exception as exc:
            self._mark_down("clearing stale entries", exc)
        held: Item | None = None  # an item read while merging batches, handled next
        while True:
            # A held item first: it may be the stop, which a recovery waiting on the queue
            # would never see.
            if held is None and (self._need_resync or self._periodic_due()):
                if not await self._recover():
                    return
                continue
            item, held = (held, None) if held is not None else (await self._queue.get(), None)
            if item is _STOP:
                return
            if isinstance(item, KVEventBatch):
                # Every batch already queued goes in the same call: with Redis slower than
                # the engine's steps, one call a batch fell behind for good (the backlog
                # grew by the step rate, in_sync still set).
                item, held = self._merge_queued(item)
                known = self._known
                try:
                    anew = await self._op(self.index.apply(self.pod, item))
                except Exception as exc:
                    self._mark_down("applying KV events", exc)
                    continue
                if anew and known:
                    self._mark_lost("applying KV events")
                self.events_applied += len(item.events)
                if self._metrics is not None:
                    self._metrics.kv_events_published.inc(len(item.events))
                self._mark_up()
            # A stale _Snapshot (from an abandoned recovery) or a _Wake: nothing to apply.

    def _merge_queued(self, first: KVEventBatch) -> tuple[KVEventBatch, Item | None]:
        """``first`` and the batches queued behind it as one batch (events in order), and
        the first other item met, which the caller handles next."""
        events: list[Any] | None = None
        last = first
        while not self._queue.empty():
            nxt = self._queue.get_nowait()
            if not isinstance(nxt, KVEventBatch):
                return self._joined(first, last, events), nxt
            if events is None:
                events = list(first.events)
            events.extend(nxt.events)
            last = nxt
        return self._joined(first, last, events), None

    @staticmethod
    def _joined(first: KVEventBatch, last: KVEventBatch, events: list[Any] | None) -> KVEventBatch:
        if events is None:
            return first
        return KVEventBatch(ts=last.ts, seq=last.seq, events=events)

    async def _recover(self) -> bool:
        """Replace the pod's set with a fresh engine snapshot; retry with backoff.

        Returns False when asked to stop meanwhile.
        """
        delay = self._backoff_initial_s
        while True:
            token = object()
            try:
                # Bounded: an engine that never answers (lost in a step, or gone) must not
                # hold the index out of sync forever; a late answer carries an old token and
                # is dropped, and the next snapshot contains every batch dropped meanwhile.
                async with asyncio.timeout(self._snapshot_timeout_s):
                    snapshot = await self._take_snapshot(token)
            except TimeoutError:
                self.snapshot_timeouts += 1
                logger.warning(
                    "the engine did not deliver its block set within %.0f s; retrying the resync",
                    self._snapshot_timeout_s,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff_max_s)
                continue
            except Exception as exc:
                logger.warning("cannot snapshot the engine's block set (%s); not resyncing", exc)
                return await self._drain_until_stop()
            if snapshot is None:
                return False
            asked = self._asked
            self._back.clear()
            try:
                await self._op(self.index.resync(self.pod, snapshot.block_hashes))
            except Exception as exc:
                self._mark_down("resyncing", exc)
                # The backoff ends early when the heartbeat gets through again: that
                # heartbeat made the pod count again with the entries it has in the index,
                # which may be stale (events dropped meanwhile, or a previous life's blocks
                # when the daemon restarted during the outage) until this resync replaces
                # them.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._back.wait()
                delay = min(delay * 2, self._backoff_max_s)
                continue
            self.resyncs += 1
            self._known = True
            self._last_resync = time.monotonic()
            if self._metrics is not None:
                self._metrics.index_resyncs.inc()
            if self._asked != asked:
                # The heartbeat failed (or a resync was asked for) while this resync was in
                # flight: the index may have lost it since (a restart after its write,
                # before its reply was read). Keep the flag: the caller resyncs again.
                return True
            self._need_resync = False
            self._mark_up()
            return True

    async def _take_snapshot(self, token: object) -> _Snapshot | None:
        """Ask the engine for its block set and wait for that answer in the queue (None:
        asked to stop meanwhile). Batches before it are contained in it: dropped."""
        await self._snapshot(
            lambda hashes, token=token: self._put_threadsafe(_Snapshot(token, hashes))
        )
        while True:
            item = await self._queue.get()
            if item is _STOP:
                return None
            if isinstance(item, _Snapshot) and item.token is token:
                return item

    async def _drain_until_stop(self) -> bool:
        while True:
            if await self._queue.get() is _STOP:
                return False

    async def _heartbeat_loop(self) -> None:
        failed = False
        while True:
            known = self._known
            try:
                anew = await self._op(self.index.heartbeat(self.pod, self._load_fn(), self._ttl_s))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failed = True
                self._mark_down("sending the heartbeat", exc)
                self._queue.put_nowait(_Wake())
            else:
                if failed:
                    failed = False
                    self._back.set()
                if anew is not None:
                    self._known = True
                if anew and known:
                    self._mark_lost("sending the heartbeat")
                # The index is back, or a periodic resync is due: wake the apply loop, which
                # checks only between items (an idle engine sends none, and the periodic
                # resync is what repairs keys Redis dropped without an error: a flush, an
                # eviction, a failover to a replica that was behind).
                if self._need_resync or self._periodic_due():
                    self._queue.put_nowait(_Wake())
            await asyncio.sleep(self._heartbeat_s)

    def _periodic_due(self) -> bool:
        return (
            self._resync_interval_s > 0
            and time.monotonic() - self._last_resync > self._resync_interval_s
        )
