"""Routing policies: order the ready pods for one request, best first.

Every policy returns *all* candidates ranked, so the proxy can retry the next-best pod when
the first refuses the connection. Policies are pure given their inputs and an RNG (tests
pass a seeded ``random.Random``); only round robin keeps a cursor, per router instance.

Cost model of ``cache_aware`` (lower is better), per ready pod ``p`` and a prompt of ``L``
tokens (``N`` full blocks of ``B`` tokens) of which ``m_p`` leading blocks are on ``p`` (the
index's exact answer, or this gateway's recent placements it has not seen yet). Every term
is prefill work in tokens, divided by ``L``: one unit is one full prefill of this prompt.

    uncached  = L - m_p * B                                # this prompt's work on p
    work_p    = prefill_work_p + others_waiting_p * mean_work
    excess    = max(0, work_p - min over pods of work - slack_p * L)
    slack_p   = slack if m_p > the longest match among the least-loaded pods, else 0
    new       = N - m_p                                    # blocks p would have to add
    evicts    = min(new, max(0, footprint_p + new - capacity_p))
    full      = 1 if new > capacity_p * (1 - kv_usage_p) else 0
    fill      = min(2, (footprint_p + new) / capacity_p)
    cost      = (w_prefill * uncached + w_queue * excess + w_fit * evicts * B) / L
                + w_kv * full + w_spread * fill

The load rule: load costs only when it would raise this request's TTFT, and by how much
work it puts ahead of it. What delays a prefill is the prefill work still queued or
running on the pod (``work_p``): the uncached tokens of this gateway's requests there that
have no first byte yet (each request's own predicted miss, so a queue of cache hits weighs
little and one long miss a lot), plus the pod's waiting requests beyond ours (other
replicas'; ``others_waiting``), each at the mean work of our recent requests. Requests
already decoding do not count: continuous batching runs a new prefill beside them. And
``work_p`` costs nothing while it is within ``slack`` prefills of this prompt (default 1)
of the least-loaded pod's: when every pod is nearly idle there is nothing to balance.
The slack protects cached work only: it applies to a pod that holds more of this prompt
than the least-loaded pods do. Between pods that offer the same hit (a new prefix, a
prompt no pod holds more of) nothing is traded, so all work ahead counts: a miss placed
behind another miss's prefill waits for it, and every request that reaches that pod
meanwhile waits too (bench/routing.py's per-request breakdown, session 5: hits that
arrived at a pod mid-prefill waited up to 1.8 s in the daemon before their first step).
Beyond it, each token ahead costs ``w_queue`` (default 0.5) of a token of own prefill:
a token computed elsewhere costs this request's TTFT once and the fleet's capacity once,
a token waited for only the former. ``queue`` (all requests in flight) drives
least_load. KV in use counts the same way: only when this request's
new blocks do not fit beside the live requests' (``full``) would it wait for blocks.
The imbalance guard falls back to pure load when the pods holding the longest prefix all
have more than ``imbalance_abs`` requests more waiting for their first token (``unanswered``:
ours not past their first byte, and every request the pod's heartbeat saw beyond ours)
than the pod with the fewest. Requests of ours already decoding do not count, as in the
cost: a popular tenant's holder running its own conversations' answers is not swamped,
and moving its next first turn off costs a full miss (bench/routing.py, session 7: the
guard moved one such turn at 5 of 8 requests in flight on the holder, 1.8 s where
sglang-router's stayed and took 0.6 s).

Hot prefixes: when the requests in flight that are copies of this prompt's matched prefix
(it is all of them but their last eighth: the same prompt, or first turns on one system
prompt) are more than ``hot`` (default 2) pods' fair shares of all in-flight requests plus
the slack (``copies > hot * total / pods + slack``), one pod cannot carry that prefix; the
request is then ranked by load, the cache only breaking ties, so the prefix is replicated
onto the least-loaded pods (a single hugely popular prompt spreads over the fleet).
Requests that extend the prefix with their own history (later turns) do not count: that
history ties each to its pod, so a replica could relieve none of them. Replicating
costs a full prefill of the prefix on the new pod and the blocks it evicts there, so a
popular tenant keeps its affinity until its holder carries twice a fair share: measured on
bench/routing.py's chat shape, replicating at one fair share (3-4 of 8 in flight, the
rule until session 4) turned two later turns into full misses and cost 7 % of the prompt
tokens (docs/benchmarks.md, session 4).

Placement (``evicts``): ``footprint_p`` is the distinct blocks this gateway sent ``p`` in
the last minute, the working set it asked ``p`` to keep; ``capacity_p`` is ``p``'s KV pool
in blocks (from its heartbeat). Blocks this request adds beyond that room push out blocks
sent there within the minute, which someone will likely prefill again: each costs its
``B`` tokens at ``w_fit`` (default 0.5: fleet capacity, not this request's TTFT). So a
prompt no pod holds goes where it evicts least, and a tenant is not moved onto a pod full
of other hot tenants to save a little queueing. Among pods that evict nothing, ``fill``
(``w_spread`` = 0.25 per pool's worth) sends it where the most room is left: a pod's
recent working set is also the traffic it will keep receiving, so new prefixes spread
over the pods (sglang-router's "smallest tree", on the blocks the pods must hold), and a
sliver shared by every prompt (a template's first block) does not pile every new tenant
onto the pod that has it. Exact ties break at random: a popular prompt spreads over the
pods that hold it.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from pagefleet.gateway.discovery import Endpoint

PolicyName = Literal["cache_aware", "least_load", "round_robin", "session"]
POLICY_NAMES: tuple[str, ...] = ("cache_aware", "least_load", "round_robin", "session")


class RoutingWeights(BaseModel):
    """Weights of the cache-aware cost; set with ``--weights prefill=1,queue=0.25,...``."""

    model_config = ConfigDict(extra="forbid")

    prefill: float = Field(1.0, ge=0, description="cost of a fully uncached prompt")
    queue: float = Field(
        0.5,
        ge=0,
        description="cost per token of prefill work queued on the pod beyond the least-loaded "
        "pod's + slack, relative to a token of this prompt's own prefill",
    )
    slack: float = Field(
        1.0,
        ge=0,
        description="prefill work (in prefills of this prompt) more than the least-loaded "
        "pod's that costs nothing on a pod holding more of the prompt than the least-loaded "
        "pods (it protects cached work, not equal choices)",
    )
    kv: float = Field(
        0.5, ge=0, description="cost of a pod whose free KV cannot hold this request's new blocks"
    )
    fit: float = Field(
        0.5,
        ge=0,
        description="cost per token of recently sent blocks this placement would evict from the "
        "pod's KV pool, relative to a token of own prefill",
    )
    spread: float = Field(
        0.25,
        ge=0,
        description="cost of a placement by how full it leaves the pod's recent working set "
        "(0..2 of its KV pool): spreads new prefixes over the pods",
    )
    hot: float = Field(
        2.0,
        ge=0,
        description="a prefix whose requests in flight exceed this many pods' fair shares "
        "(+ slack) is replicated by load",
    )
    imbalance_abs: float = Field(
        4.0,
        ge=0,
        description="fall back to least load when the best-cache pods' requests waiting for "
        "a first token exceed the least's by more",
    )

    @classmethod
    def parse(cls, spec: str | None) -> RoutingWeights:
        """``"prefill=1,queue=0.5"`` -> weights; unknown names raise with the valid ones."""
        if not spec:
            return cls()
        values: dict[str, float] = {}
        for part in spec.split(","):
            if not part.strip():
                continue
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"weight {part!r} must look like name=value")
            name = name.strip().replace("-", "_")
            if name not in cls.model_fields:
                raise ValueError(f"unknown weight {name!r}; valid: {', '.join(cls.model_fields)}")
            values[name] = float(value)
        return cls(**values)


@dataclass(slots=True, frozen=True)
class Candidate:
    """What the router knows about one ready pod for this request."""

    endpoint: Endpoint
    matched_blocks: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    inflight: int = 0
    own_at_heartbeat: int = 0  # this gateway's in-flight count when the heartbeat was taken
    has_heartbeat: bool = False
    prefilling: int = 0  # of ``inflight``, those without their first byte yet
    footprint_blocks: int = 0  # distinct blocks this gateway recently sent the pod
    capacity_blocks: int = 0  # the pod's KV pool in blocks (0: unknown)
    prefill_work: int = 0  # uncached tokens of our requests there without a first byte yet
    mean_work: float = 0.0  # mean predicted uncached tokens of our recent requests

    @property
    def queue(self) -> int:
        """Requests ahead of this one: ours now, plus what the heartbeat saw beyond ours."""
        others = max(0, self.running + self.waiting - self.own_at_heartbeat)
        return self.inflight + others

    @property
    def ahead(self) -> int:
        """Requests that would delay this one's prefill: ours not yet past their first
        byte, plus the pod's own waiting queue beyond ours (other replicas'). Requests
        already decoding do not: continuous batching runs a new prefill beside them."""
        others = max(0, self.waiting - self.own_at_heartbeat)
        return self.prefilling + others

    @property
    def unanswered(self) -> int:
        """Requests there still waiting for their first token: ours not past their first
        byte, plus everything the heartbeat saw beyond ours (its phase unknown)."""
        return self.prefilling + max(0, self.running + self.waiting - self.own_at_heartbeat)

    @property
    def work_ahead(self) -> float:
        """Prefill tokens that would run before this request's: ours (each request's own
        predicted miss) plus the pod's waiting queue beyond ours at the mean miss."""
        others = max(0, self.waiting - self.own_at_heartbeat)
        return self.prefill_work + others * self.mean_work


