"""``pagefleet dashboards``: the Grafana dashboards, built in code (grafana-foundation-sdk).

The panel catalogue (``ROWS``) is plain data, so the same queries feed the Grafana JSON, the
real-Prometheus test that executes every one of them, and the matplotlib renderer of
``pagefleet bench --plot``. The generated JSON is checked in under
``helm/pagefleet/dashboards/`` and a test fails when it drifts from this module (like the CRD).

Labels the queries rely on (docs/metrics.md): the daemon's own ``role`` and ``pod``, the
gateway's upstream ``pod``, and the target labels ``namespace`` and ``inferenceservice`` that
the chart's PodMonitor (or any scrape config) adds. Grafana itself is never a dependency.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import click

DASHBOARD_UID = "pagefleet-slo"
DASHBOARD_FILE = "pagefleet-slo.json"
RATE = "$__rate_interval"

# Bucket boundaries of the daemon's histograms that can serve as SLO targets; goodput is
# read straight from the bucket (`le` is an exact label string as prometheus-client writes
# it), so a target must be one of them. The defaults are spec.slo's defaults.
TTFT_SLO_CHOICES = ("0.1", "0.2", "0.5", "1.0", "2.0", "5.0", "10.0")
TPOT_SLO_CHOICES = ("0.02", "0.05", "0.1", "0.2", "0.5")
SLO_PERCENTILE_CHOICES = ("90", "95", "99", "99.9")

# Defaults of the variables, also what the tests and the PNG renderer substitute.
VARIABLE_DEFAULTS: dict[str, str] = {
    "namespace": ".*",
    "inferenceservice": ".*",
    "ttft_slo": "2.0",
    "tpot_slo": "0.1",
    "slo_percentile": "95",
    "replica_cost_per_hour": "2.5",
}


def sel(**extra: str) -> str:
    """The selector every query carries: the dashboard's namespace/service pickers."""
    parts = ['namespace=~"$namespace"', 'inferenceservice=~"$inferenceservice"']
    parts += [f'{k}="{v}"' for k, v in extra.items()]
    return "{" + ", ".join(parts) + "}"


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str
    # A metric family whose series only appear once the event happens (a 429, a retry): the
    # query may return nothing on a healthy fleet; the family must still be exported.
    empty_unless: str | None = None


@dataclass(frozen=True, slots=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]


def _quantiles(metric: str, by: str) -> tuple[Query, ...]:
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{sel()}[{RATE}])))",
            f"p{round(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.9, 0.99)
    )


# Each request counts once, as in the chart's SLO rules (helm/pagefleet/templates/
# _rules.tpl): on the pod that answers it (role != prefill). TPOT is read there; a TTFT miss
# is one on any pod, since behind prefill/decode a locally prefilled request records its
# TTFT on the decode pod alone and a remote one on both (clamped: a double miss is one).
def _error_ratio(metric: str, le_var: str, window: str = RATE) -> str:
    served = f'{sel()[:-1]}, role!="prefill"}}'
    if le_var == "tpot_slo":
        within = f'{sel(le=f"${le_var}")[:-1]}, role!="prefill"}}'
        return (
            f"(1 - sum(rate({metric}_bucket{within}[{window}]))"
            f" / sum(rate({metric}_count{served}[{window}])))"
        )
    return (
        f"clamp_max((sum(rate({metric}_count{sel()}[{window}]))"
        f" - sum(rate({metric}_bucket{sel(le=f'${le_var}')}[{window}])))"
        f" / sum(rate({metric}_count{served}[{window}])), 1)"
    )


def _within(metric: str, le_var: str, window: str = RATE) -> str:
    return f"1 - {_error_ratio(metric, le_var, window)}"


def _burn(metric: str, le_var: str, window: str) -> str:
    # Error ratio over the window divided by the error budget (1 - objective): 1 spends the
    # budget exactly over the SLO period, 14.4 spends a 30-day budget in ~2 days.
    return f"{_error_ratio(metric, le_var, window)} / (1 - $slo_percentile / 100)"


