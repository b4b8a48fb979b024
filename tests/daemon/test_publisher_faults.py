"""The publisher under index faults that land while a resync is in flight, or that an
index loses the pod's entries without any call failing (a flush, a restart between two
heartbeats, gc of a pod that stalled): the pod's entry must come back whole, promptly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pagefleet.daemon.publisher import KVEventPublisher
from pagefleet.dev.redis_server import LocalRedis
from pagefleet.kvindex.events import BlockStored, KVEventBatch
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.memory import MemoryKVIndex
from pagefleet.kvindex.redis_index import RedisKVIndex


async def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class _RestartsDuringResync(MemoryKVIndex):
    """A resync whose write reached the server and whose reply is still on its way when
    the server restarts empty: the heartbeat sees the restart (its connection drops) before
    the publisher reads the resync's reply (both sockets ready in one loop turn)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold_resync = False
        self.resync_written = asyncio.Event()
        self.reply = asyncio.Event()
        self.down = False
        self.heartbeat_failures = 0

    async def resync(self, pod: str, block_hashes: set[int]) -> None:
        await super().resync(pod, block_hashes)
        if self.hold_resync:
            self.hold_resync = False
            self.resync_written.set()
            await self.reply.wait()

    async def heartbeat(self, pod: str, load: PodLoad, ttl_s: float) -> None:
        if self.down:
            self.heartbeat_failures += 1
            raise ConnectionError("Connection closed by server.")
        await super().heartbeat(pod, load, ttl_s)

    def restart_empty(self) -> None:
        self._block_pods.clear()
        self._pod_blocks.clear()
        self.down = True


async def test_a_failure_seen_while_a_resync_is_in_flight_is_resynced_again() -> None:
    """The suspicion: the "resync needed" flag set by a failure is cleared before the
    resync that repairs it happened. It was: the heartbeat marked the index down while a
    resync's reply was on its way, and that resync's success then cleared the flag; the
    index, restarted empty after the resync's write, stayed without the pod's blocks until
    the periodic resync (a minute by default)."""
    index = _RestartsDuringResync()
    held = {101, 102, 103}

    async def snapshot(deliver: Callable[[set[int]], None]) -> None:
        deliver(set(held))

    pub = KVEventPublisher(index, "pod-a", asyncio.get_running_loop(), load_fn=PodLoad,
                           snapshot=snapshot, heartbeat_s=0.02, backoff_initial_s=0.01,
                           resync_interval_s=3600.0)  # fmt: skip
    await pub.start()
    try:
        await asyncio.wait_for(pub.in_sync.wait(), 5)
        index.hold_resync = True
        await pub.resync_now()
        await asyncio.wait_for(index.resync_written.wait(), 5)
        assert index.block_set("pod-a") == held
        index.restart_empty()  # after the resync's write, before its reply is read
        await _until(lambda: index.heartbeat_failures > 0)
        index.down = False  # back (empty) at once
        index.reply.set()  # the resync's reply: success
        await _until(lambda: index.block_set("pod-a") == held and pub.in_sync.is_set())
    finally:
        await pub.close()


async def test_a_flushed_index_gets_the_whole_block_set_back_within_heartbeats() -> None:
    """FLUSHALL (or an eviction, or gc of a pod that stalled past its heartbeat's TTL and
    grace) drops the pod's entries and no call fails: the publisher noticed nothing, kept
    in_sync set, and the pod held nothing in the index until the periodic resync (a minute
    by default), so the gateway's hit prediction for it stayed at zero that long. The
    heartbeat that registers the pod anew now tells the publisher, which resyncs."""
    held = {1000 + i for i in range(8)}

    async def snapshot(deliver: Callable[[set[int]], None]) -> None:
        deliver(set(held))

    async with LocalRedis() as srv:
        index = RedisKVIndex.from_url(srv.url, namespace="faults")
        reader = RedisKVIndex.from_url(srv.url, namespace="faults")
        pub = KVEventPublisher(index, "pod-a", asyncio.get_running_loop(), load_fn=PodLoad,
                               snapshot=snapshot, heartbeat_s=0.05,
                               resync_interval_s=3600.0)  # fmt: skip
        await pub.start()
        try:
            await asyncio.wait_for(pub.in_sync.wait(), 5)
            pub.sink(KVEventBatch(time.time(), 1, [BlockStored(sorted(held), None, [], 16)]))
            await _until(lambda: pub.events_applied == 1)
            assert await reader.lookup(sorted(held)) == {"pod-a": len(held)}
            assert pub.resyncs == 0  # a first registration is no loss
            await reader.client.flushall()
            found: dict[str, int] = {}
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                found = await reader.lookup(sorted(held))
                if found:
                    break
                await asyncio.sleep(0.05)
            assert found == {"pod-a": len(held)}
            await _until(lambda: pub.in_sync.is_set() and pub.idle)
        finally:
            await pub.close()
            await reader.close()


