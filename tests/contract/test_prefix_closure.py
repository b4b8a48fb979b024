"""The prefix-closure contract (pagefleet/kvindex/events.py), both sides at once.

The real engine (tiny model, a KV pool small enough to evict and preempt) publishes its
events into the real Redis index, step by step, under a workload built to hit every way
the engine can break closure: shared prefixes, a prompt repeated whole (its last block is
recomputed into a copy that must be folded back), n > 1 forks, aborts, preemption, a
prefix-cache reset. After every step, for every chain the run has produced:

- the blocks the engine caches along the chain are a leading run (prefix closure), and
- the index's bisecting lookup returns exactly that run's length for this pod.
"""

from __future__ import annotations

import random
import uuid

import pytest

from pagefleet.dev.redis_server import LocalRedis
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.kvindex.events import KVEventBatch
from pagefleet.kvindex.hashing import block_hashes
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.redis_index import RedisKVIndex

pytestmark = pytest.mark.slow

BS = 4
NS = "contract"
POD = "pod-contract"


def _leading(flags: list[bool]) -> int:
    n = 0
    while n < len(flags) and flags[n]:
        n += 1
    return n


async def test_engine_cache_and_redis_lookups_agree_after_every_step() -> None:
    batches: list[KVEventBatch] = []
    config = EngineConfig(
        model="tiny", block_size=BS, num_gpu_blocks=28, max_num_seqs=6,
        max_num_batched_tokens=48, max_model_len=96, kv_namespace=NS, seed=0,
    )  # fmt: skip
    engine = LLMEngine(config, batches.append)
    folded = 0
    end_step = engine.kv.end_step

    def counting_end_step() -> None:
        nonlocal folded
        folded += len(engine.kv._dups)  # duplicates this step: the folding is exercised
        end_step()

    engine.kv.end_step = counting_end_step  # type: ignore[method-assign]

    rng = random.Random(7)
    roots = [[rng.randrange(16, 200) for _ in range(rng.choice((8, 12, 16)))] for _ in range(3)]
    chains: dict[tuple[str, int], list[int]] = {}  # (request, index) -> prompt + output
    live: set[str] = set()
    prompts: list[list[int]] = []
    removed = 0

    with LocalRedis() as server:
        index = RedisKVIndex.from_url(server.url, namespace=f"contract-{uuid.uuid4().hex[:8]}")
        try:
            await index.heartbeat(POD, PodLoad(), ttl_s=600)
            for step in range(400):
                if step >= 60 and not engine.has_unfinished():
                    break
                if step < 60:
                    for _ in range(rng.choice((0, 1, 1, 2))):
                        rid = f"r{len(prompts)}"
                        if prompts and rng.random() < 0.3:
                            prompt = list(rng.choice(prompts))  # repeated whole
                        else:
                            tail = rng.randrange(0, 3) * BS + rng.choice((0, 0, 1, 3))
                            root = rng.choice(roots)
                            prompt = root + [rng.randrange(16, 200) for _ in range(tail)]
                        n = 2 if rng.random() < 0.2 else 1
                        params = SamplingParams(
                            n=n, temperature=0.8, seed=len(prompts), max_tokens=rng.randint(4, 20)
                        )
                        engine.add_request(rid, prompt, params)
                        prompts.append(prompt)
                        live.add(rid)
                        for i in range(n):
                            chains[(rid, i)] = list(prompt)
                if live and rng.random() < 0.05:
                    victim = rng.choice(sorted(live))
                    engine.abort(victim)
                if step == 35:
                    engine.reset_prefix_cache()
                for out in engine.step():
                    for d in out.deltas:
                        chains[(out.request_id, d.index)].extend(d.new_token_ids)
                    if out.finished:
                        live.discard(out.request_id)
                for batch in batches:
                    removed += sum(e.type == "BlockRemoved" for e in batch.events)
                    await index.apply(POD, batch)
                batches.clear()
                engine.check_integrity()

                cached = engine.cached_block_hashes()
                seen: set[tuple[int, ...]] = set()
                for tokens in chains.values():
                    hs = block_hashes(tokens, BS, namespace=NS)
                    if not hs or tuple(hs) in seen:
                        continue
                    seen.add(tuple(hs))
                    flags = [h in cached for h in hs]
                    held = _leading(flags)
                    assert not any(flags[held:]), (
                        f"step {step}: the engine caches block(s) past a hole along a chain: "
                        f"{flags}"
                    )
                    got = (await index.lookup(hs)).get(POD, 0)
                    assert got == held, f"step {step}: index says {got} blocks, engine {held}"
            assert not engine.has_unfinished()
        finally:
            await index.close()
    # The scenario did reach the hard cases, or the checks above proved little.
    assert folded > 0, "no duplicate block was folded"
    assert removed > 0, "nothing was evicted"
    assert engine.stats().num_preempted_total > 0, "nothing was preempted"
