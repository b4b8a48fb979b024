"""The autoscaler's inputs from a Prometheus that already scrapes the daemons.

For clusters that run one (`pagefleet operator --prometheus-url`): one instant PromQL query
per input instead of scraping every pod, over the same window the direct scrape uses. Series
are selected by the labels the daemons export (``pod``, ``role``) and the ``namespace``
label a PodMonitor / kubernetes_sd scrape adds. A Ready pod missing from any per-pod result
is unknown, never idle; a query that fails makes every pod unknown.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Collection
from typing import Any

import aiohttp

from pagefleet.kvindex.index import PodLoad
from pagefleet.operator.planner import RoleObservation
from pagefleet.operator.signals import WARMING, PodReport, RoleInputs, victim_requests

_PER_POD = {
    "prompt": "sum by (pod) (rate(vllm:prompt_tokens_total{S}[W]))"
    " - sum by (pod) (rate(vllm:prefix_cache_hits_total{S}[W]))",
    "generation": "sum by (pod) (rate(vllm:generation_tokens_total{S}[W]))",
    "requests": "sum by (pod) (rate(vllm:time_to_first_token_seconds_count{S}[W]))",
    "running": "sum by (pod) (vllm:num_requests_running{S})",
    "waiting": "sum by (pod) (vllm:num_requests_waiting{S})",
    "kv": "avg by (pod) (vllm:kv_cache_usage_perc{S})",
}
_ROLE = {
    "ttft": "histogram_quantile(Q, sum by (le) "
    "(rate(vllm:time_to_first_token_seconds_bucket{S}[W])))",
    "tpot": "histogram_quantile(Q, sum by (le) "
    "(rate(vllm:request_time_per_output_token_seconds_bucket{S}[W])))",
}


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def queries(
    namespace: str, role: str, pods: list[str], window_s: float, percentile: float
) -> dict[str, str]:
    """The PromQL of every input for one role's Ready pods (pod names are regex-escaped:
    they are DNS labels, so only '.' could need it)."""
    alternatives = "|".join(p.replace(".", "\\\\.") for p in sorted(pods))
    sel = f'{{namespace="{_quote(namespace)}",role="{_quote(role)}",pod=~"{alternatives}"}}'
    window = f"{max(1, round(window_s))}s"
    out = {k: q.replace("{S}", sel).replace("[W]", f"[{window}]") for k, q in _PER_POD.items()}
    for k, q in _ROLE.items():
        out[k] = (
            q.replace("{S}", sel)
            .replace("[W]", f"[{window}]")
            .replace("Q", f"{percentile / 100:g}", 1)
        )
    return out


_URL_HINT = "is --prometheus-url the server's base URL, e.g. http://prometheus.monitoring:9090?"


async def _query(session: aiohttp.ClientSession, base: str, expr: str) -> list[dict[str, Any]]:
    async with session.get(f"{base.rstrip('/')}/api/v1/query", params={"query": expr}) as resp:
        text = await resp.text(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        raise ValueError(
            f"HTTP {resp.status}, not a Prometheus API answer: {text[:200]!r} ({_URL_HINT})"
        ) from None
    ok = isinstance(body, dict) and resp.status == 200 and body.get("status") == "success"
    if not ok:
        said = body.get("error", body) if isinstance(body, dict) else body
        raise ValueError(f"HTTP {resp.status}: {str(said)[:300]}")
    return _vector(body)


def _vector(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The samples of an instant-vector answer; ValueError when the answer is not one (a
    URL that reaches another JSON API, a proxy): that is an unknown, never a crash."""
    data = body.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list) or not all(
        isinstance(s, dict)
        and isinstance(s.get("metric", {}), dict)
        and isinstance(s.get("value"), list)
        and len(s["value"]) == 2
        for s in result
    ):
        raise ValueError(f"not a Prometheus instant vector: {str(body)[:300]} ({_URL_HINT})")
    return result


def _finite(sample: dict[str, Any]) -> float | None:
    try:
        v = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v >= 0 else None


async def role_inputs(
    prometheus_url: str,
    namespace: str,
    role: str,
    current: int,
    pods: list[str],
    window_s: float,
    percentile: float,
    timeout_s: float,
    cached_blocks: dict[str, int] | None = None,
    warming: Collection[str] = (),
) -> RoleInputs:
    """One role's observation from Prometheus (every query concurrently, one timeout).
    ``warming``: pods Ready too recently to have series yet; one without them is unknown
    as a new pod is in the scrape mode (held, no alarm), not as a problem."""
    reports = [PodReport(p) for p in pods]
    if not pods:
        obs = RoleObservation(current=current, ready=0, known_pods=0)
        return RoleInputs(obs, reports)
    exprs = queries(namespace, role, pods, window_s, percentile)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            results = await asyncio.gather(
                *(_query(session, prometheus_url, e) for e in exprs.values())
            )
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        for r in reports:
            r.error = f"Prometheus {prometheus_url}: {type(exc).__name__}: {exc}"
        obs = RoleObservation(current=current, ready=len(pods), known_pods=0,
                              unknown_pods=len(pods))  # fmt: skip
        return RoleInputs(obs, reports)
    by_key = dict(zip(exprs, results, strict=True))
    per_pod: dict[str, dict[str, float]] = {p: {} for p in pods}
    for key in _PER_POD:
        for sample in by_key[key]:
            pod = (sample.get("metric") or {}).get("pod")
            value = _finite(sample)
            if pod in per_pod and value is not None:
                per_pod[pod][key] = value
    known = []
    for r in reports:
        vals = per_pod[r.name]
        missing = [k for k in _PER_POD if k not in vals]
        if missing:
            r.error = (
                WARMING
                if r.name in warming
                else f"no Prometheus series for {', '.join(missing)} over the window"
            )
            continue
        r.load = PodLoad(
            running=int(vals["running"]),
            waiting=int(vals["waiting"]),
            kv_usage=vals["kv"],
            num_cached_blocks=(cached_blocks or {}).get(r.name, 0),
            role=role,
        )
        r.rates_known = True
        known.append(vals)

    def role_value(key: str) -> float | None:
        samples = by_key[key]
        return _finite(samples[0]) if samples else None

    obs = RoleObservation(
        current=current,
        ready=len(pods),
        known_pods=len(known),
        unknown_pods=len(pods) - len(known),
        prompt_tokens_per_s=max(0.0, sum(v["prompt"] for v in known)),
        generation_tokens_per_s=sum(v["generation"] for v in known),
        requests_per_s=sum(v["requests"] for v in known),
        running=int(sum(v["running"] for v in known)),
        waiting=int(sum(v["waiting"] for v in known)),
        kv_usage=sum(v["kv"] for v in known) / len(known) if known else 0.0,
        ttft_s=role_value("ttft"),
        tpot_s=role_value("tpot"),
        # The requests on the pod a scale-down would remove, as in the scrape mode: an idle
        # one lets the planner release it sooner (PlannerConfig.idle_release_s).
        victim_requests=victim_requests(current, reports),
    )
    return RoleInputs(obs, reports)
