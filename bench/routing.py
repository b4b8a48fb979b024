"""Cache-aware routing vs the peer routers, round robin and least load, on two workloads.

    .venv/bin/python bench/routing.py --quick

A real fleet: 4 daemons + real Redis, all started by pagefleet's LocalFleet, on the 4x512
Llama of bench/throughput.py (`--model bench`, the default): a model whose prefill, not the
fixed per-request path, sets TTFT, as on a real model and GPU.

Front doors, each over the same daemons and the same trace (`--quick`: cache_aware and
sglang-router on both shapes, 32 requests each; every door starts beside the daemons'
start-up): pagefleet's gateway
(cache_aware, round_robin, least_load) and the peer routers from PyPI, sglang-router and
vllm-router, each with its cache-aware policy at its defaults (`pip install '.[bench]'`; a
peer that is not installed is skipped and its keys are null). Before every run every
daemon's prefix cache is reset (POST /reset_prefix_cache), so each front door starts cold
on identical prompts; every door is a fresh process per workload shape.

Two workload shapes, 8 closed-loop conversations in flight:
- `chat`: multi-tenant chat, Zipf tenants, ~1200-token system prompts, 1-4 turns.
- `agentic` (keys with an `_agentic` suffix): tool loops of 2-6 turns, each turn adding a
  call and a tool result, the next turn sent `--think-ms` after the answer; a few tenants
  at the start, the others appear mid-run with a burst of conversations each.

Each daemon's KV pool is sized below the chat trace's prefix working set while the fleet's
total is above it (1/3 of the working set per daemon; sizes printed), the regime where
routing decides the hit rate. Per-pod shares, prefix hits and evictions come from the
daemons' own /metrics, the same way for every door. `ideal_hit_rate` is one unbounded cache
replaying the trace in order. A last run sends one identical prompt many times through the
cache_aware gateway (`max_pod_share_single_prompt`). `gateway_overhead_ms_*` is the
gateway's own time per request (parse, tokenize, index lookup, rank, and relaying the first
chunk), from its `pagefleet_gateway_overhead_seconds` histogram, with the trace's prompts
sent one at a time after the runs (`--quick`: after the chat run only). Where each
request's TTFT went (`ttft_breakdown`: the front door's hop in and out, the daemon's
HTTP layer, queue and prefill, per door, hits and misses) comes from the daemons'
`--request-log` joined to the client's stamps (bench/ttft_breakdown.py; `--dump` writes
every request's parts). `cpu_s` is the user + system CPU seconds each door's processes, the
daemons (with their engine processes), Redis and this client used over each run
(/proc/<pid>/stat by process group): what a front door takes from daemons sharing its cores.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from ttft_breakdown import PARTS as TTFT_PARTS
from ttft_breakdown import join as join_trace
from ttft_breakdown import read_trace
from ttft_breakdown import summarize as summarize_trace

from pagefleet.api.openai import ChatCompletionRequest
from pagefleet.dev.loadgen import RequestResult, run_workload, summarize, trim
from pagefleet.dev.local_fleet import Child, FleetSpec, LocalFleet
from pagefleet.dev.peer_routers import PEERS, peer_version, spawn_peer, wait_peer_ready
from pagefleet.dev.workload import (
    AgenticSpec,
    Conversation,
    WorkloadSpec,
    build_agentic,
    build_conversations,
    flatten,
    ideal_hit_rate,
    single_prompt_trace,
)
from pagefleet.gateway.prompts import PromptTokenizer
from pagefleet.kvindex.hashing import block_hashes

OURS = ("cache_aware", "round_robin", "least_load")
# Two cache_aware gateway replicas, conversations alternating between them: what a replica
# loses by remembering only its own recent placements (docs/gateway.md).
REPLICATED = "cache_aware_x2"
# The same two replicas, each with only its own placements (--no-shared-placements).
REPLICATED_OWN = "cache_aware_x2_own"
# The cache_aware gateway of another checkout (``--base-pythonpath``): an A/B of two
# versions of the gateway on the same daemons, trace and load, in one process.
BASE = "cache_aware_base"
DOORS = ("cache_aware", "sglang", "vllm_router", "round_robin", "least_load")
BLOCK = 16


def _token_ids(tok: PromptTokenizer, convs: list[Conversation]) -> dict[tuple[int, int], list[int]]:
    return {
        (t.conversation, t.index): tok.chat_ids(
            ChatCompletionRequest(model="m", messages=t.as_openai())
        )
        for t in flatten(convs)
    }


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str) -> None:
    req = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


_SCRAPED = {
    "vllm:request_success": "requests",
    "vllm:prefix_cache_hits": "hit_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
    "pagefleet:kv_cache_evictions": "evictions",
}


def scrape(url: str) -> dict[str, float]:
    """A daemon's counters this bench compares across doors (summed over label sets)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(_SCRAPED.values(), 0.0)
    for fam in text_string_to_metric_families(text):
        key = _SCRAPED.get(fam.name)
        if key is None:
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[key] += s.value
    return out


