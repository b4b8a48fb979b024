"""Every dashboard query and every rule expression, executed on a real Prometheus that
scrapes a real local fleet under traffic: Redis, 1 prefill + 2 decode daemons on the tiny
model and the P/D gateway, so the disaggregation panels (KV transfer rate and latency,
handles) have data too; every other panel reads role-agnostic series.

Prometheus (the Debian package's binary) runs on a free loopback port with a generated
scrape config that adds the labels the chart's PodMonitor adds in a cluster (`namespace`,
`inferenceservice`) and honours the targets' own (`pod`, `role`). The rules are the chart's
PrometheusRule as the real helm renders it, loaded as Prometheus rule files.

A query must parse and return data after traffic. The few that only have series once the
event happens (429/503, retries, index errors) must parse and their metric family must be
exported. Alert expressions filter on thresholds a healthy fleet does not cross, so they are
executed in `bool` form (`a > x` -> `a > bool x`): same series, same parse, no filtering.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import start_http_server

from pagefleet.dev.dashboards import ROWS, VARIABLE_DEFAULTS, all_queries, substitute
from pagefleet.dev.loadgen import BenchOptions, run_bench
from pagefleet.dev.local_fleet import FleetSpec, LocalFleet, free_port
from pagefleet.dev.prometheus import LocalPrometheus, PrometheusAPI, ScrapeTarget
from pagefleet.operator.metrics import OperatorMetrics
from pagefleet.testing.helm import rule_groups

pytestmark = pytest.mark.slow

NAMESPACE = "pf-test"
SERVICE = "tiny"
# Rate windows long enough to span the whole traffic burst (Grafana's $__rate_interval).
RATE = "2m"


def _addr(url: str) -> str:
    return url.removeprefix("http://")


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A fleet under traffic, scraped every second; yields the API and the rules."""
    tmp = tmp_path_factory.mktemp("prom")
    rules = rule_groups()
    rules_path = tmp / "rules.yaml"
    rules_path.write_text(yaml.safe_dump(rules))
    # Remote prefill from 16 uncached tokens on: each tenant's first prompts are pulled.
    spec = FleetSpec(
        num_prefill=1, num_decode=2, log_dir=tmp / "fleet", seed=0, num_gpu_blocks=256,
        gateway_args=["--pd-min-uncached-tokens", "16"],
    )  # fmt: skip
    # The operator's registry, served as `pagefleet operator --metrics-port` serves it. No
    # InferenceService autoscales here, so its per-role series stay empty; the families
    # must still be exported for the autoscaling panels' queries.
    operator_port = free_port()
    server, _ = start_http_server(
        operator_port, addr="127.0.0.1", registry=OperatorMetrics().registry
    )
    with LocalFleet(spec) as fleet:
        labels = {"namespace": NAMESPACE, "inferenceservice": SERVICE}
        targets = [ScrapeTarget(_addr(u), labels) for u in fleet.daemon_urls]
        targets.append(ScrapeTarget(_addr(fleet.gateway_url), labels))
        targets.append(ScrapeTarget(f"127.0.0.1:{operator_port}"))
        with LocalPrometheus(targets, rule_files=[rules_path], interval_s=1.0) as prom:
            api = prom.api
            deadline = time.monotonic() + 30
            while api.targets_up() < len(targets):
                assert time.monotonic() < deadline, prom.log_path.read_text()[-2000:]
                time.sleep(0.5)
            # A request a daemon refuses as invalid (400): counted in
            # pagefleet:requests_rejected_total, but no overload, so the 429/503 panel must
            # stay empty on this healthy fleet.
            _post_invalid(fleet.daemon_urls[0] + "/v1/completions")
            t0 = time.time()
            opts = BenchOptions(
                url=fleet.gateway_url,
                model=fleet.served_model_name,
                num_requests=8,
                concurrency=4,
                num_tenants=4,
                system_prompt_words=60,
                max_tokens=8,
                progress=False,
            )
            # Two bursts a few scrapes apart: a series born in the first burst has an
            # earlier sample for rate() to difference against in the second. One burst on a
            # fast machine fell between two 1 s scrapes: every series it created appeared
            # once, already at its final count, and read as rate 0 (NaN quantiles).
            served = {"prompt_tokens": 0, "completion_tokens": 0}
            for burst in (opts, opts.model_copy(update={"num_requests": 40})):
                report, _ = asyncio.run(run_bench(burst))
                assert report["failed"] == 0, report["errors"]
                for k in served:
                    served[k] += report[k]
                time.sleep(3)  # a few scrapes and rule evaluations after the last request
            yield {
                "api": api, "rules": rules, "start": t0, "end": time.time(), "served": served,
            }  # fmt: skip
    server.shutdown()


