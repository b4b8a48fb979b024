"""The Grafana dashboard is generated from pagefleet/dev/dashboards.py (grafana-foundation-sdk)
and checked in under the chart; this fails when the two differ (regenerate with
`pagefleet dashboards`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pagefleet.dev.dashboards import (
    DAEMON_OVERLOAD_REASONS,
    DASHBOARD_FILE,
    GATEWAY_OVERLOAD_REASONS,
    ROWS,
    all_queries,
    build_dashboard,
    render_json,
    substitute,
)

CHART_DASHBOARDS = Path(__file__).resolve().parents[2] / "helm" / "pagefleet" / "dashboards"


def test_checked_in_dashboard_matches_the_generator() -> None:
    checked_in = (CHART_DASHBOARDS / DASHBOARD_FILE).read_text()
    assert checked_in == render_json(), (
        "helm/pagefleet/dashboards is stale: run `pagefleet dashboards`"
    )
    assert sorted(p.name for p in CHART_DASHBOARDS.glob("*.json")) == [DASHBOARD_FILE]


def test_every_panel_and_query_is_in_the_json() -> None:
    dash = build_dashboard()
    panels = [p for p in dash["panels"] if p["type"] != "row"]  # type: ignore[union-attr]
    assert [p["title"] for p in panels] == [s.title for _, specs in ROWS for s in specs]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert exprs == [q.expr for _, q in all_queries()]
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    names = [v["name"] for v in dash["templating"]["list"]]  # type: ignore[index]
    assert names[:3] == ["datasource", "namespace", "inferenceservice"]


def test_panels_a_platform_team_expects() -> None:
    text = "\n".join(q.expr for _, q in all_queries())
    for needle in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:prefix_cache_hits_total",
        "vllm:kv_cache_usage_perc",
        "pagefleet:kv_cache_evictions_total",
        "vllm:num_requests_waiting",
        'code=~"429|503"',
        "pagefleet_gateway_requests_total",
        "pagefleet_gateway_predicted_hit_tokens_sum",
        "pagefleet_gateway_upstream_retries_total",
        "pagefleet_gateway_routing_decision_seconds_bucket",
        'pagefleet_gateway_upstream_ttft_seconds_bucket{namespace=~"$namespace", '
        'inferenceservice=~"$inferenceservice", le="$ttft_slo"}',
        "$replica_cost_per_hour",
        "pagefleet:kv_transfer_bytes_total",
        "pagefleet:kv_transfer_seconds_bucket",
        "pagefleet:kv_transfer_pulls_failed_total",
        "pagefleet:kv_transfer_handles_active",
        "pagefleet:kv_transfer_handles_expired_total",
        "pagefleet_gateway_pd_requests_total",
        "pagefleet:client_cuts_total",
        "pagefleet_gateway_client_cuts_total",
    ):
        assert needle in text, needle
    for q in (0.5, 0.9, 0.99):
        assert f"histogram_quantile({q}, sum by (le, role)" in text


def test_substitute_leaves_no_variable_and_refuses_unknown_ones() -> None:
    for _, q in all_queries():
        assert "$" not in substitute(q.expr)
    with pytest.raises(ValueError, match="unknown dashboard variable"):
        substitute("rate(x[$nope])")
    assert json.loads(render_json())["uid"] == "pagefleet-slo"


def test_overload_panel_counts_every_429_and_503_refusal_of_the_gateway() -> None:
    """The gateway's rejected-requests counter states each reason's status in its help
    ("429 concurrency; 503 connections (...), body_budget, ...; 413 too_large; ..."): the
    429/503 panel must select exactly those reasons."""
    from pagefleet.gateway.metrics import GatewayMetrics

    doc = GatewayMetrics().rejected._documentation
    by_code: dict[str, set[str]] = {}
    for part in re.sub(r"\([^)]*\)", "", doc.split(":", 1)[1]).split(";"):
        code, _, reasons = part.strip().rstrip(".").partition(" ")
        by_code[code] = {r.strip() for r in reasons.split(",")}
    assert by_code["429"] == {"concurrency"}
    assert set(GATEWAY_OVERLOAD_REASONS.split("|")) == by_code["429"] | by_code["503"]
    assert not set(DAEMON_OVERLOAD_REASONS.split("|")) & {"invalid", "body_timeout"}
