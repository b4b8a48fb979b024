"""What the autoscaler writes when a write fails: the pod-deletion-cost mark of a
scale-down that did not happen, and a Deployment the operator may not write. Real daemons'
/metrics over HTTP, real Redis heartbeats, the in-memory API (helpers from
test_autoscaler.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_kube import FakeKube
from fake_prometheus import FakePrometheus, vector
from test_autoscaler import (
    NAME,
    NS,
    Clock,
    MetricsServers,
    heartbeat,
    make,
    make_prometheus,
    replicas,
    scaling_active,
    tick,
    world,
)

from pagefleet.operator.kube import DEPLOYMENT, Kind, KubeError
from pagefleet.operator.victims import DELETION_COST


@pytest.fixture
def servers() -> Iterator[MetricsServers]:
    s = MetricsServers()
    yield s
    s.close()


def _spec(kube: FakeKube) -> dict[str, Any]:
    obj = kube.obj("InferenceService", NS, NAME)
    assert obj is not None
    spec: dict[str, Any] = obj["spec"]
    return spec


# ------------------------------------------- a scale-down that did not happen; API refusals


class RefusingKube(FakeKube):
    """Refuses writes of Deployments: ``refusals`` times (-1: always)."""

    def __init__(self, refusals: int, error: KubeError) -> None:
        super().__init__()
        self.refusals = refusals
        self.error = error

    def merge_patch(self, kind: Kind, namespace: str, name: str, patch: Any) -> Any:
        if kind is DEPLOYMENT and self.refusals != 0:
            self.refusals -= 1
            raise self.error
        return super().merge_patch(kind, namespace, name, patch)


def test_the_deletion_cost_of_a_scale_down_that_did_not_happen_is_cleared(
    redis: str, servers: MetricsServers
) -> None:
    """The cheapest pod is marked before the Deployment's replicas are lowered. When that
    write failed and the next decision was no scale-down (here minReplicas was raised
    meanwhile), the mark stayed: the next scale-down by anyone else (a `kubectl scale`,
    maxReplicas lowered, a rollout's old ReplicaSet) removed that pod first, whatever it
    held by then."""
    kube = RefusingKube(1, KubeError(409, "the object has been modified"))
    clock, events = Clock(), []
    pods = [("chat-a", "127.0.0.2"), ("chat-b", "127.0.0.3"), ("chat-c", "127.0.0.4")]
    world(kube, redis, 3, pods)
    for (pod, ip), blocks in zip(pods, (50, 7, 30), strict=True):
        servers.add(pod, ip)
        heartbeat(redis, pod, running=0, num_cached_blocks=blocks)
    scaler = make(kube, clock)
    tick(scaler, kube, events)
    clock.t += 1
    (out,) = tick(scaler, kube, events)
    assert out.decision.reason.value == "ScaledDown" and out.victim == "chat-b"
    assert ("Warning", "ScalingFailed") in [(t, r) for t, r, _ in events]
    assert replicas(kube) == 3
    b = kube.obj("Pod", NS, "chat-b")
    assert b is not None and DELETION_COST in b["metadata"]["annotations"]

    _spec(kube)["roles"]["unified"]["autoscaling"]["minReplicas"] = 3
    clock.t += 1
    (out,) = tick(scaler, kube, events)
    assert out.decision.desired == 3, out.decision.message
    for pod, _ in pods:
        obj = kube.obj("Pod", NS, pod)
        assert obj is not None
        assert DELETION_COST not in (obj["metadata"].get("annotations") or {}), pod


def test_a_deployment_the_operator_cannot_write_is_one_event_and_a_condition(
    redis: str,
) -> None:
    """A write refused for good (RBAC, an admission webhook) posted a ScalingFailed Event
    on every pass (every 5 s: 720 an hour, each its own object), while the status said
    desiredReplicas 4 and ScalingActive True: nothing that stays said the count is not
    what the autoscaler decided."""
    refusal = KubeError(403, 'deployments.apps "chat-unified" is forbidden')
    kube, clock, events = RefusingKube(-1, refusal), Clock(), []
    world(kube, redis, 6, [])  # above maxReplicas 4: the autoscaler moves it to 4
    scaler = make(kube, clock)
    for _ in range(5):
        (out,) = tick(scaler, kube, events)
        clock.t += 1
    assert out.decision.reason.value == "AboveMax" and replicas(kube) == 6
    failed = [m for t, r, m in events if r == "ScalingFailed"]
    assert len(failed) == 1, failed
    cond = scaling_active(kube)
    assert cond["status"] == "False" and cond["reason"] == "ScalingFailed", cond
    assert "forbidden" in cond["message"]

    kube.refusals = 0  # the permission is granted
    (out,) = tick(scaler, kube, events)
    assert replicas(kube) == 4
    assert scaling_active(kube)["status"] == "True"
    # A new refusal after a success is news again.
    kube.refusals = -1
    _spec(kube)["roles"]["unified"]["autoscaling"]["maxReplicas"] = 3
    clock.t += 1
    tick(scaler, kube, events)
    assert len([r for _, r, _ in events if r == "ScalingFailed"]) == 2


def test_a_steady_fleet_with_a_wobbling_load_posts_no_event_per_pass(redis: str) -> None:
    """A fleet of 2 whose load wobbles around what 1 replica could carry: each pass's
    recommendation is 2 (Steady) or 1 (held by the scale-down window: ScaleDownStabilizing).
    An Event was posted on every change of reason, so a steady fleet posted one nearly every
    pass (12 in 12 passes here, 720 an hour at 5 s). Nothing moved and nothing is wrong:
    the status carries the reason; Events are for changes and for problems."""
    pods = ["chat-a", "chat-b"]
    gen = {"rate": 0.0}

    def answer(query: str) -> bytes:
        if "histogram_quantile" in query:
            return vector({})
        if "generation_tokens" in query:
            return vector(dict.fromkeys(pods, gen["rate"]))
        if "num_requests_running" in query:
            return vector(dict.fromkeys(pods, 1.0))  # the marked pod is busy: no idle release
        return vector(dict.fromkeys(pods, 0.0))

    prom = FakePrometheus()
    prom.answer = answer
    try:
        kube, clock, events = FakeKube(), Clock(), []
        world(
            kube, redis, 2, [(p, f"127.0.0.{i + 2}") for i, p in enumerate(pods)],
            scaleDownWindowSeconds=300, decodeTokensPerSecond=100, replicaStartupSeconds=0,
        )  # fmt: skip
        scaler = make_prometheus(kube, clock, prom.url)
        reasons = []
        for i in range(12):
            gen["rate"] = 48.0 if i % 2 == 0 else 40.0  # 96 or 80 tok/s at 100 per replica
            (out,) = tick(scaler, kube, events)
            reasons.append(out.decision.reason.value)
            clock.t += 5
    finally:
        prom.close()
    assert set(reasons) == {"Steady", "ScaleDownStabilizing"}, reasons
    assert replicas(kube) == 2
    assert len(events) <= 1, events  # the first decision's, at most
    # A change of the count, or a problem, is still an Event at once.
    _spec(kube)["roles"]["unified"]["autoscaling"]["minReplicas"] = 3
    tick(scaler, kube, events)
    assert [r for _, r, _ in events][-1] == "BelowMin"


def test_a_scale_down_by_several_marks_as_many_pods(redis: str, servers: MetricsServers) -> None:
    """maxReplicas lowered from 4 to 2 (or a maxScaleDownStep above 1) removes two pods, but
    only the cheapest one was marked: the ReplicaSet chose the other by its own ranking
    (here it may take chat-a, the pod holding 90 cached blocks). Every pod to go is marked,
    cheapest first."""
    kube, clock, events = FakeKube(), Clock(), []
    pods = [("chat-a", "127.0.0.2"), ("chat-b", "127.0.0.3"), ("chat-c", "127.0.0.4")]
    pods.append(("chat-d", "127.0.0.5"))
    world(kube, redis, 4, pods, maxReplicas=6)
    for (pod, ip), blocks in zip(pods, (90, 7, 30, 60), strict=True):
        servers.add(pod, ip)
        heartbeat(redis, pod, running=0, num_cached_blocks=blocks)
    scaler = make(kube, clock)
    tick(scaler, kube, events)
    _spec(kube)["roles"]["unified"]["autoscaling"]["maxReplicas"] = 2
    clock.t += 1
    (out,) = tick(scaler, kube, events)
    assert out.decision.reason.value == "AboveMax" and replicas(kube) == 2
    marked = {
        pod
        for pod, _ in pods
        if ((kube.obj("Pod", NS, pod) or {})["metadata"].get("annotations") or {}).get(
            DELETION_COST
        )
    }
    assert marked == {"chat-b", "chat-c"}, marked  # the two with the fewest cached blocks
    assert any("chat-b" in m and "chat-c" in m for _, r, m in events if r == "AboveMax")


def test_a_failed_scale_up_keeps_the_scale_down_window(redis: str, servers: MetricsServers) -> None:
    """A refused write undid the decision's scale time, as it should (the count did not
    move), but by starting the planner's state afresh: the scale-down window's
    recommendations went too, so the pass after a failed 2 -> 4 scale-up scaled down to 1
    on the first dip, with the window (300 s) full of recommendations of 4."""
    kube = RefusingKube(1, KubeError(500, "etcdserver: request timed out"))
    clock, events = Clock(), []
    pods = [("chat-a", "127.0.0.2"), ("chat-b", "127.0.0.3")]
    world(kube, redis, 2, pods, scaleDownWindowSeconds=300)
    daemons = [servers.add(pod, ip) for pod, ip in pods]
    for pod, _ in pods:  # a request each: the marked pod is busy, no idle release
        heartbeat(redis, pod, running=1, num_cached_blocks=10)
    scaler = make(kube, clock)
    tick(scaler, kube, events)
    for d in daemons:
        d.serve_requests(n=50, prompt=120, cached=20, out=8, ttft=0.9)
    clock.t += 1
    (out,) = tick(scaler, kube, events)
    assert out.decision.reason.value == "ScaledUp" and out.failure is not None
    assert replicas(kube) == 2
    clock.t += 1
    (out,) = tick(scaler, kube, events)  # the load is gone
    assert replicas(kube) == 2, out.decision.message
    assert out.decision.reason.value == "ScaleDownStabilizing", out.decision.message
