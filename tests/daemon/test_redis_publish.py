"""KV events and heartbeats into a REAL Redis server; graceful SIGTERM of a real process.

"Exactly the daemon's cached blocks" is checked two ways: every hash the engine reports
(``cached_block_hashes()``) is found for the pod by the index's own lookup, and Redis'
per-pod held-block counter equals the engine's count, so nothing extra is advertised.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp
import redis.asyncio as aredis

from pagefleet.daemon.config import DaemonConfig
from pagefleet.dev.process import free_port
from pagefleet.dev.redis_server import LocalRedis, find_redis_server
from pagefleet.kvindex.redis_index import RedisKVIndex, key_prefix

from .conftest import live_daemon, wait_daemon_ready

NS = "ns-test"
PROMPTS = [
    "The quick brown fox jumps over the lazy dog and then runs far away",
    "The quick brown fox jumps over the lazy dog and then sleeps all day long",
    "A completely different prompt about the weather in spring and summer",
]


def config(url: str, pod: str, **kw) -> DaemonConfig:
    base = dict(model="tiny", served_model_name="tiny-redis", port=free_port(), pod_name=pod,
                redis_url=url, kv_namespace=NS, block_size=4, num_gpu_blocks=128,
                max_model_len=256, heartbeat_s=0.1, heartbeat_ttl_s=5.0)  # fmt: skip
    base.update(kw)
    return DaemonConfig(**base)


async def held_in_redis(url: str, pod: str, hashes: set[int]) -> tuple[int, int]:
    """(blocks Redis counts for the pod, how many of ``hashes`` lookup finds for it)."""
    client = aredis.Redis.from_url(url)
    try:
        p = key_prefix(NS)
        pid = await client.hget(p + "pod", pod)
        held = 0
        if pid is not None:
            held = int(await client.hget(p + "st", b"n" + pid) or 0)
        index = RedisKVIndex(client, namespace=NS)
        found = 0
        for h in hashes:
            found += (await index.lookup([h])).get(pod, 0)
        return held, found
    finally:
        await client.aclose()


async def settle(publisher, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if publisher.in_sync.is_set() and publisher.idle:
            await asyncio.sleep(0.1)
            if publisher.idle:
                return
        await asyncio.sleep(0.05)
    raise AssertionError("publisher did not settle")


async def run_prompts(url: str, prompts: list[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for p in prompts:
            body = {"prompt": p, "max_tokens": 6, "temperature": 0}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()


async def test_redis_mirrors_engine_then_empty_after_shutdown():
    async with LocalRedis() as redis_srv:
        url = redis_srv.url
        async with live_daemon(config(url, "pod-1")) as d:
            await run_prompts(d.url, PROMPTS)
            await settle(d.daemon.publisher)
            cached = await d.daemon.engine_loop.cached_block_hashes()
            assert len(cached) >= 10
            held, found = await held_in_redis(url, "pod-1", cached)
            assert found == len(cached), "a cached block is missing from Redis"
            assert held == len(cached), "Redis advertises blocks the engine does not hold"
            pods = await RedisKVIndex.from_url(url, namespace=NS).pods()
            assert pods["pod-1"].role == "unified" and pods["pod-1"].num_blocks == 128
            assert pods["pod-1"].num_cached_blocks == len(cached)
        held, found = await held_in_redis(url, "pod-1", cached)
        assert (held, found) == (0, 0)


async def test_reset_prefix_cache_empties_engine_and_index():
    async with LocalRedis() as redis_srv:
        url = redis_srv.url
        async with live_daemon(config(url, "pod-r")) as d:
            await run_prompts(d.url, PROMPTS[:1])
            await settle(d.daemon.publisher)
            cached = await d.daemon.engine_loop.cached_block_hashes()
            assert (await held_in_redis(url, "pod-r", cached))[1] == len(cached) > 0
            async with aiohttp.ClientSession() as s, s.post(f"{d.url}/reset_prefix_cache") as r:
                assert r.status == 200 and (await r.json()) == {"reset": True}
            # Published without waiting for another request to step the engine.
            await settle(d.daemon.publisher)
            assert await d.daemon.engine_loop.cached_block_hashes() == set()
            assert (await held_in_redis(url, "pod-r", cached))[1] == 0
            # The same prompt again is a cold prefill.
            async with aiohttp.ClientSession() as s:
                body = {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
                async with s.post(f"{d.url}/v1/completions", json=body) as r:
                    usage = (await r.json())["usage"]
            assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0


def _start_redis(port: int, workdir: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with __import__("socket").create_connection(("127.0.0.1", port), 0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


async def test_redis_restart_triggers_resync(tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = _start_redis(port, str(tmp_path))
    try:
        async with live_daemon(config(url, "pod-2")) as d:
            pub = d.daemon.publisher
            pub._backoff_initial_s = 0.05
            await run_prompts(d.url, PROMPTS[:1])
            await settle(pub)
            proc.terminate()
            proc.wait(10)
            await run_prompts(d.url, PROMPTS[1:])  # still serving with Redis gone
            # The publisher learns of the outage on its next write or heartbeat: wait for it.
            deadline = time.monotonic() + 10
            while pub.in_sync.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not pub.in_sync.is_set()
            resyncs = pub.resyncs
            proc = _start_redis(port, str(tmp_path))  # back, and empty
            await asyncio.wait_for(pub.in_sync.wait(), 15)
            await settle(pub)
            assert pub.resyncs > resyncs
            cached = await d.daemon.engine_loop.cached_block_hashes()
            held, found = await held_in_redis(url, "pod-2", cached)
            assert found == held == len(cached) > 0
            metrics = d.daemon.metrics.render().decode()
            assert (
                'pagefleet:kv_index_up{model_name="tiny-redis",pod="pod-2",role="unified"} 1.0'
                in metrics
            )
    finally:
        proc.kill()
        proc.wait(10)


async def test_sigterm_drains_and_exits_zero():
    async with LocalRedis() as redis_srv:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pagefleet.cli", "daemon", "--model", "tiny",
                 "--port", str(port), "--max-model-len", "256", "--block-size", "4",
                 "--redis-url", redis_srv.url, "--kv-namespace", NS, "--pod-name", "pod-3",
                 "--served-model-name", "m", "--drain-timeout", "60"],
                stdout=log, stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            try:
                async with aiohttp.ClientSession() as s:
                    await wait_daemon_ready(s, base, proc, timeout_s=90)
                    body = {"prompt": PROMPTS[0], "max_tokens": 200, "stream": True,
                            "ignore_eos": True}  # fmt: skip
                    async with s.post(f"{base}/v1/completions", json=body) as r:
                        assert r.status == 200
                        await r.content.readline()  # in flight
                        for _ in range(50):  # its prompt blocks reach Redis
                            if (await held_in_redis(redis_srv.url, "pod-3", set()))[0]:
                                break
                            await asyncio.sleep(0.05)
                        assert (await held_in_redis(redis_srv.url, "pod-3", set()))[0] > 0
                        proc.send_signal(signal.SIGTERM)
                        deadline = time.monotonic() + 15  # the signal lands asynchronously
                        while time.monotonic() < deadline:
                            async with s.get(f"{base}/ready") as rr:
                                if rr.status == 503:  # draining: routers stop sending
                                    break
                            await asyncio.sleep(0.01)
                        assert rr.status == 503
                        async with s.post(f"{base}/v1/completions", json={"prompt": "x"}) as rr:
                            assert rr.status == 503
                            assert rr.headers["Retry-After"] == "1"
                        rest = (await r.read()).decode()
                    # The in-flight request finished normally during the drain.
                    assert '"finish_reason":"length"' in rest
                    assert rest.rstrip().endswith("data: [DONE]")
                rc = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
                log.seek(0)
                assert rc == 0, log.read().decode()[-3000:]
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
        held, _ = await held_in_redis(redis_srv.url, "pod-3", set())
        assert held == 0  # the pod removed its entries on the way out


async def test_serves_without_redis_then_syncs_when_it_appears(tmp_path, tiny_tokenizer):
    from .fake_engine import FakeEngine

    engines: list[FakeEngine] = []

    def factory(cfg, sink):
        engines.append(FakeEngine(tiny_tokenizer, event_sink=sink))
        return engines[-1]

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"  # nothing listens there yet
    proc = None
    try:
        async with live_daemon(config(url, "pod-4"), factory) as d:
            pub = d.daemon.publisher
            pub._backoff_initial_s = pub._backoff_max_s = 0.1
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{d.url}/ready") as r:
                    assert r.status == 200
                for p in ([1, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5]):
                    body = {"prompt": p, "max_tokens": 2}
                    async with s.post(f"{d.url}/v1/completions", json=body) as r:
                        assert r.status == 200
            assert not pub.in_sync.is_set()
            proc = _start_redis(port, str(tmp_path))
            await asyncio.wait_for(pub.in_sync.wait(), 15)
            await settle(pub)
            cached = engines[0].cached_block_hashes()
            held, found = await held_in_redis(url, "pod-4", cached)
            assert held == found == len(cached) == 3
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