@dataclass(slots=True, frozen=True)
class RouteRequest:
    prompt_tokens: int
    block_size: int
    session_key: str | None = None
    num_blocks: int = 0  # full blocks of the prompt (its block keys)
    hot: bool = False  # its prefix alone keeps more than one pod's fair share busy


@dataclass(slots=True, frozen=True)
class Scored:
    endpoint: Endpoint
    cost: float
    matched_tokens: int
    queue: int
    reason: str


class Policy(Protocol):
    name: str
    uses_index: bool

    def rank(
        self, candidates: list[Candidate], req: RouteRequest, rng: random.Random
    ) -> list[Scored]: ...


def _matched_tokens(c: Candidate, req: RouteRequest) -> int:
    return min(c.matched_blocks * req.block_size, req.prompt_tokens)


def _order(
    scored: list[Scored], rng: random.Random, fill: dict[str, float] | None = None
) -> list[Scored]:
    # Equal costs: the pod with more room left first (``fill``), then a random key breaks
    # exact ties uniformly, so equal pods share traffic.
    keyed = [(s.cost, (fill or {}).get(s.endpoint.pod, 0.0), rng.random(), s) for s in scored]
    keyed.sort(key=lambda t: (t[0], t[1], t[2]))
    return [t[3] for t in keyed]


