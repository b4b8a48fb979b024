"""Prometheus metrics of one gateway, in its own registry (no process-global state).

Names are prefixed ``pagefleet_gateway_``; labels stay low-cardinality (policy, pod, status
class), pods being bounded by the fleet size: a pod's series are removed once it has left
discovery with nothing in flight (``forget_pod``), as pod names change on every rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

# Seconds; the daemon's latency boundaries (pagefleet/daemon/metrics.py), so every SLO target
# the chart and dashboard accept (a daemon bucket boundary) is one here too: the client-side
# TTFT can be read against `le="<target>"` and compared with the daemon's, bucket for bucket.
# tests/observability/test_histogram_buckets.py keeps the two equal.
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
# Fine around the 2 ms budget of the gateway's own work per request.
_OVERHEAD_BUCKETS = (
    0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.1
)  # fmt: skip
_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    requests: Counter = field(init=False)
    responses: Counter = field(init=False)
    retries: Counter = field(init=False)
    predicted_hit_tokens: Histogram = field(init=False)
    prompt_tokens_total: Counter = field(init=False)
    decision_seconds: Histogram = field(init=False)
    upstream_ttft_seconds: Histogram = field(init=False)
    upstream_latency_seconds: Histogram = field(init=False)
    index_errors: Counter = field(init=False)
    inflight: Gauge = field(init=False)
    inflight_body_bytes: Gauge = field(init=False)
    overhead_seconds: Histogram = field(init=False)
    rejected: Counter = field(init=False)
    broken_streams: Counter = field(init=False)
    client_cuts: Counter = field(init=False)
    unhealthy: Counter = field(init=False)
    placements: Counter = field(init=False)
    arrivals: Counter = field(init=False)
    arrival_prompt_tokens: Counter = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        p = "pagefleet_gateway_"
        self.requests = Counter(
            p + "requests",
            "Requests routed, by policy and chosen pod.",
            ["policy", "pod"],
            registry=r,
        )
        self.responses = Counter(
            p + "responses",
            "Responses returned, by upstream pod and HTTP status code (the gateway's own 502 "
            "or 504 for that pod's answer included).",
            ["pod", "code"],
            registry=r,
        )
        self.retries = Counter(
            p + "upstream_retries",
            "Attempts moved to the next pod after a failure before "
            "the first byte, by the pod that failed.",
            ["pod"],
            registry=r,
        )
        self.predicted_hit_tokens = Histogram(
            p + "predicted_hit_tokens",
            "Prefix tokens the index said the chosen pod holds.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens_total = Counter(
            p + "prompt_tokens", "Prompt tokens seen by the router.", registry=r
        )
        self.decision_seconds = Histogram(
            p + "routing_decision_seconds",
            "Time to rank pods: tokenize excluded, index lookup included.",
            ["policy"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.upstream_ttft_seconds = Histogram(
            p + "upstream_ttft_seconds",
            "Time from forwarding a streaming request to its first upstream body byte: the "
            "chunk of the first generated token, the client's TTFT less the gateway's own "
            "parse and routing time. Behind prefill/decode disaggregation (early hand-over) "
            "it spans the remote prefill and the KV pull, which neither pod's "
            "vllm:time_to_first_token_seconds does.",
            ["pod"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_latency_seconds = Histogram(
            p + "upstream_latency_seconds",
            "Time from forwarding to the last upstream byte.",
            ["pod"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.index_errors = Counter(
            p + "index_errors",
            "Index calls that failed or timed out (routing fell back to load only).",
            ["op"],
            registry=r,
        )
        self.inflight = Gauge(
            p + "inflight_requests",
            "Requests this gateway has open per pod.",
            ["pod"],
            registry=r,
        )

        self.inflight_body_bytes = Gauge(
            p + "inflight_body_bytes",
            "Bytes of request bodies the open requests hold, against --max-inflight-body-mb.",
            registry=r,
        )
        self.overhead_seconds = Histogram(
            p + "overhead_seconds",
            "The gateway's own time per served request: parse, tokenize, index lookup and "
            "ranking before the upstream request is sent, plus relaying the first chunk.",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            p + "rejected_requests",
            "Requests the gateway answered itself without a pod, by reason: 429 concurrency; "
            "503 connections (refused at accept), body_budget, no_endpoints, intake_failed; "
            "413 too_large; 408 body_timeout; "
            "404 model_not_found; 400 context_length, invalid; "
            "502 upstream_unavailable, 504 upstream_timeout (every candidate pod failed "
            "before answering).",
            ["reason"],
            registry=r,
        )
        self.broken_streams = Counter(
            p + "broken_streams",
            "Streams that broke after their first byte (ended with an error event).",
            ["pod"],
            registry=r,
        )
        self.client_cuts = Counter(
            p + "client_cuts",
            "Clients cut for not reading, their pod requests ended, by reason (write_timeout: "
            "a write waited --client-write-timeout).",
            ["reason"],
            registry=r,
        )
        self.unhealthy = Counter(
            p + "pod_unhealthy",
            "Times a pod was marked unhealthy (timeout or failed probe).",
            ["pod"],
            registry=r,
        )

        self.placements = Counter(
            p + "placements",
            "Requests by where they were sent against the longest known prefix: "
            "best_prefix (a pod holding it), moved (away from every pod holding it), "
            "new_prefix (no pod holds any of it), no_index (a policy that does not look); and by "
            "the policy's reason.",
            ["placement", "reason"],
            registry=r,
        )

        # The operator's autoscaler reads these two as its leading signal: a request counts
        # here when it is routed, before it queues on a pod (pagefleet/operator/signals.py).
        self.arrivals = Counter(
            p + "arrivals",
            "Requests routed to the model pods (counted when routed, before any queueing).",
            registry=r,
        )
        self.arrival_prompt_tokens = Counter(
            p + "arrival_prompt_tokens",
            "Uncached prompt tokens of routed requests: prompt tokens minus the prefix the "
            "index says the first-ranked pod holds.",
            registry=r,
        )

    def forget_pod(self, pod: str) -> None:
        """Remove every series labelled with ``pod`` (a pod that left for good)."""
        for metric in (
            self.requests,
            self.responses,
            self.retries,
            self.upstream_ttft_seconds,
            self.upstream_latency_seconds,
            self.inflight,
            self.broken_streams,
            self.unhealthy,
        ):
            _remove_pod_series(metric, pod)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _remove_pod_series(metric: MetricWrapperBase, pod: str) -> None:
    """Remove ``metric``'s series whose ``pod`` label is ``pod``, whatever its other labels."""
    remove_by_labels = getattr(metric, "remove_by_labels", None)
    if remove_by_labels is not None:
        remove_by_labels({"pod": pod})
        return
    # Older prometheus-client releases (the pin allows them) match whole label sets only:
    # walk the series the metric holds.
    at = metric._labelnames.index("pod")
    for values in list(metric._metrics):
        if values[at] == pod:
            metric.remove(*values)
