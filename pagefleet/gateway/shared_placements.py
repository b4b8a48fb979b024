"""Recent placements shared between gateway replicas over one Redis pub/sub channel.

Why: each replica remembers where it sent each prompt's blocks until the index learns them
(placements.py). With several replicas, a new tenant's burst split over them was placed by
each replica blind to the others' in-flight twins: measured on bench/routing.py's agentic
shape with two replicas (docs/benchmarks.md, sessions 4 and 5), the hit rate fell several
points, nearly all of it prompt tokens lost to twins the other replica had placed.

How: a replica publishes every placement (its id, the pod, the prompt's block keys) on the
channel ``<index prefix>placements``, batched in one pipeline per event-loop turn and off
the request path (nothing waits for it); every replica folds the other replicas' messages
into its own ``PlacementMemory`` as records that hold for ``horizon_s`` (how long a request
may stay in flight before the index knows its blocks; the sender's end is not published:
one message per request). So the lookup stays one Redis round trip, and sharing costs one
PUBLISH per request in a background pipeline.

A replica that no other replica listens to publishes nothing: PUBLISH answers how many
subscribers got the message, and when no other replica's listener did (1: this replica's
own), publishing pauses for ``alone_recheck_s``; the next placement after that publishes
again and asks anew. A replica that starts beside a lone one is thus seen within that
time, and a single gateway pays nothing per request (measured: the publish and its own
echo cost CPU and wake-ups on the request path).

Invariant: sharing never fails a request, and never holds more than ``max_queued``
placements in memory. A Redis error (down, or an ACL user without pub/sub rights) or a
publish that gets no answer within ``publish_timeout_s`` (a paused or partitioned Redis
that accepts and never answers) pauses it with one warning per outage, the replica routes
on its own memory as without sharing, and it retries every ``retry_s`` (a restarted Redis
resumes it). While a publish is outstanding, placements beyond ``max_queued`` drop the
oldest (counted in ``dropped``): a placement is worth sharing only for moments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

from pagefleet.gateway.placements import PlacementMemory

logger = logging.getLogger(__name__)

# A placement message: replica id (16 bytes), pod name length (2), pod, keys (8 each).
_HEAD = struct.Struct("<16sH")


def encode(replica: bytes, pod: str, keys: Sequence[int]) -> bytes:
    """One placement as bytes (keys are 64-bit unsigned block hashes)."""
    p = pod.encode()
    return _HEAD.pack(replica, len(p)) + p + struct.pack(f"<{len(keys)}Q", *keys)


def decode(data: bytes) -> tuple[bytes, str, list[int]]:
    """``encode``'s inverse; raises ValueError on a malformed message."""
    if len(data) < _HEAD.size:
        raise ValueError("placement message too short")
    replica, n = _HEAD.unpack_from(data)
    start = _HEAD.size + n
    body = data[start:]
    if len(body) % 8:
        raise ValueError("placement message keys not a multiple of 8 bytes")
    keys = list(struct.unpack(f"<{len(body) // 8}Q", body))
    return replica, data[_HEAD.size : start].decode(), keys