def placements(url: str) -> dict[str, int]:
    """A pagefleet gateway's requests by placement and reason ("best_prefix/cache_aware":
    n), from its ``pagefleet_gateway_placements`` counter; {} for a peer router."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return {}
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "pagefleet_gateway_placements":
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                key = f"{s.labels['placement']}/{s.labels['reason']}"
                out[key] = out.get(key, 0) + int(s.value)
    return out


def histogram_buckets(url: str, name: str) -> Counter[float]:
    """Cumulative bucket counts (le -> count) of one histogram summed over its label sets."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    buckets: Counter[float] = Counter()
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == name + "_bucket":
                buckets[float(s.labels["le"])] += s.value
    return buckets


def quantiles(buckets: Counter[float], qs: tuple[float, ...]) -> dict[float, float | None]:
    """Quantiles of cumulative buckets, linear inside a bucket (Prometheus'
    histogram_quantile)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    out: dict[float, float | None] = {}
    for q in qs:
        if total <= 0:
            out[q] = None
            continue
        rank, prev_b, prev_c = q * total, 0.0, 0.0
        for b in bounds:
            c = buckets[b]
            if c >= rank:
                if b == float("inf"):
                    out[q] = prev_b
                else:
                    frac = (rank - prev_c) / (c - prev_c) if c > prev_c else 1.0
                    out[q] = prev_b + (b - prev_b) * frac
                break
            prev_b, prev_c = b, c
    return out


OVERHEAD = "pagefleet_gateway_overhead_seconds"


def overhead_probe(
    gateway_url: str, model: str, convs: list[Conversation]
) -> dict[float, float | None]:
    """The gateway's own time per request with nothing else in flight through it: the
    trace's prompts one at a time, quantiles of the histogram's delta."""
    before = histogram_buckets(gateway_url, OVERHEAD)
    asyncio.run(run_workload(gateway_url, model, convs, 1, progress=False))
    after = histogram_buckets(gateway_url, OVERHEAD)
    return quantiles(Counter({b: after[b] - before.get(b, 0.0) for b in after}), (0.5, 0.99))


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pgids: set[int]) -> dict[int, float]:
    """User + system CPU seconds of the live processes of each process group in ``pgids``
    (every Child is a group: the router or daemon and what it forked, e.g. a daemon's
    engine process), from /proc/<pid>/stat."""
    out = dict.fromkeys(pgids, 0.0)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the command's closing paren (the command may hold spaces).
        rest = stat[stat.rindex(b")") + 2 :].split()
        if int(rest[2]) in out:
            out[int(rest[2])] += (int(rest[11]) + int(rest[12])) / _TICK
    return out


def reachable(
    results: list[RequestResult], ids: dict[tuple[int, int], list[int]], namespace: str
) -> list[tuple[RequestResult, int, int]]:
    """Successful requests in send order, each with ``(ideal, done)`` in blocks: the leading
    blocks it shares with any request sent before it, and with one that had already
    *finished* when it was sent (its KV surely existed somewhere)."""
    ok = sorted((r for r in results if r.ok), key=lambda r: r.start)
    sent: list[tuple[RequestResult, list[int]]] = []
    out: list[tuple[RequestResult, int, int]] = []
    for r in ok:
        keys = block_hashes(ids[(r.conversation, r.turn)], BLOCK, namespace)
        ideal = done = 0
        for prev, pkeys in sent:
            n = 0
            while n < min(len(keys), len(pkeys)) and keys[n] == pkeys[n]:
                n += 1
            ideal = max(ideal, n)
            if prev.start + prev.e2e <= r.start:
                done = max(done, n)
        sent.append((r, keys))
        out.append((r, ideal, done))
    return out


def miss_breakdown(
    results: list[RequestResult], ids: dict[tuple[int, int], list[int]], namespace: str
) -> dict[str, Any]:
    """Where hit tokens went, against what a single unbounded cache would have hit.

    Per request (``reachable``): lost tokens split into: the prefix was only in flight
    elsewhere (``lost_inflight``: no router could have served it from cache, but could
    have placed it with its twin), and the prefix was finished somewhere but this request
    did not hit it (``lost_done``: placement or eviction). ``blind`` counts requests whose
    router predicted fewer blocks than ``done`` (only pagefleet's gateway reports a
    prediction).
    """
    lost_inflight = lost_done = blind = predicted_n = 0
    rows = reachable(results, ids, namespace)
    for r, ideal, done in rows:
        cap = max(r.prompt_tokens - 1, 0)
        cached = r.cached_tokens
        lost_done += max(0, min(done * BLOCK, cap) - cached)
        lost_inflight += max(0, min(ideal * BLOCK, cap) - max(cached, min(done * BLOCK, cap)))
        if r.predicted_hit >= 0:
            predicted_n += 1
            if r.predicted_hit < min(done * BLOCK, cap) and done > 0:
                blind += 1
    prompt = sum(r.prompt_tokens for r, _, _ in rows) or 1
    return {
        "lost_frac_done": round(lost_done / prompt, 4),
        "lost_frac_inflight": round(lost_inflight / prompt, 4),
        "blind_requests": blind if predicted_n else None,
    }


def moved_turns(results: list[RequestResult]) -> int | None:
    """Turns sent to another pod than their conversation's previous turn (None: the door
    does not name the pod it chose; only pagefleet's gateway does)."""
    by_conv: dict[int, list[RequestResult]] = {}
    for r in results:
        if r.ok:
            by_conv.setdefault(r.conversation, []).append(r)
    if not any(r.pod for rs in by_conv.values() for r in rs):
        return None
    moved = 0
    for rs in by_conv.values():
        rs.sort(key=lambda r: r.turn)
        moved += sum(1 for a, b in itertools.pairwise(rs) if a.pod != b.pod)
    return moved


