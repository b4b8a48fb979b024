"""The role autoscaler's decision: (config, observation, previous state, time) -> replicas.

Pure: no clock, no I/O, no Kubernetes. The operator's timer (pagefleet/operator/autoscaler.py)
and the fleet simulation (bench/autoscale.py) call this same function, so what the benchmark
measures is what the operator does.

How it thinks (capacity per replica at the SLO, not CPU utilisation):

- Load is measured in the units the SLOs depend on: uncached prompt tokens per second
  (prefill work, drives TTFT), generated tokens per second (decode work, drives TPOT/ITL),
  concurrent sequences against the engine's batch limit, and KV-cache usage.
- Each replica's capacity at the SLO (prefill and decode tokens/s) starts from the spec's
  hint and is learned from what the pods report: a miss while requests queue bounds it by
  what the replicas did flat out; a miss without a queue scales it by target/observed (not
  a unified role's TPOT-only miss: its TTFT says the replica ran at speed); a busy pass
  above the estimate raises it; a comfortable pass at the planned utilisation
  probes it up a little (see _learn_scale).
- Desired replicas = the most any dimension needs, where prefill and decode work add up (a
  unified replica does both in the same steps), and concurrency and KV usage are limits of
  their own. The compute dimension is sized by a queueing model of the TTFT target (the
  fewest replicas whose predicted TTFT quantile meets it: a small fleet needs a larger
  share of spare than a large one, see queue_replicas), never below the work at the
  target utilisation; where the model cannot price it (a decode role, nothing learned
  yet), by that work plus an explicit ``headroom`` (10%). A missed target asks for at
  least one more replica even when the capacity model disagrees.
- Up fast, down slowly: after any change nothing moves for a short window; scale-up is
  limited by a step, and replicas asked for but not Ready yet count as capacity on its way
  (while any starts, only a load that needs more than ready + starting adds more; a missed
  SLO does not: it is the fleet those replicas join that missed); scale-down goes
  to the highest recommendation of a longer window (so a dip shorter than it moves
  nothing; a short one when the pod to be removed is idle), a step at a time, and never
  while any pod's data is unknown.
- Unknown data never scales: no observation, no SLO, or no pod answering leaves the count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum

# Capacity samples below this many tokens/s per replica say nothing useful (an idle pod).
_MIN_SAMPLE_RATE = 1e-6
# A passing interval counts as "busy" (informative about capacity) when its latency used at
# least this share of the target, or requests were queueing.
_BUSY_LATENCY_FRACTION = 0.5
# Most a single missed interval may cut the learned capacity (noise guard).
_MAX_CUT = 0.5
# Most one interval's lesson may cut the learned capacity, whatever the load figure says:
# one window of a small fleet (a handful of queued requests, a p95 of a few dozen) is a
# noisy sample, and a cut sticks (the estimate climbs back 3% at a time). A real shortage
# misses again and cuts again, and the missed SLO adds a replica meanwhile.
_MAX_STEP_CUT = 0.8
# Probe the capacity up by this factor per interval that ran at least _AT_PLAN of the
# planned utilisation with every latency under _COMFORTABLE of its target.
_PROBE = 0.03
_AT_PLAN = 0.9
_COMFORTABLE = 0.6
# Standard deviations of a Poisson count the gateway's arrivals must clear (with_arrivals).
_ARRIVAL_Z = 2.0


class Reason(StrEnum):
    """Why a decision came out as it did (status.roles[*].reason and the Event's reason)."""

    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    STEADY = "Steady"
    BELOW_MIN = "BelowMin"
    ABOVE_MAX = "AboveMax"
    UP_WINDOW = "ScaleUpStabilizing"
    DOWN_WINDOW = "ScaleDownStabilizing"
    WAITING_FOR_REPLICAS = "WaitingForReplicas"
    UNKNOWN_INPUTS = "InputsUnknown"
    PARTIAL_INPUTS = "InputsPartial"
    NO_SLO = "SLOMissing"
    CAPACITY_UNKNOWN = "CapacityUnknown"


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """One role's autoscaling policy (from the spec's autoscaling block, SLO and engine)."""

    role: str  # unified | prefill | decode
    min_replicas: int
    max_replicas: int
    ttft_s: float | None  # None: the SLO is missing, nothing is scaled
    tpot_s: float | None
    max_num_seqs: int = 64  # the engine's batch limit (concurrent sequences per replica)
    target_utilization: float = 0.8  # share of the capacity at the SLO to plan for
    kv_target: float = 0.8  # KV usage per replica to plan for
    # Spare capacity planned above what the measured load needs, up and down: a fleet sized
    # to the load's mean misses on every upswing shorter than a start-up. (Until session 7
    # this 10% was a side effect of the scale-down tolerance, which also scaled up.)
    headroom: float = 0.1
    # Scale down only when the load, headroom included, fits the smaller fleet with this
    # much more to spare (hysteresis; never a reason to scale up).
    tolerance: float = 0.0
    scale_up_window_s: float = 30.0  # after any change, no other change for this long
    scale_down_window_s: float = 300.0  # scale down to the highest recommendation of this
    max_step_up: int = 2
    max_step_down: int = 1
    backlog_drain_s: float = 10.0  # queued prompt work should be gone this soon
    prefill_capacity_hint: float | None = None  # uncached prompt tokens/s per replica at TTFT
    decode_capacity_hint: float | None = None  # generated tokens/s per replica at TPOT
    # Rates and percentiles span this long: an interval teaches capacity only when the
    # Ready count held for all of it (else the latencies are those of another fleet size).
    observation_window_s: float = 30.0
    # A new replica serves this long after it is asked for: scale-up plans for the load
    # this far ahead, extrapolating the rising trend of the last trend_window_s.
    startup_s: float = 0.0
    trend_window_s: float = 120.0
    # Rises of the load within one start-up seen over this long size the headroom a quick
    # scale-down keeps (burst_headroom); 0 (or startup_s 0) turns the quick scale-down off.
    burst_window_s: float = 600.0
    # How the compute dimension is sized. "queue": the fewest replicas whose predicted TTFT
    # at the SLO's quantile meets the target, from a queueing model of the prefill queue
    # (queue_replicas); its spare capacity is the model's (no headroom on top, no backlog
    # term: the model prices waiting), and the utilisation figure is its floor.
    # "utilization": the work at the estimated capacities over target_utilization, plus
    # headroom and the backlog term (the planner until session 8). Roles or moments the
    # model cannot price (no prefill, no capacity or request size known yet) fall back to
    # "utilization".
    sizing: str = "queue"
    slo_quantile: float = 0.95  # share of requests the latency targets apply to
    # Allen-Cunneen's (ca^2 + cs^2) / 2: how much more variable arrivals and prompt sizes
    # are than the M/M/c model's Poisson arrivals and exponential work (1). Session 8
    # measured 1, 1.5, 2, 2.5 and 3 on both bench traces (docs/benchmarks.md): 2.5 is the
    # least that keeps every run's attainment at 0.95 or the utilisation rule's.
    queue_variability: float = 2.5
    # When the pod a scale-down would remove (the one marked with the lowest deletion cost)
    # holds no request, removing it disturbs nothing: the scale-down hold shrinks to this
    # (the recommendation must still have stayed below the count for all of it). None: off.
    # Session 9 measured 10, 20, 30 and 60 s on three traces (docs/benchmarks.md).
    idle_release_s: float | None = 20.0
    # While replicas asked for are not Ready yet, count them as capacity on its way: scale
    # up further only as far as the load itself needs more than ready + starting (the
    # planner's load figures are absolute rates and arrivals, not per Ready pod, so the
    # starting ones are not counted twice), never for a missed SLO (the miss is the short
    # fleet they are about to join). False: no scale-up at all while one starts (the rule
    # until session 10, which left a surge's queue growing for a start-up or more).
    count_starting: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"autoscaling bounds must satisfy 0 <= min <= max, got "
                f"min={self.min_replicas} max={self.max_replicas}"
            )
        if not 0 < self.target_utilization <= 1 or not 0 < self.kv_target <= 1:
            raise ValueError("target_utilization and kv_target must lie in (0, 1]")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError("max_step_up and max_step_down must be at least 1")
        if min(self.observation_window_s, self.startup_s, self.trend_window_s) < 0:
            raise ValueError("observation_window_s, startup_s and trend_window_s must be >= 0")
        if self.burst_window_s < 0:
            raise ValueError("burst_window_s must be >= 0")
        if self.sizing not in ("queue", "utilization"):
            raise ValueError(f"sizing must be 'queue' or 'utilization', got {self.sizing!r}")
        if not 0 < self.slo_quantile < 1 or self.queue_variability <= 0:
            raise ValueError(
                f"slo_quantile must lie in (0, 1) and queue_variability be > 0, got "
                f"{self.slo_quantile} and {self.queue_variability}"
            )
        if self.idle_release_s is not None and self.idle_release_s < 0:
            raise ValueError(f"idle_release_s must be >= 0 or None, got {self.idle_release_s}")
        if self.headroom < 0 or self.tolerance < 0:
            raise ValueError(
                f"headroom and tolerance must be >= 0, got {self.headroom} and {self.tolerance}"
            )

    @property
    def uses_prefill(self) -> bool:
        return self.role in ("unified", "prefill")

    @property
    def uses_decode(self) -> bool:
        return self.role in ("unified", "decode")


