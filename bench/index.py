"""Global prefix index on a real Redis: lookup latency, ingest rate, memory per entry.

    python bench/index.py            # 100 pods, 1M (block, pod) entries
    python bench/index.py --quick    # 100 pods, 200k entries (under 60 s on 2 cores)

Starts its own redis-server (LocalRedis, listpack limits tuned). Block hashes are uniform
random 64-bit ints, which is what BLAKE2b chain keys look like to the index.

Workload: every pod holds ``entries / pods`` blocks. 20 popular 512-block prompts are each
held by 10 pods (they stand for shared system prompts); the rest of each pod's blocks are
chains only it holds. Lookups of a 512-block prompt mix full hits (a popular prompt, 10
holders, bisected end to end), partial hits (a popular prompt's first k blocks, then new
ones) and misses. Latency is measured at the client (what the gateway sees: redis-py asyncio
round trip + script) and, from Redis' commandstats, inside the server.

Baseline, same run, smaller sample: the naive layout, one Redis SET per block (members: pod
names) plus one SET per pod (its blocks), looked up with one pipelined round trip of
SMEMBERS per block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagefleet.dev.redis_server import LocalRedis
from pagefleet.kvindex.events import BlockStored, KVEventBatch
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.redis_index import RedisKVIndex, suggest_bucket_bits

PROMPT_BLOCKS = 512
POPULAR = 20
HOLDERS_PER_POPULAR = 10
EVENT_BLOCKS = 16  # blocks per BlockStored (one engine step's prefill of 256 tokens)
BATCH_EVENTS = 8  # events per batch: 128 blocks per apply() round trip
CONCURRENCY = 8  # pods publishing at once


@dataclass(slots=True)
class Workload:
    pods: list[str]
    pod_blocks: dict[str, list[int]]
    popular: list[list[int]]
    entries: int


def make_workload(num_pods: int, entries: int, rng: random.Random) -> Workload:
    pods = [f"pod-{i:03d}" for i in range(num_pods)]
    per_pod = entries // num_pods
    popular = [[rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)] for _ in range(POPULAR)]
    pod_blocks: dict[str, list[int]] = {p: [] for p in pods}
    for k, chain in enumerate(popular):
        for j in range(HOLDERS_PER_POPULAR):
            pod = pods[(k * HOLDERS_PER_POPULAR + j) % num_pods]
            if len(pod_blocks[pod]) + PROMPT_BLOCKS <= per_pod:
                pod_blocks[pod].extend(chain)
    for pod in pods:
        need = per_pod - len(pod_blocks[pod])
        pod_blocks[pod].extend(rng.getrandbits(64) for _ in range(need))
    total = sum(len(b) for b in pod_blocks.values())
    return Workload(pods, pod_blocks, popular, total)


def lookup_prompts(w: Workload, n: int, rng: random.Random) -> list[tuple[str, list[int]]]:
    out: list[tuple[str, list[int]]] = []
    for i in range(n):
        kind = ("full", "partial", "full", "partial", "miss")[i % 5]
        if kind == "miss":
            prompt = [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)]
        else:
            chain = rng.choice(w.popular)
            k = PROMPT_BLOCKS if kind == "full" else rng.randrange(1, PROMPT_BLOCKS)
            prompt = chain[:k] + [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS - k)]
        out.append((kind, prompt))
    return out


async def used_memory(client: aredis.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def script_usec(client: aredis.Redis) -> tuple[int, float]:
    stats = await client.info("commandstats")
    s = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return int(s["calls"]), float(s["usec"])


async def server_percentiles(client: aredis.Redis) -> dict[str, float]:
    """EVALSHA latency percentiles measured inside Redis (7.0+ latency tracking), in ms."""
    try:
        stats = await client.info("latencystats")
    except aredis.ResponseError:
        return {}
    raw = stats.get("latency_percentiles_usec_evalsha")
    if not isinstance(raw, dict):
        return {}
    return {k: float(v) / 1000 for k, v in raw.items()}


async def redis_cpu(client: aredis.Redis) -> float:
    """CPU seconds the Redis process has used (user + sys, all its threads)."""
    cpu = await client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


async def ingest(index: RedisKVIndex, w: Workload) -> float:
    """Publish every pod's blocks as BlockStored batches; returns blocks/s."""
    per_batch = EVENT_BLOCKS * BATCH_EVENTS
    sem = asyncio.Semaphore(CONCURRENCY)

    async def publish(pod: str) -> None:
        blocks = w.pod_blocks[pod]
        async with sem:
            for seq, start in enumerate(range(0, len(blocks), per_batch)):
                part = blocks[start : start + per_batch]
                events = [
                    BlockStored(part[i : i + EVENT_BLOCKS], None, [], 16)
                    for i in range(0, len(part), EVENT_BLOCKS)
                ]
                await index.apply(pod, KVEventBatch(ts=0.0, seq=seq, events=events))

    t0 = time.perf_counter()
    await asyncio.gather(*(publish(p) for p in w.pods))
    return w.entries / (time.perf_counter() - t0)


