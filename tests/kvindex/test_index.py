"""One suite, every KVIndex backend (memory, and Redis against a real redis-server)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagefleet.kvindex.hashing import block_hashes
from pagefleet.kvindex.index import KVIndex, PodLoad

from .conftest import IndexFactory

TTL = 30.0
U64 = (1 << 64) - 1


def stored(hashes: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=[],
        block_size=16,
    )


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared, seq: int = 0) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), seq=seq, events=list(events))


def chain(n: int, seed: int = 0, namespace: str = "") -> list[int]:
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(16 * n)]
    return block_hashes(tokens, 16, namespace=namespace)


async def live(index: KVIndex, *pods: str, ttl: float = TTL) -> None:
    for pod in pods:
        await index.heartbeat(pod, PodLoad(running=1), ttl)


async def test_implements_protocol(index: KVIndex) -> None:
    assert isinstance(index, KVIndex)


async def test_store_then_lookup_whole_chain(index: KVIndex) -> None:
    c = chain(8)
    await live(index, "a")
    await index.apply("a", batch(stored(c[:5]), stored(c[5:], parent=c[4])))
    assert await index.lookup(c) == {"a": 8}
    assert await index.lookup(c[:3]) == {"a": 3}
    assert await index.lookup([]) == {}
    assert await index.lookup(chain(4, seed=99)) == {}


async def test_match_is_the_held_prefix(index: KVIndex) -> None:
    c = chain(10)
    await live(index, "a")
    await index.apply("a", batch(stored(c[:4])))
    assert await index.lookup(c) == {"a": 4}
    # A prompt starting at a held block that is not the chain's head still matches from 0.
    assert await index.lookup(c[2:]) == {"a": 2}
    # A pod that lacks the prompt's first block matches nothing.
    assert await index.lookup(c[4:]) == {}


async def test_a_hole_never_shortens_a_match(index: KVIndex) -> None:
    """Engines evict a chain's tail first, so a pod's blocks are prefix-closed; a hole only
    comes from a lost event. Then the match may run past the hole (the Redis backend
    bisects), up to the last held block, but never stops short of the held prefix."""
    c = chain(10)
    await live(index, "a")
    await index.apply("a", batch(stored(c[:4]), stored(c[5:])))
    assert 4 <= (await index.lookup(c))["a"] <= 10
    assert await index.lookup(c[5:]) == {"a": 5}
    assert await index.lookup(c[4:]) == {}


async def test_several_pods_each_get_their_own_length(index: KVIndex) -> None:
    c = chain(12, seed=1)
    await live(index, "a", "b", "c", "d")
    await index.apply("a", batch(stored(c[:12])))
    await index.apply("b", batch(stored(c[:7])))
    await index.apply("c", batch(stored(c[:2])))
    await index.apply("d", batch(stored(c[1:])))  # no block 0: absent
    assert await index.lookup(c) == {"a": 12, "b": 7, "c": 2}


async def test_remove_breaks_chain_and_store_again_restores(index: KVIndex) -> None:
    c = chain(6, seed=2)
    await live(index, "a", "b")
    await index.apply("a", batch(stored(c)))
    await index.apply("b", batch(stored(c)))
    await index.apply("a", batch(BlockRemoved(block_hashes=c[3:])))
    assert await index.lookup(c) == {"a": 3, "b": 6}
    await index.apply("a", batch(BlockRemoved(block_hashes=c[:1])))
    assert await index.lookup(c) == {"b": 6}
    await index.apply("a", batch(stored(c[:1]), stored(c[3:])))
    assert await index.lookup(c) == {"a": 6, "b": 6}


async def test_events_within_a_batch_apply_in_order(index: KVIndex) -> None:
    c = chain(4, seed=3)
    await live(index, "a")
    await index.apply(
        "a",
        batch(
            stored(c),
            BlockRemoved(block_hashes=c[2:]),
            AllBlocksCleared(),
            stored(c[:1]),
            stored(c[1:3]),
            BlockRemoved(block_hashes=[c[2]]),
        ),
    )
    assert await index.lookup(c) == {"a": 2}


async def test_all_blocks_cleared_touches_only_that_pod(index: KVIndex) -> None:
    c = chain(5, seed=4)
    await live(index, "a", "b")
    await index.apply("a", batch(stored(c)))
    await index.apply("b", batch(stored(c[:3])))
    await index.apply("a", batch(AllBlocksCleared()))
    assert await index.lookup(c) == {"b": 3}
    await index.apply("a", batch(stored(c[:1])))
    assert await index.lookup(c) == {"a": 1, "b": 3}


async def test_duplicate_store_and_unknown_remove_are_harmless(index: KVIndex) -> None:
    c = chain(3, seed=5)
    await live(index, "a")
    await index.apply("a", batch(stored(c), stored(c), stored(c[:1])))
    await index.apply("a", batch(BlockRemoved(block_hashes=chain(3, seed=6))))
    assert await index.lookup(c) == {"a": 3}
    await index.apply("a", batch(BlockRemoved(block_hashes=c[1:])))
    await index.apply("a", batch(BlockRemoved(block_hashes=c[1:])))
    assert await index.lookup(c) == {"a": 1}


async def test_pod_without_heartbeat_is_absent(index: KVIndex) -> None:
    c = chain(4, seed=7)
    await live(index, "a")
    await index.apply("a", batch(stored(c)))
    await index.apply("ghost", batch(stored(c)))
    assert await index.lookup(c) == {"a": 4}
    assert set(await index.pods()) == {"a"}
    await live(index, "ghost")
    assert await index.lookup(c) == {"a": 4, "ghost": 4}


async def _until(check, timeout_s: float = 10.0) -> bool:
    """Poll an async ``check`` until it holds or ``timeout_s`` passes (no fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


# Short heartbeat TTLs: each test checks a state that must hold *before* a TTL runs out. A
# loaded machine can stall the test longer than that; the attempt then does not count and
# the next one runs with a TTL four times longer (checked by the clock, not assumed).
WINDOWS = (0.3, 1.2, 4.8)


async def test_heartbeat_expiry_hides_pod_and_renewal_brings_it_back(index: KVIndex) -> None:
    c = chain(4, seed=8)
    await index.heartbeat("long", PodLoad(waiting=1), TTL)
    await index.apply("long", batch(stored(c[:2])))
    for attempt, ttl in enumerate(WINDOWS):
        short = f"short{attempt}"
        t0 = time.monotonic()
        await index.heartbeat(short, PodLoad(waiting=2), ttl)
        await index.apply(short, batch(stored(c)))
        got = await index.lookup(c)
        if time.monotonic() - t0 < ttl:
            break
    else:
        pytest.fail(f"the machine stalled past every TTL window {WINDOWS}")
    assert got == {short: 4, "long": 2}
    # Expired: hidden from lookups and pods (waited for, never sooner than the TTL).
    assert await _until(lambda: _eq(index.lookup(c), {"long": 2}), ttl + 10)
    assert time.monotonic() - t0 >= ttl
    assert set(await index.pods()) == {"long"}
    # Before gc runs, a renewed heartbeat makes the pod's entries count again.
    await index.heartbeat(short, PodLoad(), TTL)
    assert await index.lookup(c) == {short: 4, "long": 2}


async def _eq(awaitable, want) -> bool:
    return (await awaitable) == want


async def test_pods_reports_latest_load(index: KVIndex) -> None:
    await index.heartbeat("a", PodLoad(running=3, waiting=1, kv_usage=0.5, num_blocks=100), TTL)
    await index.heartbeat("b", PodLoad(running=0, role="decode"), TTL)
    await index.heartbeat("a", PodLoad(running=7, waiting=2, kv_usage=0.75, num_blocks=100), TTL)
    pods = await index.pods()
    assert set(pods) == {"a", "b"}
    assert (pods["a"].running, pods["a"].waiting, pods["a"].kv_usage) == (7, 2, 0.75)
    assert pods["a"].num_blocks == 100
    assert pods["b"].role == "decode"
    with pytest.raises(ValueError, match="ttl"):
        await index.heartbeat("a", PodLoad(), 0)


async def test_resync_replaces_the_set(index: KVIndex) -> None:
    c1, c2 = chain(6, seed=9), chain(6, seed=10)
    await live(index, "a", "b")
    await index.apply("a", batch(stored(c1)))
    await index.apply("b", batch(stored(c1[:2])))
    await index.resync("a", set(c2[:4]))
    assert await index.lookup(c1) == {"b": 2}
    assert await index.lookup(c2) == {"a": 4}
    await index.resync("a", set())
    assert await index.lookup(c2) == {}
    # Events after a resync apply on top of the new set.
    await index.resync("a", set(c1[:3]))
    await index.apply("a", batch(stored(c1[3:5])))
    assert await index.lookup(c1) == {"a": 5, "b": 2}


async def test_clear_pod_keeps_other_pods_and_the_heartbeat(index: KVIndex) -> None:
    c = chain(5, seed=11)
    await live(index, "a", "b")
    await index.apply("a", batch(stored(c)))
    await index.apply("b", batch(stored(c)))
    await index.clear_pod("a")
    assert await index.lookup(c) == {"b": 5}
    assert set(await index.pods()) == {"a", "b"}
    await index.clear_pod("never-seen")  # no error
    await index.apply("a", batch(stored(c[:2])))
    assert await index.lookup(c) == {"a": 2, "b": 5}


async def test_gc_removes_dead_pods_entries_only(index: KVIndex) -> None:
    c = chain(5, seed=12)
    await live(index, "alive")
    await index.apply("alive", batch(stored(c[:3])))
    for ttl in WINDOWS:
        t0 = time.monotonic()
        await index.heartbeat("dead", PodLoad(), ttl)
        await index.apply("dead", batch(stored(c)))
        collected = await index.gc(grace_s=0.0)
        if time.monotonic() - t0 < ttl:
            break
    else:
        pytest.fail(f"the machine stalled past every TTL window {WINDOWS}")
    assert collected == 0  # nobody dead yet
    assert await _until(lambda: _eq(index.lookup(c), {"alive": 3}), ttl + 10)  # expired
    assert await index.gc(grace_s=60.0) == 0  # dead, but still within its grace
    assert await index.gc(grace_s=0.0) == 1
    assert await index.gc(grace_s=0.0) == 0
    # The dead pod's entries are gone: when it comes back it starts empty.
    await live(index, "dead")
    assert await index.lookup(c) == {"alive": 3}


async def test_heartbeat_and_store_tell_when_the_index_did_not_know_the_pod(
    index: KVIndex,
) -> None:
    """A publisher must learn that the index lost its pod (gc here; a flush or a restart in
    Redis) from the answer of a call that succeeds: no call fails then."""
    c = chain(4, seed=21)
    assert await index.heartbeat("p", PodLoad(), 0.2) is True  # first registration
    assert await index.heartbeat("p", PodLoad(), 0.2) is False
    assert await index.apply("p", batch(stored(c[:2]))) is False
    await index.clear_pod("p")  # the pod's own clear: still known
    assert await index.apply("p", batch(stored(c[:2]))) is False
    assert await _until(lambda: _eq(index.lookup(c), {}), 10)  # heartbeat expired
    assert await index.gc(grace_s=0.0) == 1
    assert await index.apply("p", batch(stored(c[2:3]))) is True  # registered anew
    assert await index.heartbeat("p", PodLoad(), TTL) is False
    assert await index.gc(grace_s=0.0) == 0
    await index.resync("q", set(c))  # a resync registers without saying so
    assert await index.heartbeat("q", PodLoad(), TTL) is False


async def test_large_batch_and_long_prompt(index: KVIndex) -> None:
    c = chain(3000, seed=13)
    await live(index, "a", "b")
    await index.apply("a", batch(stored(c)))
    await index.apply("b", batch(*(stored(c[i : i + 16]) for i in range(0, 1024, 16))))
    assert await index.lookup(c) == {"a": 3000, "b": 1024}
    assert await index.lookup(c[:512]) == {"a": 512, "b": 512}
    await index.apply("a", batch(BlockRemoved(block_hashes=c[2000:])))
    assert await index.lookup(c) == {"a": 2000, "b": 1024}


async def test_many_pods_share_a_prefix(index: KVIndex) -> None:
    c = chain(40, seed=14)
    pods = [f"pod-{i}" for i in range(40)]
    await live(index, *pods)
    for i, pod in enumerate(pods):
        await index.apply(pod, batch(stored(c[: i + 1])))
    assert await index.lookup(c) == {pod: i + 1 for i, pod in enumerate(pods)}
    await index.clear_pod("pod-39")
    got = await index.lookup(c)
    assert got["pod-38"] == 39 and "pod-39" not in got and len(got) == 39


async def test_namespaces_are_isolated(make_index: IndexFactory) -> None:
    one = await make_index()
    two = await make_index()
    c = chain(4, seed=15)
    await live(one, "a")
    await live(two, "a")
    await one.apply("a", batch(stored(c)))
    assert await one.lookup(c) == {"a": 4}
    assert await two.lookup(c) == {}
    await live(two, "b")
    assert set(await one.pods()) == {"a"}
    await two.clear_pod("a")
    assert await one.lookup(c) == {"a": 4}


async def test_unsigned_64_bit_extremes(index: KVIndex) -> None:
    # Near 2^64, near 2^63 (sign bit), tiny values, and pairs that differ only in their
    # lowest or highest bits: none may collide or lose precision.
    hashes = [
        U64,
        U64 - 1,
        1 << 63,
        (1 << 63) - 1,
        (1 << 63) + 1,
        0,
        1,
        2,
        1 << 53,
        (1 << 53) + 1,
        0xFFFF_0000_0000_0000,
        0xFFFF_0000_0000_0001,
        0x8000_FFFF_FFFF_FFFF,
    ]
    await live(index, "a", "b")
    await index.apply("a", batch(stored(hashes)))
    await index.apply("b", batch(stored(hashes[:3])))
    assert await index.lookup(hashes) == {"a": len(hashes), "b": 3}
    for i, h in enumerate(hashes):
        expected = {"a": 1, "b": 1} if i < 3 else {"a": 1}
        assert await index.lookup([h]) == expected, hex(h)
    await index.apply("a", batch(BlockRemoved(block_hashes=[U64 - 1, 1 << 53])))
    assert await index.lookup([U64]) == {"a": 1, "b": 1}
    assert await index.lookup([U64 - 1]) == {"b": 1}
    assert await index.lookup([(1 << 53) + 1]) == {"a": 1}
    assert await index.lookup([1 << 53]) == {}
    with pytest.raises(ValueError, match="64-bit"):
        await index.apply("a", batch(stored([1 << 64])))
    with pytest.raises(ValueError, match="64-bit"):
        await index.apply("a", batch(stored([-1])))


async def test_event_stream_replay_reproduces_the_set(index: KVIndex) -> None:
    """A random stream of stores/removes/clears from several pods, replayed batch by batch,
    leaves exactly the (block, pod) pairs a plain set model predicts."""
    rng = random.Random(16)
    universe = chain(300, seed=16)
    pods = ["p0", "p1", "p2", "p3"]
    await live(index, *pods)
    model: dict[str, set[int]] = {p: set() for p in pods}
    for seq in range(120):
        pod = rng.choice(pods)
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for _ in range(rng.randint(1, 4)):
            r = rng.random()
            if r < 0.6:
                hs = rng.sample(universe, rng.randint(1, 20))
                events.append(stored(hs))
                model[pod].update(hs)
            elif r < 0.97:
                held = sorted(model[pod])
                hs = [*rng.sample(held, min(len(held), rng.randint(1, 15))), rng.choice(universe)]
                events.append(BlockRemoved(block_hashes=hs))
                model[pod].difference_update(hs)
            else:
                events.append(AllBlocksCleared())
                model[pod].clear()
        await index.apply(pod, batch(*events, seq=seq))
    for h in universe:
        want = {p: 1 for p in pods if h in model[p]}
        assert await index.lookup([h]) == want


async def test_resync_by_difference_with_large_overlap(index: KVIndex) -> None:
    old = chain(6000, seed=17)
    new = old[:5000] + chain(2000, seed=18)
    await live(index, "a", "b")
    await index.apply("b", batch(stored(old[:100])))
    await index.resync("fresh", set(old[:10]))  # a pod the index never saw
    await live(index, "fresh")
    assert await index.lookup(old[:20]) == {"b": 20, "fresh": 10}
    await index.apply("a", batch(stored(old)))
    await index.resync("a", set(new))
    assert await index.lookup(old) == {"a": 5000, "b": 100, "fresh": 10}
    assert await index.lookup(new[5000:]) == {"a": 2000}
    for h in old[5000:5100]:
        assert await index.lookup([h]) == {}
    await index.resync("a", set(new))  # idempotent
    assert await index.lookup(new) == {"a": 7000, "b": 100, "fresh": 10}


async def test_auto_gc_cleans_dead_pods_without_a_gc_call(make_index: IndexFactory) -> None:
    index = await make_index(auto_gc_interval_s=0.05, auto_gc_grace_s=0.0)
    c = chain(5, seed=19)
    await index.heartbeat("dead", PodLoad(), 0.1)
    await index.apply("dead", batch(stored(c)))
    await asyncio.sleep(0.2)
    await live(index, "alive")  # this heartbeat also runs a gc step
    await index.pods()
    # Had its entries survived, the renewed heartbeat would make them count again.
    await live(index, "dead")
    assert await index.lookup(c) == {}


@pytest.mark.parametrize("seed", range(6))
async def test_random_ops_agree_with_a_plain_model(index: KVIndex, seed: int) -> None:
    """Random stores/removes/clears/resyncs/clear_pods over chains that share prefixes;
    every chain's lookup must equal what per-pod sets predict where a pod's blocks along
    the chain are prefix-closed, and lie within [held prefix, last held block] where the
    random removals left a hole."""
    rng = random.Random(1000 + seed)
    trunk = chain(40, seed=seed)
    # Branches share the trunk's first k blocks, then diverge.
    chains = [trunk] + [
        trunk[: rng.randrange(1, 40)] + chain(10, seed=seed * 100 + b) for b in range(4)
    ]
    universe = sorted({h for c in chains for h in c})
    pods = ["p0", "p1", "p2"]
    await live(index, *pods)
    model: dict[str, set[int]] = {p: set() for p in pods}
    for _ in range(40):
        pod = rng.choice(pods)
        r = rng.random()
        if r < 0.45:
            c = rng.choice(chains)
            lo = rng.randrange(len(c))
            hs = c[lo : rng.randrange(lo + 1, len(c) + 1)]
            await index.apply(pod, batch(stored(hs)))
            model[pod].update(hs)
        elif r < 0.8:
            hs = rng.sample(universe, rng.randint(1, 6))
            await index.apply(pod, batch(BlockRemoved(block_hashes=hs)))
            model[pod].difference_update(hs)
        elif r < 0.88:
            await index.apply(pod, batch(AllBlocksCleared()))
            model[pod].clear()
        elif r < 0.96:
            new = set(rng.sample(universe, rng.randint(0, 30)))
            await index.resync(pod, new)
            model[pod] = new
        else:
            await index.clear_pod(pod)
            model[pod].clear()
    for c in chains:
        got = await index.lookup(c)
        for p in pods:
            held = [h in model[p] for h in c]
            exact = held.index(False) if False in held else len(c)
            last = max((i + 1 for i, x in enumerate(held) if x), default=0)
            n = got.get(p, 0)
            # Exact on a prefix-closed set; with holes, within [held prefix, last held].
            if exact == 0 or exact == last:
                assert n == exact, (p, got)
            else:
                assert exact <= n <= last, (p, exact, n, last)
