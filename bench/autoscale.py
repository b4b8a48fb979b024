"""Autoscaling policies on one simulated fleet whose replicas run at this engine's speed.

1. Measure the engine (the bench model of bench_models.py, CPU): prefill tokens/s on one
   long prompt, and the decode step time at a few batch sizes (fit: a + b * batch).
2. Simulate one role's fleet, event by event in small time slices: each replica runs
   continuous batching with that cost model (step = a + b * running + prefill chunk / P,
   one token budget per step, at most max_num_seqs seated), a least-loaded router sends each
   arrival to a Ready replica, a new replica is Ready only after a start-up delay, and a
   removed one drains (finishes what it holds) before it stops costing.
3. The trace: a daily curve (night trough, midday peak) compressed to the run length, plus
   bursts, Poisson arrivals, mixed prompt/output lengths; the same trace for every policy.
   ``--trace azure-conv``: a published shape instead (Gamma arrivals, prompt and output
   lengths measured on the Azure LLM inference trace 2023, see AZURE_CONV_*).
   ``--trace two-peak``: a day kept out of all tuning (two peaks, longer x1.5 surges and
   short x3 spikes), to check what was tuned on the other two.
   ``--day-seconds``: a longer (less compressed) day, same start-up, windows and bursts.
4. Policies: static at peak (fewest replicas that hold the SLO all day, found by search),
   static at mean, an HPA-like policy (utilisation = seated+queued / max_num_seqs, target
   70%, the HPA's ratio rule with its 10% tolerance and a scale-down stabilization window),
   and the planner: pagefleet.operator.planner.decide, the function the operator runs,
   fed the same inputs the operator scrapes (rates and latency percentiles over a window,
   running, waiting, KV usage, and the gateway's arrivals over the last interval: the
   router counts each request as it routes it, as the gateway's counters do); the
   planner again without the gateway's arrivals (the A/B of that signal); and a
   clairvoyant rate-follower (knows the trace's rate a start-up ahead) at a few headrooms.

SLO attainment = share of requests whose TTFT and TPOT both met the targets (a request
still unserved when the run ends counts as a miss). Replica-hours include starting and
draining replicas. An oracle (the fewest whole replicas at every second at the capacity
the static-peak fleet has at the SLO) bounds them from below, and a ledger books where the
planner's replica-hours above the oracle go and which fleet each missed request met
(``planner_breakdown_replica_hours``, ``planner_misses_by_fleet``). A second bound holds
for any policy at all (``work_lower_bound``: the requests' least work, the allowed misses
taken from the costliest), so a target below it is out of reach on that trace.

    python bench/autoscale.py --quick     # < 60 s
    python bench/autoscale.py             # a longer day
    python bench/autoscale.py --plot docs/autoscale.png   # also redraw the committed plot
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagefleet.operator.planner import (
    PlannerConfig,
    PlannerState,
    RoleObservation,
    decide,
    forecast,
    planned_replicas,
    replicas_needed,
)

# ------------------------------------------------------------------------ measurement


@dataclass(frozen=True, slots=True)
class EngineCost:
    prefill_tok_s: float  # P
    step_base_s: float  # a
    step_per_seq_s: float  # b

    def step(self, batch: int, prefill_tokens: float = 0.0) -> float:
        return self.step_base_s + self.step_per_seq_s * batch + prefill_tokens / self.prefill_tok_s


def measure_engine(quick: bool) -> tuple[EngineCost, dict[str, Any]]:
    """Prefill tokens/s and decode step time vs batch on the bench model (a few seconds)."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_models import ensure_bench_model

    from pagefleet.engine.config import EngineConfig
    from pagefleet.engine.engine import LLMEngine
    from pagefleet.engine.sampling_params import SamplingParams

    torch.manual_seed(0)
    # One thread: a replica's speed, not the shared machine's thread contention.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = ensure_bench_model()
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            num_gpu_blocks=4096 // 16 * 8,
            block_size=16,
            max_num_seqs=64,
            max_num_batched_tokens=1024,
            enable_prefix_caching=False,
        )
    )
    vocab = 1000
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    engine.generate([prompt(32)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    prefill_len = 256
    rates = []
    for i in range(2 if quick else 3):
        engine.add_request(
            f"p{i}",
            prompt(prefill_len),
            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        )
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        rates.append(prefill_len / (time.perf_counter() - t0))
    prefill = statistics.median(rates)

    batches = (1, 16) if quick else (1, 4, 16, 32)
    points: list[tuple[int, float]] = []
    for b in batches:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"d{b}-{i}", prompt(16), params)
        times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        decode = times[-4:]  # the batch's pure decode steps
        points.append((b, statistics.median(decode)))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    slope = max(slope, 1e-6)
    base = max(my - slope * mx, 1e-4)
    cost = EngineCost(prefill, base, slope)
    torch.set_num_threads(threads)
    info = {
        "prefill_tok_s": round(prefill, 1),
        "decode_step_ms": {str(b): round(1000 * t, 2) for b, t in points},
        "fit_step_ms": f"{1000 * base:.2f} + {1000 * slope:.3f} * batch",
    }
    return cost, info


# ------------------------------------------------------------------------------ trace


@dataclass(slots=True)
class Request:
    arrival: float
    prompt: int
    output: int
    first_token: float | None = None
    finish: float | None = None


def _thinned_requests(
    rng: random.Random, rate: Callable[[float], float], peak_rate: float, duration: float
) -> list[Request]:
    """Arrivals of a Poisson process of intensity ``rate(t)`` (thinned from ``peak_rate``),
    each with a lognormal prompt (32-1536 tokens, median 320) and 16-96 output tokens. The
    draws' order is fixed: a trace is the same for the same seed."""
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak_rate)
        if t >= duration:
            return out
        if rng.random() < rate(t) / peak_rate:
            prompt = int(min(1536, max(32, rng.lognormvariate(math.log(320), 0.6))))
            out.append(Request(t, prompt, rng.randint(16, 96)))


