"""Reading a daemon's /metrics (signals.py): a histogram that is not one makes the pod
unknown, never a latency the planner believes."""

from __future__ import annotations

import re

import pytest

from pagefleet.daemon.metrics import DaemonMetrics
from pagefleet.engine.outputs import RequestMetrics
from pagefleet.operator.signals import TTFT, MetricsError, parse_metrics, quantile
from pagefleet.testing.engine_stats import idle_engine_stats


def _daemon_text(n: int, ttft: float) -> str:
    metrics = DaemonMetrics("tiny", "unified", "pod-a")
    metrics.update_stats(idle_engine_stats(num_blocks=100))
    for _ in range(n):
        times = RequestMetrics(
            arrival_time=0.0,
            first_scheduled_time=0.0,
            first_token_time=ttft,
            last_token_time=ttft + 0.03,
            finished_time=ttft + 0.03,
        )
        metrics.observe_request(times, 4)
    return metrics.render().decode()


def test_a_histogram_whose_buckets_are_not_cumulative_makes_the_pod_unknown() -> None:
    """Ten requests at 2 s, but the le="0.1" bucket says 100 (a broken exporter, or series
    of different bucket layouts summed): the cumulative counts go down from 0.1 to 0.25.
    It was read as a TTFT p95 of 82 ms, a comfortable SLO that the planner's capacity
    probe then learns from (+3% per pass)."""
    text = _daemon_text(10, ttft=2.0)
    snap = parse_metrics(text, t=0.0)
    p95 = quantile(0.95, snap.buckets[TTFT])
    assert p95 is not None and 1.0 < p95 <= 2.5  # the real histogram: about 2 s
    broken, n = re.subn(
        r'(vllm:time_to_first_token_seconds_bucket\{le="0\.1",[^}]*\}) 0\.0', r"\1 100.0", text
    )
    assert n == 1
    with pytest.raises(MetricsError, match="not cumulative"):
        parse_metrics(broken, t=0.0)