TTFT = "vllm:time_to_first_token_seconds"
# The client-side TTFT, one observation per streamed request (the gateway's): behind P/D the
# prefill pod's TTFT stops at its own first token and the decode pod's starts after the KV
# pull, so neither shows what the client waited; this does. Same boundaries as the daemon's.
CLIENT_TTFT = "pagefleet_gateway_upstream_ttft_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
_DAEMONS = f"count(vllm:num_requests_running{sel()})"
# Tokens served to clients, each request's once: every request ends on a unified or decode
# pod, which counts its whole prompt (pulled or not) and every token it streams; a prefill
# pod counts the same prompt again, and the one token it makes is never sent.
_SERVED = sel()[:-1] + ', role!="prefill"}'


def _served_rate(metric: str) -> str:
    return f"sum(rate({metric}{_SERVED}[{RATE}]))"


# Refusals for overload (429, 503): the daemon's pagefleet:requests_rejected_total and the
# gateway's pagefleet_gateway_rejected_requests_total also count bad requests (400, 408, 413),
# which are the client's problem, not the fleet's.
DAEMON_OVERLOAD_REASONS = "queue_full|draining|not_ready|body_budget"
GATEWAY_OVERLOAD_REASONS = "concurrency|connections|body_budget|no_endpoints|intake_failed"
# The operator's series name the InferenceService `service` (and its `namespace`).
_OP = '{namespace=~"$namespace", service=~"$inferenceservice"}'

ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    (
        "SLO",
        (
            PanelSpec(
                "Goodput: share of requests within the SLO",
                "Requests whose TTFT (resp. TPOT) met the target, read from the daemons' "
                "histogram buckets; targets are the ttft_slo / tpot_slo variables (spec.slo). "
                "The client line reads the gateway's TTFT of streamed requests instead, which "
                "behind prefill/decode includes the KV hand-over that no pod's TTFT does.",
                "percentunit",
                (
                    Query(_within(TTFT, "ttft_slo"), "TTFT <= ${ttft_slo}s"),
                    Query(_within(TPOT, "tpot_slo"), "TPOT <= ${tpot_slo}s"),
                    Query(
                        f"sum(rate({CLIENT_TTFT}_bucket{sel(le='$ttft_slo')}[{RATE}]))"
                        f" / sum(rate({CLIENT_TTFT}_count{sel()}[{RATE}]))",
                        "client TTFT <= ${ttft_slo}s (gateway, streams)",
                    ),
                ),
            ),
            PanelSpec(
                "SLO error-budget burn rate",
                "Share of requests missing the target divided by the error budget "
                "(1 - slo_percentile/100). 1 = on budget; the alerts page at 14.4 (1h and 5m) "
                "and warn at 6 (6h and 30m).",
                "none",
                (
                    Query(_burn(TTFT, "ttft_slo", RATE), "TTFT burn"),
                    Query(_burn(TPOT, "tpot_slo", RATE), "TPOT burn"),
                    Query(_burn(TTFT, "ttft_slo", "1h"), "TTFT burn (1h)"),
                    Query(_burn(TPOT, "tpot_slo", "1h"), "TPOT burn (1h)"),
                ),
            ),
        ),
    ),
    (
        "Latency per role",
        (
            PanelSpec(
                "Time to first token",
                "Arrival to first generated token, per role (vllm:time_to_first_token_seconds), "
                "and as the client waits for it: the gateway forwarding a streamed request to "
                "the first token's chunk (pagefleet_gateway_upstream_ttft_seconds). Behind "
                "prefill/decode only the client line includes the KV hand-over.",
                "s",
                _quantiles(TTFT, "role")
                + tuple(
                    Query(
                        f"histogram_quantile({q}, sum by (le) "
                        f"(rate({CLIENT_TTFT}_bucket{sel()}[{RATE}])))",
                        f"p{round(q * 100)} client (gateway)",
                    )
                    for q in (0.5, 0.9, 0.99)
                ),
            ),
            PanelSpec(
                "Time per output token",
                "Per request: decode time / (output tokens - 1).",
                "s",
                _quantiles(TPOT, "role"),
            ),
            PanelSpec(
                "Inter-token latency",
                "Gap between consecutive streamed tokens, as the daemon's HTTP layer sees it.",
                "s",
                _quantiles(ITL, "role"),
            ),
        ),
    ),
    (
        "Throughput and cost",
        (
            PanelSpec(
                "Tokens per second",
                "Prompt tokens prefilled and tokens generated, per role.",
                "short",
                (
                    Query(
                        f"sum by (role) (rate(vllm:prompt_tokens_total{sel()}[{RATE}]))",
                        "prompt {{role}}",
                    ),
                    Query(
                        f"sum by (role) (rate(vllm:generation_tokens_total{sel()}[{RATE}]))",
                        "generated {{role}}",
                    ),
                ),
            ),
            PanelSpec(
                "Cost per 1M tokens",
                "Daemon replicas (prefill pods included) x replica_cost_per_hour ($/h, a "
                "dashboard variable) divided by the rate of tokens served, each request's "
                "counted once (on the pod that answers it, not again on a prefill pod).",
                "currencyUSD",
                (
                    Query(
                        f"$replica_cost_per_hour * {_DAEMONS} / clamp_min("
                        f"{_served_rate('vllm:generation_tokens_total')} * 3600, 1e-9) * 1e6",
                        "per 1M generated tokens",
                    ),
                    Query(
                        f"$replica_cost_per_hour * {_DAEMONS} / clamp_min(("
                        f"{_served_rate('vllm:generation_tokens_total')} + "
                        f"{_served_rate('vllm:prompt_tokens_total')}) * 3600, 1e-9) * 1e6",
                        "per 1M tokens (prompt + generated)",
                    ),
                ),
            ),
        ),
    ),
    (
        "Prefix cache and KV",
        (
            PanelSpec(
                "Prefix-cache hit rate",
                "Prompt tokens served from the prefix cache / prompt tokens looked up.",
                "percentunit",
                (
                    Query(
                        f"sum by (pod) (rate(vllm:prefix_cache_hits_total{sel()}[{RATE}]))"
                        f" / sum by (pod) (rate(vllm:prefix_cache_queries_total{sel()}[{RATE}]))",
                        "{{pod}}",
                    ),
                    Query(
                        f"sum(rate(vllm:prefix_cache_hits_total{sel()}[{RATE}]))"
                        f" / sum(rate(vllm:prefix_cache_queries_total{sel()}[{RATE}]))",
                        "cluster",
                    ),
                ),
            ),
            PanelSpec(
                "KV-cache usage",
                "Fraction of KV blocks referenced by live requests, per pod.",
                "percentunit",
                (Query(f"max by (pod) (vllm:kv_cache_usage_perc{sel()})", "{{pod}}"),),
            ),
            PanelSpec(
                "KV evictions and preemptions",
                "Cached blocks evicted (LRU) and requests preempted, per second and pod.",
                "ops",
                (
                    Query(
                        f"sum by (pod) (rate(pagefleet:kv_cache_evictions_total{sel()}[{RATE}]))",
                        "evictions {{pod}}",
                    ),
                    Query(
                        f"sum by (pod) (rate(vllm:num_preemptions_total{sel()}[{RATE}]))",
                        "preemptions {{pod}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Queues and back-pressure",
        (
            PanelSpec(
                "Queue depth",
                "Requests waiting (admitted, not yet scheduled) and running, per pod.",
                "short",
                (
                    Query(f"sum by (pod) (vllm:num_requests_waiting{sel()})", "waiting {{pod}}"),
                    Query(f"sum by (pod) (vllm:num_requests_running{sel()})", "running {{pod}}"),
                ),
            ),
            PanelSpec(
                "429 and 503 rates",
                "Daemons refusing before admission (queue_full = 429, draining/not_ready/"
                "body_budget = 503), pods' answers with those codes through the gateway, and "
                "the gateway's own (concurrency = 429, connections/body_budget/no_endpoints/"
                "intake_failed = 503). Refusals of bad requests (400, 408, 413) are not here.",
                "reqps",
                (
                    Query(
                        "sum by (reason) (rate(pagefleet:requests_rejected_total"
                        + sel()[:-1]
                        + f', reason=~"{DAEMON_OVERLOAD_REASONS}"}}[{RATE}]))',
                        "daemon {{reason}}",
                        empty_unless="pagefleet:requests_rejected",
                    ),
                    Query(
                        "sum by (code) (rate(pagefleet_gateway_responses_total"
                        + sel()[:-1]
                        + f', code=~"429|503"}}[{RATE}]))',
                        "gateway {{code}}",
                        empty_unless="pagefleet_gateway_responses",
                    ),
                    Query(
                        "sum by (reason) (rate(pagefleet_gateway_rejected_requests_total"
                        + sel()[:-1]
                        + f', reason=~"{GATEWAY_OVERLOAD_REASONS}"}}[{RATE}]))',
                        "gateway refused {{reason}}",
                        empty_unless="pagefleet_gateway_rejected_requests",
                    ),
                ),
            ),
            PanelSpec(
                "Clients cut for not reading",
                "Clients cut because they stopped reading, their requests aborted: a write "
                "waited --client-write-timeout (write_timeout), or a daemon's stream fell "
                "--max-stream-backlog-mb behind (backlog). Clients that hang up are not "
                "counted. A rise is stalled readers, or connections held open by an attack.",
                "reqps",
                (
                    Query(
                        f"sum by (reason) (rate(pagefleet:client_cuts_total{sel()}[{RATE}]))",
                        "daemon {{reason}}",
                        empty_unless="pagefleet:client_cuts",
                    ),
                    Query(
                        "sum by (reason) "
                        f"(rate(pagefleet_gateway_client_cuts_total{sel()}[{RATE}]))",
                        "gateway {{reason}}",
                        empty_unless="pagefleet_gateway_client_cuts",
                    ),
                ),
            ),
        ),
    ),
    (
        "Gateway routing",
        (
            PanelSpec(
                "Requests per pod",
                "Requests the gateway routed to each daemon pod.",
                "reqps",
                (
                    Query(
                        f"sum by (pod) (rate(pagefleet_gateway_requests_total{sel()}[{RATE}]))",
                        "{{pod}}",
                    ),
                ),
            ),
            PanelSpec(
                "Predicted vs actual prefix hits",
                "Prefix tokens the index said the chosen pod holds vs prompt tokens the "
                "daemons actually served from their prefix cache, per second.",
                "short",
                (
                    Query(
                        f"sum(rate(pagefleet_gateway_predicted_hit_tokens_sum{sel()}[{RATE}]))",
                        "predicted (gateway)",
                    ),
                    Query(
                        f"sum(rate(vllm:prefix_cache_hits_total{sel()}[{RATE}]))",
                        "actual (daemons)",
                    ),
                ),
            ),
            PanelSpec(
                "Retries and index errors",
                "Attempts moved to another pod before the first byte, by the pod that "
                "failed; index lookups that failed (routing fell back to load only).",
                "ops",
                (
                    Query(
                        "sum by (pod) (rate(pagefleet_gateway_upstream_retries_total"
                        f"{sel()}[{RATE}]))",
                        "retry from {{pod}}",
                        empty_unless="pagefleet_gateway_upstream_retries",
                    ),
                    Query(
                        f"sum by (op) (rate(pagefleet_gateway_index_errors_total{sel()}[{RATE}]))",
                        "index error {{op}}",
                        empty_unless="pagefleet_gateway_index_errors",
                    ),
                ),
            ),
            PanelSpec(
                "Routing decision latency",
                "Time to rank the pods (index lookup included, tokenizing excluded).",
                "s",
                tuple(
                    Query(
                        f"histogram_quantile({q}, sum by (le) (rate("
                        f"pagefleet_gateway_routing_decision_seconds_bucket{sel()}[{RATE}])))",
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.99)
                ),
            ),
        ),
    ),
    (
        "Prefill/decode disaggregation",
        (
            PanelSpec(
                "KV transfer throughput",
                "KV bytes decode pods pulled from prefill pods per second, per decode pod "
                "(pagefleet:kv_transfer_bytes_total, direction received).",
                "Bps",
                (
                    Query(
                        "sum by (pod) (rate(pagefleet:kv_transfer_bytes_total"
                        + sel()[:-1]
                        + f', direction="received"}}[{RATE}]))',
                        "pulled by {{pod}}",
                    ),
                ),
            ),
            PanelSpec(
                "KV transfer latency",
                "One pull, request to last byte verified, on the decode pod "
                "(pagefleet:kv_transfer_seconds).",
                "s",
                tuple(
                    Query(
                        f"histogram_quantile({q}, sum by (le) (rate("
                        f"pagefleet:kv_transfer_seconds_bucket{sel()}[{RATE}])))",
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.99)
                ),
            ),
            PanelSpec(
                "P/D paths and failed pulls",
                "Gateway: requests prefilled remotely vs locally on the decode pod, by reason "
                "(short_uncached, prefill_saturated, prefill_failed, ...). Decode pods: pulls "
                "that failed and fell back to local prefill, by reason.",
                "reqps",
                (
                    Query(
                        "sum by (path, reason) (rate(pagefleet_gateway_pd_requests_total"
                        f"{sel()}[{RATE}]))",
                        "{{path}} ({{reason}})",
                    ),
                    Query(
                        "sum by (reason) (rate(pagefleet:kv_transfer_pulls_failed_total"
                        f"{sel()}[{RATE}]))",
                        "pull failed: {{reason}}",
                        empty_unless="pagefleet:kv_transfer_pulls_failed",
                    ),
                ),
            ),
            PanelSpec(
                "Transfer handles",
                "Prefill pods: handles whose KV blocks are pinned now (waiting to be pulled "
                "or released), and handles freed by their deadline, never pulled (per second).",
                "short",
                (
                    Query(
                        "sum by (pod) (pagefleet:kv_transfer_handles_active"
                        + sel()[:-1]
                        + ', role="prefill"})',
                        "active {{pod}}",
                    ),
                    Query(
                        "sum by (pod) (rate(pagefleet:kv_transfer_handles_expired_total"
                        + sel()[:-1]
                        + f', role="prefill"}}[{RATE}]))',
                        "expired {{pod}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Autoscaling",
        (
            PanelSpec(
                "Replicas desired vs current vs ready, per role",
                "The operator's autoscaler (roles with autoscaling): what its last decision "
                "asked for, what the Deployment asked for and the Ready pods when it decided.",
                "short",
                tuple(
                    Query(
                        f"sum by (role) (pagefleet_operator_role_{kind}_replicas{_OP})",
                        f"{kind} {{{{role}}}}",
                        empty_unless=f"pagefleet_operator_role_{kind}_replicas",
                    )
                    for kind in ("desired", "current", "ready")
                ),
            ),
            PanelSpec(
                "Autoscaler decisions and operator errors",
                "Decisions by reason per second (ScaledUp, ScaledDown, Steady, InputsUnknown, "
                "...) and failed handler runs.",
                "ops",
                (
                    Query(
                        "sum by (reason) (rate(pagefleet_operator_autoscaler_decisions_total"
                        f"{_OP}[{RATE}]))",
                        "{{reason}}",
                        empty_unless="pagefleet_operator_autoscaler_decisions",
                    ),
                    Query(
                        "sum by (handler) (rate(pagefleet_operator_reconcile_errors_total"
                        f"[{RATE}]))",
                        "errors {{handler}}",
                        empty_unless="pagefleet_operator_reconcile_errors",
                    ),
                ),
            ),
        ),
    ),
)


def all_queries() -> list[tuple[str, Query]]:
    """Every (panel title, query) of the dashboard, in display order."""
    return [(p.title, q) for _, panels in ROWS for p in panels for q in p.queries]


def substitute(expr: str, variables: dict[str, str] | None = None, rate: str = "1m") -> str:
    """The PromQL Grafana would send: dashboard variables replaced by their values.

    Raises ValueError when a `$variable` is left over, so a new variable cannot slip past
    the tests that execute every query."""
    values = {**VARIABLE_DEFAULTS, **(variables or {}), "__rate_interval": rate}
    out = re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), expr)
    if "$" in out:
        raise ValueError(f"unknown dashboard variable left in {out!r}; known: {sorted(values)}")
    return out


# ------------------------------------------------------------------------------- build


def build_dashboard() -> dict[str, object]:
    """The SLO dashboard as Grafana JSON (a dict), deterministic for the drift test."""
    from grafana_foundation_sdk.builders import dashboard as gdash
    from grafana_foundation_sdk.builders import prometheus, timeseries
    from grafana_foundation_sdk.builders.common import VizLegendOptions
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
    from grafana_foundation_sdk.models.dashboard import (
        DashboardCursorSync,
        DataSourceRef,
        VariableOption,
        VariableRefresh,
    )

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")

    def option(value: str) -> VariableOption:
        return VariableOption(selected=True, text=value, value=value)

    def custom(name: str, label: str, choices: tuple[str, ...], doc: str) -> gdash.CustomVariable:
        return (
            gdash.CustomVariable(name)
            .label(label)
            .description(doc)
            .values(",".join(choices))
            .current(option(VARIABLE_DEFAULTS[name]))
        )

    def picker(name: str, label: str, query: str) -> gdash.QueryVariable:
        return (
            gdash.QueryVariable(name)
            .label(label)
            .datasource(ds)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .all_value(".*")
            .multi(True)
            .current(option("$__all"))
        )

    builder = (
        gdash.Dashboard("pagefleet: SLOs, cache and routing")
        .uid(DASHBOARD_UID)
        .description(
            "Generated by `pagefleet dashboards` (pagefleet/dev/dashboards.py); do not edit "
            "the JSON by hand."
        )
        .tags(["pagefleet", "llm", "slo"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(
            gdash.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        )
        .with_variable(
            picker("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)")
        )
        .with_variable(
            picker(
                "inferenceservice",
                "InferenceService",
                'label_values(vllm:num_requests_running{namespace=~"$namespace"}, '
                "inferenceservice)",
            )
        )
        .with_variable(
            custom("ttft_slo", "TTFT target (s)", TTFT_SLO_CHOICES, "spec.slo.ttftMs / 1000")
        )
        .with_variable(
            custom("tpot_slo", "TPOT target (s)", TPOT_SLO_CHOICES, "spec.slo.tpotMs / 1000")
        )
        .with_variable(
            custom(
                "slo_percentile",
                "SLO percentile",
                SLO_PERCENTILE_CHOICES,
                "spec.slo.percentile: the share of requests that must meet the targets",
            )
        )
        .with_variable(
            gdash.TextBoxVariable("replica_cost_per_hour")
            .label("$/hour per daemon replica")
            .description("What one daemon replica (its accelerator and node share) costs")
            .default_value(VARIABLE_DEFAULTS["replica_cost_per_hour"])
        )
    )
    for row_title, panels in ROWS:
        builder = builder.with_row(gdash.Row(row_title))
        for spec in panels:
            panel = (
                timeseries.Panel()
                .title(spec.title)
                .description(spec.description)
                .datasource(ds)
                .unit(spec.unit)
                .height(8)
                .span(24 // len(panels) if len(panels) > 1 else 24)
                .legend(
                    VizLegendOptions()
                    .display_mode(LegendDisplayMode.LIST)
                    .placement(LegendPlacement.BOTTOM)
                    .show_legend(True)
                )
            )
            if spec.unit == "percentunit":
                panel = panel.min(0).max(1)
            for i, q in enumerate(spec.queries):
                panel = panel.with_target(
                    prometheus.Dataquery()
                    .expr(q.expr)
                    .legend_format(q.legend)
                    .ref_id(chr(ord("A") + i))
                    .datasource(ds)
                )
            builder = builder.with_panel(panel)
    encoded = json.dumps(builder.build(), cls=JSONEncoder, sort_keys=True)
    result: dict[str, object] = json.loads(encoded)
    return result


def render_json() -> str:
    """The checked-in file's exact text."""
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


@click.command("dashboards")
@click.option(
    "-o",
    "--out-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("helm/pagefleet/dashboards"),
    show_default=True,
    help="Directory to write the dashboard JSON into (the chart ships it as a ConfigMap).",
)
def command(out_dir: Path) -> None:
    """Generate the Grafana dashboards from pagefleet/dev/dashboards.py."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / DASHBOARD_FILE
    path.write_text(render_json())
    click.echo(f"wrote {path}", err=True)