def make_trace(
    duration: float, peak_rate: float, seed: int
) -> tuple[list[Request], Callable[[float], float], list[tuple[float, float]]]:
    """Arrivals of a compressed day (trough 15% of peak at the ends, peak at midday) plus
    bursts (x2 for 30-60 s), as a thinned Poisson process; returns (requests, rate(t),
    the bursts' (start, end))."""
    rng = random.Random(seed)
    trough = 0.15
    bursts = []
    for _ in range(max(2, int(duration // 400))):
        start = rng.uniform(0.1 * duration, 0.9 * duration)
        bursts.append((start, start + rng.uniform(30, 60)))

    def rate(t: float) -> float:
        day = trough + (1 - trough) * 0.5 * (1 - math.cos(2 * math.pi * t / duration))
        burst = 2.0 if any(a <= t < b for a, b in bursts) else 1.0
        return peak_rate * min(1.0, day * burst) if burst > 1 else peak_rate * day

    return _thinned_requests(rng, rate, peak_rate, duration), rate, bursts


def steady_trace(
    duration: float, rate: float, seed: int, trace: str = "synthetic"
) -> list[Request]:
    """Arrivals at a constant rate with the day's arrival process and request mix (the
    capacity probes of the oracle)."""
    if trace == AZURE_CONV:
        return _gamma_arrivals(duration, lambda _: rate, seed, AZURE_CONV_GAMMA_SHAPE)
    rng = random.Random(seed)
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        prompt = int(min(1536, max(32, rng.lognormvariate(math.log(320), 0.6))))
        out.append(Request(t, prompt, rng.randint(16, 96)))


# The second trace: the shape of a published production trace. Source of every number:
# the Azure LLM inference trace 2023, conversation service (Patel et al., "Splitwise:
# Efficient generative LLM inference using phase splitting", ISCA 2024; data in
# github.com/Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_conv.csv, CC-BY 4.0).
# Measured this session on its first 216 requests (64 s from 2023-11-16 18:15:46; the
# whole file covers one hour, so it says nothing about a daily curve):
AZURE_CONV = "azure-conv"
# inter-arrival times: CV 1.48, i.e. a Gamma renewal process of shape 1/CV^2 = 0.46
# (burstier than Poisson, CV 1; BurstGPT and ServeGen also model LLM arrivals as Gamma)
AZURE_CONV_GAMMA_SHAPE = 0.46
# prompt (context) tokens: ln-mean 6.34, ln-std 1.10 (median 898, mean 895, p99 4085, max
# 4107: the 2023 models' 4k context); lognormal, cut to [2, 4096]
AZURE_CONV_PROMPT_LN = (6.34, 1.10)
AZURE_CONV_PROMPT_MAX = 4096
# output tokens: mean 242 (median 202, p99 520); exponential as ServeGen (Xiang et al.,
# arXiv 2505.09999) models outputs, cut to [1, 1024]; prompt/output correlation 0.03
AZURE_CONV_OUTPUT_MEAN = 242.0
AZURE_CONV_OUTPUT_MAX = 1024
# NOT from a publication: the daily curve (trough 15% of peak, as the synthetic day). No
# peak-to-trough figure of an LLM service's day was found (docs/benchmarks.md says where
# it was looked for); this trace has no added bursts, its burstiness is the Gamma process.


def _azure_conv_request(rng: random.Random) -> tuple[int, int]:
    mu, sigma = AZURE_CONV_PROMPT_LN
    prompt = int(min(AZURE_CONV_PROMPT_MAX, max(2, rng.lognormvariate(mu, sigma))))
    output = int(min(AZURE_CONV_OUTPUT_MAX, max(1, rng.expovariate(1 / AZURE_CONV_OUTPUT_MEAN))))
    return prompt, output


def _gamma_arrivals(
    duration: float, rate: Callable[[float], float], seed: int, shape: float
) -> list[Request]:
    """A Gamma renewal process (mean gap 1, shape ``shape``) in operational time, mapped
    through the cumulative rate (time rescaling): the rate follows ``rate(t)`` and the
    gaps keep the process's burstiness at every rate."""
    rng = random.Random(seed)
    cum = [0.0]
    for sec in range(int(duration)):
        cum.append(cum[-1] + rate(sec + 0.5))
    out: list[Request] = []
    u, i = 0.0, 0
    while True:
        u += rng.gammavariate(shape, 1 / shape)
        while i < len(cum) - 1 and cum[i + 1] < u:
            i += 1
        if i >= len(cum) - 1:
            return out
        t = i + (u - cum[i]) / max(cum[i + 1] - cum[i], 1e-12)
        out.append(Request(t, *_azure_conv_request(rng)))


def make_azure_conv_trace(
    duration: float, peak_rate: float, seed: int
) -> tuple[list[Request], Callable[[float], float], list[tuple[float, float]]]:
    """The published-shape day (see AZURE_CONV_*): the synthetic day's curve without its
    bursts, Gamma arrivals, the conversation trace's prompt and output lengths."""
    trough = 0.15

    def rate(t: float) -> float:
        return peak_rate * (
            trough + (1 - trough) * 0.5 * (1 - math.cos(2 * math.pi * t / duration))
        )

    return _gamma_arrivals(duration, rate, seed, AZURE_CONV_GAMMA_SHAPE), rate, []


# A third day, kept out of every tuning run (session 9's held-out shape): two peaks (a
# morning one at 70% of the evening's), a trough of 10%, and a different burst mix: more
# frequent, longer and lower surges (x1.5 for 60-180 s, one per 300 s) and a few short
# spikes (x3 for 10-20 s). The synthetic day's Poisson arrivals and request mix.
TWO_PEAK = "two-peak"


def make_two_peak_trace(
    duration: float, peak_rate: float, seed: int
) -> tuple[list[Request], Callable[[float], float], list[tuple[float, float]]]:
    """The held-out day (see TWO_PEAK); returns (requests, rate(t), the surges' (start, end))."""
    rng = random.Random(seed)
    trough = 0.10
    surges: list[tuple[float, float, float]] = []
    for _ in range(max(2, int(duration // 300))):
        start = rng.uniform(0.05 * duration, 0.95 * duration)
        surges.append((start, start + rng.uniform(60, 180), 1.5))
    for _ in range(max(1, int(duration // 900))):
        start = rng.uniform(0.1 * duration, 0.9 * duration)
        surges.append((start, start + rng.uniform(10, 20), 3.0))

    def rate(t: float) -> float:
        x = t / duration
        morning = 0.7 * math.exp(-(((x - 0.3) / 0.1) ** 2))
        evening = math.exp(-(((x - 0.7) / 0.12) ** 2))
        day = trough + (1 - trough) * max(morning, evening)
        lift = max((m for a, b, m in surges if a <= t < b), default=1.0)
        return peak_rate * min(1.0, day * lift) if lift > 1 else peak_rate * day

    return _thinned_requests(rng, rate, peak_rate, duration), rate, [(a, b) for a, b, _ in surges]


TRACES = {
    "synthetic": make_trace,
    AZURE_CONV: make_azure_conv_trace,
    TWO_PEAK: make_two_peak_trace,
}


# ------------------------------------------------------------------------------ fleet


@dataclass(slots=True)
class Replica:
    ready_at: float
    draining: bool = False
    waiting: deque[Request] = field(default_factory=deque)
    prefill: deque[list[Any]] = field(default_factory=deque)  # [request, remaining tokens]
    prefill_tokens: float = 0.0
    running: list[tuple[float, int, Request]] = field(default_factory=list)  # heap by finish
    steps: float = 0.0
    seq: int = 0
    active_prompt: int = 0  # prompt tokens of seated requests (KV usage estimate)

    def load(self) -> int:
        return len(self.waiting) + len(self.prefill) + len(self.running)

    def empty(self) -> bool:
        return self.load() == 0


@dataclass(slots=True)
class Window:
    """Per-slice fleet totals, for the policies' rates (like counters scraped)."""

    t: float
    prompt_tokens: float
    gen_tokens: float
    first_tokens: int


@dataclass(frozen=True, slots=True)
class SimConfig:
    ttft_s: float
    tpot_s: float
    max_num_seqs: int = 32
    max_batched_tokens: int = 1024
    kv_tokens: int = 32 * 1024
    startup_s: float = 30.0
    dt: float = 0.2
    interval_s: float = 10.0
    rate_window_s: float = 30.0
    down_window_s: float = 120.0
    percentile: float = 95.0
    gateway_signal: bool = True  # the planner sees the gateway's arrival rate


class Fleet:
    """The simulated role: replicas, the router, and the counters the policies read."""

    def __init__(self, cost: EngineCost, cfg: SimConfig, initial: int) -> None:
        self.cost, self.cfg = cost, cfg
        self.replicas: list[Replica] = [Replica(ready_at=0.0) for _ in range(initial)]
        self.replica_seconds = 0.0
        self.windows: deque[Window] = deque()
        self.ttfts: deque[tuple[float, float]] = deque()  # (time, ttft)
        self.tpots: deque[tuple[float, float]] = deque()
        # The gateway's view: (arrival time, prompt tokens) of every request it routed
        # within the last decision interval (its counters' rate over one tick).
        self.arrivals: deque[tuple[float, int]] = deque()

    # -- policy actions ------------------------------------------------------------------

    def serving(self, now: float) -> list[Replica]:
        return [r for r in self.replicas if not r.draining and r.ready_at <= now]

    def target(self) -> int:
        return sum(1 for r in self.replicas if not r.draining)

    def scale_to(self, n: int, now: float) -> None:
        live = [r for r in self.replicas if not r.draining]
        for _ in range(n - len(live)):
            self.replicas.append(Replica(ready_at=now + self.cfg.startup_s))
        if n < len(live):
            # The cheapest to lose first: not Ready, then least work held.
            ranked = sorted(live, key=lambda r: (r.ready_at <= now, r.load()))
            for r in ranked[: len(live) - n]:
                r.draining = True

    # -- simulation ------------------------------------------------------------------------

    def route(self, req: Request, now: float) -> None:
        self.arrivals.append((req.arrival, req.prompt))
        ready = self.serving(now) or [r for r in self.replicas if not r.draining]
        min(ready, key=lambda r: r.load()).waiting.append(req)

    def advance(self, now: float) -> None:
        dt, cfg, cost = self.cfg.dt, self.cfg, self.cost
        self.replica_seconds += dt * len(self.replicas)
        tot_prompt = tot_gen = 0.0
        firsts = 0
        for r in self.replicas:
            if r.ready_at > now:
                continue
            while r.waiting and len(r.prefill) + len(r.running) < cfg.max_num_seqs:
                req = r.waiting.popleft()
                r.prefill.append([req, float(req.prompt)])
                r.prefill_tokens += req.prompt
                r.active_prompt += req.prompt
            batch = len(r.running)
            if batch == 0 and not r.prefill:
                continue
            chunk = max(0.0, min(cfg.max_batched_tokens - batch, r.prefill_tokens))
            step = cost.step(batch, chunk)
            n = dt / step
            done = min(r.prefill_tokens, n * chunk)
            if chunk > 0 and done < n * chunk:  # the queue empties inside the slice
                rest = dt - done / cost.prefill_tok_s
                n = done / chunk + max(0.0, rest) / cost.step(batch) if batch else done / chunk
            s0 = r.steps
            firsts_before = firsts
            # Prefill completions, FIFO, at their share of the slice.
            budget, used = done, 0.0
            while r.prefill and r.prefill[0][1] <= budget - used + 1e-9:
                req, left = r.prefill.popleft()
                used += left
                frac = used / done if done else 1.0
                req.first_token = now + dt * frac
                self.ttfts.append((req.first_token, req.first_token - req.arrival))
                firsts += 1
                r.seq += 1
                join = s0 + n * frac
                heapq.heappush(r.running, (join + req.output - 1, r.seq, req))
            if r.prefill and budget - used > 0:
                r.prefill[0][1] -= budget - used
            r.prefill_tokens = max(0.0, r.prefill_tokens - done)
            r.steps = s0 + n
            tot_prompt += done
            tot_gen += n * batch + (firsts - firsts_before)
            while r.running and r.running[0][0] <= r.steps:
                fin, _, req = heapq.heappop(r.running)
                req.finish = now + dt * (fin - s0) / n if n else now + dt
                assert req.first_token is not None
                if req.output > 1:
                    tpot = (req.finish - req.first_token) / (req.output - 1)
                    self.tpots.append((req.finish, tpot))
                r.active_prompt -= req.prompt
        self.replicas = [r for r in self.replicas if not (r.draining and r.empty())]
        self.windows.append(Window(now + dt, tot_prompt, tot_gen, firsts))
        horizon = now - self.cfg.rate_window_s
        while self.windows and self.windows[0].t < horizon:
            self.windows.popleft()
        for q in (self.ttfts, self.tpots):
            while q and q[0][0] < horizon:
                q.popleft()

    # -- the operator's inputs ---------------------------------------------------------------

    def observe(self, now: float) -> RoleObservation:
        ready = self.serving(now)
        span = min(self.cfg.rate_window_s, now) or 1.0
        q = self.cfg.percentile / 100

        def pct(vals: list[float]) -> float | None:
            if not vals:
                return None
            vals.sort()
            return vals[min(len(vals) - 1, int(q * len(vals)))]

        kv = [min(1.0, r.active_prompt / self.cfg.kv_tokens) for r in ready]
        gate = min(self.cfg.interval_s, now) or 1.0
        while self.arrivals and self.arrivals[0][0] < now - gate:
            self.arrivals.popleft()
        gateway = self.cfg.gateway_signal
        return RoleObservation(
            current=self.target(),
            ready=len(ready),
            known_pods=len(ready),
            prompt_tokens_per_s=sum(w.prompt_tokens for w in self.windows) / span,
            generation_tokens_per_s=sum(w.gen_tokens for w in self.windows) / span,
            requests_per_s=sum(w.first_tokens for w in self.windows) / span,
            running=sum(len(r.running) for r in ready),
            waiting=sum(len(r.waiting) + len(r.prefill) for r in ready),
            kv_usage=statistics.fmean(kv) if kv else 0.0,
            ttft_s=pct([v for _, v in self.ttfts]),
            tpot_s=pct([v for _, v in self.tpots]),
            arrival_requests_per_s=len(self.arrivals) / gate if gateway else None,
            arrival_prompt_tokens_per_s=(
                sum(p for _, p in self.arrivals) / gate if gateway else None
            ),
            arrival_window_s=gate,
            # What the pod scale_to removes first holds: the least loaded Ready one (the
            # operator's cheapest pod); unknown while one starts (that one goes first, and
            # dropping a start-up just asked for is no idle release).
            victim_requests=(
                None if self.target() > len(ready) else min((r.load() for r in ready), default=None)
            ),
        )


# --------------------------------------------------------------------------- ledger


@dataclass(slots=True)
class Plan:
    """The planner's latest view, whole replicas: what the measured load needs, what the
    load forecast ``startup_s`` ahead needs, that with the planner's stated headroom, and
    the recommendation (with the gateway's arrivals and the one-more-replica-on-a-miss
    rule)."""

    need_now: int = 0
    need_ahead: int = 0
    with_headroom: int = 0
    recommendation: int = 0


class Ledger:
    """Where a policy's replica-seconds go against the oracle, integrated every slice.

    Starting and draining replicas are their own items. For the serving ones, at each
    slice with S serving and the oracle's count O at that second: if S < O the shortfall is
    counted (that is where SLO misses come from); otherwise S - O is split by clamped levels
    of the planner's latest view: ``model`` (the measured load at the learned capacity needs
    more than the oracle's count), ``forecast`` (the start-up-ahead trend asks more),
    ``headroom`` (the planner's stated spare share on top), ``margin`` (the gateway's
    arrivals and the SLO-miss bump in the recommendation), ``hold`` (the planner would go
    lower but its windows and step keep the replicas)."""

    ITEMS = ("startup", "drain", "model", "forecast", "headroom", "margin", "hold")

    def __init__(self, oracle_count: Callable[[float], int]) -> None:
        self.oracle_count = oracle_count
        self.seconds = dict.fromkeys((*self.ITEMS, "shortfall", "oracle", "total"), 0.0)
        self.short_at: dict[int, bool] = {}  # whole second -> serving below the oracle
        self.plan = Plan()

    def tick(self, fleet: Fleet, now: float, dt: float) -> None:
        starting = draining = serving = 0
        for r in fleet.replicas:
            if r.draining:
                draining += 1
            elif r.ready_at > now:
                starting += 1
            else:
                serving += 1
        sec = self.seconds
        oracle = self.oracle_count(now)
        sec["startup"] += starting * dt
        sec["drain"] += draining * dt
        sec["oracle"] += oracle * dt
        sec["total"] += (starting + draining + serving) * dt
        self.short_at[int(now)] = serving < oracle
        if serving < oracle:
            sec["shortfall"] += (oracle - serving) * dt
            return
        plan = self.plan
        lv1 = max(oracle, min(serving, plan.need_now))
        lv2 = max(lv1, min(serving, plan.need_ahead))
        lv3 = max(lv2, min(serving, plan.with_headroom))
        lv4 = max(lv3, min(serving, plan.recommendation))
        sec["model"] += (lv1 - oracle) * dt
        sec["forecast"] += (lv2 - lv1) * dt
        sec["headroom"] += (lv3 - lv2) * dt
        sec["margin"] += (lv4 - lv3) * dt
        sec["hold"] += (serving - lv4) * dt

    def misses(
        self, reqs: list[Request], ok: Callable[[Request], bool], bursts: list[tuple[float, float]]
    ) -> dict[str, int]:
        """Missed requests by what the fleet looked like when they arrived."""
        out = {"burst_fleet_short": 0, "fleet_short": 0, "burst_fleet_sized": 0, "other": 0}
        for r in reqs:
            if ok(r):
                continue
            burst = any(a <= r.arrival < b for a, b in bursts)
            short = self.short_at.get(int(r.arrival), False)
            key = ("burst_" if burst else "") + ("fleet_short" if short else "fleet_sized")
            out[key if key in out else "other"] += 1
        return out

    def summary(self) -> dict[str, float]:
        """Replica-hours per item; ``unexplained`` closes the sum (total - oracle =
        items - shortfall + unexplained: sampling, the oracle's per-second rounding)."""
        h = {k: v / 3600 for k, v in self.seconds.items()}
        explained = sum(h[k] for k in self.ITEMS) - h["shortfall"]
        h["unexplained"] = h["total"] - h["oracle"] - explained
        return {k: round(v, 4) for k, v in h.items()}


# ---------------------------------------------------------------------------- policies


Policy = Callable[[Fleet, float], None]


def static_policy(_: Fleet, __: float) -> None:
    return None


def planner_policy(cfg: PlannerConfig, ledger: Ledger | None = None) -> Policy:
    state = PlannerState()

    def step(fleet: Fleet, now: float) -> None:
        nonlocal state
        obs = fleet.observe(now)
        if ledger is not None:
            ahead, _ = forecast(cfg, obs, state, now)
            need_ahead = replicas_needed(cfg, ahead, state)[0]
            ledger.plan = Plan(
                need_now=math.ceil(replicas_needed(cfg, obs, state)[0] - 1e-9),
                need_ahead=math.ceil(need_ahead - 1e-9),
                # The stated headroom, or the queue model's spare (sizing="queue").
                with_headroom=math.ceil(planned_replicas(cfg, ahead, state)[0] - 1e-9),
            )
        d = decide(cfg, obs, state, now)
        if ledger is not None:
            ledger.plan.recommendation = d.recommendation or d.desired
        state = d.state
        if d.desired != fleet.target():
            fleet.scale_to(d.desired, now)

    return step


def clairvoyant_policy(
    rate: Callable[[float], float], duration: float, per_replica: float, cfg: SimConfig
) -> Policy:
    """Replicas for the highest arrival rate between one start-up and one start-up plus one
    interval ahead, at ``per_replica`` requests/s each (knows the future rate, not sizes)."""

    def step(fleet: Fleet, now: float) -> None:
        ahead = [now + cfg.startup_s + k for k in range(int(cfg.interval_s) + 1)]
        peak = max(rate(t) if t < duration else 0.0 for t in ahead)
        n = max(1, math.ceil(peak / per_replica - 1e-9))
        if n != fleet.target():
            fleet.scale_to(n, now)

    return step


def hpa_policy(
    lo: int, hi: int, max_seqs: int, down_window_s: float, target: float = 0.7
) -> Policy:
    """Kubernetes HPA's rule on a utilisation metric: desired = ceil(ready * util / target),
    no change within 10% of the target, scale-up at most max(2x, +4) per period, scale-down
    to the highest recommendation of the stabilization window."""
    recs: deque[tuple[float, int]] = deque()

    def step(fleet: Fleet, now: float) -> None:
        ready = fleet.serving(now)
        current = fleet.target()
        if not ready:
            return
        util = statistics.fmean(r.load() / max_seqs for r in ready)
        ratio = util / target
        desired = current if abs(ratio - 1) <= 0.1 else math.ceil(len(ready) * ratio)
        desired = min(hi, max(lo, desired))
        recs.append((now, desired))
        while recs and recs[0][0] < now - down_window_s:
            recs.popleft()
        if desired > current:
            desired = min(desired, max(2 * current, current + 4))
        elif desired < current:
            desired = max(r for _, r in recs)
        if desired != current:
            fleet.scale_to(desired, now)

    return step


@dataclass(slots=True)
class Result:
    attainment: float
    replica_hours: float
    timeline: list[tuple[float, int, float]]  # (t, replicas, arrival rate)
    ttft_p95: float
    tpot_p95: float
    requests: list[Request] = field(default_factory=list)  # as served
    met: Callable[[Request], bool] | None = None  # the SLO test


def simulate(
    trace: list[Request],
    rate: Callable[[float], float],
    duration: float,
    cost: EngineCost,
    cfg: SimConfig,
    initial: int,
    policy: Policy,
    ledger: Ledger | None = None,
) -> Result:
    reqs = [Request(r.arrival, r.prompt, r.output) for r in trace]
    fleet = Fleet(cost, cfg, initial)
    i, now, next_decision = 0, 0.0, cfg.interval_s
    timeline: list[tuple[float, int, float]] = []
    # Run until the last request can have finished (a request cut off counts as a miss).
    end = duration + max(120.0, 3 * (cfg.ttft_s + 100 * cfg.tpot_s))
    while now < end:
        while i < len(reqs) and reqs[i].arrival < now + cfg.dt:
            fleet.route(reqs[i], now)
            i += 1
        if ledger is not None:
            ledger.tick(fleet, now, cfg.dt)
        fleet.advance(now)
        now += cfg.dt
        if now >= next_decision:
            policy(fleet, now)
            next_decision += cfg.interval_s
            timeline.append((now, len(fleet.replicas), rate(now) if now < duration else 0.0))

    def met(r: Request) -> bool:
        return (
            r.first_token is not None
            and r.finish is not None
            and r.first_token - r.arrival <= cfg.ttft_s
            and (r.output <= 1 or (r.finish - r.first_token) / (r.output - 1) <= cfg.tpot_s)
        )

    ok = sum(1 for r in reqs if met(r))
    ttft = sorted(r.first_token - r.arrival for r in reqs if r.first_token is not None)
    tpot = sorted(
        (r.finish - r.first_token) / (r.output - 1)
        for r in reqs
        if r.finish is not None and r.first_token is not None and r.output > 1
    )

    def p95(v: list[float]) -> float:
        return v[int(0.95 * (len(v) - 1))] if v else math.inf

    return Result(
        ok / len(reqs),
        fleet.replica_seconds / 3600,
        timeline,
        p95(ttft),
        p95(tpot),
        reqs,
        met,
    )


def capacity_at_slo(
    cost: EngineCost,
    cfg: SimConfig,
    replicas: int,
    attainment: float,
    guess: float,
    quick: bool,
    trace_name: str = "synthetic",
) -> float:
    """The highest steady arrival rate (requests/s) that ``replicas`` fixed replicas serve
    with at least ``attainment`` of requests within the SLO: bisection over simulated
    steady Poisson load with the day's request mix."""
    span = 240.0 if quick else 600.0

    def holds(rate: float) -> bool:
        trace = steady_trace(span, rate, seed=1, trace=trace_name)
        res = simulate(trace, lambda _: rate, span, cost, cfg, replicas, static_policy)
        return res.attainment >= attainment

    lo, hi = 0.0, guess
    while holds(hi):
        lo, hi = hi, hi * 1.5
    for _ in range(6 if quick else 9):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


@dataclass(frozen=True, slots=True)
class WorkBound:
    """A lower bound on the replica-hours of ANY policy reaching an attainment target on a
    trace (``work_lower_bound``), in hours."""

    hours: float  # the bound: total work less the most work the allowed misses remove
    total_work: float  # every request's least work
    droppable: float  # the largest work the allowed misses can remove


def request_work(cost: EngineCost, req: Request, max_num_seqs: int) -> float:
    """Seconds of one replica's time a request costs at the least.

    A step costs a + b * batch + prefill_tokens / P (the fleet model), so a prompt token
    costs 1 / P and a decoded token at least a / max_num_seqs + b (its share of the fullest
    batch's step); the first token comes with the prefill."""
    per_token = cost.step_base_s / max_num_seqs + cost.step_per_seq_s
    return req.prompt / cost.prefill_tok_s + max(0, req.output - 1) * per_token


def work_lower_bound(
    trace: list[Request], cost: EngineCost, max_num_seqs: int, attainment: float
) -> WorkBound:
    """Replica-hours no policy can go below while meeting the SLO for ``attainment`` of
    the trace's requests, whatever it knows in advance and however fast replicas start.

    A replica works at most one second per second it exists, and every request it serves
    costs it at least ``request_work``; a policy may leave a share ``1 - attainment`` of
    the requests unserved, at best the costliest ones. Start-up, drain, idle time, whole
    replicas, queueing against the latency targets and batches below the fullest only add
    to a real fleet's cost, so the bound is loose: it can say a target is out of reach,
    never that it is within reach."""
    works = sorted((request_work(cost, r, max_num_seqs) for r in trace), reverse=True)
    allowed = math.floor((1 - attainment) * len(works) + 1e-9)
    total, droppable = sum(works), sum(works[:allowed])
    return WorkBound(
        hours=(total - droppable) / 3600, total_work=total / 3600, droppable=droppable / 3600
    )


def oracle_replica_hours(
    rate: Callable[[float], float], duration: float, end: float, per_replica: float, lo: int
) -> float:
    """Replica-hours of a perfect oracle: at every second exactly the fewest whole replicas
    whose capacity at the SLO covers that second's arrival rate, with no start-up delay,
    no drain and no forecast error (a lower bound for any policy on this trace)."""
    seconds = sum(
        max(lo, math.ceil(rate(t + 0.5) / per_replica - 1e-9) if t < duration else lo)
        for t in range(int(end))
    )
    return seconds / 3600


# -------------------------------------------------------------------------------- main


def per_replica_rate(cost: EngineCost, trace: list[Request], batch: int) -> float:
    """Requests/s one replica serves at `batch` running (a sizing estimate for the trace)."""
    prompt = statistics.fmean(r.prompt for r in trace)
    output = statistics.fmean(r.output for r in trace)
    busy = prompt / cost.prefill_tok_s + output * cost.step(batch) / batch
    return 1.0 / busy


def plot(results: dict[str, Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    load = results["planner"].timeline
    ax2 = ax.twinx()
    ax2.fill_between([t for t, _, _ in load], [x for _, _, x in load], color="0.9", step="post")
    ax2.set_ylabel("arrivals / s (shaded)")
    for name, res in results.items():
        label = f"{name} ({res.attainment:.0%} SLO, {res.replica_hours:.2f} replica-h)"
        times, counts = [t for t, _, _ in res.timeline], [n for _, n, _ in res.timeline]
        ax.step(times, counts, where="post", label=label)
    ax.set_zorder(ax2.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_xlabel("simulated seconds (one compressed day)")
    ax.set_ylabel("replicas")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter day, < 60 s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--target-utilization", type=float, default=1.0, help="the planner's (spec) setting"
    )
    ap.add_argument("--peak-replicas", type=float, default=8.0, help="peak load in replicas")
    ap.add_argument(
        "--trace",
        choices=sorted(TRACES),
        default="synthetic",
        help="the day: synthetic (Poisson, 2x bursts), azure-conv (a published trace's "
        "arrival burstiness and lengths) or two-peak (held out of all tuning: two peaks, "
        "x1.5 surges and x3 spikes); JSON keys of a non-default trace get its suffix",
    )
    ap.add_argument(
        "--day-seconds",
        type=float,
        default=None,
        help="simulated length of the day (default 1800 --quick, 5400); start-up, windows "
        "and bursts keep their length (a time-compression sensitivity)",
    )
    ap.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write the replicas-over-time plot here (the committed ones are "
        "docs/autoscale.png and docs/autoscale-azure-conv.png; none by default)",
    )
    ap.add_argument(
        "--engine-cost",
        default=None,
        help="replay a measurement instead of measuring: 'prefill_tok_s,step_base_ms,"
        "step_per_seq_ms' (as printed by a previous run)",
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="compare planner variants and the HPA-like policy over --compare-traces x "
        "--compare-seeds (a row per day, held-out days marked, a summary per group)",
    )
    ap.add_argument("--compare-traces", default=",".join(TRACES), help="with --compare")
    ap.add_argument("--compare-seeds", default="0,1,2,3,4,5,6,7,8,9", help="with --compare")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="with --compare: one more planner variant, PlannerConfig fields as JSON "
        "(e.g. 'k2={\"queue_variability\": 2.0}'); repeatable",
    )
    return ap


@dataclass(slots=True)
class Day:
    """One simulated day and what every policy on it shares: the trace, the SLO, the
    fleet settings, the static fleets run so far, the static-peak size (the fewest fixed
    replicas holding the SLO for >= 99% of requests) and the planner's configuration."""

    trace: list[Request]
    rate: Callable[[float], float]
    bursts: list[tuple[float, float]]
    duration: float
    cost: EngineCost
    cfg: SimConfig
    ttft_s: float
    tpot_s: float
    peak_rate: float
    hi: int
    planner_cfg: PlannerConfig
    static: dict[int, Result] = field(default_factory=dict)
    peak_n: int = 0
    mean_n: int = 0

    def run(self, policy: Policy, initial: int) -> Result:
        return simulate(self.trace, self.rate, self.duration, self.cost, self.cfg, initial, policy)

    def static_run(self, k: int) -> Result:
        if k not in self.static:
            self.static[k] = self.run(static_policy, k)
        return self.static[k]


def setup_day(
    trace_name: str, seed: int, duration: float, cost: EngineCost, args: argparse.Namespace
) -> Day:
    """The day ``trace_name``/``seed`` at ``args.peak_replicas`` replicas' peak load, its
    SLO from the engine's cost, its static-peak and static-mean sizes, the planner's
    configuration (what a user sets from a measurement like this one)."""
    make_day = TRACES[trace_name]
    sizing_batch = 16
    # SLO: TPOT of a replica running `sizing_batch` plus a prefill chunk's share; TTFT a
    # few mean prompts' prefill time (both from the measurement, so the machine cancels).
    probe, _, _ = make_day(600.0, 1.0, seed)
    tpot_s = 1.6 * cost.step(sizing_batch, 128)
    long_prompt = sorted(r.prompt for r in probe)[int(0.95 * (len(probe) - 1))]
    ttft_s = 2.5 * (long_prompt / cost.prefill_tok_s + cost.step(sizing_batch))
    peak_rate = args.peak_replicas * per_replica_rate(cost, probe, sizing_batch)
    trace, rate, bursts = make_day(duration, peak_rate, seed)
    # Slices short against a step, decisions every 10 s, 30 s start-up (all simulated time).
    dt = min(0.5, max(0.05, cost.step(sizing_batch) / 2))
    cfg = SimConfig(ttft_s=ttft_s, tpot_s=tpot_s, dt=dt)
    hi = 4 * math.ceil(args.peak_replicas)
    # Decode capacity at the SLO: the largest batch whose step (with a prefill chunk's share)
    # stays within the TPOT target, at most max_num_seqs.
    decode_batch = max(
        1,
        min(
            cfg.max_num_seqs,
            int((tpot_s / 1.25 - cost.step(0, 128)) / cost.step_per_seq_s),
        ),
    )
    planner_cfg = PlannerConfig(
        role="unified",
        min_replicas=1,
        max_replicas=hi,
        ttft_s=ttft_s,
        tpot_s=tpot_s,
        max_num_seqs=cfg.max_num_seqs,
        target_utilization=args.target_utilization,
        scale_up_window_s=0.0,
        scale_down_window_s=cfg.down_window_s,
        max_step_up=4,
        max_step_down=1,
        observation_window_s=cfg.rate_window_s,
        startup_s=cfg.startup_s,  # spec autoscaling.replicaStartupSeconds
        # What a user sets from a measurement like this one (spec autoscaling
        # prefillTokensPerSecond / decodeTokensPerSecond); the planner corrects it.
        prefill_capacity_hint=cost.prefill_tok_s,
        decode_capacity_hint=decode_batch / cost.step(decode_batch),
    )
    day = Day(trace, rate, bursts, duration, cost, cfg, ttft_s, tpot_s, peak_rate, hi, planner_cfg)
    # Static at peak: the fewest fixed replicas that hold the SLO for >= 99% of requests
    # (binary search; attainment grows with replicas).
    lo_n, hi_n = 1, hi
    while lo_n < hi_n:
        mid = (lo_n + hi_n) // 2
        if day.static_run(mid).attainment >= 0.99:
            hi_n = mid
        else:
            lo_n = mid + 1
    day.peak_n = lo_n
    day.static_run(lo_n)
    mean_rate = statistics.fmean(rate(t) for t in range(int(duration)))
    day.mean_n = max(1, round(lo_n * mean_rate / peak_rate))
    return day


# Days some planner setting was ever chosen on (sessions 3-9); every other day is held out.
TUNED_DAYS = {"synthetic": range(5), AZURE_CONV: range(5)}
# The variants --compare runs by default: the planner as configured, and the scale-up rule
# it replaced (no scale-up at all while a replica starts; sessions 1-9).
COMPARE_VARIANTS: dict[str, dict[str, Any]] = {
    "planner": {},
    "wait-while-starting": {"count_starting": False},
}


def held_out(trace_name: str, seed: int) -> bool:
    return seed not in TUNED_DAYS.get(trace_name, ())


def compare(args: argparse.Namespace, cost: EngineCost, duration: float) -> None:
    """--compare: the planner's variants (PlannerConfig fields changed) and the HPA-like
    policy on every trace x seed asked for, each day as the single run sizes it (static
    peak by search, the planner's configuration); prints a row per day, a summary per
    (trace, tuned / held-out) group and the JSON as the last line. Deterministic for a
    replayed --engine-cost."""
    variants = dict(COMPARE_VARIANTS)
    for spec in args.variant:
        name, _, over = spec.partition("=")
        variants[name] = json.loads(over or "{}")
    traces = args.compare_traces.split(",")
    seeds = [int(x) for x in args.compare_seeds.split(",")]
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in (*variants, "hpa")}
    print("| day | " + " | ".join((*variants, "HPA-like")) + " |")
    print("| --- " * (len(variants) + 2) + "|")
    for trace_name in traces:
        for seed in seeds:
            day = setup_day(trace_name, seed, duration, cost, args)
            peak_h = day.static[day.peak_n].replica_hours
            key = f"{trace_name}/{seed}"
            res = {
                name: day.run(planner_policy(replace(day.planner_cfg, **over)), day.mean_n)
                for name, over in variants.items()
            }
            res["hpa"] = day.run(
                hpa_policy(1, day.hi, day.cfg.max_num_seqs, day.cfg.down_window_s), day.mean_n
            )
            for name, r in res.items():
                runs[name][key] = [round(r.attainment, 4), round(r.replica_hours / peak_h, 4)]
            mark = " (held out)" if held_out(trace_name, seed) else ""
            cells = " | ".join(f"{a:.3f} / {f:.3f}" for a, f in (runs[n][key] for n in res))
            print(f"| {key}{mark} | {cells} |", flush=True)
    summary: dict[str, dict[str, str]] = {}
    groups: dict[str, list[str]] = {}
    for key in runs["hpa"]:
        trace_name, seed = key.split("/")
        group = f"{trace_name} {'held out' if held_out(trace_name, int(seed)) else 'tuned'}"
        groups.setdefault(group, []).append(key)
    print("\nper group: lowest attainment, runs below 0.95; mean fraction of static-peak "
          "replica-hours; runs above the HPA-like policy's hours")  # fmt: skip
    print("| variant | " + " | ".join(f"{g} ({len(k)})" for g, k in groups.items()) + " |")
    print("| --- " * (len(groups) + 1) + "|")
    for name in runs:
        cells = []
        for group, keys in groups.items():
            vals = [runs[name][k] for k in keys]
            low = min(a for a, _ in vals)
            below = sum(a < 0.95 for a, _ in vals)
            mean = statistics.fmean(f for _, f in vals)
            above = sum(f > runs["hpa"][k][1] for k, (_, f) in zip(keys, vals, strict=True))
            cells.append(f"{low:.3f}, {below} < 0.95; {mean:.3f}; {above}")
            summary.setdefault(name, {})[group] = cells[-1]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(json.dumps({"compare_runs": runs, "compare_summary": summary, "variants": variants}))


def main() -> None:
    args = parser().parse_args()
    t_start = time.perf_counter()

    if args.engine_cost:
        p_tok, base_ms, per_ms = (float(x) for x in args.engine_cost.split(","))
        cost = EngineCost(p_tok, base_ms / 1000, per_ms / 1000)
        measured: dict[str, Any] = {"replayed": args.engine_cost}
    else:
        cost, measured = measure_engine(args.quick)
    t_measure = time.perf_counter() - t_start
    duration = args.day_seconds or (1800.0 if args.quick else 5400.0)
    if args.compare:
        compare(args, cost, duration)
        return
    day = setup_day(args.trace, args.seed, duration, cost, args)
    trace, rate, bursts, cfg = day.trace, day.rate, day.bursts, day.cfg
    ttft_s, tpot_s, peak_rate, hi = day.ttft_s, day.tpot_s, day.peak_rate, day.hi
    static, peak_n, mean_n, planner_cfg = day.static, day.peak_n, day.mean_n, day.planner_cfg
    static_mean = day.static_run(mean_n)

    def run(policy: Policy, initial: int) -> Result:
        return simulate(trace, rate, duration, cost, cfg, initial, policy)

    # The bound: a perfect oracle at the capacity n_peak replicas have at the SLO with the
    # target's attainment (per replica; smaller fleets pool less, so this is optimistic).
    end = duration + max(120.0, 3 * (ttft_s + 100 * tpot_s))
    fleet_cap = capacity_at_slo(cost, cfg, peak_n, 0.95, peak_rate, args.quick, args.trace)
    per_replica = fleet_cap / peak_n
    oracle_h = oracle_replica_hours(rate, duration, end, per_replica, 1)

    def oracle_count(t: float) -> int:
        s = int(t)
        return max(1, math.ceil(rate(s + 0.5) / per_replica - 1e-9) if s < duration else 1)

    ledger = Ledger(oracle_count)
    planner_run = simulate(
        trace, rate, duration, cost, cfg, mean_n, planner_policy(planner_cfg, ledger), ledger
    )
    results = {
        f"static-peak ({peak_n})": static[peak_n],
        f"static-mean ({mean_n})": static_mean,
        "hpa": run(hpa_policy(1, hi, cfg.max_num_seqs, cfg.down_window_s), mean_n),
        "planner": planner_run,
    }
    assert planner_run.met is not None
    breakdown = ledger.summary()
    misses = ledger.misses(planner_run.requests, planner_run.met, bursts)
    unhinted = run(
        planner_policy(replace(planner_cfg, prefill_capacity_hint=None, decode_capacity_hint=None)),
        mean_n,
    )
    # The same planner blind to the gateway's arrivals (the A/B of the leading signal).
    no_gateway = simulate(
        trace,
        rate,
        duration,
        cost,
        replace(cfg, gateway_signal=False),
        mean_n,
        planner_policy(planner_cfg),
    )
    # A clairvoyant rate-follower: the fleet the oracle's capacity asks for at the rate
    # one start-up ahead (the most over the next interval), times a headroom, simulated
    # like any policy (start-up, drain, queues). It knows the trace's rate function,
    # bursts included, and no request's size: the lowest headroom at which it reaches
    # 0.95 shows what replica-hours the attainment target costs on this trace.
    clairvoyant: dict[float, Result] = {}
    for head in (1.0, 1.1, 1.2, 1.3):
        clairvoyant[head] = run(clairvoyant_policy(rate, duration, per_replica / head, cfg), mean_n)
        if clairvoyant[head].attainment >= 0.95:
            break
    peak_h = static[peak_n].replica_hours
    planner, hpa = results["planner"], results["hpa"]
    load = os.getloadavg()[0]
    if args.plot is not None:
        plot(
            results,
            args.plot,
            f"bench/autoscale.py{' --quick' if args.quick else ''} --trace {args.trace}: "
            f"bench model (load avg {load:.1f})",
        )
    bound = work_lower_bound(trace, cost, cfg.max_num_seqs, 0.95)
    print(f"engine: {measured} (measured in {t_measure:.1f}s)")
    print(
        f"SLO: TTFT {ttft_s * 1000:.0f} ms, TPOT {tpot_s * 1000:.1f} ms (p95 per request); "
        f"trace: {len(trace)} requests over {duration:.0f}s, peak {peak_rate:.2f} req/s"
    )
    print(f"{'policy':<18} {'SLO attain':>10} {'replica-h':>10} {'frac of peak':>12} "
          f"{'TTFT p95':>9} {'TPOT p95':>9}")  # fmt: skip
    extra = [
        ("planner (no hint)", unhinted),
        ("planner (no gw)", no_gateway),
        *((f"clairvoyant x{h:.1f}", r) for h, r in clairvoyant.items()),
    ]
    for name, res in [*results.items(), *extra]:
        print(
            f"{name:<18} {res.attainment:>10.3f} {res.replica_hours:>10.3f} "
            f"{res.replica_hours / peak_h:>12.2f} {res.ttft_p95 * 1000:>8.0f}ms "
            f"{res.tpot_p95 * 1000:>8.1f}ms"
        )
    print(
        f"oracle (integer replicas at {fleet_cap / peak_n:.2f} req/s each, the SLO capacity of "
        f"{peak_n} replicas at 95% attainment; no start-up, no forecast error): "
        f"{oracle_h:.3f} replica-h = {oracle_h / peak_h:.2f} of static-peak"
    )
    print(
        "planner's replica-hours against the oracle's (h): "
        + ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items())
    )
    print(f"planner's missed requests by the fleet at their arrival: {misses}")
    print(
        f"work bound (any policy at 95% attainment, free start-up, the 5% costliest "
        f"requests dropped): {bound.hours:.3f} replica-h = {bound.hours / peak_h:.2f} of "
        f"static-peak (all requests' work {bound.total_work / peak_h:.2f})"
    )
    print(f"plot: {args.plot or 'none (--plot PATH)'}")
    out = {
        "planner_slo_attainment": round(planner.attainment, 4),
        "planner_replica_hours_frac_of_peak": round(planner.replica_hours / peak_h, 4),
        "hpa_slo_attainment": round(hpa.attainment, 4),
        "hpa_replica_hours_frac_of_peak": round(hpa.replica_hours / peak_h, 4),
        "static_mean_slo_attainment": round(static_mean.attainment, 4),
        "static_peak_slo_attainment": round(static[peak_n].attainment, 4),
        "static_peak_replicas": peak_n,
        "static_mean_replicas": mean_n,
        "planner_unhinted_slo_attainment": round(unhinted.attainment, 4),
        "planner_unhinted_replica_hours_frac_of_peak": round(unhinted.replica_hours / peak_h, 4),
        "planner_no_gateway_slo_attainment": round(no_gateway.attainment, 4),
        "planner_no_gateway_replica_hours_frac_of_peak": round(
            no_gateway.replica_hours / peak_h, 4
        ),
        "clairvoyant": {
            f"x{h:.1f}": [round(r.attainment, 4), round(r.replica_hours / peak_h, 4)]
            for h, r in clairvoyant.items()
        },
        "ratio_planner_vs_static_peak_replica_hours": round(planner.replica_hours / peak_h, 4),
        "oracle_replica_hours_frac_of_peak": round(oracle_h / peak_h, 4),
        "work_bound_replica_hours_frac_of_peak": round(bound.hours / peak_h, 4),
        "capacity_at_slo_req_s_per_replica": round(fleet_cap / peak_n, 3),
        "planner_replica_hours_frac_of_oracle": round(planner.replica_hours / oracle_h, 4),
        "planner_breakdown_replica_hours": breakdown,
        "planner_misses_by_fleet": misses,
        "engine": measured,
        "ttft_slo_ms": round(ttft_s * 1000, 1),
        "tpot_slo_ms": round(tpot_s * 1000, 2),
        "requests": len(trace),
        "load_avg_1m": round(load, 2),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    out["trace"] = args.trace
    out["day_seconds"] = duration
    if args.trace != "synthetic":
        suffix = "_" + args.trace.replace("-", "_")
        keep = {"engine", "load_avg_1m", "wall_s", "trace", "day_seconds"}
        out = {(k if k in keep else k + suffix): v for k, v in out.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
