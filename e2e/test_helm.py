"""The Helm chart on a real control plane (issue 16): install, serve, upgrade, uninstall.

One scenario with the real helm binary against the real apiserver. The chart's pods (the
operator, the bundled Redis, the uninstall hook Job) and the operator's pods (daemon,
gateway) run as local processes on the node agent, so `operator.command` and the
InferenceService's `spec.command` point at this venv's `pagefleet` instead of an image.
There is no cluster DNS: the InferenceService reaches the bundled Redis by its pod IP.

1. `helm install` (CRD, operator with RBAC scoped to the release namespace, bundled Redis);
   then `helm upgrade` adding an InferenceService (the tiny model) as a chart value, served
   end to end through its gateway with the `openai` client;
2. `helm upgrade` changing the router replicas and an operator setting: the operator pod is
   replaced with the new flag, the gateway scales 1 -> 2, and completions keep succeeding
   during the rollout;
3. `helm uninstall`: the pre-delete hook deletes the InferenceService while the operator
   still runs, so no finalizer is left stuck and nothing of the release remains.

Two short uninstall cases follow (about 12 s and 22 s): a watched namespace deleted before
the uninstall, and an operator scaled to 0 whose finalizers the hook releases itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import ControlPlane, eventually
from e2e.kube_client import KubeClient
from e2e.kube_helpers import live_pods, pod_ready, ready_endpoints, tiny_checkpoint
from pagefleet.testing.helm import CHART, require_helm

pytestmark = pytest.mark.e2e

PAGEFLEET = str(Path(sys.executable).with_name("pagefleet"))
API = "/apis/pagefleet.io/v1alpha1"
RELEASE = "pf"


def _condition(obj: dict[str, Any], type_: str) -> str:
    for cond in (obj.get("status") or {}).get("conditions", []):
        if cond["type"] == type_:
            return str(cond["status"])
    return ""


def _complete(ip: str, prompt: str) -> Any:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{ip}:8080/v1", api_key="unused", max_retries=0, timeout=30)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)


class Helm:
    def __init__(self, cluster: ControlPlane, namespace: str, workdir: Path) -> None:
        self.base = [require_helm(), "--kubeconfig", str(cluster.kubeconfig_path)]
        self.base += ["-n", namespace]
        self.workdir = workdir
        self.calls = 0

    def __call__(self, *args: str, values: dict[str, Any] | None = None) -> str:
        cmd = [*self.base, *args]
        if values is not None:
            self.calls += 1
            path = self.workdir / f"values-{self.calls}.yaml"
            path.write_text(yaml.safe_dump(values))
            cmd += ["-f", str(path)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
        assert res.returncode == 0, f"{' '.join(args)} failed:\n{res.stdout}\n{res.stderr}"
        return res.stdout


def test_install_serve_upgrade_uninstall(
    cluster: ControlPlane, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    ns = namespace
    helm = Helm(cluster, ns, tmp_path)
    model = tiny_checkpoint()
    values: dict[str, Any] = {
        "operator": {
            "command": [PAGEFLEET],
            "watchNamespaces": [ns],
            "resyncSeconds": 5,
        },
        # The node agent mounts no volumes, so the ACL file from the auth Secret cannot
        # reach Redis here: the e2e runs the bundled Redis without auth.
        "redis": {"enabled": True, "auth": {"enabled": False}},
    }
    helm("install", RELEASE, str(CHART), "--wait", "--timeout", "3m", values=values)
    install_s = time.monotonic() - t0
    (op_pod,) = live_pods(kube, ns, "app.kubernetes.io/component=operator")
    assert "--resync-seconds=5" in op_pod["spec"]["containers"][0]["command"]
    (redis_pod,) = live_pods(kube, ns, "app.kubernetes.io/component=redis")
    assert pod_ready(redis_pod)
    redis_ip = redis_pod["status"]["podIP"]

    # 1. An InferenceService as a chart value, on the bundled Redis.
    spec = {
        "model": {"source": {"path": model}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 4},
        "roles": {"unified": {"replicas": 1}},
        "router": {"replicas": 1},
        "index": {"redisURL": f"redis://{redis_ip}:6379/0"},
    }
    values["inferenceServices"] = [{"name": "tiny", "spec": spec}]
    helm("upgrade", RELEASE, str(CHART), values=values)

    def ready(generation: int) -> dict[str, Any] | bool:
        obj = kube.get(f"{API}/namespaces/{ns}/inferenceservices/tiny")
        st = obj.get("status") or {}
        ok = (
            obj["metadata"]["generation"] == generation
            and st.get("observedGeneration") == generation
            and _condition(obj, "Ready") == "True"
        )
        return obj if ok else False

    obj = eventually(lambda: ready(1), 240, "InferenceService tiny Ready")
    assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert "pagefleet.io/finalizer" in obj["metadata"]["finalizers"]
    (gw_pod,) = live_pods(kube, ns, "pagefleet.io/service=tiny,pagefleet.io/role=gateway")
    gateway_ip = gw_pod["status"]["podIP"]
    first = eventually(lambda: _complete(gateway_ip, "Helm says hello"), 60, "a completion")
    assert first.model == "tiny" and first.usage.completion_tokens > 0
    serving_s = time.monotonic() - t0

    # The operator's metrics endpoint (operator.metrics, on by default).
    op_ip = op_pod["status"]["podIP"]
    with urllib.request.urlopen(f"http://{op_ip}:9090/metrics", timeout=10) as r:
        assert b"pagefleet_operator_reconciles_total" in r.read()

    # 2. Upgrade: router replicas 1 -> 2 and an operator setting, under traffic (the first
    # gateway pod keeps serving: a scale change does not roll it). Clients go
    # through the gateway Service; there is no kube-proxy, so each request picks a ready
    # endpoint of its EndpointSlices, as kube-proxy would.
    results: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                ips = ready_endpoints(kube, ns, "tiny-gateway")
                _complete(ips[i % len(ips)], "during the upgrade")
                results.append("ok")
            except Exception as exc:  # recorded, asserted below
                results.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.2)

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    t1 = time.monotonic()
    values["operator"]["resyncSeconds"] = 7
    values["inferenceServices"][0]["spec"]["router"]["replicas"] = 2
    helm("upgrade", RELEASE, str(CHART), "--wait", "--timeout", "3m", values=values)
    eventually(lambda: ready(2), 120, "the upgraded InferenceService Ready")
    gateways = eventually(
        lambda: (
            len(p := live_pods(kube, ns, "pagefleet.io/service=tiny,pagefleet.io/role=gateway"))
            == 2
            and all(pod_ready(x) for x in p)
            and p
        ),
        120,
        "2 gateway pods Ready",
    )
    time.sleep(1)
    stop.set()
    worker.join(timeout=60)
    upgrade_s = time.monotonic() - t1
    (new_op,) = eventually(
        lambda: (
            [
                p
                for p in live_pods(kube, ns, "app.kubernetes.io/component=operator")
                if "--resync-seconds=7" in p["spec"]["containers"][0]["command"]
            ]
            or False
        ),
        60,
        "the operator pod with the new flag",
    )
    assert new_op["metadata"]["uid"] != op_pod["metadata"]["uid"]
    failed = [r for r in results if r != "ok"]
    assert results and not failed, f"{len(failed)}/{len(results)} failed: {failed[:3]}"
    assert gw_pod["metadata"]["uid"] in {p["metadata"]["uid"] for p in gateways}
    for p in gateways:  # both replicas serve
        assert _complete(p["status"]["podIP"], "after the upgrade").usage.completion_tokens > 0

    # 3. Uninstall: nothing of the release is left, nothing stuck on a finalizer.
    t2 = time.monotonic()
    out = helm("uninstall", RELEASE, "--wait", "--timeout", "5m")
    assert "uninstalled" in out
    uninstall_s = time.monotonic() - t2
    assert kube.get(f"{API}/namespaces/{ns}/inferenceservices")["items"] == []

    def leftovers() -> list[str]:
        left = []
        for path in (
            f"/api/v1/namespaces/{ns}/pods",
            f"/api/v1/namespaces/{ns}/services",
            f"/api/v1/namespaces/{ns}/configmaps",
            f"/apis/apps/v1/namespaces/{ns}/deployments",
            f"/apis/batch/v1/namespaces/{ns}/jobs",
            f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
            f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
            f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
        ):
            for item in kube.get(path)["items"]:
                name = item["metadata"]["name"]
                if name != "kube-root-ca.crt":  # every namespace has this ConfigMap
                    left.append(f"{path.rsplit('/', 1)[1]}/{name}")
        left += [
            f"serviceaccounts/{i['metadata']['name']}"
            for i in kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts")["items"]
            if i["metadata"]["name"] != "default"
        ]
        for plural in ("clusterroles", "clusterrolebindings"):
            left += [
                f"{plural}/{i['metadata']['name']}"
                for i in kube.get(
                    f"/apis/rbac.authorization.k8s.io/v1/{plural}",
                    {"labelSelector": f"app.kubernetes.io/instance={RELEASE}"},
                )["items"]
            ]
        return left

    try:
        eventually(lambda: not leftovers(), 120, "nothing of the release left")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still there: {leftovers()}") from None
    print(
        json.dumps(
            {
                "install_s": round(install_s, 1),
                "install_to_serving_s": round(serving_s, 1),
                "upgrade_s": round(upgrade_s, 1),
                "requests_during_upgrade": len(results),
                "uninstall_s": round(uninstall_s, 1),
                "total_s": round(time.monotonic() - t0, 1),
            }
        )
    )


def test_uninstall_succeeds_when_a_watched_namespace_is_gone(
    cluster: ControlPlane, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    """A namespace the operator watched was deleted before `helm uninstall`: it has nothing
    left to tear down, so the pre-delete hook must not fail the uninstall over it (it did:
    the hook could neither bind its RBAC in the missing namespace nor list there)."""
    t0 = time.monotonic()
    ns = namespace
    gone = f"{ns[:50]}-gone"
    kube.create("/api/v1/namespaces", {"metadata": {"name": gone}})
    helm = Helm(cluster, ns, tmp_path)
    values: dict[str, Any] = {
        "operator": {"command": [PAGEFLEET], "watchNamespaces": [ns, gone]},
        "redis": {"enabled": False},
    }
    helm("install", RELEASE, str(CHART), "--wait", "--timeout", "3m", values=values)
    kube.delete(f"/api/v1/namespaces/{gone}")
    eventually(lambda: kube.get_or_none(f"/api/v1/namespaces/{gone}") is None, 60, "namespace gone")
    out = helm("uninstall", RELEASE, "--wait", "--timeout", "2m")
    assert "uninstalled" in out
    print(json.dumps({"total_s": round(time.monotonic() - t0, 1)}))


def test_uninstall_with_the_operator_scaled_to_zero_releases_the_finalizers(
    cluster: ControlPlane, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    """No operator replica is Ready (scaled to 0, crash-looping): nobody would release the
    InferenceServices' finalizer, and `helm uninstall` failed at its timeout with each one
    stuck in Terminating. The hook, told the operator's Deployment, releases it itself and
    garbage collection still takes the children."""
    t0 = time.monotonic()
    ns = namespace
    helm = Helm(cluster, ns, tmp_path)
    spec = {
        "model": {"source": {"path": "tiny"}},
        "roles": {"unified": {"replicas": 0}},
        "router": {"replicas": 0},
        "index": {"redisURL": "redis://127.0.0.1:1/0"},
    }
    values: dict[str, Any] = {
        "operator": {"command": [PAGEFLEET], "watchNamespaces": [ns], "resyncSeconds": 5},
        "redis": {"enabled": False},
        "uninstall": {"timeoutSeconds": 60},
        "inferenceServices": [{"name": "orphan", "spec": spec}],
    }
    helm("install", RELEASE, str(CHART), "--wait", "--timeout", "3m", values=values)
    path = f"{API}/namespaces/{ns}/inferenceservices/orphan"
    eventually(
        lambda: "pagefleet.io/finalizer" in (kube.get(path)["metadata"].get("finalizers") or []),
        60,
        "the operator's finalizer on the InferenceService",
    )
    deployments = f"/apis/apps/v1/namespaces/{ns}/deployments"
    selector = {"labelSelector": "pagefleet.io/service=orphan"}
    eventually(lambda: kube.get(deployments, selector)["items"], 60, "the service's Deployments")
    cluster.kubectl("scale", f"deployment/{RELEASE}-pagefleet-operator", "--replicas=0", "-n", ns)
    eventually(
        lambda: live_pods(kube, ns, "app.kubernetes.io/component=operator") == [],
        60,
        "no operator pod",
    )
    t1 = time.monotonic()
    out = helm("uninstall", RELEASE, "--wait", "--timeout", "2m")
    uninstall_s = time.monotonic() - t1
    assert "uninstalled" in out
    assert kube.get_or_none(path) is None
    eventually(lambda: kube.get(deployments, selector)["items"] == [], 60, "GC of its children")
    # Well under the hook's 60 s wait for an operator that will not come.
    assert uninstall_s < 45, uninstall_s
    total_s = time.monotonic() - t0
    print(json.dumps({"uninstall_s": round(uninstall_s, 1), "total_s": round(total_s, 1)}))