@dataclass(frozen=True, slots=True)
class RoleObservation:
    """What one role's pods reported over the last interval.

    Load figures are sums over the pods that answered (``known_pods``); a pod that did not
    answer is counted in ``unknown_pods`` and never treated as idle."""

    current: int  # replicas the Deployment asks for now
    ready: int  # of those, pods Ready
    known_pods: int
    unknown_pods: int = 0
    prompt_tokens_per_s: float = 0.0  # uncached prompt tokens computed per second
    generation_tokens_per_s: float = 0.0
    requests_per_s: float = 0.0  # requests that got their first token, per second
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # mean over known pods, 0..1
    ttft_s: float | None = None  # observed TTFT at the SLO percentile (None: no sample)
    tpot_s: float | None = None  # observed TPOT/ITL at the SLO percentile
    # What the gateway saw arrive for this role over the last interval (None: no gateway
    # figure). It leads the pods' figures: a request counts here before it queues, and
    # while the pods run flat out their served rates stop at their capacity, the arrivals
    # do not.
    arrival_requests_per_s: float | None = None
    arrival_prompt_tokens_per_s: float | None = None  # uncached prompt tokens per second
    arrival_window_s: float = 0.0  # the span those rates were counted over
    # Requests (running + waiting) on the pod a scale-down would remove, the one the
    # operator marks with the lowest deletion cost (None: not known). 0: it is idle.
    victim_requests: int | None = None