def _room(c: Candidate, req: RouteRequest) -> float:
    """How full the pod's recent working set would be with this request, to 1 %: the
    tie-break among pods of equal cost (a coarse one, so near-equal pods still share)."""
    if c.capacity_blocks <= 0:
        return 0.0
    new = max(0, req.num_blocks - c.matched_blocks)
    return round(min(2.0, (c.footprint_blocks + new) / c.capacity_blocks), 2)


class LeastLoadPolicy:
    name = "least_load"
    uses_index = False

    def __init__(self, weights: RoutingWeights | None = None) -> None:
        self.weights = weights or RoutingWeights()

    def rank(
        self, candidates: list[Candidate], req: RouteRequest, rng: random.Random
    ) -> list[Scored]:
        # A full KV cache weighs like one more queued request.
        return _order(
            [
                Scored(
                    c.endpoint, c.queue + c.kv_usage, _matched_tokens(c, req), c.queue, "least_load"
                )
                for c in candidates
            ],
            rng,
        )


class CacheAwarePolicy:
    name = "cache_aware"
    uses_index = True

    def __init__(self, weights: RoutingWeights | None = None) -> None:
        self.weights = weights or RoutingWeights()

    def cost(
        self, c: Candidate, req: RouteRequest, min_work: float = 0.0, idle_match: int = 0
    ) -> float:
        """The module docstring's cost; ``min_work``: the least-loaded pod's work ahead;
        ``idle_match``: the most blocks of this prompt a least-loaded pod holds (the slack
        applies only to a pod holding more)."""
        w = self.weights
        length = max(1, req.prompt_tokens)
        uncached = req.prompt_tokens - _matched_tokens(c, req)
        slack = w.slack if c.matched_blocks > idle_match else 0.0
        excess = max(0.0, c.work_ahead - min_work - slack * length)
        evicts = full = fill = 0.0
        if c.capacity_blocks > 0:
            new = max(0, req.num_blocks - c.matched_blocks)
            evicts = min(new, max(0, c.footprint_blocks + new - c.capacity_blocks))
            fill = min(2.0, (c.footprint_blocks + new) / c.capacity_blocks)
            # Live requests hold kv_usage of the pool; the rest is free or evictable. Only
            # when this request's new blocks do not fit there must it wait for others.
            full = 1.0 if new > c.capacity_blocks * (1.0 - c.kv_usage) else 0.0
        work = w.prefill * uncached + w.queue * excess + w.fit * evicts * req.block_size
        return work / length + w.kv * full + w.spread * fill

    def rank(
        self, candidates: list[Candidate], req: RouteRequest, rng: random.Random
    ) -> list[Scored]:
        if not candidates:
            return []
        min_unanswered = min(c.unanswered for c in candidates)
        min_work = min(c.work_ahead for c in candidates)
        if req.hot:
            # Replicate a hot prefix: least load first, the cache only breaks ties (a
            # holder wins at equal load; one more request than elsewhere moves it on).
            return _order(
                [
                    Scored(
                        c.endpoint,
                        c.queue
                        + c.kv_usage
                        + 0.5 * (1 - _matched_tokens(c, req) / req.prompt_tokens),
                        _matched_tokens(c, req),
                        c.queue,
                        "hot_prefix",
                    )
                    for c in candidates
                ],
                rng,
            )
        idle_match = max(c.matched_blocks for c in candidates if c.work_ahead <= min_work)
        ranked = _order(
            [
                Scored(
                    c.endpoint,
                    self.cost(c, req, min_work, idle_match),
                    _matched_tokens(c, req),
                    c.queue,
                    "cache_aware",
                )
                for c in candidates
            ],
            rng,
            {c.endpoint.pod: _room(c, req) for c in candidates},
        )
        best_match = max(s.matched_tokens for s in ranked)
        # The guard looks at the pods holding the longest prefix, not just the cheapest one:
        # a hot prefix whose holders are all swamped must spill, even if the cost tie-break
        # happens to favour a holder.
        holders = {s.endpoint.pod for s in ranked if s.matched_tokens == best_match > 0}
        busy = [c.unanswered for c in candidates if c.endpoint.pod in holders]
        if busy and min(busy) - min_unanswered > self.weights.imbalance_abs:
            guard = LeastLoadPolicy(self.weights)
            by_load = guard.rank(candidates, req, rng)
            return [
                Scored(s.endpoint, s.cost, s.matched_tokens, s.queue, "imbalance_guard")
                for s in by_load
            ]
        return ranked


