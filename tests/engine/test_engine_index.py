"""The engine's KV event stream, replayed into the real in-memory index, reproduces exactly
the blocks the engine holds as cached, and the gateway-side lookup (same hash function)
finds the prefix the engine would reuse."""

from __future__ import annotations

import random

from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.kvindex.hashing import block_hashes
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.memory import MemoryKVIndex


async def test_replayed_index_equals_cached_blocks(fake_engine) -> None:
    batches = []
    eng = fake_engine(
        num_blocks=24,
        block_size=4,
        event_sink=batches.append,
        kv_namespace="svc/model",
        max_model_len=64,
    )
    index = MemoryKVIndex(namespace="svc/model", auto_gc_interval_s=None)
    await index.heartbeat("pod-a", PodLoad(), ttl_s=60)
    rng = random.Random(3)
    systems = [[rng.randrange(1, 256) for _ in range(18)] for _ in range(3)]
    for step in range(60):
        if step % 3 == 0:
            prompt = rng.choice(systems) + [rng.randrange(1, 256) for _ in range(rng.randint(0, 9))]
            eng.add_request(
                f"r{step}",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8), ignore_eos=True),
            )
        if step % 7 == 6:
            eng.abort(f"r{step - 6}")
        eng.step()
        for b in batches:
            await index.apply("pod-a", b)
        batches.clear()
        assert index.block_set("pod-a") == eng.cached_block_hashes()
    while eng.has_unfinished():
        eng.step()
    for b in batches:
        await index.apply("pod-a", b)
    assert index.block_set("pod-a") == eng.cached_block_hashes()
    assert eng.stats().evictions_total > 0  # the small pool forced evictions
    # The gateway's view of a prompt agrees with what the engine would reuse.
    probe = systems[0] + [7, 7, 7]
    keys = block_hashes(probe, 4, namespace="svc/model")
    matched = (await index.lookup(keys)).get("pod-a", 0)
    eng.add_request("probe", probe, SamplingParams(temperature=0.0, max_tokens=1))
    seq = eng._requests["probe"].seqs[0]
    assert matched == len(eng.kv.get_computed_blocks(seq)[0])


def test_same_prefix_in_one_step_shares_one_copy(fake_engine) -> None:
    """Two requests prefilling the same blocks in one step both compute them; after the
    step the second is pointed at the first's blocks and its copies are freed, so its later
    blocks are cached under a parent it holds (prefix closure, which the Redis index's
    bisection relies on) and the pool holds one copy."""
    eng = fake_engine(num_blocks=32, block_size=4, max_model_len=64)
    prompt = list(range(1, 18))  # 4 full blocks + 1 token
    for rid in ("a", "b"):
        eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()  # both prefill: blocks 0-3 computed twice, cached once
    tables = [eng.kv.block_ids(eng._requests[r].seqs[0]) for r in ("a", "b")]
    assert tables[0][:4] == tables[1][:4]
    assert tables[0][4] != tables[1][4]  # the partial block stays private
    assert eng.kv.pool.num_free_blocks == 32 - 6
    eng.check_integrity()
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
    # Greedy outputs are equal, so the decode blocks were deduplicated as well.
    held = eng.cached_block_hashes()
    assert len(held) == 6  # (17 prompt + 7 output tokens with KV) // 4


def test_greedy_forks_share_their_identical_blocks(fake_engine) -> None:
    eng = fake_engine(num_blocks=40, block_size=2, max_model_len=64)
    eng.add_request("r", list(range(1, 10)), SamplingParams(n=3, temperature=0.0, max_tokens=12))
    used = []
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
        used.append(eng.kv.pool.num_blocks - eng.kv.pool.num_free_blocks)
    # Three identical sequences of up to 21 tokens: one copy (11 blocks) plus each
    # sequence's partial tail block, far below three private copies.
    assert max(used) <= 11 + 3
