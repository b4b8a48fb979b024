"""Restarts on the autoscaler's live path: a daemon that restarts in place (its counters
begin again at zero) and an operator that restarts mid-scale (its memory is gone). Real
daemons' /metrics over HTTP, real Redis heartbeats, the in-memory API (helpers from
test_autoscaler.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_kube import FakeKube
from test_autoscaler import (
    NAME,
    NS,
    PORT,
    Clock,
    MetricsServers,
    heartbeat,
    make,
    replicas,
    tick,
    world,
)

from pagefleet.daemon.metrics import DaemonMetrics
from pagefleet.operator.autoscaler import Autoscaler, AutoscalerSettings
from pagefleet.operator.builders import BuildSettings
from pagefleet.operator.metrics import OperatorMetrics
from pagefleet.testing.engine_stats import idle_engine_stats


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


def _ready_pod(kube: FakeKube, pod: str, ip: str) -> None:
    labels = {"pagefleet.io/service": NAME, "pagefleet.io/role": "unified"}
    kube.add(
        {
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": NS, "labels": labels},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        }
    )


# ----------------------------------------------------------- an operator that restarts


def test_an_operator_restart_keeps_the_stabilization_windows(
    redis: str, servers: MetricsServers
) -> None:
    """The planner's memory (last scale time, the scale-down window's recommendations,
    learned capacity) lived only in the operator. A restart a few seconds after a scale-up
    forgot all of it: the next pass with a dip in the load scaled down at once, through
    both the 30 s scale-up window and the 300 s scale-down window, and planned on the
    spec's capacity hint instead of the learned one. The status holds what is needed."""
    kube, clock, events = FakeKube(), Clock(), []
    world(
        kube, redis, 1, [("chat-a", "127.0.0.2")],
        scaleUpWindowSeconds=30, scaleDownWindowSeconds=300,
    )  # fmt: skip
    a = servers.add("chat-a", "127.0.0.2")
    heartbeat(redis, "chat-a", running=2, num_cached_blocks=50)
    first = make(kube, clock)
    tick(first, kube, events)
    a.serve_requests(n=50, prompt=120, cached=20, out=8, ttft=0.9)
    clock.t += 1
    (out,) = tick(first, kube, events)
    assert out.decision.reason.value == "ScaledUp" and replicas(kube) == 3
    # What this operator learned by now (the figure the status carries; a made-up one, so
    # that it differs from the spec's hint of 1000).
    stored = kube.obj("InferenceService", NS, NAME)
    assert stored is not None
    stored["status"]["roles"][0]["autoscaling"]["prefillTokensPerSecond"] = 640.0

    # The new pods are up; the load is gone (each pod still holds a request, so the pod a
    # scale-down removes is busy: no idle release).
    for pod, ip in (("chat-b", "127.0.0.3"), ("chat-c", "127.0.0.4")):
        servers.add(pod, ip)
        _ready_pod(kube, pod, ip)
    for pod, blocks in (("chat-a", 50), ("chat-b", 7), ("chat-c", 30)):
        heartbeat(redis, pod, running=1, num_cached_blocks=blocks)

    restarted = make(kube, clock)  # the operator restarts: a fresh process
    clock.t += 5
    tick(restarted, kube, events)  # first scrape of every pod
    state = restarted.memory[(NS, NAME, "unified")].state
    assert state.prefill_capacity == 640.0
    clock.t += 1
    (out,) = tick(restarted, kube, events)
    assert replicas(kube) == 3, out.decision.message
    assert out.decision.reason.value == "ScaleDownStabilizing", out.decision.message
    clock.t += 40  # past the scale-up window, within the scale-down window
    (out,) = tick(restarted, kube, events)
    assert replicas(kube) == 3, out.decision.message
    assert out.decision.reason.value == "ScaleDownStabilizing", out.decision.message