class RoundRobinPolicy:
    name = "round_robin"
    uses_index = False

    def __init__(self) -> None:
        self._cursor = 0

    def rank(
        self, candidates: list[Candidate], req: RouteRequest, rng: random.Random
    ) -> list[Scored]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda c: c.endpoint.pod)
        start = self._cursor % len(ordered)
        self._cursor += 1
        rotated = ordered[start:] + ordered[:start]
        return [
            Scored(c.endpoint, float(i), _matched_tokens(c, req), c.queue, "round_robin")
            for i, c in enumerate(rotated)
        ]


def _rendezvous(key: str, pod: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{pod}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SessionPolicy:
    """Affinity on a session key by rendezvous hashing: every gateway replica picks the same
    pod for a session, and a pod leaving moves only its own sessions. Requests without a key
    go to the least-loaded pod."""

    name = "session"
    uses_index = False

    def __init__(self, weights: RoutingWeights | None = None) -> None:
        self._fallback = LeastLoadPolicy(weights)

    def rank(
        self, candidates: list[Candidate], req: RouteRequest, rng: random.Random
    ) -> list[Scored]:
        if not req.session_key:
            return self._fallback.rank(candidates, req, rng)
        key = req.session_key
        ordered = sorted(candidates, key=lambda c: _rendezvous(key, c.endpoint.pod), reverse=True)
        return [
            Scored(c.endpoint, float(i), _matched_tokens(c, req), c.queue, "session")
            for i, c in enumerate(ordered)
        ]


def make_policy(name: str, weights: RoutingWeights | None = None) -> Policy:
    """A fresh policy instance by name; raises ValueError naming the valid policies."""
    if name == "cache_aware":
        return CacheAwarePolicy(weights)
    if name == "least_load":
        return LeastLoadPolicy(weights)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "session":
        return SessionPolicy(weights)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
