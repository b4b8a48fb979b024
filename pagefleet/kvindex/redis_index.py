"""Redis backend of the global prefix index (docs/architecture.md), redis-py asyncio.

Layout, all keys under the namespace prefix ``P = pf:{ns=<namespace>}:`` (one hash tag, so
one Redis Cluster slot, so one Lua script may touch them all):

``P b<2 bytes>``  HASH  block table. The bucket is the hash's first two bytes with all but
                        the top ``bucket_bits`` bits zeroed (binary, so the script builds the
                        key without number formatting); the field is the hash's last 7 bytes;
                        the value is the sorted 2-byte ids of the pods holding the block.
                        Small hashes stay in Redis' listpack encoding: ~13 bytes per block
                        instead of the ~100+ bytes of one Redis key per block.
``P r:<id>``      LIST  the pod's reverse log: packed 8-byte hashes it added, so clearing a
                        pod costs O(its blocks); compacted when removals dominate.
``P r2:<id>``     LIST  the new set's log while a resync is in flight (then becomes ``r:<id>``).
``P rs:<id>``     SET   the new set's members while a resync is in flight (temporary).
``P pod`` / ``P pid``  HASH  pod name -> id / id -> name (ids are small and reused).
``P hb:<id>``     STRING  the pod's last load (JSON) with the heartbeat TTL.
``P exp``         HASH  id -> ms after which the pod counts as dead (gc's grace starts here).
``P st``          HASH  per-id counters: held blocks, logged hashes.
``P dead``        SET   retired ids whose entries gc() still has to sweep.
``P cfg``         STRING  bucket_bits, fixed by the first writer so all clients agree.

A pod counts only while ``hb:<id>`` exists, so dead pods vanish from lookups the moment
their heartbeat expires; ``gc()`` removes their entries later. Clearing a pod (an
AllBlocksCleared event, ``clear_pod``) gives it a fresh id, which hides the old entries at
once in O(1); gc sweeps them in bounded slices. ``resync`` instead applies the difference,
so the blocks a pod keeps never blink out of lookups (daemons resync periodically).
"""

from __future__ import annotations

import logging
import math
import struct
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import NoScriptError, RedisError, ResponseError

from pagefleet.kvindex import redis_lua
from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.redis_auth import RedisCredentials, credentials_from_env

logger = logging.getLogger(__name__)

# Hashes per script call: bounds how long one call holds Redis (a few ms).
CHUNK = 1024
# Blocks per lookup script call (see lookup()).
LOOKUP_SEGMENT = 4096
# Hash removals per gc() script call (a few ms of Redis time, like every other call).
GC_BUDGET = 2048
# Connect and per-reply read limits of clients made by ``from_url``: every call answers in
# milliseconds (scripts are bounded above), so a Redis silent this long is hung, and the
# call fails instead of waiting forever (older redis-py releases set no limit at all).
SOCKET_TIMEOUT_S = 5.0