@dataclass(frozen=True, slots=True)
class PlannerState:
    """What the planner remembers between decisions (kept in memory by the operator)."""

    last_scale_time: float | None = None
    prefill_capacity: float | None = None  # learned tokens/s per replica at the TTFT target
    decode_capacity: float | None = None  # learned tokens/s per replica at the TPOT target
    mean_prompt_tokens: float | None = None  # uncached tokens per request (backlog estimate)
    mean_output_tokens: float | None = None  # generated tokens per request (arrivals -> decode)
    # (time, recommendation) over the last scale-down window, oldest first.
    history: tuple[tuple[float, int], ...] = field(default_factory=tuple)
    # (time, uncached prompt tokens/s, generated tokens/s) over the trend window, oldest first.
    rates: tuple[tuple[float, float, float], ...] = field(default_factory=tuple)
    ready: int | None = None  # Ready replicas at the last decision
    ready_since: float | None = None  # when that count was first seen


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    reason: Reason
    message: str
    state: PlannerState
    recommendation: int | None = None  # what the load alone asks for (None: unknown)

    @property
    def changed(self) -> bool:
        """This decision moves the replica count."""
        return self.reason in _CHANGES


_CHANGES = frozenset({Reason.SCALED_UP, Reason.SCALED_DOWN, Reason.BELOW_MIN, Reason.ABOVE_MAX})


def _learn_scale(
    utilization: float,
    missed_ratio: float | None,
    queueing: bool,
    busy: bool,
    comfortable: bool,
    target_utilization: float,
) -> float:
    """The factor to multiply a role's capacity estimates by after one interval.

    ``utilization``: this interval's load per replica in units of the current estimates
    (1.0 = exactly the estimated capacity). A miss while requests queue: the replicas ran
    flat out, so the estimate shrinks to what they did. A miss without a queue: each
    request was slow, so also scale by target/observed (at most halving). Either cut is at
    most 20% per interval (one window is a noisy sample; a real shortage misses again). A
    pass while busy (a queue, or latency past half the target) proves at least the load seen
    (move half way there). A pass with every latency far below its target while the
    replicas run at the planned utilisation says the estimate is conservative: probe a few
    percent up (a later miss cuts it back)."""
    if missed_ratio is not None:
        cut = utilization if queueing else utilization * max(_MAX_CUT, missed_ratio)
        return max(_MAX_STEP_CUT, min(1.0, cut))
    if busy and utilization > 1.0:
        return 1.0 + 0.5 * (utilization - 1.0)
    if comfortable and utilization >= _AT_PLAN * target_utilization:
        return 1.0 + _PROBE
    return 1.0


def _mix_miss(dims: dict[str, tuple[float, float | None, float | None, float]]) -> bool:
    """A unified replica missed TPOT while its TTFT held: it is not slower than estimated
    (its prefill, in the same steps, ran at speed); its steps were long because long
    prompts' chunks shared them, a mix effect of a small fleet that one more replica (the
    missed-SLO bump) dilutes. Cutting the capacity for it would hold that replica all day
    (seen session 8: one such miss at 2-3 replicas early in the day cut the estimate to
    0.8 for the rest of it). A decode role has no TTFT to tell the two apart."""
    if "prefill" not in dims or "decode" not in dims:
        return False
    _, _, ttft, ttft_target = dims["prefill"]
    _, _, tpot, tpot_target = dims["decode"]
    return ttft is not None and ttft <= ttft_target and tpot is not None and tpot > tpot_target


