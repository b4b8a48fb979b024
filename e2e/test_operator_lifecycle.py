"""An InferenceService over its life on a real control plane: objects stored before a
CRD rule existed must still be deletable once the rule is in place; a role switch under
traffic answers every request.

The operator here is this module's own (same identity and flags as test_operator.py's).
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import ControlPlane, eventually
from e2e.kube_client import KubeClient
from e2e.kube_helpers import ready_endpoints, tiny_checkpoint
from e2e.operator_process import CRD, OperatorProcess
from e2e.test_operator import (  # noqa: F401  (module fixture: redis_url)
    API,
    apply,
    apply_service,
    condition,
    events_for,
    gateway_kubeconfig,
    get_is,
    infsvc,
    redis_url,
)

pytestmark = pytest.mark.e2e


def _crd_without_root_rules() -> dict[str, Any]:
    crd = copy.deepcopy(yaml.safe_load(CRD.read_text()))
    for version in crd["spec"]["versions"]:
        version["schema"]["openAPIV3Schema"].pop("x-kubernetes-validations", None)
    return crd


def test_service_stored_before_the_name_rule_can_still_be_deleted(
    cluster: ControlPlane, kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    """A 60-character name, accepted by a CRD that had no name rule, carries the operator's
    finalizer; after the CRD gains the rule, deleting it must still complete (kopf patches
    the finalizer away, and the API server must not refuse that patch over the name)."""
    name = "n" * 60
    spec = {
        "model": {"source": {"path": "tiny"}},
        "roles": {"unified": {"replicas": 0}},
        "router": {"replicas": 0},
        "index": {"redisURL": "redis://127.0.0.1:1/0"},
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(_crd_without_root_rules()))
    try:
        res = apply(cluster, infsvc(name, namespace, spec))
        assert res.returncode == 0, res.stderr
        degraded = eventually(
            lambda: (
                condition(get_is(kube, namespace, name), "Degraded").get("reason") == "InvalidName"
                and get_is(kube, namespace, name)
            ),
            60,
            "Degraded=True/InvalidName on the long name",
        )
        assert "pagefleet.io/finalizer" in degraded["metadata"]["finalizers"]
    finally:
        cluster.kubectl("apply", "-f", str(CRD))
    # The rule is back: a new object with such a name is refused...
    res = apply(cluster, infsvc("m" * 60, namespace, spec))
    assert res.returncode != 0 and "at most 55 characters" in res.stderr, res.stderr
    # ... while the one stored before it is still deleted completely.
    time.sleep(4)  # a resync pass or two with the rule in place
    cluster.kubectl("delete", "infsvc", name, "-n", namespace, "--wait=false")
    eventually(
        lambda: get_is_or_none(kube, namespace, name) is None, 60, "the old long-named service gone"
    )
    operator.check_alive()


CHILD_COLLECTIONS = (
    "/apis/apps/v1/namespaces/{ns}/deployments",
    "/api/v1/namespaces/{ns}/services",
    "/api/v1/namespaces/{ns}/configmaps",
    "/api/v1/namespaces/{ns}/serviceaccounts",
    "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
)


def get_is_or_none(kube: KubeClient, ns: str, name: str) -> dict[str, Any] | None:
    return kube.get_or_none(f"{API}/namespaces/{ns}/inferenceservices/{name}")


def _versions_of_children(kube: KubeClient, ns: str, name: str) -> dict[str, str]:
    """resourceVersion of every child, by plural/name."""
    out = {}
    for coll in CHILD_COLLECTIONS:
        path = coll.format(ns=ns)
        for item in kube.get(path, {"labelSelector": f"pagefleet.io/service={name}"})["items"]:
            out[f"{path.rsplit('/', 1)[1]}/{item['metadata']['name']}"] = item["metadata"][
                "resourceVersion"
            ]
    return out


def _versions(kube: KubeClient, ns: str, name: str) -> dict[str, str]:
    """resourceVersion of the InferenceService and of every child."""
    return {
        "InferenceService": get_is(kube, ns, name)["metadata"]["resourceVersion"],
        **_versions_of_children(kube, ns, name),
    }


def _settled(kube: KubeClient, ns: str, name: str, generation: int) -> dict[str, Any]:
    def check() -> dict[str, Any] | bool:
        obj = get_is(kube, ns, name)
        ok = (obj.get("status") or {}).get("observedGeneration") == generation and condition(
            obj, "Ready"
        ).get("status") == "True"
        return obj if ok else False

    return eventually(check, 60, f"{name} Ready at generation {generation}")


def _assert_quiet(cluster: ControlPlane, kube: KubeClient, ns: str, name: str) -> None:
    """Several resync passes (3 s apart) with nothing changed write nothing and post no
    Event."""
    time.sleep(4)  # let the Deployment controller finish its own status writes
    before = _versions(kube, ns, name)
    events = len(events_for(cluster, ns, name))
    time.sleep(10)
    after = _versions(kube, ns, name)
    assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
    assert len(events_for(cluster, ns, name)) == events


def test_steady_service_is_left_alone_and_role_switches_prune(
    cluster: ControlPlane, kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    name = "life"
    path = f"{API}/namespaces/{namespace}/inferenceservices/{name}"
    spec = {
        "model": {"source": {"path": "tiny"}},
        "image": "pagefleet:e2e",
        "roles": {
            # Quantities the API server stores in another form ("500m", "1536Mi").
            # A number where a Pod takes one (the CRD was int-or-string: 0.5 refused).
            "prefill": {"replicas": 0, "resources": {"requests": {"cpu": 0.5}}},
            "decode": {"replicas": 0, "resources": {"limits": {"memory": "1.5Gi"}}},
        },
        "router": {"replicas": 0},
        "index": {"redisURL": "redis://127.0.0.1:1/0"},
    }
    assert apply(cluster, infsvc(name, namespace, spec)).returncode == 0
    _settled(kube, namespace, name, 1)
    _assert_quiet(cluster, kube, namespace, name)

    # prefill + decode -> unified: the P/D workloads go, the gateway points at unified.
    kube.merge_patch(
        path, {"spec": {"roles": {"prefill": None, "decode": None, "unified": {"replicas": 0}}}}
    )
    obj = _settled(kube, namespace, name, 2)
    left = sorted(k for k in _versions(kube, namespace, name) if k != "InferenceService")
    assert not [k for k in left if "prefill" in k or "decode" in k], left
    assert [c["type"] for c in obj["status"]["conditions"] if c["type"].endswith("Ready")] == [
        "UnifiedReady",
        "Ready",
    ]
    gw = kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}-gateway")
    cmd = gw["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--service") + 1] == f"{name}-unified"
    assert "--prefill-service" not in cmd
    _assert_quiet(cluster, kube, namespace, name)

    # An operator restart re-runs every pass (kopf's resume): no child is rewritten and no
    # Event posted.
    before = _versions(kube, namespace, name)
    events = len(events_for(cluster, namespace, name))
    operator.stop()
    operator.start()
    time.sleep(12)
    operator.check_alive()
    after = _versions(kube, namespace, name)
    del before["InferenceService"], after["InferenceService"]  # kopf's own annotations
    assert after == before
    assert len(events_for(cluster, namespace, name)) == events


def test_a_deletion_while_the_operator_is_down_completes_when_it_returns(
    cluster: ControlPlane, kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    name = "gone"
    spec = {
        "model": {"source": {"path": "tiny"}},
        "roles": {"unified": {"replicas": 0}},
        "router": {"replicas": 0},
        "index": {"redisURL": "redis://127.0.0.1:1/0"},
    }
    assert apply(cluster, infsvc(name, namespace, spec)).returncode == 0
    _settled(kube, namespace, name, 1)
    operator.stop()
    try:
        cluster.kubectl("delete", "infsvc", name, "-n", namespace, "--wait=false")
        time.sleep(3)
        dying = get_is(kube, namespace, name)  # held by the finalizer meanwhile
        assert dying["metadata"]["deletionTimestamp"]
        assert len(_versions(kube, namespace, name)) > 1
    finally:
        operator.start()
    eventually(lambda: get_is_or_none(kube, namespace, name) is None, 60, "the service gone")
    eventually(lambda: list(_versions_of_children(kube, namespace, name)) == [], 60, "GC")
    operator.check_alive()


def test_a_scale_of_an_autoscaled_role_is_no_drift(
    cluster: ControlPlane, kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    """The autoscaler (or `kubectl scale`) sets an autoscaled role's replicas; the next
    pass keeps that count. Nothing was restored, so no DriftRepaired Event."""
    name = "scaled"
    slow = {"intervalSeconds": 3600, "scaleDownWindowSeconds": 3600}
    spec = {
        "model": {"source": {"path": "tiny"}},
        # A pod that idles (never Ready: no daemon answers the probe).
        "command": ["/bin/sh", "-c", "exec sleep 3600"],
        "roles": {"unified": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2, **slow}}},
        "router": {"replicas": 0},
        "index": {"redisURL": "redis://127.0.0.1:1/0"},
    }
    assert apply(cluster, infsvc(name, namespace, spec)).returncode == 0
    _settled(kube, namespace, name, 1)
    time.sleep(4)
    cluster.kubectl("scale", f"deployment/{name}-unified", "--replicas=1", "-n", namespace)
    time.sleep(10)  # three resync passes
    deploy = kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}-unified")
    assert deploy["spec"]["replicas"] == 1
    reasons = [e["reason"] for e in events_for(cluster, namespace, name)]
    assert "DriftRepaired" not in reasons, reasons


PAGEFLEET = str(Path(sys.executable).with_name("pagefleet"))


class _Traffic:
    """Completions through the gateway Service's ready endpoints, one at a time, as a
    client behind kube-proxy would send them (there is no kube-proxy here). A connection
    refused by a gateway pod that has meanwhile left the endpoints (rolled away) is sent
    again to the ones listed now; any answer that is not a completion is a failure."""

    def __init__(self, kube: KubeClient, ns: str, gateway: str) -> None:
        self.kube, self.ns, self.gateway = kube, ns, gateway
        self.results: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _once(self, i: int) -> str:
        from openai import APIConnectionError, OpenAI

        for _ in range(3):
            ips = ready_endpoints(self.kube, self.ns, self.gateway)
            if not ips:
                return "no ready gateway endpoint"
            ip = ips[i % len(ips)]
            client = OpenAI(
                base_url=f"http://{ip}:8080/v1", api_key="unused", max_retries=0, timeout=30
            )
            try:
                out = client.completions.create(
                    model="tiny", prompt=f"switch {i}", max_tokens=4, temperature=0
                )
            except APIConnectionError as exc:
                if ip in ready_endpoints(self.kube, self.ns, self.gateway):
                    return f"{type(exc).__name__}: {exc}"
                continue  # that gateway pod was rolled away meanwhile
            except Exception as exc:  # recorded, asserted by the test
                return f"{type(exc).__name__}: {exc}"
            return "ok" if out.usage and out.usage.completion_tokens > 0 else "empty"
        return "gateway endpoints kept vanishing"

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            self.results.append(self._once(i))
            time.sleep(0.2)

    def __enter__(self) -> _Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def test_a_role_switch_under_traffic_answers_every_request(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    operator: OperatorProcess,
    redis_url: str,  # noqa: F811
) -> None:
    """unified -> prefill + decode while a client sends completions. The pass deleted the
    unified pool in the same pass that created the new one: until the new pods were Ready
    the gateway had nothing to route to and answered 503. Now unified keeps serving until
    prefill and decode have Ready pods and every gateway pod routes to them."""
    t0 = time.monotonic()
    name, ns = "switch", namespace
    gw_kubeconfig = gateway_kubeconfig(cluster, ns, name)
    spec = {
        "model": {"source": {"path": tiny_checkpoint()}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 4},
        "roles": {"unified": {"replicas": 1}},
        "router": {"replicas": 1, "env": [{"name": "KUBECONFIG", "value": str(gw_kubeconfig)}]},
        "index": {"redisURL": redis_url},
    }
    apply_service(cluster, kube, ns, name, spec)
    _settled(kube, ns, name, 1)
    eventually(lambda: ready_endpoints(kube, ns, f"{name}-gateway"), 60, "a gateway endpoint")
    serving_s = time.monotonic() - t0

    t1 = time.monotonic()
    seen: set[str] = set()
    with _Traffic(kube, ns, f"{name}-gateway") as traffic:
        eventually(lambda: "ok" in traffic.results, 60, "a first completion")
        pd = {"unified": None, "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
        kube.merge_patch(f"{API}/namespaces/{ns}/inferenceservices/{name}", {"spec": {"roles": pd}})

        def switched() -> bool:
            obj = get_is(kube, ns, name)
            seen.add(condition(obj, "Progressing").get("reason", ""))
            gone = kube.get_or_none(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}-unified")
            return gone is None and condition(obj, "Ready").get("status") == "True"

        eventually(switched, 180, "prefill + decode Ready and the unified pool gone")
        time.sleep(2)  # a few requests through the new roles
    switch_s = time.monotonic() - t1
    failed = [r for r in traffic.results if r != "ok"]
    assert traffic.results and not failed, f"{len(failed)}/{len(traffic.results)}: {failed[:3]}"
    assert "RoleSwitch" in seen, seen
    reasons = [e["reason"] for e in events_for(cluster, ns, name)]
    assert "RoleSwitch" in reasons and "RoleSwitchComplete" in reasons, reasons
    gw = kube.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}-gateway")
    cmd = gw["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--service") + 1] == f"{name}-decode"
    cluster.kubectl("delete", "infsvc", name, "-n", ns, "--wait=false")
    operator.check_alive()
    print(
        json.dumps(
            {
                "serving_s": round(serving_s, 1),
                "switch_under_traffic_s": round(switch_s, 1),
                "requests": len(traffic.results),
                "total_s": round(time.monotonic() - t0, 1),
            }
        )
    )


def test_a_role_switch_waiting_for_the_old_pods_resources_ends_at_the_deadline(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    operator: OperatorProcess,
    redis_url: str,  # noqa: F811
) -> None:
    """A node with room for one big daemon (32 CPUs, each big daemon requests 20): the
    decode pod of a unified -> prefill + decode switch cannot be scheduled while the
    unified pod holds its CPUs, and the switch kept unified until decode was Ready, so
    it waited for ever. Now unified serves until decode's Deployment passes its
    progressDeadlineSeconds (set to 15 s here), then goes, and decode takes its place."""
    name, ns = "starved", namespace
    big = {"requests": {"cpu": "20"}}
    spec = {
        "model": {"source": {"path": tiny_checkpoint()}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 4},
        "roles": {"unified": {"replicas": 1, "resources": big}},
        "router": {
            "replicas": 1,
            "env": [{"name": "KUBECONFIG", "value": str(gateway_kubeconfig(cluster, ns, name))}],
        },
        "index": {"redisURL": redis_url},
    }
    apply_service(cluster, kube, ns, name, spec)
    _settled(kube, ns, name, 1)
    eventually(lambda: ready_endpoints(kube, ns, f"{name}-gateway"), 60, "a gateway endpoint")
    deployments = f"/apis/apps/v1/namespaces/{ns}/deployments"
    with _Traffic(kube, ns, f"{name}-gateway") as traffic:
        eventually(lambda: "ok" in traffic.results, 60, "a first completion")
        pd = {
            "unified": None,
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1, "resources": big},
        }
        kube.merge_patch(f"{API}/namespaces/{ns}/inferenceservices/{name}", {"spec": {"roles": pd}})
        eventually(
            lambda: kube.get_or_none(f"{deployments}/{name}-decode"), 30, "the decode Deployment"
        )
        # Not a field the operator sets: its applies leave this value alone.
        kube.merge_patch(f"{deployments}/{name}-decode", {"spec": {"progressDeadlineSeconds": 15}})

        def stalled() -> str | bool:
            progressing = condition(get_is(kube, ns, name), "Progressing")
            stuck = progressing.get("reason") == "RoleSwitchStalled"
            return str(progressing.get("message", "")) if stuck else False

        message = eventually(stalled, 60, "the switch stalled on the unschedulable decode pod")
        assert kube.get_or_none(f"{deployments}/{name}-unified") is not None
        before_release = len(traffic.results)
        eventually(
            lambda: kube.get_or_none(f"{deployments}/{name}-unified") is None,
            60,
            "unified deleted past decode's progress deadline",
        )
        served_until_release = traffic.results[:before_release]
        # What is coming was said beforehand.
        assert "Insufficient cpu" in message, message
        assert "progressDeadlineSeconds, unified is deleted" in message, message
        _settled(kube, ns, name, 2)  # decode took the freed CPUs and turned Ready
        eventually(lambda: ready_endpoints(kube, ns, f"{name}-gateway"), 60, "a gateway endpoint")
        at_ready = len(traffic.results)
        eventually(lambda: traffic.results[at_ready:].count("ok") >= 3, 60, "completions again")
    failed = [r for r in served_until_release if r != "ok"]
    assert served_until_release and not failed, f"{len(failed)} failed before the release"
    warnings = [e for e in events_for(cluster, ns, name) if e["reason"] == "RoleSwitchDeadline"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning", warnings
    cluster.kubectl("delete", "infsvc", name, "-n", ns, "--wait=false")
    operator.check_alive()
