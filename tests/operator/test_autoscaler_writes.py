"""What the autoscaler writes when a write fails: the pod-deletion-cost mark of a
scale-down that did not happen, and a Deployment the operator may not write. Real daemons'
/metrics over HTTP, real Redis heartbeats, the in-memory API (helpers from
test_autoscaler.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_kube import FakeKube
from test_autoscaler import NAME, NS, Clock, MetricsServers, heartbeat, make, replicas, tick, world

from pagefleet.dev.redis_server import LocalRedis
from pagefleet.operator.autoscaler import DELETION_COST
from pagefleet.operator.kube import DEPLOYMENT, Kind, KubeError


@pytest.fixture(scope="module")
def redis() -> Iterator[str]:
    with LocalRedis() as server:
        yield server.url


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