class SharedPlacements:
    """Publishes this replica's placements; folds the other replicas' into ``memory``."""

    def __init__(
        self,
        client: Any,  # redis.asyncio.Redis
        channel: str,
        memory: PlacementMemory,
        horizon_s: float = 10.0,
        retry_s: float = 5.0,
        alone_recheck_s: float = 1.0,
        publish_timeout_s: float = 1.0,
        max_queued: int = 512,
    ) -> None:
        self.client = client
        self.channel = channel
        self.memory = memory
        self.horizon_s = horizon_s
        self.retry_s = retry_s
        self.alone_recheck_s = alone_recheck_s
        self.published = 0  # placements published (not skipped while alone)
        self._alone_until = 0.0  # no other replica listened at the last publish
        self.replica = uuid.uuid4().bytes
        self.received = 0  # other replicas' placements folded in
        # A publish round trip takes milliseconds; one that takes longer counts as failed.
        self.publish_timeout_s = publish_timeout_s
        self.dropped = 0  # placements dropped unpublished: the queue was full
        # Placements waiting for the publisher: the oldest drop first beyond ``max_queued``
        # (a Redis that never answers held every placement in memory for the whole hang).
        self._out: deque[bytes] = deque(maxlen=max_queued)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._subscribed = asyncio.Event()
        self._broken = False
        self._closing = False

    def sent(self, keys: Sequence[int], pod: str) -> None:
        """This replica sent a prompt with ``keys`` to ``pod`` (never blocks)."""
        if self._broken or not keys:
            return
        if self._alone_until and self.memory.clock() < self._alone_until:
            return
        self._alone_until = 0.0
        if len(self._out) == self._out.maxlen:
            self.dropped += 1  # the append below pushes out the oldest
        self._out.append(encode(self.replica, pod, keys))
        self._wake.set()

    async def start(self, wait_s: float = 2.0) -> None:
        """Subscribe (waiting up to ``wait_s`` for the subscription) and start publishing."""
        self._tasks = [
            asyncio.create_task(self._listen(), name="gateway-placements-listen"),
            asyncio.create_task(self._publish(), name="gateway-placements-publish"),
        ]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await self._subscribed.wait()

    async def close(self, wait_s: float = 3.0) -> None:
        """Stop both loops within ``wait_s``. A cancel alone is not enough: redis-py's
        ``get_message`` can swallow the CancelledError (seen: a gateway's cleanup waited on
        it for minutes), so the listener also checks ``_closing`` after every read."""
        self._closing = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=wait_s)
            for t in pending:
                logger.warning(
                    "placement-sharing task %s did not stop in %.0f s", t.get_name(), wait_s
                )
        for t in self._tasks:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved: a failure at shutdown is not worth a warning
        self._tasks = []

    def _failed(self, what: str, exc: BaseException) -> None:
        """Stop sharing until the next success (one warning per outage)."""
        if not self._broken:
            logger.warning(
                "sharing placements with other gateway replicas paused (%s failed: %s: %s); "
                "this replica routes on its own placements and the index, retrying every "
                "%.0f s",
                what,
                type(exc).__name__,
                exc,
                self.retry_s,
            )
        self._broken = True
        self._out.clear()

    def _recovered(self) -> None:
        if self._broken:
            logger.info("sharing placements with other gateway replicas resumed")
        self._broken = False

    async def _publish(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._out = self._out, deque(maxlen=self._out.maxlen)
            if not batch:
                continue
            try:
                async with (
                    asyncio.timeout(self.publish_timeout_s),
                    self.client.pipeline(transaction=False) as pipe,
                ):
                    for msg in batch:
                        pipe.publish(self.channel, msg)
                    receivers = await pipe.execute()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, TimeoutError) and not str(exc):
                    exc = TimeoutError(f"no answer within {self.publish_timeout_s:.1f} s")
                self._failed("publish", exc)
                await asyncio.sleep(self.retry_s)
                self._broken = False  # publish again; the next failure warns again
                continue
            self.published += len(batch)
            # Each count includes this replica's own listener: at most 1, nobody else.
            if all(int(n) <= 1 for n in receivers):
                self._alone_until = self.memory.clock() + self.alone_recheck_s

    async def _listen(self) -> None:
        while not self._closing:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self._recovered()
                self._subscribed.set()
                while not self._closing:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    try:
                        replica, pod, keys = decode(msg["data"])
                    except (ValueError, UnicodeDecodeError, struct.error) as exc:
                        logger.debug("ignoring a malformed placement message: %s", exc)
                        continue
                    if replica == self.replica:
                        continue
                    self.memory.remember(keys, pod, self.memory.clock() + self.horizon_s)
                    self.received += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed("subscribe", exc)
                self._subscribed.set()  # start() waits no longer
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            if not self._closing:
                await asyncio.sleep(self.retry_s)
