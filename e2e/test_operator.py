"""The InferenceService operator on a real control plane (issue 7).

The operator runs as a subprocess (`pagefleet operator`) authenticated as the ServiceAccount
of deploy/rbac.yaml, so every step also proves those permissions suffice. Pods run as local
processes on the node agent; the gateway finds the daemons through EndpointSlices, as in a
cluster, using a kubeconfig of the gateway's own ServiceAccount (the Role the operator made).
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import ControlPlane, ControlPlaneError, eventually
from e2e.kube_client import KubeClient
from e2e.kube_helpers import live_pods, pod_ready, ready_endpoints, tiny_checkpoint
from e2e.operator_process import PAGEFLEET, ROOT, OperatorProcess

pytestmark = pytest.mark.e2e

API = "/apis/pagefleet.io/v1alpha1"


# Kept under its old name: the P/D scenario imports it.
Operator = OperatorProcess


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    from pagefleet.dev.redis_server import LocalRedis

    server = LocalRedis()
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


def apply(cluster: ControlPlane, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj), check=False)


def infsvc(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def gateway_kubeconfig(cluster: ControlPlane, namespace: str, name: str) -> Path:
    """The kubeconfig of service ``name``'s gateway ServiceAccount: its gateway's env names
    this path (KUBECONFIG), and ``apply_service`` writes it."""
    return cluster.workdir / f"kubeconfig-sa-{namespace}-{name}-gateway"


def apply_service(
    cluster: ControlPlane, kube: KubeClient, namespace: str, name: str, spec: dict[str, Any]
) -> None:
    """Apply InferenceService ``name``; once the operator has made its gateway's
    ServiceAccount, write the kubeconfig that gateway reads (it retries until then)."""
    res = apply(cluster, infsvc(name, namespace, spec))
    assert res.returncode == 0, res.stderr
    eventually(
        lambda: kube.get_or_none(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}-gateway"),
        60,
        "the gateway ServiceAccount",
    )
    written = cluster.service_account_kubeconfig(namespace, f"{name}-gateway")
    assert written == gateway_kubeconfig(cluster, namespace, name)


def get_is(kube: KubeClient, ns: str, name: str) -> dict[str, Any]:
    return kube.get(f"{API}/namespaces/{ns}/inferenceservices/{name}")


def deployment(kube: KubeClient, ns: str, name: str) -> dict[str, Any] | None:
    return kube.get_or_none(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")


def names(kube: KubeClient, path: str, selector: str) -> list[str]:
    items = kube.get(path, {"labelSelector": selector})["items"]
    return sorted(
        i["metadata"]["name"] for i in items if not i["metadata"].get("deletionTimestamp")
    )


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions", []):
        if cond["type"] == type_:
            return cond
    return {}


def events_for(cluster: ControlPlane, ns: str, name: str) -> list[dict[str, Any]]:
    out = cluster.kubectl_json(
        "get", "events", "-n", ns, f"--field-selector=involvedObject.name={name}"
    )
    return out["items"]


# ---------------------------------------------------------------------------------------


def test_crd_is_installed_and_explained(cluster: ControlPlane, operator: Operator) -> None:
    # The OpenAPI document is republished a moment after the CRD is Established.
    explain = eventually(
        lambda: (
            (
                r := cluster.kubectl("explain", "inferenceservice.spec.roles.unified", check=False)
            ).returncode
            == 0
            and r.stdout
        ),
        60,
        "kubectl explain of the CRD",
    )
    assert "either replicas or autoscaling" not in explain  # rules are not fields
    assert "Fixed number of daemon pods" in explain
    short = cluster.kubectl("api-resources", "--api-group=pagefleet.io").stdout
    assert "infsvc" in short and "InferenceService" in short


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"roles": {"unified": {"replicas": 1, "autoscaling": {"maxReplicas": 2}}}},
            "a role sets either replicas or autoscaling, not both",
        ),
        (
            {"roles": {"unified": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}}},
            "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
        ),
        ({"roles": {"prefill": {"replicas": 1}}}, "prefill and decode must be set together"),
        ({"engine": {"blockSize": 0}}, "spec.engine.blockSize"),
        ({"router": {"policy": "fastest"}}, 'Unsupported value: "fastest"'),
    ],
    ids=["replicas-and-autoscaling", "min-gt-max", "prefill-alone", "block-size", "policy"],
)
def test_invalid_spec_is_refused_by_the_api_server(
    cluster: ControlPlane, namespace: str, operator: Operator, spec: dict[str, Any], message: str
) -> None:
    full = {"model": {"source": {"path": "tiny"}}, **spec}
    res = apply(cluster, infsvc("bad", namespace, full))
    assert res.returncode != 0
    assert message in res.stderr, res.stderr
    assert "is invalid" in res.stderr


def test_unrealisable_spec_sets_degraded_then_recovers(
    cluster: ControlPlane, kube: KubeClient, namespace: str, operator: Operator
) -> None:
    # No spec.index.redisURL and the operator runs without a bundled Redis: the schema
    # cannot know that, the operator must say so.
    spec = {
        "model": {"source": {"path": "tiny"}},
        "roles": {"unified": {"replicas": 0}},
        "router": {"replicas": 0},
    }
    assert apply(cluster, infsvc("noredis", namespace, spec)).returncode == 0
    degraded = eventually(
        lambda: (
            condition(get_is(kube, namespace, "noredis"), "Degraded").get("status") == "True"
            and condition(get_is(kube, namespace, "noredis"), "Degraded")
        ),
        timeout_s=60,
        what="Degraded=True on an InferenceService without Redis",
    )
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.index.redisURL" in degraded["message"]
    eventually(
        lambda: any(
            e["type"] == "Warning" and e["reason"] == "InvalidSpec"
            for e in events_for(cluster, namespace, "noredis")
        ),
        30,
        "an InvalidSpec Warning Event",
    )
    operator.check_alive()

    kube.merge_patch(
        f"{API}/namespaces/{namespace}/inferenceservices/noredis",
        {"spec": {"index": {"redisURL": "redis://127.0.0.1:1/0"}}},
    )
    eventually(
        lambda: condition(get_is(kube, namespace, "noredis"), "Degraded").get("status") == "False",
        timeout_s=60,
        what="Degraded cleared after the spec was fixed",
    )
    assert deployment(kube, namespace, "noredis-unified") is not None


def test_children_are_owned_repaired_switched_and_collected(
    cluster: ControlPlane, kube: KubeClient, namespace: str, operator: Operator
) -> None:
    # Zero replicas: this test exercises the control loop, not the pods.
    spec = {
        "model": {"source": {"path": "tiny"}},
        "image": "pagefleet:e2e",
        "roles": {"unified": {"replicas": 0}},
        "router": {"replicas": 0},
        "index": {"redisURL": "redis://127.0.0.1:1/0"},
    }
    assert apply(cluster, infsvc("ctl", namespace, spec)).returncode == 0
    sel = "pagefleet.io/service=ctl"
    ns_api = f"/api/v1/namespaces/{namespace}"
    # status.observedGeneration is written after the whole pass applied every child.
    eventually(
        lambda: (get_is(kube, namespace, "ctl").get("status") or {}).get("observedGeneration") == 1,
        timeout_s=60,
        what="the first reconcile pass",
    )
    assert names(kube, f"/apis/apps/v1/namespaces/{namespace}/deployments", sel) == [
        "ctl-gateway",
        "ctl-unified",
    ]
    assert names(kube, f"{ns_api}/services", sel) == ["ctl-gateway", "ctl-unified"]
    assert names(kube, f"{ns_api}/configmaps", sel) == ["ctl-config"]
    assert names(kube, f"{ns_api}/serviceaccounts", sel) == ["ctl-gateway"]
    uid = get_is(kube, namespace, "ctl")["metadata"]["uid"]
    unified = deployment(kube, namespace, "ctl-unified")
    assert unified is not None
    (ref,) = unified["metadata"]["ownerReferences"]
    assert ref["uid"] == uid and ref["controller"] is True
    svc = kube.get(f"{ns_api}/services/ctl-unified")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["name"] == "http"

    ready = eventually(
        lambda: (
            condition(get_is(kube, namespace, "ctl"), "Ready").get("status") == "True"
            and get_is(kube, namespace, "ctl")
        ),
        timeout_s=60,
        what="Ready=True (zero replicas are trivially ready)",
    )
    assert ready["status"]["observedGeneration"] == ready["metadata"]["generation"]
    printed = cluster.kubectl("get", "infsvc", "ctl", "-n", namespace).stdout
    assert "unified:0/0" in printed and "ctl-gateway" in printed

    # A child deleted by hand comes back (from the Deployment watch, not the resync).
    old_uid = unified["metadata"]["uid"]
    cluster.kubectl("delete", "deployment", "ctl-unified", "-n", namespace)
    restored = eventually(
        lambda: (
            (d := deployment(kube, namespace, "ctl-unified"))
            and d["metadata"]["uid"] != old_uid
            and d
        ),
        timeout_s=30,
        what="the deleted Deployment restored",
    )
    assert restored["metadata"]["ownerReferences"][0]["uid"] == uid
    eventually(  # kopf posts Events from a queue, a moment after the handler
        lambda: any(e["reason"] == "Restored" for e in events_for(cluster, namespace, "ctl")),
        30,
        "a Restored Event on the InferenceService",
    )

    # A child edited by hand is put back (by the resync pass).
    cluster.kubectl("set", "image", "deployment/ctl-unified", "daemon=evil:1", "-n", namespace)
    eventually(
        lambda: (
            deployment(kube, namespace, "ctl-unified")["spec"]["template"]["spec"]["containers"][0][
                "image"
            ]
            == "pagefleet:e2e"
        ),
        timeout_s=30,
        what="the hand-edited image reverted",
    )

    # unified -> prefill + decode replaces the role workloads.
    kube.merge_patch(
        f"{API}/namespaces/{namespace}/inferenceservices/ctl",
        {
            "spec": {
                "roles": {"unified": None, "prefill": {"replicas": 0}, "decode": {"replicas": 0}}
            }
        },
    )
    eventually(
        lambda: (
            names(kube, f"/apis/apps/v1/namespaces/{namespace}/deployments", sel)
            == ["ctl-decode", "ctl-gateway", "ctl-prefill"]
        ),
        timeout_s=60,
        what="prefill and decode Deployments replacing unified",
    )
    eventually(
        lambda: (get_is(kube, namespace, "ctl").get("status") or {}).get("observedGeneration") == 2,
        timeout_s=60,
        what="the pass for the switched spec",
    )
    assert names(kube, f"{ns_api}/services", sel) == ["ctl-decode", "ctl-gateway", "ctl-prefill"]
    gw = deployment(kube, namespace, "ctl-gateway")
    cmd = gw["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--service") + 1] == "ctl-decode"

    # The switch's own steps are no drift: the one repaired was the hand-edited image.
    def drift_events() -> list[str]:
        return [
            e["message"]
            for e in events_for(cluster, namespace, "ctl")
            if e["reason"] == "DriftRepaired"
        ]

    # kopf posts Events from a queue: on a loaded machine the repair's Event can land
    # seconds after the image was put back, so wait for it rather than a fixed time.
    eventually(drift_events, 30, "a DriftRepaired Event for the hand-edited image")
    time.sleep(4)  # the pass the old roles' deletion triggers, and a resync
    drift = drift_events()
    assert all("Deployment ctl-unified" in m for m in drift), drift

    # Deleting the InferenceService garbage-collects every child.
    cluster.kubectl("delete", "infsvc", "ctl", "-n", namespace, "--wait=false")
    for path in (
        f"/apis/apps/v1/namespaces/{namespace}/deployments",
        f"{ns_api}/services",
        f"{ns_api}/configmaps",
        f"{ns_api}/serviceaccounts",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
    ):
        eventually(lambda path=path: names(kube, path, sel) == [], 60, f"GC of {path}")
    operator.check_alive()


# ---------------------------------------------------------------------------------------


def _wait_ready(kube: KubeClient, ns: str, name: str, timeout_s: float) -> dict[str, Any]:
    def check() -> dict[str, Any] | bool:
        obj = get_is(kube, ns, name)
        st = obj.get("status") or {}
        ok = (
            st.get("observedGeneration") == obj["metadata"]["generation"]
            and condition(obj, "Ready").get("status") == "True"
        )
        return obj if ok else False

    return eventually(check, timeout_s, f"InferenceService {name} Ready")


def _complete(gateway_ip: str, prompt: str) -> Any:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{gateway_ip}:8080/v1", api_key="unused", max_retries=2)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)


def test_serving_lifecycle(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    operator: Operator,
    redis_url: str,
) -> None:
    """apply -> pods Ready + EndpointSlices -> openai completion through the gateway ->
    scale + engine knob rollout -> delete, everything collected."""
    t0 = time.monotonic()
    model = tiny_checkpoint()
    # The gateway discovers pods with its own ServiceAccount's token; the file is written
    # once the operator created that ServiceAccount (the gateway retries until then).
    gw_kubeconfig = gateway_kubeconfig(cluster, namespace, "tiny")
    spec = {
        "model": {"source": {"path": model}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 8},
        "roles": {"unified": {"replicas": 2}},
        "router": {"replicas": 1, "env": [{"name": "KUBECONFIG", "value": str(gw_kubeconfig)}]},
        "index": {"redisURL": redis_url},
    }
    apply_service(cluster, kube, namespace, "tiny", spec)

    obj = _wait_ready(kube, namespace, "tiny", timeout_s=240)
    assert obj["status"]["replicas"] == "unified:2/2"
    assert obj["status"]["url"] == f"http://tiny-gateway.{namespace}.svc:8080/v1"
    daemons = live_pods(kube, namespace, "pagefleet.io/service=tiny,pagefleet.io/role=unified")
    assert len(daemons) == 2 and all(pod_ready(p) for p in daemons)
    ips = sorted(p["status"]["podIP"] for p in daemons)
    # The EndpointSlice controller publishes a pod's readiness asynchronously, after the
    # pod's own status says Ready: poll until the slice catches up.
    eventually(
        lambda: ready_endpoints(kube, namespace, "tiny-unified") == ips,
        30,
        f"EndpointSlices of tiny-unified listing {ips}",
    )
    (gw_pod,) = live_pods(kube, namespace, "pagefleet.io/service=tiny,pagefleet.io/role=gateway")
    gateway_ip = gw_pod["status"]["podIP"]
    first_ready_s = time.monotonic() - t0

    completion = eventually(
        lambda: _complete(gateway_ip, "The operator says hello"), 60, "a completion via the gateway"
    )
    assert completion.model == "tiny"
    assert completion.usage.completion_tokens > 0
    assert completion.choices[0].finish_reason in ("length", "stop")

    # Scale out and change an engine knob: a rolling update to 3 pods with the new flag.
    t1 = time.monotonic()
    kube.merge_patch(
        f"{API}/namespaces/{namespace}/inferenceservices/tiny",
        {"spec": {"roles": {"unified": {"replicas": 3}}, "engine": {"maxNumSeqs": 4}}},
    )
    obj = _wait_ready(kube, namespace, "tiny", timeout_s=300)
    assert obj["metadata"]["generation"] == 2
    assert obj["status"]["replicas"] == "unified:3/3"
    dep = deployment(kube, namespace, "tiny-unified")
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--max-num-seqs") + 1] == "4"
    eventually(
        lambda: len(ready_endpoints(kube, namespace, "tiny-unified")) == 3, 60, "3 endpoints"
    )
    for pod in live_pods(kube, namespace, "pagefleet.io/service=tiny,pagefleet.io/role=unified"):
        pod_cmd = pod["spec"]["containers"][0]["command"]
        assert pod_cmd[pod_cmd.index("--max-num-seqs") + 1] == "4"
    rollout_s = time.monotonic() - t1
    # A daemon-only knob must not have restarted the gateway.
    (gw_after,) = live_pods(kube, namespace, "pagefleet.io/service=tiny,pagefleet.io/role=gateway")
    assert gw_after["metadata"]["uid"] == gw_pod["metadata"]["uid"]
    completion = eventually(
        lambda: _complete(gateway_ip, "After the rollout"), 60, "a completion after the rollout"
    )
    assert completion.usage.completion_tokens > 0

    cluster.kubectl("delete", "infsvc", "tiny", "-n", namespace, "--wait=false")
    eventually(
        lambda: live_pods(kube, namespace, "pagefleet.io/service=tiny") == [], 120, "pods removed"
    )
    assert (
        names(
            kube, f"/apis/apps/v1/namespaces/{namespace}/deployments", "pagefleet.io/service=tiny"
        )
        == []
    )
    operator.check_alive()
    print(
        json.dumps(
            {
                "first_ready_s": round(first_ready_s, 1),
                "rollout_2_to_3_s": round(rollout_s, 1),
                "total_s": round(time.monotonic() - t0, 1),
            }
        )
    )


def test_a_fresh_service_reports_no_drift(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    operator: Operator,
    redis_url: str,
) -> None:
    """Nobody edits anything: the passes after creation (resync, child events) must not post
    DriftRepaired for what Kubernetes' own controllers write (the Deployment controller's
    revision annotation, status, defaults), or operators go hunting for a hand edit."""
    model = tiny_checkpoint()
    gw_kubeconfig = gateway_kubeconfig(cluster, namespace, "calm")
    spec = {
        "model": {"source": {"path": model}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 8},
        "roles": {"unified": {"replicas": 1}},
        "router": {"replicas": 1, "env": [{"name": "KUBECONFIG", "value": str(gw_kubeconfig)}]},
        "index": {"redisURL": redis_url},
    }
    apply_service(cluster, kube, namespace, "calm", spec)
    _wait_ready(kube, namespace, "calm", timeout_s=240)
    # A few resync passes (3 s apart here) over the settled children, plus the ones the
    # pods' start-up triggered while they came up.
    time.sleep(12)
    reasons = [e["reason"] for e in events_for(cluster, namespace, "calm")]
    assert "Created" in reasons  # the Events are there to be read
    drift = [
        e["message"]
        for e in events_for(cluster, namespace, "calm")
        if e["reason"] == "DriftRepaired"
    ]
    assert drift == [], f"DriftRepaired with no edit: {drift}"
    operator.check_alive()


def test_operator_identity_is_least_privilege(cluster: ControlPlane, operator: Operator) -> None:
    kubeconfig = cluster.service_account_kubeconfig("pagefleet-system", "pagefleet-operator")

    def can(*args: str) -> bool:
        res = cluster.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False)
        return res.stdout.strip() == "yes"

    assert can("patch", "deployments.apps", "-n", "default")
    assert can("patch", "inferenceservices.pagefleet.io/status", "-n", "default")
    # No access to Secrets from the ClusterRole: not even get by name.
    for verb in ("get", "list", "watch"):
        assert not can(verb, "secrets", "-n", "default")
    assert not can("get", "secrets/chat-redis", "-n", "default")
    assert not can("create", "pods", "-n", "default")
    assert not can("delete", "nodes")
    with pytest.raises(ControlPlaneError, match=r"[Ff]orbidden"):
        cluster.kubectl("get", "secrets", "-A", kubeconfig=kubeconfig)

    # The per-Secret Role (a service's own Redis password, for the autoscaler) grants get on
    # that one Secret in that one namespace, and nothing else. Read for real, not only asked.
    role = (ROOT / "deploy" / "redis-secret-role.yaml").read_text()
    role = role.replace("NAMESPACE", "default").replace("SECRET", "chat-redis")
    cluster.kubectl("apply", "-f", "-", input=role)
    for name in ("chat-redis", "other"):
        cluster.kubectl(
            "create", "secret", "generic", name, "-n", "default", f"--from-literal=pw={name}-pw"
        )
    try:
        eventually(lambda: can("get", "secrets/chat-redis", "-n", "default"), 30, "Role")
        got = cluster.kubectl(
            "get", "secret", "chat-redis", "-n", "default", "-o", "jsonpath={.data.pw}",
            kubeconfig=kubeconfig,
        )  # fmt: skip
        assert base64.b64decode(got.stdout).decode() == "chat-redis-pw"
        assert not can("get", "secrets/other", "-n", "default")
        assert not can("list", "secrets", "-n", "default")
        assert not can("get", "secrets/chat-redis", "-n", "kube-system")
        with pytest.raises(ControlPlaneError, match=r"[Ff]orbidden"):
            cluster.kubectl("get", "secret", "other", "-n", "default", kubeconfig=kubeconfig)
    finally:
        cluster.kubectl("delete", "-f", "-", input=role, check=False)
        cluster.kubectl("delete", "secret", "chat-redis", "other", "-n", "default", check=False)