def _post_invalid(url: str) -> None:
    req = urllib.request.Request(
        url, data=b"{not json", headers={"Content-Type": "application/json"}, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400


def _finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def test_every_dashboard_query_returns_data(observed: dict[str, Any]) -> None:
    api: PrometheusAPI = observed["api"]
    families = set(api.metadata())
    empty_ok, failures = [], []
    units = {p.title: p.unit for _, panels in ROWS for p in panels}
    for title, q in all_queries():
        expr = substitute(q.expr, {"namespace": NAMESPACE, "inferenceservice": SERVICE}, RATE)
        result = api.query(expr)  # raises PrometheusError on a parse error
        if q.empty_unless is not None:
            # Counters are exported under their family name (no `_total`).
            if q.empty_unless not in families and f"{q.empty_unless}_total" not in families:
                failures.append(f"{title}: family {q.empty_unless} not exported")
            if not result:
                empty_ok.append(q.empty_unless)
            continue
        if not result or not _finite(result):
            failures.append(f"{title} [{q.legend}]: {expr} -> {result}")
        failures += _legend_and_unit_failures(title, q.legend, units[title], result)
    assert not failures, "\n".join(failures)
    # On a healthy fleet nothing is refused or retried, and no client is cut: those stay
    # empty, as expected.
    assert "pagefleet:requests_rejected" in empty_ok
    invalid = api.query('sum(pagefleet:requests_rejected_total{reason="invalid"})')
    assert float(invalid[0]["value"][1]) == 1  # counted, yet no 429/503 line
    assert {"pagefleet:client_cuts", "pagefleet_gateway_client_cuts"} <= set(empty_ok)


def _legend_and_unit_failures(
    title: str, legend: str, unit: str, result: list[dict[str, Any]]
) -> list[str]:
    """Every label the legend names is on every series (not aggregated away), and values
    fit the panel's unit: ratios in [0, 1], durations, rates and counts not negative."""
    out = []
    for r in result:
        missing = [n for n in re.findall(r"\{\{(\w+)\}\}", legend) if not r["metric"].get(n)]
        if missing:
            out.append(f"{title} [{legend}]: no label {missing} on {r['metric']}")
        v = float(r["value"][1])
        if not math.isfinite(v):
            continue
        if (unit == "percentunit" and not 0 <= v <= 1) or v < 0:
            out.append(f"{title} [{legend}]: {v} out of range for unit {unit}")
    return out


def test_dashboard_variable_queries_find_the_fleet(observed: dict[str, Any]) -> None:
    api: PrometheusAPI = observed["api"]
    by = api.query("count by (namespace, inferenceservice, role) (vllm:num_requests_running)")
    found = {r["metric"]["role"]: r["value"][1] for r in by}
    assert found == {"prefill": "1", "decode": "2"}
    assert all(
        (r["metric"]["namespace"], r["metric"]["inferenceservice"]) == (NAMESPACE, SERVICE)
        for r in by
    )
    pods = api.query("count by (pod) (pagefleet_gateway_requests_total)")
    assert len(pods) == 2  # the gateway spread the traffic over both decode daemons
    remote = api.query('sum(pagefleet_gateway_pd_requests_total{path="remote"})')
    assert remote and float(remote[0]["value"][1]) > 0, "no request was prefilled remotely"


# What dashboards built for vLLM query, current names and the pre-0.11 TPOT name many still
# use: each must find data on a pagefleet fleet with no configuration.
VLLM_DASHBOARD_QUERIES = (
    *(
        f"histogram_quantile(0.99, sum by (le) (rate(vllm:{h}_bucket[{RATE}])))"
        for h in (
            "time_to_first_token_seconds",
            "time_per_output_token_seconds",
            "inter_token_latency_seconds",
            "e2e_request_latency_seconds",
        )
    ),
    f"sum(rate(vllm:request_time_per_output_token_seconds_sum[{RATE}]))",
    f"sum(rate(vllm:request_queue_time_seconds_sum[{RATE}]))",
    f"sum(rate(vllm:request_inference_time_seconds_sum[{RATE}]))",
    f"sum(rate(vllm:request_prefill_time_seconds_sum[{RATE}]))",
    f"sum(rate(vllm:request_decode_time_seconds_sum[{RATE}]))",
    f"sum(rate(vllm:prompt_tokens_total[{RATE}]))",
    f"sum(rate(vllm:generation_tokens_total[{RATE}]))",
    f"sum by (finished_reason) (increase(vllm:request_success_total[{RATE}]))",
    f"sum(rate(vllm:gpu_prefix_cache_hits_total[{RATE}])) / "
    f"sum(rate(vllm:gpu_prefix_cache_queries_total[{RATE}]))",
    "max(vllm:gpu_cache_usage_perc)",
    "max(vllm:kv_cache_usage_perc)",
    "sum(vllm:num_requests_running)",
    "sum(vllm:num_requests_waiting)",
    "sum(rate(vllm:num_preemptions_total[2m]))",
    *(
        f"sum by (le) (increase(vllm:request_{t}_tokens_bucket[{RATE}]))"
        for t in ("prompt", "generation")
    ),
)


def test_queries_of_vllm_dashboards_return_data(observed: dict[str, Any]) -> None:
    api: PrometheusAPI = observed["api"]
    failures = [e for e in VLLM_DASHBOARD_QUERIES if not _finite(api.query(e))]
    assert not failures, "\n".join(failures)
    # The older TPOT name is ITL under another name: the same observations.
    itl = api.query("sum(vllm:inter_token_latency_seconds_count)")
    alias = api.query("sum(vllm:time_per_output_token_seconds_count)")
    assert float(itl[0]["value"][1]) > 0
    assert alias[0]["value"][1] == itl[0]["value"][1]
    # Per-request token histograms where the client is answered: what the clients got.
    generated = api.query('sum(vllm:request_generation_tokens_sum{role!="prefill"})')
    assert float(generated[0]["value"][1]) == observed["served"]["completion_tokens"]


def test_cost_panel_counts_each_served_token_once(observed: dict[str, Any]) -> None:
    """Behind P/D a prompt is counted on the prefill pod and again on the decode pod: the
    cost panel's token counters, read whole with its own selectors, must add up to the
    usage the clients were sent."""
    api: PrometheusAPI = observed["api"]
    (panel,) = [p for _, ps in ROWS for p in ps if p.title == "Cost per 1M tokens"]
    expr = substitute(panel.queries[1].expr, {"namespace": NAMESPACE, "inferenceservice": SERVICE})
    for counter, usage in (
        ("vllm:prompt_tokens_total", "prompt_tokens"),
        ("vllm:generation_tokens_total", "completion_tokens"),
    ):
        selector = re.search(re.escape(counter) + r"\{[^}]*\}", expr)
        assert selector, f"{counter} not in {expr}"
        total = api.query(f"sum({selector.group(0)})")
        assert float(total[0]["value"][1]) == observed["served"][usage], selector.group(0)


def _as_bool(expr: str) -> str:
    return re.sub(r" (>=|<=|==|!=|>|<) ", r" \1 bool ", expr)


def test_every_rule_expression_returns_data(observed: dict[str, Any]) -> None:
    api: PrometheusAPI = observed["api"]
    failures = []
    rules = [r for g in observed["rules"]["groups"] for r in g["rules"]]
    assert len(rules) >= 15
    for rule in rules:
        expr = rule["expr"] if "record" in rule else _as_bool(rule["expr"])
        result = api.query(expr)
        if not result:
            failures.append(f"{rule.get('record') or rule['alert']}: {expr}")
        if "record" in rule and not api.query(rule["record"]):
            failures.append(f"recorded series {rule['record']} missing")
    assert not failures, "\n".join(failures)
    # Prometheus evaluated every rule without error; a healthy fleet fires nothing.
    loaded = [r for g in api.rules() for r in g["rules"]]
    assert len(loaded) == len(rules)
    assert all(r["health"] == "ok" for r in loaded), [r for r in loaded if r["health"] != "ok"]
    assert not [r["name"] for r in loaded if r.get("state") == "firing"]
    ratio = api.query("pagefleet:ttft_slo_error_ratio:rate5m")
    assert float(ratio[0]["value"][1]) == 0.0  # the tiny model answers well within 2 s


def test_bench_plots_the_slo_panels_from_query_range(
    observed: dict[str, Any], tmp_path: Path
) -> None:
    from pagefleet.dev.slo_plots import plot_from_prometheus

    paths = plot_from_prometheus(
        observed["api"],
        tmp_path,
        start=observed["start"],
        end=observed["end"],
        variables={**VARIABLE_DEFAULTS, "namespace": NAMESPACE},
    )
    assert [p.name for p in paths] == ["slo_latency.png", "slo_goodput_cache.png"]
    for p in paths:
        assert p.stat().st_size > 10_000
