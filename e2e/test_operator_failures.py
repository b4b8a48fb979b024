"""An InferenceService whose daemons cannot start (issue 14): the operator says why.

A model path that does not exist makes every daemon exit at start-up with a one-line cause
in its termination-message file; the node agent reports it as the container's
lastState.terminated.message with a rising restartCount, as a kubelet does, and the
operator turns it into Degraded=True / CrashLoopBackOff carrying that message. Fixing the
path rolls out pods that start, and Degraded clears. Along the way: the hardened pod
fields and the NetworkPolicies exist on the real API server.
"""

from __future__ import annotations

import time

import pytest

from e2e.cluster import ControlPlane, eventually
from e2e.kube_client import KubeClient
from e2e.test_operator import (  # noqa: F401  (module-scoped fixtures)
    API,
    PAGEFLEET,
    Operator,
    _pods,
    _tiny_checkpoint,
    _wait_ready,
    apply,
    condition,
    events_for,
    get_is,
    infsvc,
    operator,
    redis_url,
)

pytestmark = pytest.mark.e2e


def test_crash_looping_daemons_degrade_with_their_last_words_then_recover(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    operator: Operator,  # noqa: F811
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
    (pod,) = _pods(kube, namespace, "pagefleet.io/service=broken")
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
        {"spec": {"model": {"source": {"path": _tiny_checkpoint()}}}},
    )
    obj = _wait_ready(kube, namespace, "broken", timeout_s=240)
    assert condition(obj, "Degraded")["status"] == "False"
    operator.check_alive()
    print(f"degraded after {degraded_s:.1f}s; recovered {time.monotonic() - t1:.1f}s after the fix")
