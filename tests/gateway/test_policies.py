"""Routing policies and the router over a real in-memory index (deterministic seeds)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest

from pagefleet.gateway.discovery import Endpoint, StaticDiscovery
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.policies import (
    CacheAwarePolicy,
    Candidate,
    RoundRobinPolicy,
    RouteRequest,
    RoutingWeights,
    Scored,
    SessionPolicy,
    make_policy,
)
from pagefleet.gateway.router import Router, Ticket
from pagefleet.kvindex.events import BlockStored, KVEventBatch
from pagefleet.kvindex.hashing import block_hashes
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.memory import MemoryKVIndex

BS = 16
NS = "test-ns"
URLS = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
PODS = [f"127.0.0.1:{9000 + i}" for i in range(4)]


async def _store(index: MemoryKVIndex, pod: str, tokens: list[int], seq: int = 0) -> None:
    keys = block_hashes(tokens, BS, NS)
    batch = KVEventBatch(
        ts=0.0,
        seq=seq,
        events=[BlockStored(keys, None, tokens[: len(keys) * BS], BS)],
    )
    await index.apply(pod, batch)


async def _router(policy: str, index: MemoryKVIndex | None, seed: int = 0, **kw) -> Router:
    r = Router(
        discovery=StaticDiscovery(URLS),
        policy=make_policy(policy, kw.pop("weights", None)),
        index=index,
        block_size=BS,
        kv_namespace=NS,
        seed=seed,
        **kw,
    )
    await r.start()
    return r


async def _beat(index: MemoryKVIndex, loads: dict[str, int] | None = None) -> None:
    for pod in PODS:
        await index.heartbeat(pod, PodLoad(running=(loads or {}).get(pod, 0)), ttl_s=30)


def _prompt(seed: int, n_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n_tokens)]


async def test_prefix_affinity_picks_the_pod_holding_the_longest_prefix() -> None:
    index = MemoryKVIndex(NS)
    await _beat(index)
    prompt = _prompt(1, 20 * BS + 5)
    await _store(index, PODS[2], prompt[: 12 * BS])
    await _store(index, PODS[1], prompt[: 4 * BS])
    router = await _router("cache_aware", index)
    try:
        for _ in range(20):
            d = await router.route(prompt)
            assert d.ranked[0].endpoint.pod == PODS[2]
            assert d.predicted_hit_tokens == 12 * BS
            assert d.ranked[1].endpoint.pod == PODS[1]  # next best by cache
            assert d.index_ok and d.num_blocks == 20
    finally:
        await router.close()


async def test_unknown_prompt_spreads_at_random_over_equal_pods() -> None:
    index = MemoryKVIndex(NS)
    await _beat(index)
    router = await _router("cache_aware", index, seed=3)
    try:
        picks = Counter()
        for i in range(400):
            d = await router.route(_prompt(100 + i, 3 * BS))
            picks[d.ranked[0].endpoint.pod] += 1
        assert set(picks) == set(PODS)
        assert max(picks.values()) < 0.35 * 400
    finally:
        await router.close()


async def test_imbalance_guard_falls_back_to_least_load() -> None:
    index = MemoryKVIndex(NS)
    prompt = _prompt(2, 10 * BS)
    await _store(index, PODS[0], prompt)
    # Moderate load on the holder: cache still wins.
    await _beat(index, {PODS[0]: 2})
    router = await _router("cache_aware", index)
    try:
        d = await router.route(prompt)
        assert d.ranked[0].endpoint.pod == PODS[0]
        assert d.ranked[0].reason == "cache_aware"
        # Far busier than the idle pods: the guard sends the request elsewhere.
        await _beat(index, {PODS[0]: 12, PODS[1]: 1})
        await router.refresh_loads()
        d = await router.route(prompt)
        assert d.ranked[0].endpoint.pod in {PODS[2], PODS[3]}
        assert d.ranked[0].reason == "imbalance_guard"
        assert d.ranked[-1].endpoint.pod == PODS[0]
    finally:
        await router.close()


async def test_own_inflight_counts_as_load_between_heartbeats() -> None:
    router = await _router("least_load", None)
    try:
        ep = Endpoint(PODS[0], URLS[0])
        for _ in range(3):
            router.acquire(ep)
        for _ in range(20):
            d = await router.route(_prompt(5, 40))
            assert d.ranked[0].endpoint.pod != PODS[0]
            assert d.ranked[-1].endpoint.pod == PODS[0]
        for _ in range(3):
            router.release(ep)
        assert router.inflight == {}
    finally:
        await router.close()


async def test_single_popular_prompt_does_not_pin_one_pod() -> None:
    """Closed-loop simulation: 8 requests in flight, each finishes after 8 more arrive and
    then its pod advertises the prompt (as the daemon's KV events would)."""
    index = MemoryKVIndex(NS)
    await _beat(index)
    prompt = _prompt(9, 30 * BS)
    router = await _router("cache_aware", index, seed=11)
    try:
        inflight: list[Endpoint] = []
        share = Counter()
        seq = 0
        for _ in range(800):
            d = await router.route(prompt)
            ep = d.ranked[0].endpoint
            router.acquire(ep)
            inflight.append(ep)
            share[ep.pod] += 1
            if len(inflight) >= 8:
                done = inflight.pop(0)
                router.release(done)
                seq += 1
                await _store(index, done.pod, prompt, seq)
        busiest = max(share.values()) / sum(share.values())
        assert busiest <= 0.4, share
        assert len(share) == 4
    finally:
        await router.close()


async def test_replicas_sharing_an_index_rank_identically() -> None:
    index = MemoryKVIndex(NS)
    await _beat(index)
    prompts = [_prompt(50 + i, 12 * BS) for i in range(8)]
    for i, p in enumerate(prompts):
        await _store(index, PODS[i % 4], p[: (4 + i) * BS], seq=i)
    a = await _router("cache_aware", index, seed=1)
    b = await _router("cache_aware", index, seed=2)
    try:
        for i, p in enumerate(prompts):
            da, db = await a.route(p), await b.route(p)
            assert (
                da.ranked[0].endpoint == db.ranked[0].endpoint == Endpoint(PODS[i % 4], URLS[i % 4])
            )
    finally:
        await a.close()
        await b.close()


async def test_session_affinity_is_stable_and_moves_only_lost_sessions() -> None:
    policy = SessionPolicy()
    rng = random.Random(0)
    eps = [Endpoint(p, u) for p, u in zip(PODS, URLS, strict=True)]
    cands = [Candidate(e) for e in eps]
    before = {}
    for s in range(200):
        req = RouteRequest(prompt_tokens=10, block_size=BS, session_key=f"user-{s}")
        picks = {policy.rank(cands, req, rng)[0].endpoint.pod for _ in range(3)}
        assert len(picks) == 1
        before[s] = picks.pop()
    assert len(set(before.values())) == 4
    # Pod 3 leaves: only its sessions move.
    smaller = cands[:3]
    for s, pod in before.items():
        req = RouteRequest(prompt_tokens=10, block_size=BS, session_key=f"user-{s}")
        now = policy.rank(smaller, req, rng)[0].endpoint.pod
        if pod != PODS[3]:
            assert now == pod
    # No key: least load.
    busy = [Candidate(eps[0], running=5), Candidate(eps[1]), Candidate(eps[2], running=2)]
    req = RouteRequest(prompt_tokens=10, block_size=BS)
    assert policy.rank(busy, req, rng)[0].endpoint == eps[1]


async def test_round_robin_cycles_through_every_pod() -> None:
    router = await _router("round_robin", None)
    try:
        firsts = [(await router.route([1, 2, 3])).ranked[0].endpoint.pod for _ in range(8)]
        assert firsts == sorted(PODS) * 2
    finally:
        await router.close()
    rr = RoundRobinPolicy()
    assert rr.rank([], RouteRequest(0, BS), random.Random(0)) == []


class _BrokenIndex(MemoryKVIndex):
    """Unit-level stand-in for a Redis that went away (the e2e test stops a real one)."""

    async def lookup(self, block_hashes: list[int]) -> dict[str, int]:
        raise ConnectionError("Connection refused")

    async def pods(self) -> dict[str, PodLoad]:
        raise ConnectionError("Connection refused")


async def test_index_failure_degrades_to_load_only_and_opens_breaker() -> None:
    index = _BrokenIndex(NS)
    router = await _router("cache_aware", index, breaker_cooldown_s=60)
    try:
        for _ in range(2):  # two misses of this size: beyond the slack of one prefill
            router.acquire(Endpoint(PODS[1], URLS[1]), work=5 * BS)
        d = await router.route(_prompt(3, 5 * BS))
        assert not d.index_ok
        assert d.ranked and d.ranked[-1].endpoint.pod == PODS[1]
        assert router._breaker.failures == 1
        d = await router.route(_prompt(3, 5 * BS))  # breaker open: no second lookup
        assert not d.index_ok and router._breaker.failures == 1
    finally:
        await router.close()


class _HungIndex(MemoryKVIndex):
    """A Redis that accepts and never answers (SIGSTOP): lookups wait until cancelled."""

    lookups = 0

    async def lookup(self, block_hashes: list[int]) -> dict[str, int]:
        self.lookups += 1
        await asyncio.Event().wait()
        return {}


async def test_after_the_cooldown_one_probe_asks_a_hung_index_not_every_request() -> None:
    """Once the breaker's cooldown was over, every request routed before the first of them
    timed out asked the hung index too, each waiting the whole lookup timeout (a burst of
    requests: all of them) and each opening a connection to the stalled Redis. One probe
    now asks; the others route on load at once, as while the breaker is open."""
    index = _HungIndex(NS)
    router = await _router("cache_aware", index, lookup_timeout_s=0.2, breaker_cooldown_s=0.1)
    try:
        assert not (await router.route(_prompt(3, 5 * BS))).index_ok  # opens the breaker
        await asyncio.sleep(0.15)  # the cooldown is over
        before = index.lookups
        t0 = time.monotonic()
        routes = [asyncio.create_task(router.route(_prompt(i, 5 * BS))) for i in range(20)]
        done, _ = await asyncio.wait(routes, timeout=0.1)
        assert len(done) == 19, "requests waited on the hung index behind the probe"
        assert index.lookups - before == 1
        decisions = await asyncio.gather(*routes)
        assert not any(d.index_ok for d in decisions) and time.monotonic() - t0 < 1.0
        # A probe cancelled with its request (the client left) leaves the next one free.
        await asyncio.sleep(0.15)
        probe = asyncio.create_task(router.route(_prompt(1, 5 * BS)))
        await asyncio.sleep(0.02)
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        before = index.lookups
        await router.route(_prompt(2, 5 * BS))
        assert index.lookups - before == 1
    finally:
        await router.close()


def test_weights_parse_and_reject_unknown_names() -> None:
    w = RoutingWeights.parse("prefill=2, queue=0.5,imbalance-abs=8")
    assert (w.prefill, w.queue, w.kv, w.imbalance_abs) == (2.0, 0.5, 0.5, 8.0)
    with pytest.raises(ValueError, match="unknown weight 'bogus'"):
        RoutingWeights.parse("bogus=1")
    with pytest.raises(ValueError, match="name=value"):
        RoutingWeights.parse("prefill")
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")


def test_cache_aware_cost_trades_hits_against_work_ahead() -> None:
    """Load is prefill work queued ahead, in tokens: a queue of cache hits weighs little,
    a queue of long misses a lot; decoding requests nothing. (The cost alone: the
    imbalance guard, which counts requests waiting for a first token, is out of reach.)"""
    policy = CacheAwarePolicy(
        RoutingWeights(prefill=1.0, queue=0.5, slack=1, kv=0.0, fit=0.0, imbalance_abs=100)
    )
    ep = [Endpoint(p, u) for p, u in zip(PODS, URLS, strict=True)]
    n = 10 * BS
    req = RouteRequest(prompt_tokens=n, block_size=BS, num_blocks=10)

    def first(cands: list[Candidate]) -> Endpoint:
        return policy.rank(cands, req, random.Random(0))[0].endpoint

    # Full hit with two prefills of work ahead (cost 0.5 * (2 - 1)) beats a cold idle pod
    # (cost 1.0) ...
    assert first([Candidate(ep[0], 10, prefill_work=2 * n), Candidate(ep[1])]) == ep[0]
    # ... but not with four (cost 1.5).
    assert first([Candidate(ep[0], 10, prefill_work=4 * n), Candidate(ep[1])]) == ep[1]
    # Six requests ahead that are themselves hits (a block of work each) cost nothing.
    hits = [Candidate(ep[0], 10, prefilling=6, prefill_work=6 * BS), Candidate(ep[1])]
    assert first(hits) == ep[0]
    # Another replica's waiting requests count at our mean work per request.
    others = [Candidate(ep[0], 10, waiting=4, mean_work=n), Candidate(ep[1], mean_work=n)]
    assert first(others) == ep[1]
    # Requests already decoding do not delay a prefill: a busy decoder keeps its hits.
    decoding = [Candidate(ep[0], 10, running=4, mean_work=n), Candidate(ep[1])]
    assert first(decoding) == ep[0]
    # Load is counted from the least-loaded pod: all busy alike, the hit wins however busy.
    busy = [Candidate(ep[0], 10, prefill_work=9 * n), Candidate(ep[1], prefill_work=8 * n)]
    assert first(busy) == ep[0]


def test_slack_makes_one_prefill_more_free() -> None:
    """Nearly idle pods: a partial hit stays with its holder while the work ahead of it is
    within one prefill of this prompt; with slack 0 the same work moves it."""
    ep = [Endpoint(p, u) for p, u in zip(PODS, URLS, strict=True)]
    req = RouteRequest(prompt_tokens=10 * BS, block_size=BS, num_blocks=10)
    cands = [Candidate(ep[0], 6, prefilling=1, prefill_work=10 * BS), Candidate(ep[1])]
    slack = CacheAwarePolicy(RoutingWeights(queue=0.5, slack=1, kv=0.0, fit=0.0))
    assert slack.rank(cands, req, random.Random(0))[0].endpoint == ep[0]
    strict = CacheAwarePolicy(RoutingWeights(queue=1.0, slack=0, kv=0.0, fit=0.0))
    assert strict.rank(cands, req, random.Random(0))[0].endpoint == ep[1]


def test_placement_weighs_evictions_against_work_ahead() -> None:
    """A new prompt on a pod whose recent working set fills its pool evicts blocks someone
    will prefill again: it goes to a pod with room unless that pod's queue costs more."""
    ep = [Endpoint(p, u) for p, u in zip(PODS, URLS, strict=True)]
    n = 40 * BS
    req = RouteRequest(prompt_tokens=n, block_size=BS, num_blocks=40)
    policy = CacheAwarePolicy()
    full_idle = Candidate(ep[0], footprint_blocks=200, capacity_blocks=200)
    # One prefill ahead is within the slack: the pod with room wins.
    room = Candidate(ep[1], prefilling=1, prefill_work=n, footprint_blocks=40, capacity_blocks=200)
    for seed in range(5):
        assert policy.rank([full_idle, room], req, random.Random(seed))[0].endpoint == ep[1]
    # Three prefills ahead (cost 0.5 * 2) outweigh evicting this prompt's 40 blocks (0.5).
    busy = Candidate(
        ep[1], prefilling=3, prefill_work=3 * n, footprint_blocks=40, capacity_blocks=200
    )
    assert policy.rank([full_idle, busy], req, random.Random(0))[0].endpoint == ep[0]
    # A sliver every prompt shares (a template's first block) does not outweigh room.
    sliver = Candidate(ep[0], 1, footprint_blocks=150, capacity_blocks=200)
    empty = Candidate(ep[1], footprint_blocks=0, capacity_blocks=200)
    assert policy.rank([sliver, empty], req, random.Random(0))[0].endpoint == ep[1]
    # A partial hit whose new blocks fit stays with its holder over an idle pod with room.
    holder = Candidate(ep[2], 30, prefill_work=n, footprint_blocks=190, capacity_blocks=200)
    other = Candidate(ep[3], footprint_blocks=0, capacity_blocks=200)
    assert policy.rank([holder, other], req, random.Random(0))[0].endpoint == ep[2]


def test_new_prefix_goes_where_its_blocks_fit() -> None:
    """No pod holds the prompt: the pod with the smallest recent footprint for its capacity
    wins, even when it has a request more in flight (within the slack)."""
    ep = [Endpoint(p, u) for p, u in zip(PODS, URLS, strict=True)]
    req = RouteRequest(prompt_tokens=40 * BS, block_size=BS, num_blocks=40)
    policy = CacheAwarePolicy()
    cands = [
        Candidate(ep[0], footprint_blocks=300, capacity_blocks=200),
        Candidate(ep[1], running=1, footprint_blocks=40, capacity_blocks=200),
        Candidate(ep[2], footprint_blocks=160, capacity_blocks=200),
    ]
    for seed in range(5):
        assert policy.rank(cands, req, random.Random(seed))[0].endpoint == ep[1]
    # A bigger pool is more room for the same footprint.
    cands = [
        Candidate(ep[0], footprint_blocks=100, capacity_blocks=100),
        Candidate(ep[1], footprint_blocks=100, capacity_blocks=400),
    ]
    assert policy.rank(cands, req, random.Random(0))[0].endpoint == ep[1]


async def test_failed_pod_is_ranked_last_until_ejection_expires() -> None:
    index = MemoryKVIndex(NS)
    await _beat(index)
    prompt = _prompt(4, 8 * BS)
    await _store(index, PODS[0], prompt)
    router = await _router("cache_aware", index, eject_s=0.3)
    try:
        assert (await router.route(prompt)).ranked[0].endpoint.pod == PODS[0]
        # The demotion must be seen before eject_s runs out; a loaded machine can stall the
        # test past it, so that attempt does not count and the next one gets a longer window.
        for eject_s in (0.3, 1.2, 4.8):
            router.eject_s = eject_s
            t0 = time.monotonic()
            router.mark_failed(Endpoint(PODS[0], URLS[0]))
            d = await router.route(prompt)
            if time.monotonic() - t0 < eject_s:
                break
        else:
            pytest.fail("the machine stalled past every ejection window")
        assert d.ranked[0].endpoint.pod != PODS[0]
        assert d.ranked[-1].endpoint.pod == PODS[0]  # demoted, still a last resort
        # Back in first place once the ejection expires (waited for, not slept for).
        deadline = time.monotonic() + eject_s + 10
        while (await router.route(prompt)).ranked[0].endpoint.pod != PODS[0]:
            assert time.monotonic() < deadline, "the pod never came back from ejection"
            await asyncio.sleep(0.02)
        assert time.monotonic() - t0 >= eject_s
    finally:
        await router.close()


class _Rollout:
    """A discovery whose pods the test replaces, as a rollout does (new names each time)."""

    def __init__(self) -> None:
        self.eps: list[Endpoint] = []

    def endpoints(self) -> list[Endpoint]:
        return list(self.eps)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_pods_that_left_discovery_are_forgotten_once_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Per-pod state (in-flight history, ejections, placements, metric series) was kept for
    # every pod name ever seen: it grew with every rollout.
    # route() looks for pods that left idle once a second: on every call here
    monkeypatch.setattr("pagefleet.gateway.router._SWEEP_S", 0.0, raising=False)
    disc = _Rollout()
    metrics = GatewayMetrics()
    router = Router(
        discovery=disc, policy=make_policy("cache_aware"), block_size=BS, kv_namespace=NS,
        seed=0, metrics=metrics,
    )  # fmt: skip
    held: tuple[Endpoint, list[int], Ticket] | None = None
    for gen in range(20):
        disc.eps = [Endpoint(f"decode-{gen}-{i}", f"http://10.0.{gen}.{i}:8000") for i in range(3)]
        if held is not None:
            ep, keys, ticket = held  # sent before the rollout, ends after it
            assert ep.pod in router._history
            router.release(ep, keys, ticket)
            assert ep.pod not in router._history
        for i, ep in enumerate(disc.eps):
            keys = router.block_keys(_prompt(gen * 3 + i, 4 * BS))
            ticket = router.acquire(ep, keys, work=BS)
            metrics.requests.labels(policy="cache_aware", pod=ep.pod).inc()
            metrics.responses.labels(pod=ep.pod, code="200").inc()
            router.first_token(ticket)
            if i == 0:
                held = (ep, keys, ticket)
            else:
                router.release(ep, keys, ticket)
        router.mark_failed(disc.eps[1])
        await router.route(_prompt(999, 4 * BS))
    live = {ep.pod for ep in disc.eps}
    assert set(router._history) <= live and set(router._ejected) <= live
    assert set(router.placements._seen) <= live
    text = metrics.render().decode()
    assert 'pod="decode-0-' not in text and 'pod="decode-18-' not in text
    assert 'pod="decode-19-1"' in text  # the live pods' series stay


async def test_heartbeat_load_is_not_double_counted_with_own_inflight() -> None:
    index = MemoryKVIndex(NS)
    router = await _router("least_load", index)
    try:
        ep = Endpoint(PODS[0], URLS[0])
        for _ in range(3):
            router.acquire(ep)
        # The pod reports our 3 requests: queue is 3, not 6.
        await index.heartbeat(PODS[0], PodLoad(running=3), ttl_s=30)
        await router.refresh_loads()
        d = await router.route([1] * 40)
        assert {s.endpoint.pod: s.queue for s in d.ranked}[PODS[0]] == 3
        # An older heartbeat (taken before we sent anything) saw 2 other requests: 3 + 2.
        await index.heartbeat(PODS[0], PodLoad(running=2, ts=time.time() - 60), ttl_s=30)
        await router.refresh_loads()
        d = await router.route([1] * 40)
        assert {s.endpoint.pod: s.queue for s in d.ranked}[PODS[0]] == 5
        # The heartbeat was taken while our 3 ran; they finished since: the pod is idle.
        taken = time.time()
        await asyncio.sleep(0.01)
        for _ in range(3):
            router.release(ep)
        await index.heartbeat(PODS[0], PodLoad(running=3, ts=taken), ttl_s=30)
        await router.refresh_loads()
        d = await router.route([1] * 40)
        assert {s.endpoint.pod: s.queue for s in d.ranked}[PODS[0]] == 0
    finally:
        await router.close()


def test_decision_names_where_a_request_went_against_the_longest_prefix() -> None:
    """The placements counter's labels: the holder of the longest prefix, another pod, or
    no holder at all."""
    from pagefleet.gateway.router import RoutingDecision

    ep = [Endpoint(p, u) for p, u in zip(PODS, URLS, strict=True)]
    ranked = [Scored(ep[0], 1.0, 32, 0, "cache_aware"), Scored(ep[1], 0.5, 64, 0, "cache_aware")]
    d = RoutingDecision(ranked, "cache_aware", 80, 5, True, 0.0)
    assert d.placement(ranked[1]) == "best_prefix"
    assert d.placement(ranked[0]) == "moved"
    cold = [Scored(ep[0], 1.0, 0, 0, "cache_aware")]
    assert RoutingDecision(cold, "cache_aware", 80, 5, True, 0.0).placement(cold[0]) == "new_prefix"
    rr = RoutingDecision(cold, "round_robin", 80, 5, True, 0.0, uses_index=False)
    assert rr.placement(cold[0]) == "no_index"


async def test_a_popular_tenant_keeps_affinity_a_single_hot_prompt_spreads() -> None:
    """Hot means more than twice a fair share of the requests in flight (+ slack): a
    tenant with 3 of 8 stays on its holder, a prompt with 8 of 13 is replicated by load."""
    index = MemoryKVIndex(NS)
    await _beat(index)
    tenant, other = _prompt(21, 20 * BS), _prompt(22, 20 * BS)
    router = await _router("cache_aware", index)
    try:
        holder = Endpoint(PODS[0], URLS[0])
        keys = router.block_keys(tenant)
        for _ in range(3):
            router.acquire(holder, keys, work=BS)
        for i in range(5):  # the rest of the fleet's traffic, elsewhere
            router.acquire(Endpoint(PODS[1 + i % 3], URLS[1 + i % 3]), router.block_keys(other))
        d = await router.route(tenant)
        assert d.ranked[0].endpoint == holder and d.ranked[0].reason == "cache_aware"
        for _ in range(5):  # 8 of 13 in flight share the prompt: beyond 2 * 13/4 + 1
            router.acquire(holder, keys, work=BS)
        d = await router.route(tenant)
        assert d.ranked[0].reason == "hot_prefix" and d.ranked[0].endpoint != holder
    finally:
        await router.close()


async def test_a_tenant_whose_conversations_run_on_its_holder_is_not_hot() -> None:
    """Hot counts copies of the prefix, not requests extending it with their own history:
    6 of 8 in flight carry a tenant's system prompt, but 4 are later turns (each tied to
    the holder by its own history): a new first turn stays on the holder. With 6 first
    turns (copies of the prefix up to their last eighth) it is replicated by load. (The
    imbalance guard, a separate rule, is set out of reach.)"""
    index = MemoryKVIndex(NS)
    await _beat(index)
    system = _prompt(31, 40 * BS)
    weights = RoutingWeights(imbalance_abs=100)
    router = await _router("cache_aware", index, weights=weights)
    try:
        holder = Endpoint(PODS[0], URLS[0])
        others = [Endpoint(p, u) for p, u in zip(PODS[1:], URLS[1:], strict=True)]
        placed = []
        for i in range(4):  # later turns: the system prompt + 12 blocks of history each
            keys = router.block_keys(system + _prompt(100 + i, 12 * BS))
            router.acquire(holder, keys, work=BS)
            placed.append(keys)
        for i in range(2):  # first turns: the system prompt + a question (2 blocks)
            keys = router.block_keys(system + _prompt(200 + i, 2 * BS))
            router.acquire(holder, keys, work=BS)
            placed.append(keys)
        for i in range(2):  # the rest of the fleet's traffic
            router.acquire(others[i], router.block_keys(_prompt(300 + i, 20 * BS)))
        first_turn = system + _prompt(400, 2 * BS)
        d = await router.route(first_turn)
        assert d.ranked[0].endpoint == holder and d.ranked[0].reason == "cache_aware"
        # The later turns finish, first turns of the tenant take their slots: 6 copies.
        for keys in placed[:4]:
            router.release(holder, keys)
        for i in range(4):
            router.acquire(holder, router.block_keys(system + _prompt(500 + i, 3 * BS)))
        d = await router.route(first_turn)
        assert d.ranked[0].reason == "hot_prefix" and d.ranked[0].endpoint != holder
    finally:
        await router.close()


def test_slack_protects_cached_work_not_equal_choices() -> None:
    """A prompt no pod holds more of than the least-loaded pod does goes to the pod with
    less prefill work ahead, even within the slack (nothing cached is traded: a miss sent
    behind another miss's prefill waits for it); a partial hit keeps its slack."""
    ep = [Endpoint(p, u) for p, u in zip(PODS, URLS, strict=True)]
    n = 40 * BS
    req = RouteRequest(prompt_tokens=n, block_size=BS, num_blocks=40)
    policy = CacheAwarePolicy()
    # A new prefix: one pod prefilling a miss with more room, one idle with a bit less.
    busy = Candidate(ep[0], prefilling=1, prefill_work=n, footprint_blocks=0, capacity_blocks=200)
    idle = Candidate(ep[1], footprint_blocks=60, capacity_blocks=200)
    for seed in range(5):
        assert policy.rank([busy, idle], req, random.Random(seed))[0].endpoint == ep[1]
    # The shared sliver (a template's first block) on both: still nothing to protect.
    busy1 = Candidate(ep[0], 1, prefilling=1, prefill_work=n, capacity_blocks=200)
    idle1 = Candidate(ep[1], 1, footprint_blocks=60, capacity_blocks=200)
    assert policy.rank([busy1, idle1], req, random.Random(0))[0].endpoint == ep[1]
    # Two holders of the same prefix: the one with nothing ahead.
    h_busy = Candidate(ep[2], 30, prefilling=1, prefill_work=n // 2, capacity_blocks=200)
    h_idle = Candidate(ep[3], 30, footprint_blocks=100, capacity_blocks=200)
    assert policy.rank([h_busy, h_idle, idle], req, random.Random(0))[0].endpoint == ep[3]
    # The only holder keeps its hit with one prefill ahead (the slack protects it).
    assert policy.rank([h_busy, idle], req, random.Random(0))[0].endpoint == ep[2]


def test_imbalance_guard_counts_requests_waiting_not_answers_streaming() -> None:
    """A tenant's holder running 6 of its conversations' answers (past their first token)
    is not swamped: the request keeps its hit there. The same 6 waiting for their first
    token (ours prefilling, or the heartbeat's beyond ours) trip the guard."""
    ep = [Endpoint(p, u) for p, u in zip(PODS, URLS, strict=True)]
    req = RouteRequest(prompt_tokens=40 * BS, block_size=BS, num_blocks=40)
    policy = CacheAwarePolicy()
    idle = [Candidate(e, capacity_blocks=200) for e in ep[1:]]
    answering = Candidate(ep[0], 36, inflight=6, capacity_blocks=200)
    first = policy.rank([answering, *idle], req, random.Random(0))[0]
    assert first.endpoint == ep[0] and first.reason == "cache_aware"
    waiting = Candidate(ep[0], 36, inflight=6, prefilling=6, prefill_work=6 * BS)
    first = policy.rank([waiting, *idle], req, random.Random(0))[0]
    assert first.endpoint != ep[0] and first.reason == "imbalance_guard"
    others = Candidate(ep[0], 36, running=6, has_heartbeat=True)
    first = policy.rank([others, *idle], req, random.Random(0))[0]
    assert first.endpoint != ep[0] and first.reason == "imbalance_guard"
