"""One forged index entry must not route all traffic to a pod (issue 14): heartbeat loads
read back from a real Redis are range-checked (``PodLoad.checked``, the check the gateway
applies too), malformed or negative ones drop that pod, and a lookup never reports more
matched blocks than the prompt has."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from pagefleet.dev.redis_server import LocalRedis
from pagefleet.kvindex.index import MAX_COUNT, PodLoad
from pagefleet.kvindex.redis_index import RedisKVIndex, key_prefix


@pytest.fixture
async def index(redis_server: LocalRedis) -> AsyncIterator[RedisKVIndex]:
    namespace = f"ranges-{uuid.uuid4().hex[:8]}"
    idx = RedisKVIndex.from_url(redis_server.url, namespace=namespace, auto_gc_interval_s=None)
    try:
        yield idx
    finally:
        await idx.close()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"running": 10**30, "kv_usage": 7.5}, PodLoad(MAX_COUNT, 0, 1.0)),
        ({"running": 2.9, "num_blocks": 100}, PodLoad(2, 0, 0.0, 100)),
    ],
)
def test_out_of_range_loads_are_clamped(raw, expected):
    load = PodLoad.from_dict({**raw, "ts": 1.0})
    assert (load.running, load.waiting, load.kv_usage, load.num_blocks) == (
        expected.running,
        expected.waiting,
        expected.kv_usage,
        expected.num_blocks,
    )


@pytest.mark.parametrize(
    "raw",
    [
        {"running": "0"},
        {"running": True},
        {"kv_usage": math.nan},
        {"waiting": None},
        {"role": "admin"},
        {"ts": math.inf},
        {"role": ["unified"]},
        {"running": -1000},
        {"waiting": -5},
        {"kv_usage": -3.0},
        {"ts": time.time() + 3600},
    ],
)
def test_malformed_loads_are_refused(raw):
    with pytest.raises(ValueError, match="heartbeat"):
        PodLoad.from_dict(raw)


async def test_forged_heartbeats_in_redis_cannot_outbid_an_idle_pod(index: RedisKVIndex) -> None:
    await index.heartbeat("honest", PodLoad(running=0, waiting=0, kv_usage=0.0), 30.0)
    await index.heartbeat(
        "forged", PodLoad(running=-(10**9), waiting=-(10**9), kv_usage=-100.0), 30.0
    )
    await index.heartbeat("garbage", PodLoad(), 30.0)
    # Overwrite one heartbeat value in place with something no daemon writes.
    prefix = key_prefix(index.namespace)
    pod_id = await index.client.hget(f"{prefix}pod", "garbage")
    key = f"{prefix}hb:{pod_id.decode()}"
    ttl = await index.client.pttl(key)
    await index.client.set(key, json.dumps({"running": "lots", "role": "unified"}), px=ttl)
    pods = await index.pods()
    assert set(pods) == {"honest"}  # negative loads and the malformed one are not routed to
    honest = pods["honest"]
    assert (honest.running, honest.waiting, honest.kv_usage) == (0, 0, 0.0)


async def test_a_connection_error_in_background_gc_does_not_fail_the_heartbeat(
    redis_server: LocalRedis,
) -> None:
    # The heartbeat was written; a dropped connection during the gc that follows it failed
    # the call, and the daemon's publisher then resynced its whole block set for nothing.
    from redis.exceptions import ConnectionError as RedisConnectionError

    idx = RedisKVIndex.from_url(
        redis_server.url, namespace=f"gc-{uuid.uuid4().hex[:8]}", auto_gc_interval_s=0.0
    )

    async def dropped(grace_s: float) -> tuple[int, int]:
        raise RedisConnectionError("Connection closed by server.")

    idx._gc_once = dropped  # type: ignore[method-assign]
    try:
        assert await idx.heartbeat("pod-a", PodLoad(1, 0, 0.1), ttl_s=5.0) is True
        assert "pod-a" in await idx.pods()
    finally:
        await idx.close()
