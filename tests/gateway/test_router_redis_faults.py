"""The router against a real Redis that stops answering (SIGSTOP) and then resumes."""

from __future__ import annotations

import asyncio
import signal
import time

from pagefleet.dev import process
from pagefleet.dev.redis_server import LocalRedis
from pagefleet.gateway.discovery import StaticDiscovery
from pagefleet.gateway.policies import make_policy
from pagefleet.gateway.router import Router
from pagefleet.kvindex.events import BlockStored, KVEventBatch
from pagefleet.kvindex.hashing import block_hashes
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.redis_index import RedisKVIndex

BS = 16
NS = "router-faults"
PODS = ["127.0.0.1:9101", "127.0.0.1:9102"]


async def test_a_paused_redis_never_stalls_routing_and_answers_stay_paired_after() -> None:
    """While Redis is stopped, each route waits at most the lookup timeout and routes on
    load; once it resumes, the hits come back, and every answer is its own request's: a
    lookup cut by its timeout must not leave its late reply on a pooled connection, where
    the next lookup would read it as its own."""
    prompts = [[p * 1000 + t for t in range(8 * BS)] for p in range(len(PODS))]
    async with LocalRedis() as srv:
        writer = RedisKVIndex.from_url(srv.url, namespace=NS)
        for pod, prompt in zip(PODS, prompts, strict=True):
            await writer.heartbeat(pod, PodLoad(), 600)
            keys = block_hashes(prompt, BS, NS)
            await writer.apply(pod, KVEventBatch(0.0, 0, [BlockStored(keys, None, [], BS)]))
        await writer.close()
        router = Router(
            discovery=StaticDiscovery(["http://" + p for p in PODS]),
            policy=make_policy("cache_aware"),
            index=RedisKVIndex.from_url(srv.url, namespace=NS),
            block_size=BS,
            kv_namespace=NS,
            breaker_cooldown_s=0.2,
            placement_ttl_s=0,  # the index alone decides
            seed=0,
        )
        await router.start()
        assert proc_of(srv) is not None
        try:
            process.signal_group(proc_of(srv), signal.SIGSTOP)
            try:
                slowest = 0.0
                for i in range(12):
                    t0 = time.monotonic()
                    d = await router.route(prompts[i % 2])
                    slowest = max(slowest, time.monotonic() - t0)
                    assert not d.index_ok
                    await asyncio.sleep(0.05)
                assert slowest < 0.5, f"a route waited {slowest:.2f} s on the stopped Redis"
            finally:
                process.signal_group(proc_of(srv), signal.SIGCONT)
            await asyncio.sleep(0.3)  # past the breaker's cooldown
            for i in range(60):
                d = await router.route(prompts[i % 2])
                if d.index_ok:
                    assert d.ranked[0].endpoint.pod == PODS[i % 2]
                    assert d.predicted_hit_tokens == 8 * BS
            assert d.index_ok
        finally:
            await router.close()


def proc_of(srv: LocalRedis):  # type: ignore[no-untyped-def]
    return srv._proc