def learn(cfg: PlannerConfig, obs: RoleObservation, state: PlannerState) -> PlannerState:
    """The state after this interval's capacity samples (used from the next decision on).

    A unified replica spends its time on prefill and decode alike, so its two estimates
    move together, by the factor its combined load and latencies call for."""
    if obs.known_pods <= 0 or obs.unknown_pods > 0:
        return state
    k = obs.known_pods
    # (per-replica load, capacity estimate, observed latency, target) per dimension used.
    dims: dict[str, tuple[float, float | None, float | None, float]] = {}
    if cfg.uses_prefill and cfg.ttft_s is not None:
        cap = state.prefill_capacity or cfg.prefill_capacity_hint
        dims["prefill"] = (obs.prompt_tokens_per_s / k, cap, obs.ttft_s, cfg.ttft_s)
    if cfg.uses_decode and cfg.tpot_s is not None:
        cap = state.decode_capacity or cfg.decode_capacity_hint
        dims["decode"] = (obs.generation_tokens_per_s / k, cap, obs.tpot_s, cfg.tpot_s)
    caps = {name: d[1] for name, d in dims.items()}
    active = {n: d for n, d in dims.items() if d[0] > _MIN_SAMPLE_RATE}
    observed = [d for d in dims.values() if d[2] is not None]
    if active and observed:
        ratios = [t / o for _, _, o, t in observed if o is not None and o > t]
        missed = min(ratios) if ratios else None
        if missed is not None and obs.ready < obs.current:
            # New replicas are still starting: the fleet is known to be short; a miss now
            # says nothing about what one replica can do.
            return replace(
                state,
                prefill_capacity=caps.get("prefill", state.prefill_capacity),
                decode_capacity=caps.get("decode", state.decode_capacity),
            )
        queueing = obs.waiting > 0
        busy = queueing or any(
            o is not None and o >= _BUSY_LATENCY_FRACTION * t for _, _, o, t in observed
        )
        unknown = [n for n, d in active.items() if d[1] is None]
        if unknown:
            if missed is not None:
                # First evidence: the unknown dimensions take an equal share of the load
                # this interval carried, scaled by the miss as a known one would be.
                factor = 1.0 if queueing else max(_MAX_CUT, missed)
                for n in unknown:
                    caps[n] = active[n][0] * len(active) * factor
        else:
            util = sum(d[0] / d[1] for d in active.values() if d[1])
            comfortable = all(
                o is not None and o <= _COMFORTABLE * t for _, _, o, t in dims.values()
            )
            scale = _learn_scale(util, missed, queueing, busy, comfortable, cfg.target_utilization)
            if missed is not None and _mix_miss(dims):
                scale = 1.0
            caps = {n: (c * scale if c is not None else None) for n, c in caps.items()}
    return replace(
        state,
        prefill_capacity=caps.get("prefill", state.prefill_capacity),
        decode_capacity=caps.get("decode", state.decode_capacity),
        mean_prompt_tokens=_ewma(state.mean_prompt_tokens, obs.prompt_tokens_per_s, obs),
        mean_output_tokens=_ewma(state.mean_output_tokens, obs.generation_tokens_per_s, obs),
    )


def _ewma(mean: float | None, tokens_per_s: float, obs: RoleObservation) -> float | None:
    """Tokens per request, smoothed: this interval's ``tokens_per_s / requests_per_s``
    folded into ``mean`` (kept when the interval served no request)."""
    if obs.requests_per_s <= 0 or tokens_per_s <= 0:
        return mean
    sample = tokens_per_s / obs.requests_per_s
    return sample if mean is None else 0.7 * mean + 0.3 * sample


def with_arrivals(obs: RoleObservation, state: PlannerState) -> RoleObservation:
    """The observation with its token rates raised to what the gateway saw arrive.

    Uncached prompt tokens arriving count as prefill work at once; requests arriving count
    as decode work at the learned generated tokens per request (none learned yet: not
    counted). Never lowers a figure: the pods' served rates include work that arrived
    before the gateway's interval (a queue draining). Non-decreasing in every figure."""
    reqs = obs.arrival_requests_per_s
    if reqs is None or reqs <= 0 or obs.arrival_window_s <= 0:
        return obs
    # A short window of arrivals is a noisy sample: plan for its lower confidence bound
    # (count - z * sqrt(count)), so chance clusters of a steady load move nothing while a
    # real surge (twice the load over one interval: hundreds of requests) passes at once.
    count = reqs * obs.arrival_window_s
    if count <= _ARRIVAL_Z**2:
        return obs  # the bound is 0: too few requests to say anything
    sure = 1.0 - _ARRIVAL_Z / math.sqrt(count)
    prompt = None
    if obs.arrival_prompt_tokens_per_s is not None:
        prompt = obs.arrival_prompt_tokens_per_s * sure
    gen = reqs * sure * state.mean_output_tokens if state.mean_output_tokens else None
    if (prompt is None or prompt <= obs.prompt_tokens_per_s) and (
        gen is None or gen <= obs.generation_tokens_per_s
    ):
        return obs
    return replace(
        obs,
        prompt_tokens_per_s=max(obs.prompt_tokens_per_s, prompt or 0.0),
        generation_tokens_per_s=max(obs.generation_tokens_per_s, gen or 0.0),
    )


