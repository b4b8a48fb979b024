"""The publisher's resync when the engine does not answer its snapshot request."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from pagefleet.daemon.publisher import KVEventPublisher
from pagefleet.kvindex.events import BlockStored, KVEventBatch
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.memory import MemoryKVIndex


async def _no_blocks(deliver: Callable[[set[int]], None]) -> None:
    """An engine holding no blocks: the snapshot the publisher asks for."""
    deliver(set())


async def test_an_unanswered_snapshot_is_asked_again_and_the_resync_completes() -> None:
    """The first request for the engine's block set is never answered (as if lost in a step);
    the publisher must not wait on it forever: it asks again and resyncs the index."""
    index = MemoryKVIndex()
    asked: list[int] = []

    async def snapshot(deliver: Callable[[set[int]], None]) -> None:
        asked.append(len(asked))
        if len(asked) > 1:  # the first request is swallowed
            deliver({11, 22, 33})

    pub = KVEventPublisher(
        index,
        "pod-a",
        asyncio.get_running_loop(),
        load_fn=PodLoad,
        snapshot=snapshot,
        heartbeat_s=0.05,
        snapshot_timeout_s=0.2,
        backoff_initial_s=0.01,
    )
    await pub.start()
    try:
        await asyncio.wait_for(pub.in_sync.wait(), 5)
        await pub.resync_now()
        # Cleared by the resync request, set again only once a snapshot reached the index.
        await asyncio.wait_for(_until(lambda: pub.resyncs == 1), 5)
        assert pub.snapshot_timeouts == 1 and len(asked) == 2
        assert index.block_set("pod-a") == {11, 22, 33}
        assert pub.in_sync.is_set()
    finally:
        await pub.close()


async def test_stop_while_waiting_for_a_snapshot_ends_the_publisher() -> None:
    """An engine that never answers and a daemon that stops: close() returns promptly."""
    index = MemoryKVIndex()

    async def snapshot(deliver: Callable[[set[int]], None]) -> None:
        return None  # never delivers

    pub = KVEventPublisher(
        index, "pod-b", asyncio.get_running_loop(), load_fn=PodLoad, snapshot=snapshot,
        heartbeat_s=0.05, snapshot_timeout_s=30.0,
    )  # fmt: skip
    await pub.start()
    await asyncio.wait_for(pub.in_sync.wait(), 5)
    await pub.resync_now()
    await asyncio.sleep(0.1)
    await asyncio.wait_for(pub.close(timeout_s=2.0), 3)
    assert index.block_set("pod-b") == set()


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def test_a_cancel_that_lands_as_an_index_call_ends_still_stops_the_heartbeat() -> None:
    """close() cancels the heartbeat task; when that cancel lands in the loop turn where the
    task's index call completes (ordering injected here: the call itself cancels the task),
    the task must still end. Python 3.11's asyncio.wait_for returned the call's result then
    and dropped the cancel: the task slept and beat on, and close() awaited it forever (the
    CI hang of test_publisher_resyncs_after_outage)."""
    pub: KVEventPublisher | None = None

    class CancelledAsItAnswers(MemoryKVIndex):
        async def heartbeat(self, pod, load, ttl_s):
            await super().heartbeat(pod, load, ttl_s)
            assert pub is not None
            pub._tasks[1].cancel()

    pub = KVEventPublisher(
        CancelledAsItAnswers(), "pod-c", asyncio.get_running_loop(), load_fn=PodLoad,
        snapshot=_no_blocks, heartbeat_s=0.05,
    )  # fmt: skip
    await pub.start()
    heartbeat = pub._tasks[1]
    done, _ = await asyncio.wait([heartbeat], timeout=2.0)
    assert heartbeat in done and heartbeat.cancelled(), "the cancel was swallowed"
    await asyncio.wait_for(pub.close(), 5)


async def test_close_is_bounded_when_a_task_swallows_its_cancel(caplog) -> None:
    """close() bounds its waits even for a task that ignores cancellation (an index call
    that hangs inside a suppressing handler, a library bug): on Python 3.11, wait_for's
    timeout cancelled the task and then awaited it without a bound."""
    release = asyncio.Event()

    class Stubborn(KVEventPublisher):
        async def _apply_loop(self) -> None:
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await release.wait()

    pub = Stubborn(
        MemoryKVIndex(), "pod-d", asyncio.get_running_loop(), load_fn=PodLoad,
        snapshot=_no_blocks, heartbeat_s=0.05,
    )  # fmt: skip
    await pub.start()
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.shield(pub.close(timeout_s=0.2)), 5)
    finally:
        release.set()
    assert time.monotonic() - t0 < 2.0
    assert "did not stop" in caplog.text


def _blocks(seq: int, n: int = 1) -> KVEventBatch:
    return KVEventBatch(
        time.time(), seq, [BlockStored([seq * 100 + i for i in range(n)], None, [], 16)]
    )


async def test_the_periodic_resync_runs_while_the_engine_is_idle() -> None:
    """The periodic resync repairs an index that lost the pod's keys without an error (a
    Redis flush, an eviction, a failover to a lagging replica). It was checked only between
    queued items: an idle engine queues none, so the pod looked live and held nothing."""
    index = MemoryKVIndex()
    held: set[int] = set()

    async def snapshot(deliver: Callable[[set[int]], None]) -> None:
        deliver(set(held))

    pub = KVEventPublisher(index, "pod-a", asyncio.get_running_loop(), load_fn=PodLoad,
                           snapshot=snapshot, heartbeat_s=0.05, resync_interval_s=0.2)  # fmt: skip
    await pub.start()
    try:
        await asyncio.wait_for(pub.in_sync.wait(), 5)
        held.update({100})
        pub.sink(_blocks(1))
        await _until(lambda: pub.events_applied == 1)
        await index.clear_pod("pod-a")  # the index lost the pod's entries
        before = pub.resyncs
        await asyncio.wait_for(_until(lambda: pub.resyncs > before), 3)
        assert index.block_set("pod-a") == {100}
    finally:
        await pub.close()


class _SlowIndex(MemoryKVIndex):
    """Each apply takes a round trip longer than the engine's steps (a loaded Redis)."""

    calls = 0

    async def apply(self, pod: str, batch: KVEventBatch) -> None:
        self.calls += 1
        await asyncio.sleep(0.01)
        await super().apply(pod, batch)


async def test_batches_queued_behind_a_slow_index_go_in_one_call() -> None:
    """One index call a batch, at 10 ms a call, fell behind a batch every 5 ms for good;
    the queued batches now go together, in order, and the backlog stays small."""
    index = _SlowIndex()

    pub = KVEventPublisher(index, "pod-a", asyncio.get_running_loop(), load_fn=PodLoad,
                           snapshot=_no_blocks, heartbeat_s=0.1)  # fmt: skip
    await pub.start()
    try:
        await asyncio.wait_for(pub.in_sync.wait(), 5)
        sizes = []
        for seq in range(1, 301):
            pub.sink(_blocks(seq))
            await asyncio.sleep(0.005)
            if seq % 100 == 0:
                sizes.append(pub._queue.qsize())
        await _until(lambda: pub.events_applied == 300)
        assert max(sizes) < 20, f"the backlog grew: {sizes}"
        assert index.calls < 300
        assert len(index.block_set("pod-a")) == 300
    finally:
        await pub.close()
