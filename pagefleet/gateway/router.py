"""The routing step: prompt -> block keys -> one index lookup -> ranked pods.

Invariant: routing never fails because the index does. A lookup that errors or exceeds its
timeout counts as "no pod holds anything" (cache_aware degrades to load-only) and opens a
short circuit breaker so later requests do not each pay the timeout while Redis is down.
Hit predictions come from the shared index, merged (per pod, the larger) with this
replica's memory of where it sent each block in the last moments (``PlacementMemory``):
what the index cannot know yet. When the memory holds a whole earlier prompt that this one
extends by at most an eighth (a conversation's next turn), the index is not asked.
Replicas differ only by their own recent traffic.

Health: a pod that failed or timed out a request is ranked last for ``eject_s``; one that
its discovery probe declares unreachable is also signalled to every request waiting on it,
which then moves on. One request's timeout cuts no other request: it may have waited in a
busy pod's queue while the pod's other streams flow. While heartbeats can be read, a pod
without a live heartbeat ranks after every pod with one (it may be frozen: no load figures
is not the same as idle). Values read from the index are range-checked: a forged or
corrupt entry is clamped or dropped, never trusted to make a pod look infinitely
attractive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagefleet.gateway.discovery import Discovery, Endpoint
from pagefleet.gateway.placements import PlacementMemory
from pagefleet.gateway.policies import Candidate, Policy, RouteRequest, Scored
from pagefleet.gateway.shared_placements import SharedPlacements
from pagefleet.kvindex.hashing import chain_hash, root_hash
from pagefleet.kvindex.index import KVIndex, PodLoad

if TYPE_CHECKING:
    from pagefleet.gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

# Block keys remembered by (parent, tokens): about 30 MB at this bound.
_KEY_CACHE_MAX = 131_072
# In-flight changes remembered per pod, to line heartbeats up with our own traffic.
_HISTORY_LEN = 512
# How often route() looks for pods that left discovery idle, to drop their state.
_SWEEP_S = 1.0
# Weight of the newest request in the mean predicted work per request.
_WORK_EWMA = 0.1
# The index is not asked when this gateway's recent placements already match a prompt
# up to its last 1/8 of blocks (a conversation's next turn, sent moments after the last).
_SKIP_INDEX_NEW_BLOCKS = 8


@dataclass(slots=True)
class RoutingDecision:
    """Pods best first; ``predicted_hit_tokens`` is what the index promised the first one."""

    ranked: list[Scored]
    policy: str
    prompt_tokens: int
    num_blocks: int
    index_ok: bool
    decision_s: float
    keys: list[int] = field(default_factory=list)
    uses_index: bool = True  # the policy looked up prefixes (else placement is unknown)

    @property
    def predicted_hit_tokens(self) -> int:
        return self.ranked[0].matched_tokens if self.ranked else 0

    def placement(self, chosen: Scored) -> str:
        """``best_prefix`` when ``chosen`` holds the longest prefix any pod holds, ``moved``
        when another pod holds more, ``new_prefix`` when no pod holds any; ``no_index``
        when the policy never asked (round robin, least load, session)."""
        if not self.uses_index:
            return "no_index"
        best = max((s.matched_tokens for s in self.ranked), default=0)
        if best <= 0:
            return "new_prefix"
        return "best_prefix" if chosen.matched_tokens >= best else "moved"


@dataclass(slots=True)
class Ticket:
    """One attempt in flight; ``prefilling`` until its first byte came back, with ``work``
    uncached prompt tokens predicted for its pod."""

    pod: str
    prefilling: bool = True
    work: int = 0


@dataclass(slots=True)
class _Breaker:
    """Skips the index for ``cooldown_s`` after a failure; one probe then decides: the
    requests routed while it is out skip the index too."""

    cooldown_s: float
    open_until: float = 0.0
    failures: int = 0
    probing: bool = False

    def allow(self, now: float) -> bool:
        if not self.failures:
            return True
        if self.probing or now < self.open_until:
            return False
        self.probing = True
        return True

    def failed(self, now: float) -> None:
        self.failures += 1
        self.open_until = now + self.cooldown_s
        self.probing = False

    def succeeded(self) -> None:
        self.failures = 0
        self.open_until = 0.0
        self.probing = False

    def abandoned(self) -> None:
        """The call ended without an answer either way (its request was cancelled)."""
        self.probing = False


@dataclass(slots=True)
class Router:
    """Ranks the discovered pods for one prompt with the configured policy."""

    discovery: Discovery
    policy: Policy
    index: KVIndex | None = None  # None: no index at all, route on load only
    block_size: int = 16
    kv_namespace: str = ""
    lookup_timeout_s: float = 0.1
    load_refresh_s: float = 0.25
    breaker_cooldown_s: float = 1.0
    seed: int | None = None
    metrics: GatewayMetrics | None = None
    eject_s: float = 5.0
    # How long a finished request's placement counts before the index alone decides;
    # 0 turns the placement memory off.
    placement_ttl_s: float = 2.0
    inflight: dict[str, int] = field(default_factory=dict)
    # Of those, the ones still waiting for their first byte (queued or prefilling).
    prefilling: dict[str, int] = field(default_factory=dict)
    # Their predicted uncached prompt tokens: the prefill work queued there by us.
    prefill_work: dict[str, int] = field(default_factory=dict)
    # Mean predicted uncached tokens per request (moving average): the work a request
    # seen only as a count in a heartbeat (another replica's) is taken to carry.
    mean_work: float = 0.0
    placements: PlacementMemory = field(default_factory=PlacementMemory)
    # Other replicas' placements folded into ``placements``, ours published (None: alone)
    shared: SharedPlacements | None = None
    _ejected: dict[str, float] = field(default_factory=dict)
    _history: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    _loads: dict[str, PodLoad] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=random.Random)
    _breaker: _Breaker = field(default_factory=lambda: _Breaker(1.0))
    _load_task: asyncio.Task[None] | None = None
    _key_cache: dict[tuple[int, tuple[int, ...], str | None], int] = field(default_factory=dict)
    _loads_ok: bool = False  # the last heartbeat read succeeded
    _watchers: dict[str, set[Callable[[], None]]] = field(default_factory=dict)
    _sweep_at: float = 0.0  # monotonic time of the next sweep for pods that left

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._breaker = _Breaker(self.breaker_cooldown_s)
        self.placements.ttl_s = self.placement_ttl_s

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        subscribe = getattr(self.discovery, "subscribe_unreachable", None)
        if subscribe is not None:
            subscribe(self._pod_unreachable)
        await self.discovery.start()
        if self.shared is not None:
            await self.shared.start()
        if self.index is not None:
            await self.refresh_loads()
            self._load_task = asyncio.create_task(self._load_loop(), name="gateway-load-refresh")

    async def close(self) -> None:
        if self._load_task is not None:
            self._load_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._load_task
        await self.discovery.close()
        if self.shared is not None:
            await self.shared.close()
        if self.index is not None:
            with contextlib.suppress(Exception):
                await self.index.close()

    async def _load_loop(self) -> None:
        while True:
            await asyncio.sleep(self.load_refresh_s)
            await self.refresh_loads()

    async def refresh_loads(self) -> None:
        """Pull every live pod's heartbeat; on failure forget them (load = own in-flight)."""
        if self.index is None:
            return
        try:
            async with asyncio.timeout(self.lookup_timeout_s * 5):
                pods = await self.index.pods()
        except Exception as exc:
            if self._loads:
                logger.warning("index heartbeat read failed (%s); routing on in-flight counts", exc)
            self._loads = {}
            self._loads_ok = False
            if self.metrics is not None:
                self.metrics.index_errors.labels(op="pods").inc()
            return
        loads: dict[str, PodLoad] = {}
        for pod, raw in pods.items():
            try:
                loads[pod] = raw.checked()
            except ValueError as exc:
                logger.debug("ignoring pod %r's heartbeat: %s", pod, exc)
        self._loads = loads
        self._loads_ok = True

    # -- in-flight accounting -------------------------------------------------------------

    def acquire(self, ep: Endpoint, keys: Sequence[int] = (), work: int = 0) -> Ticket:
        """A request (with block ``keys`` and ``work`` predicted uncached prompt tokens on
        this pod) is being sent to ``ep``."""
        self._set_inflight(ep.pod, self.inflight.get(ep.pod, 0) + 1)
        self.prefilling[ep.pod] = self.prefilling.get(ep.pod, 0) + 1
        work = max(0, work)
        if work:
            self.prefill_work[ep.pod] = self.prefill_work.get(ep.pod, 0) + work
        self.mean_work += (work - self.mean_work) * _WORK_EWMA
        if keys and self.placement_ttl_s > 0:
            self.placements.begin(keys, ep.pod)
            if self.shared is not None:
                self.shared.sent(keys, ep.pod)
        return Ticket(ep.pod, work=work)

    def first_token(self, ticket: Ticket) -> None:
        """The attempt's first byte arrived: it no longer delays a new prefill there."""
        if ticket.prefilling:
            ticket.prefilling = False
            self._dec_prefilling(ticket.pod, ticket.work)

    def release(self, ep: Endpoint, keys: Sequence[int] = (), ticket: Ticket | None = None) -> None:
        """The request :meth:`acquire` announced finished (or failed)."""
        self._set_inflight(ep.pod, max(0, self.inflight.get(ep.pod, 0) - 1))
        if ticket is None or ticket.prefilling:
            self._dec_prefilling(ep.pod, ticket.work if ticket is not None else 0)
            if ticket is not None:
                ticket.prefilling = False
        if keys and self.placement_ttl_s > 0:
            self.placements.end(keys, ep.pod)
        if ep.pod not in self.inflight and not self._discovered(ep.pod):
            self._forget(ep.pod)  # its last request ended after it left discovery

    def _discovered(self, pod: str) -> bool:
        configured = getattr(self.discovery, "pods", None)
        if configured is not None and pod in configured():
            return True
        return any(e.pod == pod for e in self.discovery.endpoints())

    def _members(self, endpoints: Sequence[Endpoint]) -> set[str]:
        """The pods whose state is kept: those routed to now, and (static discovery) every
        configured one. A configured pod out for a while (busy past its probes, draining)
        is still part of the fleet: forgetting it dropped its metric series, the
        ``pod_unhealthy`` count of the outage included, moments after it was counted."""
        live = {ep.pod for ep in endpoints}
        configured = getattr(self.discovery, "pods", None)
        return live | configured() if configured is not None else live

    def _forget(self, pod: str) -> None:
        """Drop what this router keeps per pod (in-flight history, ejection, placements,
        metric series) for ``pod``, which has left discovery with nothing in flight.

        Invariant: per-pod state is bounded by the pods in discovery plus those with
        requests in flight; pod names change on every rollout, so state kept for every
        name ever seen grows without end. A pod that comes back starts afresh."""
        self._history.pop(pod, None)
        self._ejected.pop(pod, None)
        self.placements.forget_pod(pod)
        if self.metrics is not None:
            self.metrics.forget_pod(pod)

    def _sweep(self, live: set[str]) -> None:
        """Forget the pods that left discovery while nothing was in flight to them (the
        release of their last request found them still there)."""
        for pod in self._history.keys() | self._ejected.keys():
            if pod not in live and pod not in self.inflight:
                self._forget(pod)

    def _dec_prefilling(self, pod: str, work: int = 0) -> None:
        n = self.prefilling.get(pod, 0) - 1
        if n > 0:
            self.prefilling[pod] = n
        else:
            self.prefilling.pop(pod, None)
        left = self.prefill_work.get(pod, 0) - work
        if left > 0 and n > 0:
            self.prefill_work[pod] = left
        else:
            self.prefill_work.pop(pod, None)

    def _set_inflight(self, pod: str, n: int) -> None:
        if n > 0:
            self.inflight[pod] = n
        else:
            self.inflight.pop(pod, None)
        # Wall clock: heartbeats carry the pod's wall-clock time of measurement.
        hist = self._history.setdefault(pod, deque(maxlen=_HISTORY_LEN))
        hist.append((time.time(), n))

    def inflight_at(self, pod: str, ts: float) -> int:
        """This gateway's in-flight count to ``pod`` at wall-clock time ``ts``."""
        for t, n in reversed(self._history.get(pod, ())):
            if t <= ts:
                return n
        return 0

    def mark_failed(self, ep: Endpoint) -> None:
        """A pod refused or dropped a request: rank it last for ``eject_s`` seconds, so a
        crashed pod costs one failed attempt, not one per request until discovery notices."""
        self._ejected[ep.pod] = time.monotonic() + self.eject_s
        self.placements.forget_pod(ep.pod)

    def mark_ok(self, ep: Endpoint) -> None:
        self._ejected.pop(ep.pod, None)

    def mark_hung(self, ep: Endpoint) -> None:
        """One request to ``ep`` timed out: rank the pod last for ``eject_s``, as
        :meth:`mark_failed` does, and leave its other requests alone.

        A timeout is that request's verdict, not the pod's: a request that waited in a
        busy daemon's queue past its timeout says nothing of the streams the pod sends
        meanwhile, and cutting them would turn one slow request into many broken ones.
        Only the discovery probe judges the whole pod (:meth:`_pod_unreachable`). Its
        placements are kept: a slow pod still holds its cache."""
        self._ejected[ep.pod] = time.monotonic() + self.eject_s
        if self.metrics is not None:
            self.metrics.unhealthy.labels(pod=ep.pod).inc()

    def _pod_unreachable(self, pod: str) -> None:
        """The discovery probe found ``pod`` unreachable: rank it last and release every
        request waiting on it (its watchers), streams included."""
        self._ejected[pod] = time.monotonic() + self.eject_s
        if self.metrics is not None:
            self.metrics.unhealthy.labels(pod=pod).inc()
        for cb in list(self._watchers.get(pod, ())):
            cb()

    def watch(self, pod: str, on_hung: Callable[[], None]) -> Callable[[], None]:
        """Call ``on_hung`` if the discovery probe declares ``pod`` unreachable; returns the
        function that unwatches."""
        watchers = self._watchers.setdefault(pod, set())
        watchers.add(on_hung)
        # Declared unreachable after this request was routed (a retry's next pod, or a
        # decode pod chosen before a remote prefill): its signal has gone out already.
        unreachable = getattr(self.discovery, "is_unreachable", None)
        if unreachable is not None and unreachable(pod):
            on_hung()

        def unwatch() -> None:
            watchers.discard(on_hung)
            if not watchers and self._watchers.get(pod) is watchers:
                del self._watchers[pod]

        return unwatch

    def _demote_unhealthy(self, ranked: list[Scored]) -> list[Scored]:
        """Healthy pods first, then pods without a live heartbeat, then ejected ones."""
        now = time.monotonic()
        for pod, until in list(self._ejected.items()):
            if until <= now:
                del self._ejected[pod]
        check_hb = self.index is not None and self._loads_ok
        if not self._ejected and not check_hb:
            return ranked
        # Never drop candidates: if every pod is demoted, still try them in order.
        tiers: tuple[list[Scored], list[Scored], list[Scored]] = ([], [], [])
        for s in ranked:
            if s.endpoint.pod in self._ejected:
                tiers[2].append(s)
            elif check_hb and s.endpoint.pod not in self._loads:
                tiers[1].append(s)
            else:
                tiers[0].append(s)
        return tiers[0] + tiers[1] + tiers[2]

    # -- routing --------------------------------------------------------------------------

    def block_keys(self, token_ids: Sequence[int], extra: str | None = None) -> list[int]:
        """``block_hashes(...)``, with each (parent key, block tokens) remembered: chat turns
        repeat their system prompt and history, whose keys then cost a dict lookup each
        instead of a hash."""
        bs = self.block_size
        prev = root_hash(self.kv_namespace)
        cache = self._key_cache
        out: list[int] = []
        for i in range(len(token_ids) // bs):
            block = tuple(token_ids[i * bs : (i + 1) * bs])
            k = (prev, block, extra)
            h = cache.get(k)
            if h is None:
                h = chain_hash(prev, block, extra)
                if len(cache) >= _KEY_CACHE_MAX:
                    cache.clear()  # rare and cheap to refill; no LRU bookkeeping per hit
                cache[k] = h
            out.append(h)
            prev = h
        return out

    async def lookup(self, keys: list[int]) -> tuple[dict[str, int], bool]:
        """Each live pod's matched leading blocks; ``({}, False)`` when the index failed."""
        if self.index is None or not keys:
            return {}, self.index is not None
        now = time.monotonic()
        if not self._breaker.allow(now):
            return {}, False
        try:
            # asyncio.timeout, not wait_for: no extra task per request on the hot path.
            async with asyncio.timeout(self.lookup_timeout_s):
                matched = await self.index.lookup(keys)
        except asyncio.CancelledError:
            self._breaker.abandoned()
            raise
        except Exception as exc:
            self._breaker.failed(time.monotonic())
            logger.warning(
                "index lookup failed (%s: %s); routing on load only for %.1fs",
                type(exc).__name__,
                exc,
                self._breaker.cooldown_s,
            )
            if self.metrics is not None:
                self.metrics.index_errors.labels(op="lookup").inc()
            return {}, False
        self._breaker.succeeded()
        # One forged entry must not claim more blocks than the prompt has.
        n = len(keys)
        return {
            pod: min(int(v), n)
            for pod, v in matched.items()
            if isinstance(v, int) and not isinstance(v, bool) and v > 0
        }, True

    def _is_hot(
        self, keys: list[int], matched: dict[str, int], candidates: list[Candidate]
    ) -> bool:
        """The requests in flight that are copies of this prompt's matched prefix (the
        prefix is all of them but a last eighth: the same prompt, or first turns on one
        system prompt) are more than ``hot`` times one pod's fair share of all in flight,
        plus the slack: more than its holder can carry without queueing that a replica's
        full prefill (and the evictions it causes there) would undo.

        Requests that extend the prefix with a history of their own (a conversation's
        later turns) do not count: that history ties each to the pod holding it, so a
        replica of the prefix could take none of their load, and a popular tenant whose
        conversations run on its holder is not a hot prompt (bench/routing.py, session
        6: a tenant with 5-6 of 8 in flight, most of them later turns, had its next
        first turns moved off the holder, each a full miss the peers did not make)."""
        if not keys or not matched or not candidates or self.placement_ttl_s <= 0:
            return False
        m = min(max(matched.values()), len(keys))
        if m <= 0:
            return False
        weights = getattr(self.policy, "weights", None)
        slack = getattr(weights, "slack", 1.0)
        factor = getattr(weights, "hot", 2.0)
        total = sum(c.queue for c in candidates)
        # A fair share below one request would make any twin "hot" on an idle fleet.
        limit = factor * max(1.0, total / len(candidates)) + slack
        # Cheap bound first: every copy also carries the prefix's last block.
        if self.placements.inflight_with(keys[m - 1]) <= limit:
            return False
        spare = max(1, m // _SKIP_INDEX_NEW_BLOCKS)
        return self.placements.copies_inflight(keys[m - 1], m, spare) > limit

    async def route(
        self,
        token_ids: Sequence[int] | None,
        session_key: str | None = None,
        extra: str | None = None,
    ) -> RoutingDecision:
        """Rank the ready pods for a prompt (``None``: prompt unknown, route on load)."""
        t0 = time.perf_counter()
        endpoints = self.discovery.endpoints()
        now = time.monotonic()
        if now >= self._sweep_at:
            self._sweep_at = now + _SWEEP_S
            self._sweep(self._members(endpoints))
        tokens = list(token_ids or [])
        keys: list[int] = []
        matched: dict[str, int] = {}
        index_ok = self.index is not None
        if self.policy.uses_index and endpoints:
            keys = self.block_keys(tokens, extra)
            recent = self.placements.lookup(keys) if self.placement_ttl_s > 0 else {}
            known = max(recent.values(), default=0)
            if (
                0 < known < len(keys)
                and known * _SKIP_INDEX_NEW_BLOCKS >= len(keys) * (_SKIP_INDEX_NEW_BLOCKS - 1)
                and self.placements.extends(keys[known - 1])
            ):
                # The next turn of a conversation placed moments ago: the memory has
                # the whole earlier prompt it extends, all but the new turn's blocks.
                # The index could add at most those (only if a request older than the
                # memory carried the very same turn) and pods holding less, and it never
                # lowers what the memory says, so the Redis round trip (the request
                # path's one wait) is skipped; once the record lapses the index decides
                # again. Prompts that only share a prefix with recent ones (a popular
                # system prompt, a template) and a prompt the memory has whole still ask:
                # other pods may hold as much, and a popular prefix spreads over them.
                matched = dict(recent)
            else:
                matched, index_ok = await self.lookup(keys)
                # Read the memory again after the wait: a twin routed meanwhile (an
                # opening burst's requests all wait on their lookups at once) has been
                # placed since, and this request must see it.
                if self.placement_ttl_s > 0:
                    recent = self.placements.lookup(keys)
                for pod, n in recent.items():
                    if n > matched.get(pod, 0):
                        matched[pod] = n
        candidates = []
        for ep in endpoints:
            load = self._loads.get(ep.pod)
            candidates.append(
                Candidate(
                    endpoint=ep,
                    matched_blocks=matched.get(ep.pod, 0),
                    running=load.running if load else 0,
                    waiting=load.waiting if load else 0,
                    kv_usage=load.kv_usage if load else 0.0,
                    inflight=self.inflight.get(ep.pod, 0),
                    prefilling=self.prefilling.get(ep.pod, 0),
                    own_at_heartbeat=self.inflight_at(ep.pod, load.ts) if load else 0,
                    has_heartbeat=load is not None,
                    footprint_blocks=self.placements.footprint(ep.pod) if keys else 0,
                    capacity_blocks=load.num_blocks if load else 0,
                    prefill_work=self.prefill_work.get(ep.pod, 0),
                    mean_work=self.mean_work,
                )
            )
        req = RouteRequest(
            prompt_tokens=len(tokens),
            block_size=self.block_size,
            session_key=session_key,
            num_blocks=len(keys),
            hot=self._is_hot(keys, matched, candidates),
        )
        ranked = self._demote_unhealthy(self.policy.rank(candidates, req, self._rng))
        decision = RoutingDecision(
            ranked=ranked,
            policy=self.policy.name,
            prompt_tokens=len(tokens),
            num_blocks=len(keys),
            index_ok=index_ok,
            decision_s=time.perf_counter() - t0,
            keys=keys,
            uses_index=self.policy.uses_index,
        )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route policy=%s tokens=%d blocks=%d index_ok=%s -> %s",
                decision.policy,
                decision.prompt_tokens,
                decision.num_blocks,
                index_ok,
                ", ".join(
                    f"{s.endpoint.pod}(cost={s.cost:.3f} hit={s.matched_tokens} q={s.queue}"
                    f" {s.reason})"
                    for s in ranked
                ),
            )
        return decision
