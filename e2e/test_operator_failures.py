"""Faults around the operator (issue 14): daemons that cannot start, an operator killed
mid-reconcile.

A model path that does not exist makes every daemon exit at start-up with a one-line cause
in its termination-message file; the node agent reports it as the container's
lastState.terminated.message with a rising restartCount, as a kubelet does, and the
operator turns it into Degraded=True / CrashLoopBackOff carrying that message. Fixing the
path rolls out pods that start, and Degraded clears. Along the way: the hardened pod
fields and the NetworkPolicies exist on the real API server.

The operator here is this module's own (same identity and flags as test_operator.py's) so a
test can SIGKILL it halfway through a pass and start it again: the service must converge
with exactly one of every object.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from e2e.cluster import ControlPlane, eventually
from e2e.kube_client import KubeClient
from e2e.kube_helpers import live_pods, tiny_checkpoint
from e2e.operator_process import OperatorProcess
from e2e.test_operator import (
    API,
    PAGEFLEET,
    _wait_ready,
    apply,
    condition,
    events_for,
    get_is,
    infsvc,
    redis_url,  # noqa: F401  (module-scoped fixture)
)

pytestmark = pytest.mark.e2e


def test_crash_looping_daemons_degrade_with_their_last_words_then_recover(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    operator: OperatorProcess,
    redis_url: str,  # noqa: F811
) -> None:
    t0 = time.monotonic()
    missing = "/nonexistent/pagefleet-e2e/model"
    spec = {
        "model": {"source": {"path": missing}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 4},
        "roles": {"unified": {"replicas": 1}},
        "router": {"replicas": 0},
        "index": {"redisURL": redis_url},
    }
    res = apply(cluster, infsvc("broken", namespace, spec))
    assert res.returncode == 0, res.stderr

    def degraded() -> dict | bool:
        cond = condition(get_is(kube, namespace, "broken"), "Degraded")
        return cond if cond.get("status") == "True" else False

    cond = eventually(degraded, 180, "Degraded=True for the crash-looping daemon")
    degraded_s = time.monotonic() - t0
    assert cond["reason"] == "CrashLoopBackOff", cond
    assert "unified pod broken-unified-" in cond["message"]
    assert f"model '{missing}' is neither a checkpoint directory" in cond["message"]
    obj = get_is(kube, namespace, "broken")
    assert condition(obj, "Ready")["status"] == "False"
    assert condition(obj, "Progressing")["reason"] == "Stalled"  # not "waiting for" forever
    reasons = {e["reason"] for e in events_for(cluster, namespace, "broken")}
    assert "CrashLoopBackOff" in reasons

    # What the kubelet (here: the node agent) reported, and what the pod runs with.
    (pod,) = live_pods(kube, namespace, "pagefleet.io/service=broken")
    (cs,) = pod["status"]["containerStatuses"]
    assert cs["restartCount"] >= 2
    last = cs["lastState"]["terminated"]
    assert last["exitCode"] == 1
    assert last["message"].startswith("the engine failed to start: model ")
    assert last["message"].count("\n") == 1  # the daemon's one line, not a log tail
    pod_spec = pod["spec"]
    assert pod_spec["automountServiceAccountToken"] is False
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    csc = pod_spec["containers"][0]["securityContext"]
    assert csc["readOnlyRootFilesystem"] is True and csc["capabilities"]["drop"] == ["ALL"]
    assert pod_spec["containers"][0]["resources"]["requests"]["memory"]
    policies = kube.get(
        f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
        {"labelSelector": "pagefleet.io/service=broken"},
    )["items"]
    assert sorted(p["metadata"]["name"] for p in policies) == [
        "broken-daemons",
        "broken-gateway",
    ]

    # Fix the path: the new pods start and Degraded clears.
    t1 = time.monotonic()
    kube.merge_patch(
        f"{API}/namespaces/{namespace}/inferenceservices/broken",
        {"spec": {"model": {"source": {"path": tiny_checkpoint()}}}},
    )
    obj = _wait_ready(kube, namespace, "broken", timeout_s=240)
    assert condition(obj, "Degraded")["status"] == "False"
    operator.check_alive()
    print(f"degraded after {degraded_s:.1f}s; recovered {time.monotonic() - t1:.1f}s after the fix")


CHILDREN = [
    ("/api/v1", "configmaps", "config"),
    ("/api/v1", "serviceaccounts", "gateway"),
    ("/apis/rbac.authorization.k8s.io/v1", "roles", "gateway"),
    ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", "gateway"),
    ("/apis/apps/v1", "deployments", "unified"),
    ("/api/v1", "services", "unified"),
    ("/apis/apps/v1", "deployments", "gateway"),
    ("/api/v1", "services", "gateway"),
    ("/apis/networking.k8s.io/v1", "networkpolicies", "daemons"),
    ("/apis/networking.k8s.io/v1", "networkpolicies", "gateway"),
]


def _owned(kube: KubeClient, ns: str, group: str, plural: str, service: str) -> list[str]:
    items = kube.get(
        f"{group}/namespaces/{ns}/{plural}", {"labelSelector": f"pagefleet.io/service={service}"}
    )["items"]
    return sorted(
        i["metadata"]["name"] for i in items if not i["metadata"].get("deletionTimestamp")
    )


def _present(kube: KubeClient, ns: str, service: str) -> int:
    return sum(
        kube.get_or_none(f"{group}/namespaces/{ns}/{plural}/{service}-{suffix}") is not None
        for group, plural, suffix in CHILDREN
    )


def test_operator_killed_mid_reconcile_converges_without_duplicates(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    operator: OperatorProcess,
    redis_url: str,  # noqa: F811
) -> None:
    """SIGKILL the operator once the first child of a new service exists (the pass is
    then half done), start it again: the service becomes Ready with exactly one of every
    child, one ReplicaSet per Deployment and no extra pods."""
    spec: dict[str, Any] = {
        "model": {"source": {"path": tiny_checkpoint()}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 4},
        "roles": {"unified": {"replicas": 1}},
        "router": {"replicas": 1},
        "index": {"redisURL": redis_url},
    }
    present_at_kill = len(CHILDREN)
    name = ""
    # The kill must land inside the first pass; if a pass ever finishes before the poll
    # sees its first child, try again with a fresh service.
    for attempt in range(3):
        name = f"restart{attempt}"
        res = apply(cluster, infsvc(name, namespace, spec))
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 60
        cm = f"/api/v1/namespaces/{namespace}/configmaps/{name}-config"
        while kube.get_or_none(cm) is None:
            assert time.monotonic() < deadline, "the operator never created the ConfigMap"
        operator.kill()
        present_at_kill = _present(kube, namespace, name)
        operator.start()
        if present_at_kill < len(CHILDREN):
            break
        cluster.kubectl("delete", "infsvc", name, "-n", namespace, "--wait=false")
    assert present_at_kill < len(CHILDREN), "every pass finished before the kill"
    t0 = time.monotonic()
    obj = _wait_ready(kube, namespace, name, timeout_s=240)
    converged_s = time.monotonic() - t0
    assert condition(obj, "Degraded")["status"] == "False"

    for group, plural, suffix in CHILDREN:
        assert f"{name}-{suffix}" in _owned(kube, namespace, group, plural, name), plural
    assert _owned(kube, namespace, "/apis/apps/v1", "deployments", name) == [
        f"{name}-gateway",
        f"{name}-unified",
    ]
    assert len(_owned(kube, namespace, "/api/v1", "configmaps", name)) == 1
    assert len(_owned(kube, namespace, "/apis/networking.k8s.io/v1", "networkpolicies", name)) == 2
    # One ReplicaSet per Deployment: the restarted operator applied the same template.
    for component in ("unified", "gateway"):
        rs = _owned(kube, namespace, "/apis/apps/v1", "replicasets", name)
        assert sum(r.startswith(f"{name}-{component}-") for r in rs) == 1, rs
        pods = live_pods(
            kube, namespace, f"pagefleet.io/service={name},pagefleet.io/role={component}"
        )
        assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    # The gateway found the daemon with its projected token (no token is automounted).
    (gw,) = live_pods(kube, namespace, f"pagefleet.io/service={name},pagefleet.io/role=gateway")
    assert gw["spec"]["automountServiceAccountToken"] is False
    operator.check_alive()
    print(
        f"killed with {present_at_kill}/{len(CHILDREN)} children applied "
        f"(attempt {attempt + 1}); Ready {converged_s:.1f}s after the restart"
    )