def _loads(
    cfg: PlannerConfig, obs: RoleObservation, state: PlannerState, backlog: bool
) -> tuple[float, float, float, bool]:
    """(the concurrency and KV limits in replicas, compute work in replicas at the
    estimated capacities, its decode part, exact)."""
    limits = (obs.running + obs.waiting) / (cfg.max_num_seqs * cfg.target_utilization)
    if cfg.uses_decode:
        limits = max(limits, obs.kv_usage * obs.known_pods / cfg.kv_target)
    exact = True
    work = decode = 0.0  # replicas' worth of compute at the estimated capacities
    if cfg.uses_prefill:
        cap = state.prefill_capacity or cfg.prefill_capacity_hint
        prompt = obs.prompt_tokens_per_s
        if backlog:
            prompt += obs.waiting * (state.mean_prompt_tokens or 0.0) / cfg.backlog_drain_s
        if cap:
            work += prompt / cap
        elif prompt > 0:
            exact = False
    if cfg.uses_decode:
        cap = state.decode_capacity or cfg.decode_capacity_hint
        if cap:
            decode = obs.generation_tokens_per_s / cap
            work += decode
        elif obs.generation_tokens_per_s > 0:
            exact = False
    return limits, work, decode, exact


def replicas_needed(
    cfg: PlannerConfig, obs: RoleObservation, state: PlannerState
) -> tuple[float, bool]:
    """(replicas the measured load needs at the target utilisation, exact).

    Prefill and decode work add up (a unified replica does both in the same steps); the
    concurrency and KV dimensions are limits of their own. Not exact when a dimension
    carrying load has no capacity estimate yet: the figure is then only a lower bound (good
    for scaling up, never for scaling down). With ``sizing="utilization"`` queued prompts
    count as work to drain within backlog_drain_s; the queue model prices them itself.
    Non-decreasing in every load figure of ``obs`` for a fixed state."""
    limits, work, _, exact = _loads(cfg, obs, state, backlog=cfg.sizing == "utilization")
    return max(limits, work / cfg.target_utilization), exact


def planned_replicas(
    cfg: PlannerConfig, obs: RoleObservation, state: PlannerState
) -> tuple[float, bool]:
    """(replicas to plan for, exact): what replicas_needed says with the stated headroom on
    top, except where the queue model sizes the compute (``sizing="queue"``): there the
    fewest replicas whose predicted TTFT quantile meets the target, never below the
    utilisation figure. Non-decreasing in every load figure of ``obs`` for a fixed state."""
    use_queue = cfg.sizing == "queue"
    limits, work, decode, exact = _loads(cfg, obs, state, backlog=not use_queue)
    lift = 1 + cfg.headroom
    util = work / cfg.target_utilization
    # (Priced on the known work even when a dimension's capacity is unknown: the figure is
    # then a lower bound like the utilisation one, and stays non-decreasing as that
    # dimension's load appears.)
    queued = queue_replicas(cfg, obs, state, work, decode) if use_queue else None
    if queued is None:
        return max(limits, util) * lift, exact
    return max(limits * lift, util, queued), exact


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue (Erlang C) with ``servers``
    servers and ``offered`` load (arrival rate x service time); 1 when unstable.
    Non-decreasing in ``offered``."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    b = 1.0  # Erlang B by its recursion (numerically stable for any c)
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1 - b))


