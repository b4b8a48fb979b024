"""Scale-downs the spec asks for (a lowered ``replicas`` or ``autoscaling.maxReplicas``) take
the pods the autoscaler would: the kopf handlers' pass over the in-memory API, with real
Redis heartbeats read as the autoscaler reads them."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest
from fake_kube import FakeKube
from test_autoscaler import Clock, heartbeat, make

from pagefleet.operator import handlers
from pagefleet.operator.builders import BuildSettings
from pagefleet.operator.handlers import OperatorContext
from pagefleet.operator.kube import KubeError
from pagefleet.operator.victims import DELETION_COST, VICTIM_COST

NS, NAME = "ml", "chat"  # test_autoscaler's service: its heartbeat() writes there
# (pod, cached blocks in the index): chat-b and chat-d hold the least.
PODS = [("chat-a", 90), ("chat-b", 7), ("chat-c", 30), ("chat-d", 12)]


@pytest.fixture(autouse=True)
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    events: list[tuple[str, str, str]] = []

    def recorder(body: Any) -> Any:
        return lambda t, r, m: events.append((t, r, m))

    # kopf.event needs a running operator's posting queue; record instead.
    monkeypatch.setattr(handlers, "_recorder", recorder)
    return events


def _world(redis: str, role: dict[str, Any], running: int) -> OperatorContext:
    """A service whose unified role runs ``running`` Ready pods (heartbeats in Redis) and
    whose first pass has been made."""
    kube = FakeKube()
    ctx = OperatorContext(kube=kube, settings=BuildSettings(), autoscaler=make(kube, Clock()))
    kube.add(
        {
            "apiVersion": "pagefleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NS, "generation": 1},
            "spec": {
                "model": {"source": {"path": "tiny"}},
                "roles": {"unified": role},
                "index": {"redisURL": redis},
            },
        }
    )
    _pass(ctx)
    kube.objects[("Deployment", NS, f"{NAME}-unified")]["spec"]["replicas"] = running
    labels = {
        "pagefleet.io/service": NAME,
        "pagefleet.io/role": "unified",
        "app.kubernetes.io/managed-by": "pagefleet-operator",
    }
    for pod, blocks in PODS[:running]:
        kube.add(
            {
                "kind": "Pod",
                "metadata": {"name": pod, "namespace": NS, "labels": labels},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            }
        )
        heartbeat(redis, pod, running=0, num_cached_blocks=blocks)
    return ctx


def _pass(ctx: OperatorContext) -> None:
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    body = kube.obj("InferenceService", NS, NAME)
    handlers.on_change(body=kopf.Body(copy.deepcopy(body)), memo=kopf.Memo(ctx=ctx))


def _edit_role(ctx: OperatorContext, role: dict[str, Any]) -> None:
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    obj = kube.objects[("InferenceService", NS, NAME)]
    obj["spec"]["roles"]["unified"] = role
    obj["metadata"]["generation"] += 1
    _pass(ctx)


def _marked(ctx: OperatorContext) -> set[str]:
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    return {
        pod
        for pod, _ in PODS
        if (obj := kube.obj("Pod", NS, pod)) is not None
        and (obj["metadata"].get("annotations") or {}).get(DELETION_COST) == VICTIM_COST
    }


def _replicas(ctx: OperatorContext) -> int:
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    deploy = kube.obj("Deployment", NS, f"{NAME}-unified")
    assert deploy is not None
    return int(deploy["spec"]["replicas"])


def _marks_before_the_write(ctx: OperatorContext) -> None:
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    calls = kube.calls
    write = max(i for i, c in enumerate(calls) if c == ("apply", "Deployment", f"{NAME}-unified"))
    marks = [i for i, c in enumerate(calls) if c[:2] == ("merge_patch", "Pod")]
    assert marks and max(marks) < write, calls


def test_a_lowered_max_replicas_removes_the_pods_the_autoscaler_would(
    redis: str, recorded: list[tuple[str, str, str]]
) -> None:
    """maxReplicas 6 -> 2 on a role at 4: the pass applied replicas 2 at once, unmarked,
    and the ReplicaSet picked the two pods to go by its own ranking (chat-a, holding 90
    cached blocks, as likely as any)."""
    auto = {"minReplicas": 1, "maxReplicas": 6}
    ctx = _world(redis, {"autoscaling": auto}, running=4)
    _edit_role(ctx, {"autoscaling": {**auto, "maxReplicas": 2}})
    assert _replicas(ctx) == 2
    assert _marked(ctx) == {"chat-b", "chat-d"}
    _marks_before_the_write(ctx)
    (message,) = [m for _, r, m in recorded if r == "ScalingDown"]
    assert "4 -> 2" in message and "chat-b, chat-d" in message, message


def test_lowered_fixed_replicas_remove_the_cheapest_pods(redis: str) -> None:
    ctx = _world(redis, {"replicas": 3}, running=3)
    _edit_role(ctx, {"replicas": 1})
    assert _replicas(ctx) == 1
    assert _marked(ctx) == {"chat-b", "chat-c"}
    _marks_before_the_write(ctx)


def test_the_marks_of_a_scale_down_reverted_before_it_happened_are_cleared(redis: str) -> None:
    """The marks are written, the Deployment write fails (transient: kopf retries), and the
    spec goes back to 3 before the retry: the marked pods would be the first to go in any
    later scale-down, whatever they hold by then."""
    ctx = _world(redis, {"replicas": 3}, running=3)
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    kube.fail_next["apply"] = KubeError(503, "the API server is busy")
    with pytest.raises(kopf.TemporaryError):
        _edit_role(ctx, {"replicas": 1})
    assert _replicas(ctx) == 3 and _marked(ctx) == {"chat-b", "chat-c"}
    _edit_role(ctx, {"replicas": 3})
    assert _replicas(ctx) == 3 and _marked(ctx) == set()


def test_without_heartbeats_the_scale_down_still_marks_not_ready_pods_first(redis: str) -> None:
    """Redis unreadable (here: no autoscaler to read it): loads are unknown, readiness
    still ranks, and the count still goes down."""
    ctx = _world(redis, {"replicas": 3}, running=3)
    ctx.autoscaler = None
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    kube.objects[("Pod", NS, "chat-c")]["status"]["conditions"][0]["status"] = "False"
    _edit_role(ctx, {"replicas": 2})
    assert _replicas(ctx) == 2 and _marked(ctx) == {"chat-c"}
