"""Latency histograms can be read against every SLO target the chart and dashboard accept.

Goodput and burn rates are read from a bucket (`le="<target>"`), and a quantile near the
target is only as good as the boundaries around it. Checked on what the real registries
expose (prometheus-client's text format, parsed back), not on the bucket constants: the
daemon's TTFT/TPOT, and the gateway's upstream TTFT (the client-side TTFT) against the
same targets, so the two can be compared bucket for bucket.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagefleet.daemon.metrics import DaemonMetrics
from pagefleet.dev.dashboards import TPOT_SLO_CHOICES, TTFT_SLO_CHOICES
from pagefleet.gateway.metrics import GatewayMetrics


def _boundaries(exposition: bytes, family: str) -> dict[str, list[str]]:
    """Every histogram of ``family``'s ``le`` labels, as written, keyed by series name."""
    out: dict[str, list[str]] = {}
    for fam in text_string_to_metric_families(exposition.decode()):
        if fam.name != family:
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                out.setdefault(s.name, []).append(s.labels["le"])
    assert out, f"{family} not exported"
    return out


def _exposed() -> tuple[bytes, bytes]:
    daemon = DaemonMetrics("tiny", "unified", "pod-0")
    daemon.ttft.observe(0.3)
    daemon.tpot.observe(0.03)
    gateway = GatewayMetrics()
    gateway.upstream_ttft_seconds.labels(pod="pod-0").observe(0.3)
    gateway.upstream_latency_seconds.labels(pod="pod-0").observe(0.9)
    return daemon.render(), gateway.render()


def _brackets(les: list[str], target: str) -> None:
    """``target`` is a boundary, with neighbours close enough (within 2.5x) that a quantile
    interpolated near it says something."""
    assert target in les, f"no bucket le={target!r} in {les}"
    finite = [float(x) for x in les if x != "+Inf"]
    i = finite.index(float(target))
    assert 0 < i < len(finite) - 1, f"{target} is an end bucket of {les}"
    assert finite[i] / finite[i - 1] <= 2.5 and finite[i + 1] / finite[i] <= 2.5, les


def test_every_slo_target_is_a_bucket_of_the_daemon_and_the_gateway_ttft() -> None:
    daemon, gateway = _exposed()
    ttft = _boundaries(daemon, "vllm:time_to_first_token_seconds")
    tpot = _boundaries(daemon, "vllm:request_time_per_output_token_seconds")
    client = _boundaries(gateway, "pagefleet_gateway_upstream_ttft_seconds")
    for target in TTFT_SLO_CHOICES:
        for les in (*ttft.values(), *client.values()):
            _brackets(les, target)
    for target in TPOT_SLO_CHOICES:
        for les in tpot.values():
            _brackets(les, target)


def test_gateway_and_daemon_latency_histograms_share_their_boundaries() -> None:
    daemon, gateway = _exposed()
    (ttft,) = _boundaries(daemon, "vllm:time_to_first_token_seconds").values()
    for family in (
        "pagefleet_gateway_upstream_ttft_seconds",
        "pagefleet_gateway_upstream_latency_seconds",
    ):
        (les,) = _boundaries(gateway, family).values()
        assert les == ttft, family