def write_dump(
    path: Path,
    shape: str,
    door: str,
    results: list[RequestResult],
    ids: dict[tuple[int, int], list[int]],
    namespace: str,
    trace_rows: list[dict[str, Any]] | None = None,
) -> None:
    """One JSON line per request (appended): where it went, what it hit, what it could
    have hit, its TTFT and where the TTFT went (bench/ttft_breakdown.py); the raw material
    of the per-request analysis in docs."""
    rows = reachable(results, ids, namespace)
    t0 = min((r.start for r, _, _ in rows), default=0.0)
    parts = {(t["conv"], t["turn"]): t for t in trace_rows or []}
    with path.open("a") as f:
        for r, ideal, done in rows:
            t = parts.get((r.conversation, r.turn), {})
            f.write(
                json.dumps(
                    {
                        "shape": shape,
                        "door": door,
                        "conv": r.conversation,
                        "turn": r.turn,
                        "tenant": r.tenant,
                        "pod": r.pod,
                        "start_ms": round((r.start - t0) * 1000, 1),
                        "ttft_ms": round(r.ttft * 1000, 1),
                        "e2e_ms": round(r.e2e * 1000, 1),
                        "prompt": r.prompt_tokens,
                        "cached": r.cached_tokens,
                        "predicted": r.predicted_hit,
                        "route": r.route,
                        "ideal": min(ideal * BLOCK, max(r.prompt_tokens - 1, 0)),
                        "done": min(done * BLOCK, max(r.prompt_tokens - 1, 0)),
                        "daemon_pod": t.get("pod"),
                        **{
                            k: round(t[k], 1)
                            for k in (*TTFT_PARTS, "ahead", "co_prefill")
                            if k in t
                        },
                    }
                )
                + "\n"
            )


