"""In-memory KV index: the Redis backend's semantics in plain Python.

Serves tests and the single-machine mode, where the gateway and the daemons share one
process or where no Redis is wanted. Not shared between processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagefleet.kvindex.index import PodLoad


class MemoryKVIndex:
    """block -> pods and pod -> blocks dicts plus heartbeats with expiry.

    ``clock`` is monotonic seconds; tests may inject a fake one.
    """

    def __init__(
        self,
        namespace: str = "",
        clock: Callable[[], float] = time.monotonic,
        auto_gc_interval_s: float | None = 30.0,
        auto_gc_grace_s: float = 30.0,
    ) -> None:
        """``auto_gc_interval_s``: as in RedisKVIndex, heartbeat()/pods() run gc at most
        this often. None disables it."""
        self.namespace = namespace
        self._clock = clock
        self._auto_gc_interval_s = auto_gc_interval_s
        self._auto_gc_grace_s = auto_gc_grace_s
        self._next_auto_gc = (
            clock() + auto_gc_interval_s if auto_gc_interval_s is not None else float("inf")
        )
        self._block_pods: dict[int, set[str]] = {}
        self._pod_blocks: dict[str, set[int]] = {}
        self._loads: dict[str, PodLoad] = {}
        # pod -> time after which it is dead (heartbeat expiry, or last apply if it never
        # sent a heartbeat); gc counts its grace from here.
        self._expires: dict[str, float] = {}
        self._live_until: dict[str, float] = {}

    # -- writes -------------------------------------------------------------------------

    async def apply(self, pod: str, batch: KVEventBatch) -> bool:
        # Validate the whole batch first so a bad hash never leaves it half applied.
        for event in batch.events:
            if isinstance(event, BlockStored | BlockRemoved):
                for h in event.block_hashes:
                    _check_hash(h)
        anew = pod not in self._expires and any(
            isinstance(e, BlockStored) and e.block_hashes for e in batch.events
        )
        self._touch(pod)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(pod, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(pod, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear(pod)
            else:
                raise TypeError(
                    f"unknown KV event {event!r}; expected BlockStored, "
                    "BlockRemoved or AllBlocksCleared"
                )
        return anew

    async def heartbeat(self, pod: str, load: PodLoad, ttl_s: float) -> bool:
        if ttl_s <= 0:
            raise ValueError(f"heartbeat ttl_s must be positive, got {ttl_s}")
        anew = pod not in self._expires
        until = self._clock() + ttl_s
        self._loads[pod] = load
        self._live_until[pod] = until
        self._expires[pod] = max(self._expires.get(pod, until), until)
        await self._maybe_auto_gc()
        return anew

    async def clear_pod(self, pod: str) -> None:
        self._clear(pod)

    async def resync(self, pod: str, block_hashes: set[int]) -> None:
        for h in block_hashes:
            _check_hash(h)
        self._touch(pod)
        self._clear(pod)
        self._store(pod, block_hashes)

    async def gc(self, grace_s: float = 30.0) -> int:
        now = self._clock()
        dead = [
            pod
            for pod, exp in self._expires.items()
            if not self._is_live(pod, now) and exp + grace_s <= now
        ]
        for pod in dead:
            self._clear(pod)
            self._pod_blocks.pop(pod, None)
            self._loads.pop(pod, None)
            self._expires.pop(pod, None)
            self._live_until.pop(pod, None)
        return len(dead)

    async def close(self) -> None:
        return None

    # -- reads --------------------------------------------------------------------------

    async def lookup(self, block_hashes: list[int]) -> dict[str, int]:
        matched: dict[str, int] = {}
        if not block_hashes:
            return matched
        now = self._clock()
        first = self._block_pods.get(block_hashes[0])
        if not first:
            return matched
        alive = {p for p in first if self._is_live(p, now)}
        for i, h in enumerate(block_hashes):
            holders = self._block_pods.get(h)
            still = alive & holders if holders else set()
            for pod in alive - still:
                matched[pod] = i
            alive = still
            if not alive:
                break
        for pod in alive:
            matched[pod] = len(block_hashes)
        return {p: n for p, n in matched.items() if n > 0}

    async def pods(self) -> dict[str, PodLoad]:
        await self._maybe_auto_gc()
        now = self._clock()
        return {p: load for p, load in self._loads.items() if self._is_live(p, now)}

    def block_set(self, pod: str) -> set[int]:
        """A copy of the blocks ``pod`` holds (live or not): for tests and debugging."""
        return set(self._pod_blocks.get(pod, ()))

    # -- internals ----------------------------------------------------------------------

    async def _maybe_auto_gc(self) -> None:
        now = self._clock()
        if self._auto_gc_interval_s is None or now < self._next_auto_gc:
            return
        self._next_auto_gc = now + self._auto_gc_interval_s
        await self.gc(self._auto_gc_grace_s)

    def _is_live(self, pod: str, now: float) -> bool:
        return self._live_until.get(pod, float("-inf")) > now

    def _touch(self, pod: str) -> None:
        now = self._clock()
        self._expires[pod] = max(self._expires.get(pod, now), now)

    def _store(self, pod: str, hashes: Iterable[int]) -> None:
        mine = self._pod_blocks.setdefault(pod, set())
        for h in hashes:
            mine.add(h)
            self._block_pods.setdefault(h, set()).add(pod)

    def _remove(self, pod: str, hashes: Iterable[int]) -> None:
        mine = self._pod_blocks.get(pod)
        if not mine:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                self._unlink(h, pod)

    def _clear(self, pod: str) -> None:
        mine = self._pod_blocks.get(pod)
        if not mine:
            return
        for h in mine:
            self._unlink(h, pod)
        mine.clear()

    def _unlink(self, h: int, pod: str) -> None:
        holders = self._block_pods.get(h)
        if holders is not None:
            holders.discard(pod)
            if not holders:
                del self._block_pods[h]


def _check_hash(h: int) -> None:
    if not 0 <= h < 1 << 64:
        raise ValueError(
            f"block hash {h} is not an unsigned 64-bit int; compute keys with "
            "pagefleet.kvindex.hashing.block_hashes"
        )