def queue_replicas(
    cfg: PlannerConfig, obs: RoleObservation, state: PlannerState, work: float, decode: float
) -> float | None:
    """The fewest replicas whose predicted TTFT meets the target at the SLO quantile (None
    when the model cannot price it: no prefill in the role, no TTFT target, no capacity or
    mean request size known yet, no prompt load).

    The model: each replica is a prefill server whose speed is its prefill capacity less
    the share of its time decoding takes (``decode`` replicas' worth of decode work spread
    over c); requests arrive at prompt rate / mean prompt; a request meets TTFT when its
    wait is within the target less its own prefill. The wait's tail is the M/M/c one,
    C(c, a) exp(-(c mu - lambda) w), stretched by queue_variability (Allen-Cunneen's
    G/G/c correction); c mu - lambda is the surplus (c - work) x capacity / mean prompt.
    Non-decreasing in ``work`` and ``decode`` for every c (the wait probability, its decay
    and the own-prefill time all worsen with load), so in every load figure."""
    cap = state.prefill_capacity or cfg.prefill_capacity_hint
    mean_prompt = state.mean_prompt_tokens
    if not cfg.uses_prefill or cfg.ttft_s is None or not cap or not mean_prompt:
        return None
    prompt = (work - decode) * cap  # uncached prompt tokens/s
    if prompt <= 0:
        return None
    tail = 1.0 - cfg.slo_quantile
    c = max(1, math.ceil(work - 1e-9))
    limit = 4 * max(cfg.max_replicas, 1)
    while c < limit:
        share = 1.0 - decode / c  # of each replica's time left for prefill
        if share > 0 and c > work:
            speed = cap * share
            budget = cfg.ttft_s - mean_prompt / speed
            if budget > 0:
                surplus = (c - work) * cap / mean_prompt  # c mu - lambda, requests/s
                wait = erlang_c(c, prompt / speed)
                if wait * math.exp(-surplus * budget / cfg.queue_variability) <= tail:
                    return float(c)
        c += 1
    return float(limit)