class Bench:
    def __init__(self, fleet: LocalFleet, args: argparse.Namespace) -> None:
        self.fleet = fleet
        self.args = args
        self.children: list[Child] = []
        self._ours: list[Child] = []
        self._last: list[dict[str, float]] | None = None
        # Every daemon's --request-log (one file), read from where the last run left it.
        self.trace_path = fleet.log_dir / "requests.jsonl"
        self._trace_pos = 0

    def spawn_doors(self, shapes: list[str]) -> dict[str, dict[str, list[Child]]]:
        """Fresh processes for every door of every shape, all started at once (no router
        remembers another shape's run; none pays another's start-up); not waited for."""
        doors: dict[str, dict[str, list[Child]]] = {}
        ours: list[Child] = []
        for shape in shapes:
            doors[shape] = {}
            for name in self.args.doors if shape == "chat" else self.args.agentic_doors:
                if name in OURS:
                    gw = self.fleet.spawn_gateway(name, name=f"gateway-{name}-{shape}")
                    doors[shape][name] = [gw]
                elif name == BASE:
                    if not self.args.base_pythonpath:
                        raise SystemExit(f"door {BASE} needs --base-pythonpath DIR")
                    doors[shape][name] = [
                        self.fleet.spawn_gateway(
                            "cache_aware",
                            name=f"gateway-base-{shape}",
                            # PYTHONSAFEPATH: `python -m` must not put the working
                            # directory (this checkout) ahead of the other one.
                            env={
                                "PYTHONPATH": self.args.base_pythonpath,
                                "PYTHONSAFEPATH": "1",
                            },
                        )
                    ]
                elif name in (REPLICATED, REPLICATED_OWN):
                    own = ["--no-shared-placements"] if name == REPLICATED_OWN else []
                    doors[shape][name] = [
                        self.fleet.spawn_gateway(
                            "cache_aware", name=f"gateway-{name}-{i}-{shape}", args=own
                        )
                        for i in range(2)
                    ]
                elif peer_version(name) is not None:
                    doors[shape][name] = [
                        spawn_peer(name, self.fleet.daemon_urls, self.fleet.log_dir, tag=shape)
                    ]
                    continue
                else:
                    continue
                ours += doors[shape][name]
        self.children += [c for by_name in doors.values() for cs in by_name.values() for c in cs]
        self._ours = ours
        return doors

    def wait_doors(self) -> None:
        """Block until every door started by :meth:`spawn_doors` answers."""
        self.fleet.wait_ready(self._ours)
        for c in self.children:
            if c not in self._ours:
                wait_peer_ready(c, self.fleet.served_model_name)

    def reset_caches(self) -> None:
        for url in self.fleet.daemon_urls:
            _post(url + "/reset_prefix_cache")

    def settled(self, before: list[dict[str, float]], ok: int) -> list[dict[str, float]]:
        """The daemons' counters once they count every one of ``ok`` successes (their
        last engine step's snapshot can trail the stream's end by a moment), at most 3 s."""
        deadline = time.monotonic() + 3.0
        while True:
            after = [scrape(u) for u in self.fleet.daemon_urls]
            done = sum(a["requests"] - b["requests"] for a, b in zip(after, before, strict=True))
            if done >= ok or time.monotonic() > deadline:
                self._last = after
                return after
            time.sleep(0.05)

    def forget_counters(self) -> None:
        """Traffic outside :meth:`run` went to the daemons: the next run scrapes afresh."""
        self._last = None

    def run(
        self,
        door: list[Child],
        convs: list[Conversation],
        think_s: float = 0.0,
        ids: dict[tuple[int, int], list[int]] | None = None,
    ) -> tuple[dict[str, Any], list[RequestResult]]:
        self.reset_caches()
        before = self._last or [scrape(u) for u in self.fleet.daemon_urls]
        _, self._trace_pos = read_trace(self.trace_path, self._trace_pos)
        n = len(door)
        # CPU by process group over the run: the door, the daemons, Redis, this client.
        groups = {
            "door": {c.proc.pid for c in door if c.proc},
            "daemons": {c.proc.pid for c in self.fleet.daemons if c.proc},
        }
        # A LocalRedis is spawned as its own group too (pagefleet.dev.process.spawn).
        redis_proc = getattr(getattr(self.fleet, "_redis", None), "_proc", None)
        if redis_proc is not None:
            groups["redis"] = {redis_proc.pid}
        every = set().union(*groups.values())
        cpu0, client0 = cpu_s(every), time.process_time()

        async def drive() -> tuple[list[RequestResult], float]:
            # Replicas: conversation i through replica i % n, the concurrency split evenly.
            parts = await asyncio.gather(
                *(
                    run_workload(
                        d.url,
                        self.fleet.served_model_name,
                        convs[i::n],
                        max(1, self.args.concurrency // n),
                        progress=False,
                        seed=self.args.seed,
                        think_s=think_s,
                    )
                    for i, d in enumerate(door)
                )
            )
            return [r for res, _ in parts for r in res], max(w for _, w in parts)

        results, wall = asyncio.run(drive())
        cpu1, client1 = cpu_s(every), time.process_time()
        after = self.settled(before, sum(1 for r in results if r.ok))
        report = summarize(results, wall)
        delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
        served = sum(d["requests"] for d in delta) or 1.0
        report["pod_share"] = [round(d["requests"] / served, 3) for d in delta]
        report["max_pod_share"] = max(report["pod_share"])
        report["evictions_per_pod"] = [int(d["evictions"]) for d in delta]
        report["cpu_s"] = {
            name: round(sum(cpu1[g] - cpu0[g] for g in gs), 2) for name, gs in groups.items()
        } | {"client": round(client1 - client0, 2)}
        if ids is not None:
            report.update(miss_breakdown(results, ids, self.fleet.namespace))
            trace, self._trace_pos = read_trace(self.trace_path, self._trace_pos)
            rows = join_trace(results, ids, trace)
            report["ttft_breakdown"] = summarize_trace(rows)
            report["_trace_rows"] = rows
        report["moved_turns"] = moved_turns(results)
        if any(d in self._ours for d in door):
            total: Counter[str] = Counter()
            for d in door:
                total.update(placements(d.url))
            report["placements"] = dict(sorted(total.items()))
        return report, results


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def shape_keys(reports: dict[str, dict[str, Any]], ideal: float, suffix: str) -> dict[str, Any]:
    """The issue's comparison keys for one shape (``suffix`` "" or "_agentic")."""

    def get(door: str, key: str) -> Any:
        return reports[door][key] if door in reports else None

    ca_hit, ca_p50 = get("cache_aware", "prefix_hit_rate"), get("cache_aware", "ttft_ms_p50")
    # A peer whose every request failed (ttft None) has no figures to compare.
    peers = [p for p in PEERS if p in reports and reports[p]["ttft_ms_p50"] is not None]
    best_hit = max((reports[p]["prefix_hit_rate"] for p in peers), default=None)
    best_p50 = min((reports[p]["ttft_ms_p50"] for p in peers), default=None)
    best_p99 = min((reports[p]["ttft_ms_p99"] for p in peers), default=None)
    out = {
        "ideal_hit_rate": round(ideal, 4),
        "cache_aware_hit_rate": ca_hit,
        "sglang_hit_rate": get("sglang", "prefix_hit_rate"),
        "vllm_router_hit_rate": get("vllm_router", "prefix_hit_rate"),
        "round_robin_hit_rate": get("round_robin", "prefix_hit_rate"),
        "least_load_hit_rate": get("least_load", "prefix_hit_rate"),
        "cache_aware_frac_of_ideal": round(ca_hit / ideal, 4) if ca_hit and ideal else None,
        "ttft_p50_ms_cache_aware": ca_p50,
        "ttft_p50_ms_sglang": get("sglang", "ttft_ms_p50"),
        "ttft_p50_ms_vllm_router": get("vllm_router", "ttft_ms_p50"),
        "ttft_p50_ms_round_robin": get("round_robin", "ttft_ms_p50"),
        "ttft_p50_ms_least_load": get("least_load", "ttft_ms_p50"),
        "ttft_p99_ms_cache_aware": get("cache_aware", "ttft_ms_p99"),
        "ttft_p99_ms_best_peer": best_p99,
        "ttft_p50_ratio_best_peer_over_ca": _ratio(best_p50, ca_p50),
        "ttft_p99_ratio_best_peer_over_ca": _ratio(best_p99, get("cache_aware", "ttft_ms_p99")),
        "hit_rate_minus_best_peer": round(ca_hit - best_hit, 4)
        if ca_hit is not None and best_hit is not None
        else None,
        # The most any router could lead the best peer by: the single unbounded cache's
        # rate (ideal_hit_rate, the ceiling) minus the peer's. Below 0.02, the target
        # hit_rate_minus_best_peer >= 0.02 cannot be met on this trace by anyone.
        "ceiling_minus_best_peer": round(ideal - best_hit, 4) if best_hit is not None else None,
        "ttft_p50_ratio_rr_over_ca": _ratio(get("round_robin", "ttft_ms_p50"), ca_p50),
        "ttft_mean_ratio_rr_over_ca": _ratio(
            get("round_robin", "ttft_ms_mean"), get("cache_aware", "ttft_ms_mean")
        ),
        "max_pod_share": {d: r["max_pod_share"] for d, r in reports.items()},
        "evictions": {d: sum(r["evictions_per_pod"]) for d, r in reports.items()},
        "cpu_s": {d: r["cpu_s"] for d, r in reports.items()},
        "ttft_breakdown": {d: r.get("ttft_breakdown") for d, r in reports.items()},
        "lost_frac_inflight": {d: r.get("lost_frac_inflight") for d, r in reports.items()},
        "lost_frac_done": {d: r.get("lost_frac_done") for d, r in reports.items()},
        "blind_requests_cache_aware": get("cache_aware", "blind_requests"),
        "moved_turns_cache_aware": get("cache_aware", "moved_turns"),
        "placements_cache_aware": reports.get("cache_aware", {}).get("placements"),
        "cache_aware_x2_hit_rate": get(REPLICATED, "prefix_hit_rate"),
        "cache_aware_x2_own_hit_rate": get(REPLICATED_OWN, "prefix_hit_rate"),
        "ttft_p50_ms_cache_aware_x2_own": get(REPLICATED_OWN, "ttft_ms_p50"),
        "cache_aware_base_hit_rate": get(BASE, "prefix_hit_rate"),
        "ttft_p50_ms_cache_aware_base": get(BASE, "ttft_ms_p50"),
        "ttft_p50_ms_cache_aware_x2": get(REPLICATED, "ttft_ms_p50"),
        "failed": sum(r["failed"] for r in reports.values()),
    }
    return {k + suffix: v for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small traces, under ~60 s")
    ap.add_argument("--daemons", type=int, default=4)
    ap.add_argument("--requests", type=int, default=None, help="chat turns per door")
    ap.add_argument("--agentic-requests", type=int, default=None, help="agentic turns per door")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--doors",
        default=None,
        help="front doors on the chat shape: "
        + ", ".join((*DOORS, REPLICATED, REPLICATED_OWN, BASE))
        + " (default: all but the last three; with "
        "--quick, cache_aware and sglang-router)",
    )
    ap.add_argument(
        "--agentic-doors",
        default=None,
        help="front doors on the agentic shape (default: all; with --quick, cache_aware and "
        "sglang-router)",
    )
    ap.add_argument(
        "--shapes", default="chat,agentic", help="workload shapes: chat, agentic (or one)"
    )
    ap.add_argument("--think-ms", type=float, default=5.0, help="agentic: pause between turns")
    ap.add_argument(
        "--overhead-requests",
        type=int,
        default=None,
        help="requests sent one at a time to measure the gateway's own time (default 12 "
        "with --quick, on the chat shape only; 24 per shape)",
    )
    ap.add_argument(
        "--kv-blocks-per-daemon",
        type=int,
        default=None,
        help="default: 1/3 of the chat trace's prefix working set",
    )
    ap.add_argument(
        "--single-requests",
        type=int,
        default=None,
        help="requests of the single-hot-prompt run (default 40 with --quick, 160)",
    )
    ap.add_argument("--dump", default=None, help="append one JSON line per request here")
    ap.add_argument(
        "--base-pythonpath",
        default=None,
        help=f"checkout whose gateway the door {BASE} runs (an A/B against this one)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf-s", type=float, default=0.8, help="tenant popularity skew")
    ap.add_argument(
        "--tenants",
        type=int,
        default=None,
        help="chat tenants; default 12 with --quick, 32 for the full trace",
    )
    ap.add_argument(
        "--system-prompt-words",
        type=int,
        default=280,
        help="~4.3 tokens per word with the tiny tokenizer: ~1200-token system prompts",
    )
    ap.add_argument("--weights", default=None, help="cache_aware weights for the gateway")
    ap.add_argument(
        "--gateway-args", default="", help="extra flags for pagefleet's gateways (space separated)"
    )
    ap.add_argument(
        "--daemon-args",
        default="",
        help="extra flags for every daemon (space separated), e.g. "
        "'--long-prefill-token-threshold 0' for one-step prefills",
    )
    ap.add_argument(
        "--model",
        default="bench",
        help="'bench' = the 4x512 Llama of bench/throughput.py, where prefill dominates a "
        "request's fixed overhead; or a preset (smollm2-135m: the real model, tiny*), a "
        "checkpoint dir or a .gguf file",
    )
    args = ap.parse_args()
    # --quick: the two routers that reach the ceiling (vllm-router: the full run).
    quick_chat = "cache_aware,sglang"
    chat_doors = args.doors or (quick_chat if args.quick else ",".join(DOORS))
    args.doors = [d for d in chat_doors.split(",") if d]
    quick_agentic = "cache_aware,sglang"
    agentic_doors = args.agentic_doors or (quick_agentic if args.quick else ",".join(DOORS))
    args.agentic_doors = [d for d in agentic_doors.split(",") if d]
    shapes = [s for s in args.shapes.split(",") if s]
    if args.model == "bench":
        from bench_models import ensure_bench_model

        args.model = str(ensure_bench_model())
    else:
        from pagefleet.dev.local_fleet import resolve_checkpoint_dir

        args.model = str(resolve_checkpoint_dir(args.model))

    t_start = time.perf_counter()
    t_doors = 0.0
    n_req = args.requests or (32 if args.quick else 240)
    n_agent = args.agentic_requests or (32 if args.quick else 200)
    if args.single_requests is None:
        args.single_requests = 40 if args.quick else 160
    if args.overhead_requests is None:
        args.overhead_requests = 12 if args.quick else 24
    dump = Path(args.dump) if args.dump else None
    if args.tenants is None:
        args.tenants = 12 if args.quick else 32
    spec = WorkloadSpec(
        num_conversations=n_req,
        num_tenants=args.tenants,
        system_prompt_words=args.system_prompt_words,
        user_turn_words=8,
        assistant_turn_words=12,
        max_turns=4,
        zipf_s=args.zipf_s,
        max_tokens=4,
        seed=args.seed,
    )
    agentic = AgenticSpec(
        num_conversations=n_agent,  # trimmed to n_agent turns
        num_tenants=6 if args.quick else 12,
        initial_tenants=2 if args.quick else 4,
        system_prompt_words=args.system_prompt_words,
        zipf_s=args.zipf_s,
        seed=args.seed,
    )
    served = args.model
    tok = PromptTokenizer.from_dir(args.model)
    traces = {
        "chat": trim(build_conversations(spec), n_req),
        "agentic": trim(build_agentic(agentic), n_agent),
    }
    ids = {shape: _token_ids(tok, convs) for shape, convs in traces.items()}
    ordered = {s: [ids[s][(t.conversation, t.index)] for t in flatten(traces[s])] for s in traces}

    def working_set(lists: list[list[int]]) -> int:
        uses: Counter[int] = Counter()
        for x in lists:
            uses.update(set(block_hashes(x, BLOCK, served)))
        return sum(1 for n in uses.values() if n >= 2)

    reusable = {s: working_set(ordered[s]) for s in traces}
    ideal = {s: ideal_hit_rate(ordered[s], BLOCK, served) for s in traces}
    # A third of the chat working set per daemon, 4/3 of it across the fleet: only a router
    # that partitions the reused prefixes across pods keeps the hit rate near the ceiling.
    # ... but never below the longest prompt (+ a few blocks to decode into): a daemon
    # refuses a prompt its whole pool cannot hold (the long agentic turns).
    longest = max(len(x) for s in traces for x in ordered[s]) // BLOCK + 4
    kv_blocks = args.kv_blocks_per_daemon or max(16, reusable["chat"] // 3, longest)
    fleet = LocalFleet(
        FleetSpec(
            num_daemons=args.daemons,
            model=args.model,
            num_gpu_blocks=kv_blocks,
            seed=args.seed,
            weights=args.weights,
            gateway_port=0,
            # The bench's bodies (2-4 KB) are all parsed inline (IntakePool.inline_bytes):
            # worker processes would only cost each gateway's start-up.
            gateway_args=["--intake-workers", "0", *args.gateway_args.split()],
        )
    )
    assert fleet.namespace == served, (fleet.namespace, served)
    # Every daemon appends its per-request timings to one file (O_APPEND, one write a line).
    fleet.spec.daemon_args += ["--request-log", str(fleet.log_dir / "requests.jsonl")]
    fleet.spec.daemon_args += args.daemon_args.split()
    bench = Bench(fleet, args)
    reports: dict[str, dict[str, dict[str, Any]]] = {}
    overhead: dict[str, dict[float, float | None]] = {}
    loaded: dict[str, dict[float, float | None]] = {}
    single_report: dict[str, Any] = {}
    all_doors: dict[str, dict[str, list[Child]]] = {}
    try:
        # Every door of every shape starts as soon as the daemons' URLs are known, beside
        # their start-up (each door waits for its workers itself).
        fleet.start(on_spawned=lambda: all_doors.update(bench.spawn_doors(shapes)))
        t_ready = time.perf_counter() - t_start
        blocks_per_daemon = int(_get_json(fleet.daemon_urls[0] + "/get_server_info")["num_blocks"])
        print(
            f"fleet ready in {t_ready:.1f}s; {args.daemons} daemons x {blocks_per_daemon} KV "
            f"blocks; prefix working set chat {reusable['chat']} / agentic "
            f"{reusable['agentic']} blocks; requests chat {len(ordered['chat'])} / agentic "
            f"{len(ordered['agentic'])}; peers "
            + ", ".join(f"{p} {peer_version(p)}" for p in PEERS)
        )
        # Warm every daemon's first-forward costs so no door pays them.
        warm = trim(
            build_conversations(
                WorkloadSpec(num_conversations=2 * args.daemons, max_turns=1, salt="warm ")
            ),
            2 * args.daemons,
        )
        assert fleet.gateway is not None
        asyncio.run(
            run_workload(
                fleet.gateway.url, fleet.served_model_name, warm, args.daemons, progress=False
            )
        )
        bench.wait_doors()
        t_doors = time.perf_counter() - t_start - t_ready
        print(f"doors ready {t_doors:.1f}s after the fleet")
        for shape in shapes:
            doors = all_doors[shape]
            reports[shape] = {}
            think = args.think_ms / 1000.0 if shape == "agentic" else 0.0
            for name, door in doors.items():
                r, results = bench.run(door, traces[shape], think, ids[shape])
                trace_rows = r.pop("_trace_rows", [])
                reports[shape][name] = r
                if dump is not None:
                    write_dump(dump, shape, name, results, ids[shape], fleet.namespace, trace_rows)
                print(
                    f"{shape:8s} {name:14s} hit {r['prefix_hit_rate']:.3f}  ttft p50 "
                    f"{r['ttft_ms_p50']} p99 {r['ttft_ms_p99']} ms  wall {r['wall_s']} s  "
                    f"failed {r['failed']}  shares {r['pod_share']}  evictions "
                    f"{r['evictions_per_pod']}  lost inflight/done "
                    f"{r['lost_frac_inflight']}/{r['lost_frac_done']}  blind "
                    f"{r['blind_requests']}  moved {r['moved_turns']}  "
                    f"{r.get('placements', '')}  cpu_s {r['cpu_s']}",
                    flush=True,
                )
                for cls, med in r["ttft_breakdown"].items():
                    print(
                        f"{'':8s} {'':14s} {cls} medians: "
                        + " ".join(f"{k} {v}" for k, v in med.items()),
                        flush=True,
                    )
            if "cache_aware" in doors and (shape == "chat" or not args.quick):
                # --quick: the chat shape's probe only (a sequential probe is slow).
                url = doors["cache_aware"][0].url
                loaded[shape] = quantiles(histogram_buckets(url, OVERHEAD), (0.5, 0.99))
                overhead[shape] = overhead_probe(
                    url, fleet.served_model_name, trim(traces[shape], args.overhead_requests)
                )
                bench.forget_counters()
                print(f"{shape:8s} gateway overhead, one request at a time: {overhead[shape]}")
        single = single_prompt_trace(args.single_requests, words=140, salt="single ")
        bench.reset_caches()
        results, wall = asyncio.run(
            run_workload(
                fleet.gateway.url, fleet.served_model_name, single, args.concurrency, progress=False
            )
        )
        single_report = summarize(results, wall)
        if dump is not None:  # which pod served each copy, in send order
            write_dump(dump, "single", "cache_aware", results, _token_ids(tok, single), served)
        print(
            f"single prompt via cache_aware: pod share {single_report['pod_share']} "
            f"hit {single_report['prefix_hit_rate']:.3f}"
        )
        t_runs = time.perf_counter() - t_start - t_ready
    finally:
        for c in bench.children:
            c.terminate()
        fleet.stop()
        for c in bench.children:
            c.stop()

    out: dict[str, Any] = {}
    for shape in shapes:
        suffix = "" if shape == "chat" else f"_{shape}"
        out.update(shape_keys(reports[shape], ideal[shape], suffix))
        ms = {
            q: (None if v is None else round(v * 1000, 3))
            for q, v in overhead.get(shape, {}).items()
        }
        out[f"gateway_overhead_ms_p50{suffix}"] = ms.get(0.5)
        out[f"gateway_overhead_ms_p99{suffix}"] = ms.get(0.99)
        # The same histogram over the loaded run itself (8 conversations in flight, the
        # daemons busy): the gateway's own time under CPU contention, the part of a
        # request's `door_in` spent inside the gateway process rather than in the hops.
        under = {
            q: (None if v is None else round(v * 1000, 3)) for q, v in loaded.get(shape, {}).items()
        }
        out[f"gateway_overhead_ms_p50_under_load{suffix}"] = under.get(0.5)
        out[f"gateway_overhead_ms_p99_under_load{suffix}"] = under.get(0.99)
    out.update(
        {
            "max_pod_share_single_prompt": single_report["max_pod_share"],
            "failed_requests": sum(r["failed"] for s in reports.values() for r in s.values())
            + single_report["failed"],
            "peers": {p: peer_version(p) for p in PEERS},
            "requests_per_door": {s: len(ordered[s]) for s in shapes},
            "model": Path(args.model).name,
            "tenants": args.tenants,
            "system_prompt_words": args.system_prompt_words,
            "load": f"closed {args.concurrency}",
            "think_ms_agentic": args.think_ms,
            "daemons": args.daemons,
            "kv_blocks_per_daemon": blocks_per_daemon,
            "prefix_working_set_blocks": reusable,
            "start_s": round(t_ready, 1),
            "doors_start_s": round(t_doors, 1),
            "runs_s": round(t_runs, 1),
            "wall_s": round(time.perf_counter() - t_start, 1),
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
