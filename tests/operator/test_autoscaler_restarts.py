"""Restarts on the autoscaler's live path: a daemon that restarts in place (its counters
begin again at zero) and an operator that restarts mid-scale (its memory is gone). Real
daemons' /metrics over HTTP, real Redis heartbeats, the in-memory API (helpers from
test_autoscaler.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_kube import FakeKube
from test_autoscaler import PORT, Clock, MetricsServers, heartbeat, tick, world

from pagefleet.daemon.metrics import DaemonMetrics
from pagefleet.dev.redis_server import LocalRedis
from pagefleet.operator.autoscaler import Autoscaler, AutoscalerSettings
from pagefleet.operator.builders import BuildSettings
from pagefleet.operator.metrics import OperatorMetrics
from pagefleet.testing.engine_stats import idle_engine_stats


@pytest.fixture(scope="module")
def redis() -> Iterator[str]:
    with LocalRedis() as server:
        yield server.url


@pytest.fixture
def servers() -> Iterator[MetricsServers]:
    s = MetricsServers()
    yield s
    s.close()


# --------------------------------------------------------------------- a pod that restarts


def test_a_daemon_restart_costs_one_interval_not_the_rate_window(
    redis: str, servers: MetricsServers
) -> None:
    """A daemon restarting in place (same pod, counters from zero) made its next delta
    unknown, as it should; but the scrapes from before the restart stayed in the rate
    window's history and every later delta started from the oldest of them, so the pod
    stayed unknown (holding every scale-down as InputsPartial) for the whole window (30 s
    by default), or, once its new counters passed the old ones, reported a rate diluted
    over the restart."""
    kube, clock, events = FakeKube(), Clock(), []
    world(kube, redis, 1, [("chat-a", "127.0.0.2")])
    a = servers.add("chat-a", "127.0.0.2")
    heartbeat(redis, "chat-a", running=1, num_cached_blocks=5)
    scaler = Autoscaler(
        kube,
        BuildSettings(),
        AutoscalerSettings(scrape_timeout_s=1.0, metrics_port=PORT, rate_window_s=30.0),
        OperatorMetrics(),
        clock=clock,
    )

    def step() -> Any:
        clock.t += 1
        (out,) = tick(scaler, kube, events)
        return out

    a.serve_requests(n=20, prompt=100, cached=0, out=4, ttft=0.1)
    step()  # first scrape
    a.serve_requests(n=5, prompt=100, cached=0, out=4, ttft=0.1)
    assert step().inputs.observation.known_pods == 1
    # The container restarts: same pod and uid, every counter from zero.
    a.metrics = DaemonMetrics("tiny", "unified", "chat-a")
    a.stats = idle_engine_stats(num_blocks=100)
    a.metrics.update_stats(a.stats)
    out = step()
    assert out.inputs.observation.known_pods == 0  # the restart's interval: no rate
    a.serve_requests(n=5, prompt=100, cached=0, out=4, ttft=0.1)
    out = step()
    assert out.inputs.observation.known_pods == 1, [p.error for p in out.inputs.pods]
    # The rate is the new process's alone: 500 uncached tokens since the restart's scrape.
    (report,) = out.inputs.pods
    assert report.delta is not None and report.delta.prompt_tokens == 500