async def bench_layout(
    url: str, w: Workload, prompts: list[tuple[str, list[int]]], bucket_bits: int
) -> dict[str, float]:
    admin = aredis.Redis.from_url(url)
    await admin.flushall()
    index = RedisKVIndex.from_url(url, namespace="bench", bucket_bits=bucket_bits)
    for pod in w.pods:
        await index.heartbeat(pod, PodLoad(running=1), 3600)
    before = await used_memory(admin)
    rate = await ingest(index, w)
    after = await used_memory(admin)

    # Correctness spot check: a popular prompt is matched in full by its holders.
    got = await index.lookup(w.popular[0])
    assert len(got) == HOLDERS_PER_POPULAR and set(got.values()) == {PROMPT_BLOCKS}, got

    for _, prompt in prompts[:50]:  # warm up: script load, connection
        await index.lookup(prompt)
    # The machine's floor: a PING round trip on the same client, interleaved with nothing.
    rtt: list[float] = []
    for _ in range(len(prompts)):
        t0 = time.perf_counter()
        await index.client.ping()
        rtt.append((time.perf_counter() - t0) * 1000)
    await admin.config_resetstat()  # server-side latency percentiles of lookups only
    calls0, usec0 = await script_usec(admin)
    lat: dict[str, list[float]] = {"full": [], "partial": [], "miss": []}
    for kind, prompt in prompts:
        t0 = time.perf_counter()
        await index.lookup(prompt)
        lat[kind].append((time.perf_counter() - t0) * 1000)
    calls1, usec1 = await script_usec(admin)
    server_p = await server_percentiles(admin)

    # CPU time per full-hit lookup (the most expensive kind): unlike wall time it does not
    # count the waits for a CPU that a busy shared machine adds, so it approximates the
    # latency on a machine where Redis and the caller each have a core.
    full = [p for kind, p in prompts if kind == "full"][:300]
    rcpu0, ccpu0 = await redis_cpu(admin), time.process_time()
    for prompt in full:
        await index.lookup(prompt)
    rcpu1, ccpu1 = await redis_cpu(admin), time.process_time()

    # A daemon's periodic resync: the same pod set, 5% of it replaced.
    pod = w.pods[-1]
    held = w.pod_blocks[pod]
    keep = held[: len(held) * 19 // 20]
    rng = random.Random(1)
    new = set(keep) | {rng.getrandbits(64) for _ in range(len(held) - len(keep))}
    await admin.config_resetstat()
    t0 = time.perf_counter()
    await index.resync(pod, new)
    resync_ms = (time.perf_counter() - t0) * 1000
    resync_calls = (await script_usec(admin))[0]
    resync_call_max = (await server_percentiles(admin)).get("p99.9", float("nan"))
    got = await index.lookup(keep[:50])
    assert got.get(pod) == 50, got

    allv = [x for v in lat.values() for x in v]
    server_ms = (usec1 - usec0) / max(1, calls1 - calls0) / 1000
    await index.close()
    await admin.aclose()
    return {
        "ingest_blocks_per_s": rate,
        "bytes_per_entry": (after - before) / w.entries,
        "lookup_p50_ms": pct(allv, 50),
        "lookup_p99_ms": pct(allv, 99),
        "lookup_full_hit_p99_ms": pct(lat["full"], 99),
        "lookup_miss_p50_ms": pct(lat["miss"], 50),
        "lookup_server_mean_ms": server_ms,
        "lookup_server_p99_ms": server_p.get("p99", float("nan")),
        "lookup_full_hit_server_cpu_ms": (rcpu1 - rcpu0) / len(full) * 1000,
        "lookup_full_hit_client_cpu_ms": (ccpu1 - ccpu0) / len(full) * 1000,
        "ping_p50_ms": pct(rtt, 50),
        "ping_p99_ms": pct(rtt, 99),
        "resync_blocks": len(new),
        "resync_ms": resync_ms,
        "resync_script_calls": resync_calls,
        "resync_longest_call_ms": resync_call_max,
    }


async def bench_naive(
    url: str, w: Workload, prompts: list[tuple[str, list[int]]]
) -> dict[str, float]:
    admin = aredis.Redis.from_url(url)
    await admin.flushall()
    before = await used_memory(admin)
    t0 = time.perf_counter()
    for pod in w.pods:
        blocks = w.pod_blocks[pod]
        for start in range(0, len(blocks), 1024):
            pipe = admin.pipeline(transaction=False)
            for h in blocks[start : start + 1024]:
                pipe.sadd(f"naive:b:{h}", pod)
            pipe.sadd(f"naive:p:{pod}", *blocks[start : start + 1024])
            await pipe.execute()
    rate = w.entries / (time.perf_counter() - t0)
    after = await used_memory(admin)
    lat: list[float] = []
    for _, prompt in prompts:
        t0 = time.perf_counter()
        pipe = admin.pipeline(transaction=False)
        for h in prompt:
            pipe.smembers(f"naive:b:{h}")
        holders = await pipe.execute()
        alive: set[bytes] | None = None
        for hs in holders:  # same chain semantics, computed client-side
            alive = set(hs) if alive is None else alive & hs
            if not alive:
                break
        lat.append((time.perf_counter() - t0) * 1000)
    await admin.flushall()
    await admin.aclose()
    return {
        "ingest_blocks_per_s": rate,
        "bytes_per_entry": (after - before) / w.entries,
        "lookup_p50_ms": pct(lat, 50),
        "lookup_p99_ms": pct(lat, 99),
    }


async def main_async(args: argparse.Namespace) -> dict[str, float | int | str]:
    rng = random.Random(args.seed)
    entries = args.entries or (200_000 if args.quick else 1_000_000)
    naive_entries = max(args.pods * PROMPT_BLOCKS * 2, entries // 10)
    n_lookups = 1000 if args.quick else 5000
    w = make_workload(args.pods, entries, rng)
    prompts = lookup_prompts(w, n_lookups, rng)
    wn = make_workload(args.pods, naive_entries, rng)
    naive_prompts = lookup_prompts(wn, 30 if args.quick else 100, rng)
    distinct = len({h for b in w.pod_blocks.values() for h in b})
    args.bucket_bits = args.bucket_bits or suggest_bucket_bits(distinct)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(
        f"pods={args.pods} entries={w.entries} distinct_blocks={distinct} "
        f"lookups={n_lookups} prompt_blocks={PROMPT_BLOCKS} bucket_bits={args.bucket_bits}"
    )

    with LocalRedis() as server:
        ours = await bench_layout(server.url, w, prompts, args.bucket_bits)
        print("packed layout:  " + "  ".join(f"{k}={v:.4g}" for k, v in ours.items()))
        naive = await bench_naive(server.url, wn, naive_prompts)
        print(
            f"naive layout ({wn.entries} entries): "
            + "  ".join(f"{k}={v:.4g}" for k, v in naive.items())
        )
        version = (await aredis.Redis.from_url(server.url).info("server"))["redis_version"]

    ratio = naive["bytes_per_entry"] / ours["bytes_per_entry"]
    print(
        f"memory: naive / packed = {ratio:.1f}x; lookup p99: naive / packed = "
        f"{naive['lookup_p99_ms'] / ours['lookup_p99_ms']:.1f}x"
    )
    print(
        f"targets: lookup_p99_ms < 1 -> {ours['lookup_p99_ms']:.3f} "
        f"({'met' if ours['lookup_p99_ms'] < 1 else 'MISSED'}); bytes_per_entry <= 32 -> "
        f"{ours['bytes_per_entry']:.1f} ({'met' if ours['bytes_per_entry'] <= 32 else 'MISSED'})"
    )
    return {
        "pods": args.pods,
        "entries": w.entries,
        "distinct_blocks": distinct,
        "redis_version": version,
        "lookup_p50_ms": round(ours["lookup_p50_ms"], 4),
        "lookup_p99_ms": round(ours["lookup_p99_ms"], 4),
        "lookup_full_hit_p99_ms": round(ours["lookup_full_hit_p99_ms"], 4),
        "lookup_server_mean_ms": round(ours["lookup_server_mean_ms"], 4),
        "lookup_server_p99_ms": round(ours["lookup_server_p99_ms"], 4),
        "lookup_full_hit_server_cpu_ms": round(ours["lookup_full_hit_server_cpu_ms"], 4),
        "lookup_full_hit_client_cpu_ms": round(ours["lookup_full_hit_client_cpu_ms"], 4),
        "ping_p50_ms": round(ours["ping_p50_ms"], 4),
        "ping_p99_ms": round(ours["ping_p99_ms"], 4),
        "resync_blocks": ours["resync_blocks"],
        "resync_ms": round(ours["resync_ms"], 1),
        "resync_script_calls": ours["resync_script_calls"],
        "resync_longest_call_ms": round(ours["resync_longest_call_ms"], 2),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "ingest_blocks_per_s": round(ours["ingest_blocks_per_s"]),
        "bytes_per_entry": round(ours["bytes_per_entry"], 2),
        "naive_bytes_per_entry": round(naive["bytes_per_entry"], 2),
        "naive_lookup_p99_ms": round(naive["lookup_p99_ms"], 4),
        "naive_ingest_blocks_per_s": round(naive["ingest_blocks_per_s"]),
        "memory_ratio_naive_over_packed": round(ratio, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="200k entries, 1000 lookups")
    ap.add_argument("--pods", type=int, default=100)
    ap.add_argument("--entries", type=int, default=0, help="(block, pod) entries to load")
    ap.add_argument("--bucket-bits", type=int, default=0, help="default: suggest_bucket_bits")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = asyncio.run(main_async(args))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