def _rising(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (time, value) samples per second, never below 0; 0 with fewer
    than 3 samples. Non-decreasing in the newest sample's value (it has the latest time)."""
    if len(samples) < 3:
        return 0.0
    mt = sum(t for t, _ in samples) / len(samples)
    mv = sum(v for _, v in samples) / len(samples)
    den = sum((t - mt) ** 2 for t, _ in samples)
    if den <= 0:
        return 0.0
    return max(0.0, sum((t - mt) * (v - mv) for t, v in samples) / den)


def forecast(
    cfg: PlannerConfig, obs: RoleObservation, state: PlannerState, now: float
) -> tuple[RoleObservation, tuple[tuple[float, float, float], ...]]:
    """(the observation with its token rates moved ``startup_s`` ahead along their rising
    trend, the rate samples to remember). A replica asked for now serves only after its
    start-up, so scaling on today's rate is late by that much on a rising curve; a falling
    trend is not extrapolated (scale-down stays on measured load). Only observations of
    every pod are remembered (a partial sum would look like a dip, then a rise)."""
    horizon = now - max(cfg.trend_window_s, cfg.burst_window_s)
    rates = tuple(r for r in state.rates if horizon < r[0] < now)
    if obs.unknown_pods == 0 and obs.known_pods > 0:
        rates = (*rates, (now, obs.prompt_tokens_per_s, obs.generation_tokens_per_s))
    if cfg.startup_s <= 0 or not rates or rates[-1][0] != now:
        return obs, rates
    trend = [r for r in rates if r[0] > now - cfg.trend_window_s]
    lead_prompt = _rising([(t, p) for t, p, _ in trend]) * cfg.startup_s
    lead_gen = _rising([(t, g) for t, _, g in trend]) * cfg.startup_s
    if lead_prompt <= 0 and lead_gen <= 0:
        return obs, rates
    ahead = replace(
        obs,
        prompt_tokens_per_s=obs.prompt_tokens_per_s + lead_prompt,
        generation_tokens_per_s=obs.generation_tokens_per_s + lead_gen,
    )
    return ahead, rates


def burst_headroom(
    cfg: PlannerConfig, rates: tuple[tuple[float, float, float], ...], state: PlannerState
) -> float | None:
    """The largest relative rise of the load within one start-up over the burst window
    (0.5: the load once grew by half of itself faster than a new replica starts), in units
    of replicas' work at the current capacity estimates; None when a dimension in use has
    no estimate (the rise cannot be weighed). What a quick scale-down keeps in reserve: a
    surge like the ones seen arrives before a replica asked for then could serve.
    Non-decreasing in the newest sample (it only ends rises)."""
    pcap = state.prefill_capacity or cfg.prefill_capacity_hint
    dcap = state.decode_capacity or cfg.decode_capacity_hint
    if (cfg.uses_prefill and not pcap) or (cfg.uses_decode and not dcap):
        return None
    work = [
        (
            t,
            (p / pcap if cfg.uses_prefill and pcap else 0.0)
            + (g / dcap if cfg.uses_decode and dcap else 0.0),
        )
        for t, p, g in rates
    ]
    rise = 0.0
    for j, (tj, wj) in enumerate(work):
        low = min((w for t, w in work[:j] if t >= tj - cfg.startup_s), default=wj)
        if wj > low:
            rise = max(rise, (wj - low) / max(low, _MIN_SAMPLE_RATE))
    return rise


def slo_missed(cfg: PlannerConfig, obs: RoleObservation) -> list[str]:
    """Which targets the observed percentiles missed, as human-readable phrases."""
    out = []
    ttft, tpot = obs.ttft_s, obs.tpot_s
    if cfg.uses_prefill and cfg.ttft_s is not None and ttft is not None and ttft > cfg.ttft_s:
        out.append(f"TTFT {obs.ttft_s * 1000:.0f} ms > {cfg.ttft_s * 1000:.0f} ms")
    if cfg.uses_decode and cfg.tpot_s is not None and tpot is not None and tpot > cfg.tpot_s:
        out.append(f"TPOT {obs.tpot_s * 1000:.0f} ms > {cfg.tpot_s * 1000:.0f} ms")
    return out


def _slack(cfg: PlannerConfig, obs: RoleObservation) -> bool:
    """Every latency the role is judged on was observed and sits within _COMFORTABLE of
    its target."""
    pairs = []
    if cfg.uses_prefill:
        pairs.append((obs.ttft_s, cfg.ttft_s))
    if cfg.uses_decode:
        pairs.append((obs.tpot_s, cfg.tpot_s))
    return all(o is not None and t is not None and o <= _COMFORTABLE * t for o, t in pairs)


def _describe(obs: RoleObservation) -> str:
    parts = [
        f"prompt {obs.prompt_tokens_per_s:.0f} tok/s",
        f"gen {obs.generation_tokens_per_s:.0f} tok/s",
        f"running {obs.running}",
        f"waiting {obs.waiting}",
        f"kv {obs.kv_usage:.0%}",
    ]
    if obs.ttft_s is not None:
        parts.append(f"ttft {obs.ttft_s * 1000:.0f} ms")
    if obs.tpot_s is not None:
        parts.append(f"tpot {obs.tpot_s * 1000:.0f} ms")
    return ", ".join(parts)


def decide(
    cfg: PlannerConfig, obs: RoleObservation | None, state: PlannerState, now: float
) -> Decision:
    """One decision for one role.

    Invariants (tested with hypothesis): the result lies in [min, max] whenever the current
    count does, and is moved into it otherwise; nothing changes within the stabilization
    window of the last change (except moving into [min, max]); for fixed state, time and
    latencies, the result is non-decreasing in every load figure; unknown inputs (no
    observation, no SLO, no pod answering) leave the current count."""
    current = obs.current if obs is not None else None
    if current is None:
        return Decision(0, Reason.UNKNOWN_INPUTS, "no observation of the role", state)
    if current < cfg.min_replicas or current > cfg.max_replicas:
        desired = min(max(current, cfg.min_replicas), cfg.max_replicas)
        reason = Reason.BELOW_MIN if current < cfg.min_replicas else Reason.ABOVE_MAX
        msg = f"{current} replicas outside [{cfg.min_replicas}, {cfg.max_replicas}]"
        return Decision(desired, reason, msg, replace(state, last_scale_time=now))
    assert obs is not None
    if cfg.ttft_s is None or cfg.tpot_s is None:
        return Decision(current, Reason.NO_SLO, "no SLO targets: set spec.slo", state)
    if obs.known_pods == 0 and obs.ready > 0:
        return Decision(
            current,
            Reason.UNKNOWN_INPUTS,
            f"none of the {obs.ready} ready pods reported metrics; holding {current}",
            state,
        )

    ahead, rates = forecast(cfg, obs, state, now)
    ahead = with_arrivals(ahead, state)
    need, exact = planned_replicas(cfg, ahead, state)
    missed = slo_missed(cfg, obs)
    up_rec = math.ceil(need - 1e-9)
    if missed:
        up_rec = max(up_rec, current + 1)
    # Scale down only when the smaller fleet still has `tolerance` to spare, and only on
    # an exact figure (a lower bound cannot prove that fewer replicas suffice). The
    # tolerance only holds replicas: capped at the current count, it never adds one.
    down_rec = max(up_rec, min(current, math.ceil(need * (1 + cfg.tolerance) - 1e-9)))
    if not exact:
        down_rec = max(down_rec, current)
    rec = min(max(up_rec if up_rec > current else down_rec, cfg.min_replicas), cfg.max_replicas)

    window_start = now - cfg.scale_down_window_s
    history = (*((t, r) for t, r in state.history if t > window_start), (now, rec))
    # Capacity is learned only from an interval whose whole observation window saw the
    # current Ready count (a first decision has no record of a change: it trusts the data).
    if state.ready is None:
        ready_since = -math.inf
    elif state.ready != obs.ready or state.ready_since is None:
        ready_since = now
    else:
        ready_since = state.ready_since
    settled = now - ready_since >= cfg.observation_window_s
    new_state = replace(
        learn(cfg, obs, state) if settled else state,
        history=history,
        rates=rates,
        ready=obs.ready,
        ready_since=ready_since,
    )
    since = math.inf if state.last_scale_time is None else now - state.last_scale_time
    why = _describe(obs) + (f"; SLO missed: {', '.join(missed)}" if missed else "")
    if ahead is not obs:
        why += (
            f"; in {cfg.startup_s:.0f}s at the trend: prompt "
            f"{ahead.prompt_tokens_per_s:.0f} tok/s, gen {ahead.generation_tokens_per_s:.0f} tok/s"
        )

    if rec > current:
        if obs.ready < current:
            # Capacity on its way: current counts the starting replicas, so only the load's
            # own figure (no miss bump) may ask for more than it.
            load_rec = min(max(math.ceil(need - 1e-9), cfg.min_replicas), cfg.max_replicas)
            if not cfg.count_starting or load_rec <= current:
                return Decision(
                    current,
                    Reason.WAITING_FOR_REPLICAS,
                    f"{'load asks for' if load_rec >= rec else 'a miss asks for'} {rec} but "
                    f"only {obs.ready}/{current} replicas are Ready ({why})",
                    new_state,
                    rec,
                )
            rec = load_rec
        if since < cfg.scale_up_window_s:
            return Decision(
                current,
                Reason.UP_WINDOW,
                f"load asks for {rec}; last change {since:.0f}s ago ({why})",
                new_state,
                rec,
            )
        desired = min(rec, current + cfg.max_step_up)
        return Decision(
            desired,
            Reason.SCALED_UP,
            f"{current} -> {desired} (load asks for {rec}): {why}",
            replace(new_state, last_scale_time=now),
            rec,
        )
    if rec < current:
        if obs.unknown_pods > 0:
            return Decision(
                current,
                Reason.PARTIAL_INPUTS,
                f"{obs.unknown_pods} pod(s) did not report; not scaling down ({why})",
                new_state,
                rec,
            )
        if since < cfg.scale_up_window_s:
            return Decision(
                current,
                Reason.DOWN_WINDOW,
                f"load fits {rec}; last change {since:.0f}s ago ({why})",
                new_state,
                rec,
            )
        # The window's highest recommendation: a dip shorter than the window moves nothing.
        # With every observed percentile far inside its target, the SLO has slack: a high
        # recommendation from a burst that is over is weaker evidence, so hold half as long.
        hold = cfg.scale_down_window_s * (0.5 if _slack(cfg, obs) else 1.0)
        # The pod to go is idle: its removal interrupts nothing, so only a recommendation
        # within idle_release_s holds it (a load that comes back gets a replica a start-up
        # later, as after any scale-down). Heavier load only makes it busy: monotone.
        if obs.victim_requests == 0 and cfg.idle_release_s is not None:
            hold = min(hold, cfg.idle_release_s)
        target = max(r for t, r in history if t > now - hold or t == now)
        # Quicker, on a forecast: go below the window's highest recommendation as far as
        # the load, raised by the largest surge seen within one start-up (burst window),
        # still fits with the tolerance to spare, once the recommendation stayed there for
        # a start-up (hysteresis; never on a lower bound).
        quick_on = cfg.burst_window_s > 0 and cfg.startup_s > 0
        headroom = burst_headroom(cfg, rates, state) if quick_on else None
        if exact and headroom is not None and target > rec:
            reserve = math.ceil(need * (1 + headroom) * (1 + cfg.tolerance) - 1e-9)
            recent = max(r for t, r in history if t > now - cfg.startup_s or t == now)
            quick = min(max(reserve, recent, cfg.min_replicas), cfg.max_replicas)
            if quick < target:
                hold, target = cfg.startup_s, quick
        desired = max(target, current - cfg.max_step_down)
        if desired >= current:
            return Decision(
                current,
                Reason.DOWN_WINDOW,
                f"load fits {rec} but asked for {target} within the last {hold:.0f}s ({why})",
                new_state,
                rec,
            )
        return Decision(
            desired,
            Reason.SCALED_DOWN,
            f"{current} -> {desired} (load fits {rec}): {why}",
            replace(new_state, last_scale_time=now),
            rec,
        )
    if not exact:
        return Decision(
            current,
            Reason.CAPACITY_UNKNOWN,
            f"no per-replica capacity learned yet and the SLO holds; holding {current} ({why})",
            new_state,
            rec,
        )
    return Decision(
        current, Reason.STEADY, f"{current} replicas fit the load ({why})", new_state, rec
    )
