"""The autoscaler's inputs, from raw pod reports to one `RoleObservation` (no I/O here).

A daemon's /metrics holds cumulative counters and histograms; the planner wants rates and
percentiles over the last interval. `PodSnapshot` keeps what one scrape said; two snapshots
of the same pod give its rates, and the bucket increments of every pod together give the
role's latency percentile the way PromQL's histogram_quantile does. Anything that does not
parse makes the pod unknown (never idle): a pod serving garbage cannot talk the fleet down.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from itertools import pairwise

from prometheus_client.parser import text_string_to_metric_families

from pagefleet.kvindex.index import PodLoad
from pagefleet.operator.planner import RoleObservation

PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
PREFIX_HITS = "vllm:prefix_cache_hits"
TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
_COUNTERS = (PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_HITS)
_HISTOGRAMS = (TTFT, TPOT)
# The gateway's arrival counters (pagefleet/gateway/metrics.py): the leading signal.
GATEWAY_ARRIVALS = "pagefleet_gateway_arrivals"
GATEWAY_ARRIVAL_PROMPT_TOKENS = "pagefleet_gateway_arrival_prompt_tokens"
_GATEWAY_COUNTERS = (GATEWAY_ARRIVALS, GATEWAY_ARRIVAL_PROMPT_TOKENS)


# Why a pod is unknown when it is only new (or just restarted): held, but no problem to
# report (the autoscaler's condition and Events name only real ones).
WARMING = "first scrape (or a restart): its rates are known from the next interval"


class MetricsError(ValueError):
    """A pod's /metrics could not be read as the daemon's metrics."""


@dataclass(frozen=True, slots=True)
class PodSnapshot:
    """Cumulative figures of one pod at one time (``t``: the operator's monotonic clock)."""

    t: float
    counters: dict[str, float]
    # histogram name -> ((upper bound, cumulative count), ...) ascending, ending with +Inf
    buckets: dict[str, tuple[tuple[float, float], ...]]


def parse_metrics(text: str, t: float) -> PodSnapshot:
    """Read the series the autoscaler needs from a daemon's Prometheus text; raises
    MetricsError when one is missing or not a finite non-negative number."""
    return _parse(text, t, _COUNTERS, _HISTOGRAMS, "a pagefleet daemon")


def parse_gateway_metrics(text: str, t: float) -> PodSnapshot:
    """The gateway's arrival counters from its Prometheus text (MetricsError as
    parse_metrics)."""
    return _parse(text, t, _GATEWAY_COUNTERS, (), "a pagefleet gateway of this version")


def _parse(
    text: str, t: float, names: tuple[str, ...], histograms: tuple[str, ...], what: str
) -> PodSnapshot:
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {h: {} for h in histograms}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_total") and s.name[: -len("_total")] in names:
                    key = s.name[: -len("_total")]
                    counters[key] = counters.get(key, 0.0) + float(s.value)
                elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in buckets:
                    le = float(s.labels["le"])
                    hist = buckets[s.name[: -len("_bucket")]]
                    hist[le] = hist.get(le, 0.0) + float(s.value)
    except (ValueError, KeyError, TypeError) as exc:
        raise MetricsError(f"unparsable Prometheus text: {exc}") from exc
    missing = [n for n in names if n not in counters]
    missing += [n for n, b in buckets.items() if math.inf not in b]
    if missing:
        raise MetricsError(f"missing series {', '.join(missing)} (is this {what}?)")
    values = [*counters.values(), *(v for b in buckets.values() for v in b.values())]
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise MetricsError("a counter or bucket is negative or not finite")
    for name, hist in buckets.items():
        counts = [c for _, c in sorted(hist.items())]
        if any(b < a for a, b in pairwise(counts)):
            # Its percentiles would be garbage the planner believes (a low TTFT, say).
            raise MetricsError(f"histogram {name}: bucket counts are not cumulative in le")
    return PodSnapshot(
        t=t,
        counters=counters,
        buckets={n: tuple(sorted(b.items())) for n, b in buckets.items()},
    )


def quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile (0..1) of a cumulative histogram, interpolated linearly inside the
    bucket as PromQL's histogram_quantile; None without observations."""
    items = sorted(buckets)
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # beyond the last finite bound: report that bound
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


@dataclass(frozen=True, slots=True)
class PodDelta:
    """One pod's activity between two snapshots."""

    seconds: float
    prompt_tokens: float  # uncached (prompt minus prefix-cache hits)
    generation_tokens: float
    requests: float  # first tokens (TTFT observations)
    buckets: dict[str, dict[float, float]]  # increments per bucket bound


def delta(old: PodSnapshot, new: PodSnapshot) -> PodDelta | None:
    """Increments from ``old`` to ``new``; None when the interval is empty or a counter went
    backwards (the daemon restarted: the next pair of scrapes gives a clean rate)."""
    dt = new.t - old.t
    if dt <= 0:
        return None
    d = {k: new.counters[k] - old.counters.get(k, 0.0) for k in new.counters}
    incs: dict[str, dict[float, float]] = {}
    for name, bounds in new.buckets.items():
        before = dict(old.buckets.get(name, ()))
        incs[name] = {le: c - before.get(le, 0.0) for le, c in bounds}
        if any(v < 0 for v in incs[name].values()):
            return None
    if any(v < 0 for v in d.values()):
        return None
    return PodDelta(
        seconds=dt,
        prompt_tokens=max(0.0, d[PROMPT_TOKENS] - d[PREFIX_HITS]),
        generation_tokens=d[GENERATION_TOKENS],
        requests=incs[TTFT].get(math.inf, 0.0),
        buckets=incs,
    )


def restarted(old: PodSnapshot, new: PodSnapshot) -> bool:
    """Some counter or bucket of ``new`` is below ``old``'s: the process behind the pod
    restarted in between (its counters began again at zero), so no rate spans the two."""
    if any(v < old.counters.get(k, 0.0) for k, v in new.counters.items()):
        return True
    for name, bounds in new.buckets.items():
        before = dict(old.buckets.get(name, ()))
        if any(c < before.get(le, 0.0) for le, c in bounds):
            return True
    return False


@dataclass(frozen=True, slots=True)
class Arrivals:
    """What the gateways routed per second over their last interval (all of them summed)."""

    requests_per_s: float
    prompt_tokens_per_s: float  # uncached
    window_s: float


def gateway_arrivals(pairs: Iterable[tuple[PodSnapshot, PodSnapshot]]) -> Arrivals | None:
    """The summed arrival rates of every gateway pod from its (previous, latest) scrape;
    None when there is no pair or any counter went backwards (a restart: unknown, and the
    planner then plans on the pods' own figures alone)."""
    reqs = prompt = span = 0.0
    n = 0
    for old, new in pairs:
        dt = new.t - old.t
        d = {k: new.counters[k] - old.counters.get(k, 0.0) for k in _GATEWAY_COUNTERS}
        if dt <= 0 or any(v < 0 for v in d.values()):
            return None
        reqs += d[GATEWAY_ARRIVALS] / dt
        prompt += d[GATEWAY_ARRIVAL_PROMPT_TOKENS] / dt
        span = max(span, dt)
        n += 1
    return Arrivals(reqs, prompt, span) if n else None


@dataclass(slots=True)
class PodReport:
    """Everything known about one Ready pod this interval (None fields: not known)."""

    name: str
    load: PodLoad | None = None  # its Redis heartbeat
    delta: PodDelta | None = None  # its /metrics since the previous scrape
    error: str | None = None  # why it is unknown, for the status message
    rates_known: bool = False  # rates came from elsewhere (Prometheus), not from `delta`

    @property
    def known(self) -> bool:
        return self.load is not None and (self.delta is not None or self.rates_known)


@dataclass(slots=True)
class RoleInputs:
    """One role's inputs this interval: the planner's observation plus per-pod facts."""

    observation: RoleObservation
    pods: list[PodReport] = field(default_factory=list)

    @property
    def unknown(self) -> list[PodReport]:
        return [p for p in self.pods if not p.known]


def observe_role(
    current: int,
    ready: int,
    reports: list[PodReport],
    percentile: float,
    arrivals: Arrivals | None = None,
    role: str = "unified",
) -> RoleInputs:
    """Sum the known pods' rates, merge their histograms into percentiles. Pods without a
    heartbeat or a metrics delta count as unknown (``unknown_pods``), never as idle.

    The gateways' ``arrivals`` lead a unified or decode role's figures (every routed
    request reaches it). A prefill role gets none: in P/D the gateway prefills remotely
    only some requests, so its totals would overstate the prefill pool's work."""
    known = [p for p in reports if p.known]
    q = percentile / 100.0
    prompt = gen = reqs = 0.0
    running = waiting = 0
    kv = 0.0
    merged: dict[str, dict[float, float]] = {TTFT: {}, TPOT: {}}
    for p in known:
        assert p.delta is not None and p.load is not None
        prompt += p.delta.prompt_tokens / p.delta.seconds
        gen += p.delta.generation_tokens / p.delta.seconds
        reqs += p.delta.requests / p.delta.seconds
        running += p.load.running
        waiting += p.load.waiting
        kv += p.load.kv_usage
        for name, incs in p.delta.buckets.items():
            m = merged.setdefault(name, {})
            for le, v in incs.items():
                m[le] = m.get(le, 0.0) + v
    obs = RoleObservation(
        current=current,
        ready=ready,
        known_pods=len(known),
        unknown_pods=len(reports) - len(known),
        prompt_tokens_per_s=prompt,
        generation_tokens_per_s=gen,
        requests_per_s=reqs,
        running=running,
        waiting=waiting,
        kv_usage=kv / len(known) if known else 0.0,
        ttft_s=quantile(q, merged[TTFT].items()),
        tpot_s=quantile(q, merged[TPOT].items()),
        victim_requests=victim_requests(current, reports),
    )
    if arrivals is not None and role != "prefill":
        obs = replace(
            obs,
            arrival_requests_per_s=arrivals.requests_per_s,
            arrival_prompt_tokens_per_s=arrivals.prompt_tokens_per_s if role == "unified" else None,
            arrival_window_s=arrivals.window_s,
        )
    return RoleInputs(observation=obs, pods=reports)


def victim_requests(current: int, reports: list[PodReport]) -> int | None:
    """Requests on the pod a scale-down would remove (cheapest_pod's choice among the Ready
    ones); None when it is not known: its load is unknown, or a pod is not Ready (that one
    goes first, and dropping a start-up just asked for is no idle release)."""
    if current > len(reports):
        return None
    name = cheapest_pod(reports, {p.name: True for p in reports})
    load = next((p.load for p in reports if p.name == name), None)
    return None if load is None else load.running + load.waiting


def cheapest_pod(reports: Iterable[PodReport], ready: Mapping[str, bool]) -> str | None:
    """The pod whose loss costs least: not Ready first, then fewest cached blocks in the
    index, then fewest running requests; ties by name (deterministic)."""
    ranked = cheapest_pods(reports, ready, 1)
    return ranked[0] if ranked else None


def cheapest_pods(reports: Iterable[PodReport], ready: Mapping[str, bool], n: int) -> list[str]:
    """The ``n`` pods whose loss costs least, cheapest first (cheapest_pod's order)."""

    def cost(p: PodReport) -> tuple[int, float, float, str]:
        load = p.load
        cached = load.num_cached_blocks if load else math.inf
        running = load.running + load.waiting if load else math.inf
        return (1 if ready.get(p.name, False) else 0, cached, running, p.name)

    return [p.name for p in sorted(reports, key=cost)[: max(0, n)]]
