"""The e2e harness itself, on the real control plane: pods run as processes, readiness drives
EndpointSlices, scaling and deletion stop processes, auth and RBAC are enforced."""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import ControlPlane, eventually
from e2e.kube_client import JSON, KubeAPIError, KubeClient, KubeConfig
from e2e.node_agent import POD_NETWORK, NodeAgentProcess

pytestmark = pytest.mark.e2e

PORT = 8080


def apply(cluster: ControlPlane, *objs: JSON) -> None:
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}),
    )


def http_server_deployment(name: str, replicas: int, probe_path: str, serve_dir: Path) -> JSON:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "web",
                            "image": "python:local",  # ignored: the node agent runs `command`
                            "command": [sys.executable, "-m", "http.server"],
                            "args": ["--bind", "$(POD_IP)", "-d", str(serve_dir), str(PORT)],
                            "ports": [{"name": "http", "containerPort": PORT}],
                            "readinessProbe": {
                                "httpGet": {"path": probe_path, "port": "http"},
                                "periodSeconds": 1,
                                "failureThreshold": 1,
                            },
                        }
                    ],
                },
            },
        },
    }


def service(name: str) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": PORT}]},
    }


def pods(kube: KubeClient, ns: str, app: str) -> list[JSON]:
    return kube.get(f"/api/v1/namespaces/{ns}/pods", {"labelSelector": f"app={app}"})["items"]


def is_ready(pod: JSON) -> bool:
    conds = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def slice_addresses(kube: KubeClient, ns: str, svc: str) -> dict[str, bool]:
    """Address -> ready for every endpoint of the Service's EndpointSlices."""
    slices = kube.get(
        f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
        {"labelSelector": f"kubernetes.io/service-name={svc}"},
    )["items"]
    out: dict[str, bool] = {}
    for s in slices:
        for ep in s.get("endpoints") or []:
            for addr in ep["addresses"]:
                out[addr] = bool(ep.get("conditions", {}).get("ready"))
    return out


def pid_of(pod: JSON) -> int:
    container_id = pod["status"]["containerStatuses"][0]["containerID"]
    assert container_id.startswith("local://"), container_id
    return int(container_id.removeprefix("local://"))


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0) until reaped; it no longer runs, which is what counts.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1].startswith("Z")


def http_get(ip: str, path: str = "/") -> tuple[int, str]:
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # dial the pod
        with opener.open(f"http://{ip}:{PORT}{path}", timeout=3) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def refuses(ip: str) -> bool:
    try:
        http_get(ip)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