def suggest_bucket_bits(expected_blocks: int, per_bucket: int = 64) -> int:
    """Bucket bits that put ~``per_bucket`` blocks in each bucket hash.

    Fewer blocks per bucket: faster field scans, more per-key overhead; more: the reverse.
    ~64 keeps both small, far below the listpack entry limit (512 by default).
    """
    want = max(1, expected_blocks // per_bucket)
    return min(16, max(8, round(math.log2(want))))


def key_prefix(namespace: str) -> str:
    """Prefix of every key of ``namespace``; its ``{...}`` is the Cluster hash tag."""
    return f"pf:{{ns={namespace}}}:"


def pack_hashes(hashes: Sequence[int] | set[int]) -> bytes:
    """Block hashes as 8-byte big-endian strings, concatenated."""
    try:
        return struct.pack(f">{len(hashes)}Q", *hashes)
    except struct.error as exc:
        bad = next((h for h in hashes if not (isinstance(h, int) and 0 <= h < 1 << 64)), None)
        raise ValueError(
            f"block hash {bad!r} is not an unsigned 64-bit int; compute keys with "
            "pagefleet.kvindex.hashing.block_hashes"
        ) from exc


class _Script:
    """One Lua script, run by EVALSHA; reloaded when the server lost its script cache."""

    def __init__(self, name: str, body: str) -> None:
        self.name = name
        self.body = body
        self.sha = ""

    async def load(self, client: aredis.Redis) -> str:
        self.sha = str(await client.script_load(self.body))
        return self.sha

    async def __call__(self, client: aredis.Redis, prefix: str, *args: Any) -> Any:
        if not self.sha:
            await self.load(client)
        try:
            return await client.evalsha(self.sha, 1, prefix, *args)
        except NoScriptError:
            await self.load(client)  # Redis restarted or SCRIPT FLUSH
            return await client.evalsha(self.sha, 1, prefix, *args)


class RedisKVIndex:
    """KVIndex on Redis; one instance per namespace; safe to share within one event loop."""

    def __init__(
        self,
        client: aredis.Redis,
        namespace: str = "",
        bucket_bits: int = 14,
        owns_client: bool = False,
        auto_gc_interval_s: float | None = 30.0,
        auto_gc_grace_s: float = 30.0,
    ) -> None:
        """``bucket_bits``: 2^bits bucket hashes; 14 suits ~0.5-2M distinct blocks (see
        suggest_bucket_bits); the namespace's first writer fixes it for every client.

        ``auto_gc_interval_s``: at most this often, a heartbeat() or pods() call also
        runs one bounded gc step, so dead pods get cleaned without anyone scheduling gc()
        (every daemon heartbeats; any replica may do it). None disables it."""
        if not 8 <= bucket_bits <= 16:
            raise ValueError(f"bucket_bits must be within 8..16, got {bucket_bits}")
        self.client = client
        self.namespace = namespace
        # Only the first writer's value counts (stored under P cfg); see module docstring.
        self.bucket_bits = bucket_bits
        self.prefix = key_prefix(namespace)
        self._owns_client = owns_client
        self._apply = _Script("apply", redis_lua.APPLY)
        self._lookup = _Script("lookup", redis_lua.LOOKUP)
        self._heartbeat = _Script("heartbeat", redis_lua.HEARTBEAT)
        self._pods = _Script("pods", redis_lua.PODS)
        self._gc = _Script("gc", redis_lua.GC)
        self._auto_gc_interval_s = auto_gc_interval_s
        self._next_bad_heartbeat_warning = 0.0
        self._auto_gc_grace_s = auto_gc_grace_s
        self._next_auto_gc = (
            time.monotonic() + auto_gc_interval_s if auto_gc_interval_s is not None else math.inf
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str = "",
        bucket_bits: int = 14,
        credentials: RedisCredentials | None = None,
        **kwargs: Any,
    ) -> RedisKVIndex:
        """Connect lazily to ``url`` (redis://, rediss:// or unix://).

        ``credentials`` (ACL user, password, CA for rediss://) win over the URL's; None
        reads them from the environment (``redis_auth.credentials_from_env``)."""
        creds = credentials_from_env() if credentials is None else credentials
        client = aredis.Redis.from_url(
            url,
            decode_responses=False,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
            **creds.client_kwargs(url),
        )
        return cls(client, namespace=namespace, bucket_bits=bucket_bits, owns_client=True, **kwargs)

    # -- writes -------------------------------------------------------------------------

    async def apply(self, pod: str, batch: KVEventBatch) -> bool:
        return bool(await self._run_events(pod, _encode_events(batch.events)) & 2)

    async def resync(self, pod: str, block_hashes: set[int]) -> None:
        """Replace the pod's set by difference, in bounded script calls.

        One pipeline adds the new set chunk by chunk; then finish calls drop what the pod
        held outside it, a slice each (one more round trip per ~1024 old hashes beyond the
        first slice). Blocks in both sets never drop out of lookups meanwhile; the pod may
        briefly count as holding old blocks too, never fewer.
        """
        packed = pack_hashes(list(block_hashes))
        more = await self._run_events(pod, [b"B", *_chunked(b"A", packed), b"F"])
        while more & 1:
            more = await self._run_events(pod, [b"F"])

    async def clear_pod(self, pod: str) -> None:
        await self._run_events(pod, [b"C"])
        await self._sweep()

    async def heartbeat(self, pod: str, load: PodLoad, ttl_s: float) -> bool:
        if ttl_s <= 0:
            raise ValueError(f"heartbeat ttl_s must be positive, got {ttl_s}")
        ttl_ms = max(1, round(ttl_s * 1000))
        known = await self._heartbeat(
            self.client, self.prefix, self.bucket_bits, pod, load.to_json(), ttl_ms
        )
        await self._maybe_auto_gc()
        return int(known) == 2

    async def gc(self, grace_s: float = 30.0) -> int:
        retired, _left = await self._gc_once(grace_s)
        await self._sweep()
        return retired

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    # -- reads --------------------------------------------------------------------------

    async def lookup(self, block_hashes: list[int]) -> dict[str, int]:
        if not block_hashes:
            return {}
        packed = pack_hashes(block_hashes)
        matched: dict[str, int] = {}
        carry = b""
        # Prompts up to LOOKUP_SEGMENT blocks take one round trip. Longer ones walk a
        # segment per call, and only while some pod still matches, so no single script
        # holds Redis for more than a few milliseconds.
        step = LOOKUP_SEGMENT * 8
        for start in range(0, len(packed), step):
            flat = await self._lookup(
                self.client, self.prefix, packed[start : start + step], start // 8, carry
            )
            carry = flat[0]
            for k in range(1, len(flat), 2):
                # Never more than the prompt's blocks, whatever the index holds.
                n = min(int(flat[k + 1]), len(block_hashes))
                if n > 0:
                    matched[flat[k].decode(errors="replace")] = n
            if not carry:
                break
        return matched

    async def pods(self) -> dict[str, PodLoad]:
        flat = await self._pods(self.client, self.prefix)
        await self._maybe_auto_gc()
        out: dict[str, PodLoad] = {}
        for k in range(0, len(flat), 2):
            name = flat[k].decode(errors="replace")
            try:
                out[name] = PodLoad.from_json(flat[k + 1])
            except ValueError as exc:
                # A malformed (forged or corrupt) heartbeat: that pod is not routed to.
                self._warn_bad_heartbeat(name, exc)
        return out

    # -- internals ----------------------------------------------------------------------

    def _warn_bad_heartbeat(self, pod: str, exc: ValueError) -> None:
        now = time.monotonic()
        if now >= self._next_bad_heartbeat_warning:  # at most one line a minute
            self._next_bad_heartbeat_warning = now + 60.0
            logger.warning("index %s: ignoring pod %r, bad heartbeat: %s", self.prefix, pod, exc)

    async def _run_events(self, pod: str, args: list[bytes]) -> int:
        """Run the apply script over ``args`` in CHUNK-sized calls, all in one round trip.

        Returns the last call's result, 1 when a resync finish ('F') has more to do, plus 2
        when any call's stored blocks registered a pod the index did not know. Pipelined
        calls run in order. Re-running a suffix of them after NOSCRIPT is safe: the failed
        calls never ran.
        """
        calls = _group(args)
        if not calls:
            return 0
        if not self._apply.sha:
            await self._apply.load(self.client)
        done: list[int] = []
        for _attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for call in calls:
                pipe.evalsha(self._apply.sha, 1, self.prefix, self.bucket_bits, pod, *call)
            results = await pipe.execute(raise_on_error=False)
            failed = next((i for i, r in enumerate(results) if isinstance(r, Exception)), None)
            if failed is None:
                done += [int(r) for r in results]
                return (done[-1] & 1) | (2 if any(r & 2 for r in done) else 0)
            err = results[failed]
            if not isinstance(err, NoScriptError):
                raise err
            done += [int(r) for r in results[:failed]]
            calls = calls[failed:]
            await self._apply.load(self.client)
        raise ResponseError("pagefleet index: apply script kept missing after SCRIPT LOAD")

    async def _gc_once(self, grace_s: float) -> tuple[int, int]:
        retired, left = await self._gc(
            self.client, self.prefix, max(0, round(grace_s * 1000)), GC_BUDGET
        )
        return int(retired), int(left)

    async def _maybe_auto_gc(self) -> None:
        now = time.monotonic()
        if now < self._next_auto_gc:
            return
        assert self._auto_gc_interval_s is not None
        self._next_auto_gc = now + self._auto_gc_interval_s
        try:
            retired, left = await self._gc_once(self._auto_gc_grace_s)
        except (RedisError, OSError) as exc:
            # gc is housekeeping: never fail the caller's call, whose own command already
            # went through. A connection error here used to fail a heartbeat that had been
            # written, and its publisher then resynced its whole block set for nothing;
            # a Redis that is really gone fails the next call itself.
            logger.warning("pagefleet index %s: background gc failed: %s", self.prefix, exc)
            return
        if retired or left:
            logger.debug(
                "index %s: gc retired %d dead pods, %d ids left to sweep",
                self.prefix,
                retired,
                left,
            )

    async def _sweep(self) -> None:
        """Sweep retired ids' entries in bounded slices until none are left."""
        left = 1
        while left:
            # grace is huge: only sweep here, never retire a merely late pod.
            _, left = await self._gc_once(1e12)


def _encode_events(events: Sequence[BlockStored | BlockRemoved | AllBlocksCleared]) -> list[bytes]:
    # Packing everything before sending means a bad hash never leaves a batch half applied.
    out: list[bytes] = []
    for event in events:
        if isinstance(event, BlockStored):
            out += _chunked(b"S", pack_hashes(event.block_hashes))
        elif isinstance(event, BlockRemoved):
            out += _chunked(b"R", pack_hashes(event.block_hashes))
        elif isinstance(event, AllBlocksCleared):
            out.append(b"C")
        else:
            raise TypeError(
                f"unknown KV event {event!r}; expected BlockStored, BlockRemoved or "
                "AllBlocksCleared"
            )
    return out


def _chunked(kind: bytes, packed: bytes) -> list[bytes]:
    step = CHUNK * 8
    return [kind + packed[i : i + step] for i in range(0, len(packed), step)]


def _group(args: list[bytes]) -> list[list[bytes]]:
    """Split event arguments into script calls of at most ~CHUNK hashes each."""
    calls: list[list[bytes]] = []
    cur: list[bytes] = []
    size = 0
    for arg in args:
        n = (len(arg) - 1) // 8
        if cur and size + n > CHUNK:
            calls.append(cur)
            cur, size = [], 0
        cur.append(arg)
        size += n
    if cur:
        calls.append(cur)
    return calls