class _Partitioned(MemoryKVIndex):
    """Every write fails while ``down`` (a daemon cut off from Redis); reads still work."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("Connection refused")

    async def apply(self, pod, batch):  # type: ignore[no-untyped-def]
        self._check()
        return await super().apply(pod, batch)

    async def heartbeat(self, pod, load, ttl_s):  # type: ignore[no-untyped-def]
        self._check()
        return await super().heartbeat(pod, load, ttl_s)

    async def resync(self, pod, block_hashes):  # type: ignore[no-untyped-def]
        self._check()
        await super().resync(pod, block_hashes)

    async def clear_pod(self, pod):  # type: ignore[no-untyped-def]
        self._check()
        await super().clear_pod(pod)


async def test_a_restarted_pods_heartbeat_after_an_outage_does_not_revive_its_old_blocks() -> None:
    """A daemon killed (its entries left behind) and restarted under the same name with an
    empty cache while Redis is unreachable: when Redis answers again, its first heartbeat
    makes the previous life's blocks count again. They attracted requests (a full hit
    predicted on a pod holding nothing) until the resync's backoff sleep ran out, up to
    ``backoff_max_s`` (5 s by default); the resync now follows the heartbeat at once."""
    index = _Partitioned()
    old = [7000 + i for i in range(6)]
    loop = asyncio.get_running_loop()
    await index.heartbeat("pod-a", PodLoad(), 0.05)  # the previous life, killed
    await index.apply("pod-a", KVEventBatch(time.time(), 1, [BlockStored(old, None, [], 16)]))
    while await index.lookup(old):  # until that life's heartbeat expired
        await asyncio.sleep(0.01)

    async def empty(deliver: Callable[[set[int]], None]) -> None:
        deliver(set())

    index.down = True
    pub = KVEventPublisher(index, "pod-a", loop, load_fn=PodLoad, snapshot=empty,
                           heartbeat_s=0.02, backoff_initial_s=2.0, backoff_max_s=2.0)  # fmt: skip
    await pub.start()
    try:
        await asyncio.sleep(0.3)  # the clear, heartbeats and a resync failed meanwhile
        assert await index.lookup(old) == {}
        index.down = False
        stale_s, t0 = 0.0, time.monotonic()
        while time.monotonic() - t0 < 2.5:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            if await index.lookup(old):
                stale_s += time.monotonic() - t
        assert stale_s < 0.5, f"the old life's blocks counted for {stale_s:.2f} s"
        assert await index.lookup(old) == {} and index.block_set("pod-a") == set()
        assert pub.in_sync.is_set()
    finally:
        await pub.close()


class _Flapping(MemoryKVIndex):
    """An index that loses the pod between any two heartbeats (a Redis failing over to an
    empty replica again and again, an eviction policy that keeps dropping its keys): every
    heartbeat registers the pod anew."""

    beats = 0

    async def heartbeat(self, pod, load, ttl_s):  # type: ignore[no-untyped-def]
        self.beats += 1
        self._clear(pod)
        self._expires.pop(pod, None)  # and forgets it was ever there
        return await super().heartbeat(pod, load, ttl_s)


async def test_an_index_that_keeps_losing_the_pod_is_warned_about_once_an_interval(
    caplog,
) -> None:
    """Each loss logged a warning: an index flapping at the heartbeat's rate wrote one a
    heartbeat (20 a second here, one a second by default) for as long as it flapped,
    burying every other line. Now one warning an interval; the next one says how many
    losses went unlogged meanwhile, and ``losses`` counts them all."""

    async def snapshot(deliver: Callable[[set[int]], None]) -> None:
        deliver(set())

    index = _Flapping()
    pub = KVEventPublisher(index, "pod-a", asyncio.get_running_loop(), load_fn=PodLoad,
                           snapshot=snapshot, heartbeat_s=0.05,
                           resync_interval_s=3600.0)  # fmt: skip
    caplog.set_level("WARNING", logger="pagefleet.daemon.publisher")

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "lost pod" in r.getMessage()]

    await pub.start()
    try:
        await _until(lambda: index.beats >= 10)  # nine losses at least (the first: none)
        assert len(warned()) == 1, warned()
        assert pub.losses >= 9
        # The interval passes: one more warning, naming the losses it did not log.
        pub._lost_log.interval_s = 0.0
        await _until(lambda: len(warned()) >= 2)
        assert "not logged" in warned()[1] and "more" in warned()[1], warned()[1]
        assert pub.resyncs >= 1, "a loss still asks for a resync, logged or not"
    finally:
        await pub.close()