def test_deployment_runs_serves_scales_and_deletes(
    cluster: ControlPlane, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    (tmp_path / "hello.txt").write_text("served by a pod\n")
    dep = http_server_deployment("web", 2, "/hello.txt", tmp_path)
    dep["metadata"]["namespace"] = namespace
    svc = service("web")
    svc["metadata"]["namespace"] = namespace
    apply(cluster, dep, svc)

    ready = eventually(
        lambda: (
            [p for p in pods(kube, namespace, "web") if is_ready(p)]
            if sum(is_ready(p) for p in pods(kube, namespace, "web")) == 2
            else None
        ),
        60,
        "2 Ready pods",
    )
    ips = {p["status"]["podIP"] for p in ready}
    assert len(ips) == 2, f"pods share an IP: {ips}"
    for p in ready:
        assert p["status"]["phase"] == "Running"
        assert p["spec"]["nodeName"] == "pagefleet-node"
        assert p["status"]["podIPs"] == [{"ip": p["status"]["podIP"]}]
    for ip in ips:
        assert ipaddress.ip_address(ip) in POD_NETWORK, f"{ip} outside {POD_NETWORK}"
        # Each pod is a process bound to its own address, serving the file we wrote.
        assert http_get(ip, "/hello.txt") == (200, "served by a pod\n")

    # The controller-manager's EndpointSlice controller publishes both pods as ready.
    eventually(
        lambda: slice_addresses(kube, namespace, "web") == dict.fromkeys(ips, True),
        30,
        f"EndpointSlice listing {sorted(ips)} as ready",
    )

    # Scale down: one process stops, its address stops answering, the slice shrinks.
    pids = {p["status"]["podIP"]: pid_of(p) for p in ready}
    cluster.kubectl("scale", "deployment/web", "--replicas=1", "-n", namespace)
    remaining = eventually(
        lambda: (lambda ps: ps if len(ps) == 1 else None)(pods(kube, namespace, "web")),
        30,
        "one pod left",
    )
    kept_ip = remaining[0]["status"]["podIP"]
    assert kept_ip in ips
    (gone_ip,) = ips - {kept_ip}
    eventually(lambda: process_gone(pids[gone_ip]), 15, f"process {pids[gone_ip]} exiting")
    assert refuses(gone_ip)
    assert not process_gone(pids[kept_ip])
    eventually(
        lambda: slice_addresses(kube, namespace, "web") == {kept_ip: True},
        30,
        f"EndpointSlice shrinking to {kept_ip}",
    )

    # Delete the Deployment: the garbage collector removes the ReplicaSet and pod, the agent
    # stops the last process and removes the pod object.
    cluster.kubectl("delete", "deployment/web", "-n", namespace, "--wait=false")
    eventually(lambda: not pods(kube, namespace, "web"), 30, "all pods deleted")
    eventually(lambda: process_gone(pids[kept_ip]), 15, "last process exiting")
    assert refuses(kept_ip)
    eventually(lambda: slice_addresses(kube, namespace, "web") == {}, 30, "empty EndpointSlice")


def test_failing_readiness_keeps_pod_out_of_service(
    cluster: ControlPlane, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    dep = http_server_deployment("unready", 1, "/missing", tmp_path)
    dep["metadata"]["namespace"] = namespace
    svc = service("unready")
    svc["metadata"]["namespace"] = namespace
    apply(cluster, dep, svc)

    pod = eventually(
        lambda: next(
            (p for p in pods(kube, namespace, "unready") if p["status"].get("phase") == "Running"),
            None,
        ),
        60,
        "a Running pod",
    )
    ip = pod["status"]["podIP"]
    eventually(lambda: http_get(ip, "/missing")[0] == 404, 30, "the server answering 404")
    # Served, but the probe fails: the endpoint is published as not ready.
    eventually(
        lambda: slice_addresses(kube, namespace, "unready") == {ip: False},
        30,
        "the endpoint listed as not ready",
    )
    assert not is_ready(pods(kube, namespace, "unready")[0])


def test_pod_env_downward_api_configmaps_and_logs(
    cluster: ControlPlane, kube: KubeClient, namespace: str, node_agent: NodeAgentProcess
) -> None:
    keys = ["POD_NAME", "POD_NS", "MY_IP", "POD_IP", "GREETING", "COMPOSED", "CM_COLOR"]
    keys += ["KUBECONFIG"]
    script = (
        "import json, os, sys; "
        f"env = {{k: os.environ.get(k) for k in {keys!r}}}; "
        "env['CWD'] = os.getcwd(); env['ARGV'] = sys.argv[1:]; print(json.dumps(env))"
    )
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "settings", "namespace": namespace},
        "data": {"greeting": "hello", "COLOR": "blue"},
    }
    field = {
        "POD_NAME": "metadata.name",
        "POD_NS": "metadata.namespace",
        "MY_IP": "status.podIP",
    }
    env: list[dict[str, Any]] = [
        {"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}} for k, v in field.items()
    ]
    env += [
        {
            "name": "GREETING",
            "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}},
        },
        {"name": "COMPOSED", "value": "$(GREETING)-$(POD_NAME)-$$(LITERAL)"},
    ]
    ok_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "printenv", "namespace": namespace},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "python:local",
                    "command": [sys.executable, "-c", script],
                    "args": ["$(GREETING)", "$(UNDEFINED)"],
                    "env": env,
                    "envFrom": [{"prefix": "CM_", "configMapRef": {"name": "settings"}}],
                }
            ],
        },
    }
    failing_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "exits-3", "namespace": namespace},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "python:local",
                    "command": [sys.executable, "-c", "raise SystemExit(3)"],
                }
            ],
        },
    }
    apply(cluster, cm, ok_pod, failing_pod)

    def phase(name: str) -> str | None:
        return kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")["status"].get("phase")

    eventually(lambda: phase("printenv") == "Succeeded", 60, "printenv Succeeded")
    eventually(lambda: phase("exits-3") == "Failed", 60, "exits-3 Failed")
    failed = kube.get(f"/api/v1/namespaces/{namespace}/pods/exits-3")
    assert failed["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3

    pod = kube.get(f"/api/v1/namespaces/{namespace}/pods/printenv")
    log = node_agent.pod_log_path(namespace, "printenv", "main").read_text()
    seen = json.loads(log.strip().splitlines()[-1])
    # The pod acts as its ServiceAccount through $KUBECONFIG (no token volume here).
    pod_kubeconfig = Path(seen.pop("KUBECONFIG"))
    review = KubeClient.from_kubeconfig(pod_kubeconfig).create(
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    assert review["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:default"
    assert seen == {
        "POD_NAME": "printenv",
        "POD_NS": namespace,
        "MY_IP": pod["status"]["podIP"],
        "POD_IP": pod["status"]["podIP"],
        "GREETING": "hello",
        "COMPOSED": "hello-printenv-$(LITERAL)",
        "CM_COLOR": "blue",
        "CWD": str(Path(__file__).resolve().parents[1]),
        "ARGV": ["hello", "$(UNDEFINED)"],
    }


def test_crashing_container_is_restarted(
    cluster: ControlPlane, kube: KubeClient, namespace: str, node_agent: NodeAgentProcess
) -> None:
    crasher = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "crasher", "namespace": namespace},
        "spec": {
            "restartPolicy": "Always",
            "containers": [
                {
                    "name": "main",
                    "image": "python:local",
                    "command": [sys.executable, "-c", "print('boom'); raise SystemExit(7)"],
                }
            ],
        },
    }
    apply(cluster, crasher)

    def restarted() -> JSON | None:
        pod = kube.get(f"/api/v1/namespaces/{namespace}/pods/crasher")
        statuses = pod["status"].get("containerStatuses") or [{}]
        return statuses[0] if statuses[0].get("restartCount", 0) >= 2 else None

    status = eventually(restarted, 30, "two restarts")
    assert status["lastState"]["terminated"]["exitCode"] == 7
    pod = kube.get(f"/api/v1/namespaces/{namespace}/pods/crasher")
    assert pod["status"]["phase"] == "Running"  # restartPolicy Always never ends the pod
    log = node_agent.pod_log_path(namespace, "crasher", "main").read_text()
    assert log.count("boom") >= 2  # every run appends to the same log


def test_bad_token_is_unauthorized(cluster: ControlPlane) -> None:
    good = KubeConfig.load(cluster.kubeconfig_path)
    assert KubeClient(good).get("/api/v1/namespaces")["kind"] == "NamespaceList"
    bad = KubeClient(KubeConfig(good.server, "not-a-valid-token", good.ca_path))
    with pytest.raises(KubeAPIError) as err:
        bad.get("/api/v1/namespaces")
    assert err.value.status == 401


def test_rbac_denies_service_account_until_a_role_allows(
    cluster: ControlPlane, namespace: str
) -> None:
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    sa_kubeconfig = cluster.service_account_kubeconfig(namespace, "reader")
    sa = KubeClient.from_kubeconfig(sa_kubeconfig)
    with pytest.raises(KubeAPIError) as err:
        sa.get(f"/api/v1/namespaces/{namespace}/pods")
    assert err.value.status == 403
    assert f"system:serviceaccount:{namespace}:reader" in str(err.value)

    cluster.kubectl(
        "create", "role", "pod-reader", "--verb=list", "--resource=pods", "-n", namespace
    )
    cluster.kubectl(
        "create", "rolebinding", "reader-binding", "--role=pod-reader",
        f"--serviceaccount={namespace}:reader", "-n", namespace,
    )  # fmt: skip
    # The same token now lists pods (so the 403 was RBAC, not authentication) but still may
    # not touch anything the Role does not grant.
    listing = eventually(lambda: sa.get(f"/api/v1/namespaces/{namespace}/pods"), 10, "list")
    assert listing["kind"] == "PodList"
    with pytest.raises(KubeAPIError) as err:
        sa.get(f"/api/v1/namespaces/{namespace}/secrets")
    assert err.value.status == 403
    res = cluster.kubectl("get", "pods", "-n", namespace, kubeconfig=sa_kubeconfig)
    assert res.returncode == 0
