"""The role autoscaler on a real control plane (issue 13).

One InferenceService with unified autoscaling {min 1, max 3} and short windows; a load step
through the gateway (`pagefleet bench`, open loop) scales it to >= 2 Ready pods; when the
load stops it scales back to 1, and every pod the ReplicaSet removes is the one the planner
marked with `controller.kubernetes.io/pod-deletion-cost`. Status and Events carry reasons,
and the operator's /metrics show desired replicas.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster import ControlPlane, eventually, tail
from e2e.kube_client import KubeClient
from e2e.kube_helpers import live_pods, pod_ready, tiny_checkpoint
from e2e.operator_process import OperatorProcess, install_prerequisites
from e2e.test_operator import (
    PAGEFLEET,
    apply_service,
    condition,
    events_for,
    gateway_kubeconfig,
    get_is,
    redis_url,  # noqa: F401 (fixture)
)
from pagefleet.dev.process import free_port

pytestmark = pytest.mark.e2e

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
SELECTOR = "pagefleet.io/service=auto,pagefleet.io/role=unified"


@pytest.fixture(scope="module")
def autoscaling_operator(
    cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[OperatorProcess, int]]:
    install_prerequisites(cluster)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    port = free_port()
    op = OperatorProcess(
        cluster, log,
        "--resync-seconds", "5", "--autoscale-seconds", "1", "--rate-window-seconds", "6",
        "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
    )  # fmt: skip
    op.start()
    try:
        yield op, port
    finally:
        op.stop()
        op.assert_not_refused()
        text = log.read_text(errors="replace")
        if "autoscaler tick of" in text:  # an unexpected exception: show its traceback
            at = text.index("autoscaler tick of")
            raise AssertionError("the autoscaler raised:\n" + text[at : at + 4000])


def _autoscaling(obj: dict[str, Any]) -> dict[str, Any]:
    roles = (obj.get("status") or {}).get("roles") or []
    return next((r.get("autoscaling") or {} for r in roles if r["name"] == "unified"), {})


class PodWatch:
    """Polls the role's pods; remembers each pod's annotations when it starts terminating."""

    def __init__(self, kube: KubeClient, ns: str, selector: str = SELECTOR) -> None:
        self.kube, self.ns, self.selector = kube, ns, selector
        self.removed: dict[str, str | None] = {}  # pod -> its deletion cost when removed

    def poll(self) -> list[dict[str, Any]]:
        items = self.kube.get(
            f"/api/v1/namespaces/{self.ns}/pods", {"labelSelector": self.selector}
        )["items"]
        for p in items:
            name = p["metadata"]["name"]
            if p["metadata"].get("deletionTimestamp") and name not in self.removed:
                self.removed[name] = (p["metadata"].get("annotations") or {}).get(DELETION_COST)
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def test_load_step_scales_out_and_back_removing_the_marked_pod(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    autoscaling_operator: tuple[OperatorProcess, int],
    redis_url: str,  # noqa: F811
) -> None:
    operator, metrics_port = autoscaling_operator
    log = operator.log
    t0 = time.monotonic()
    model = tiny_checkpoint()
    gw_kubeconfig = gateway_kubeconfig(cluster, namespace, "auto")
    spec = {
        "model": {"source": {"path": model}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 8},
        "roles": {
            "unified": {
                "autoscaling": {
                    "minReplicas": 1,
                    "maxReplicas": 3,
                    "intervalSeconds": 1,
                    "scaleUpWindowSeconds": 0,
                    "scaleDownWindowSeconds": 8,
                    "maxScaleUpStep": 1,
                    # A tiny CPU replica rated low, so a modest load step needs more of them.
                    "prefillTokensPerSecond": 40,
                    "decodeTokensPerSecond": 20,
                }
            }
        },
        "router": {"replicas": 1, "env": [{"name": "KUBECONFIG", "value": str(gw_kubeconfig)}]},
        "index": {"redisURL": redis_url},
        "slo": {"ttftMs": 2000, "tpotMs": 500},
    }
    apply_service(cluster, kube, namespace, "auto", spec)
    watch = PodWatch(kube, namespace)

    def one_ready_and_gateway() -> str | bool:
        daemons = watch.poll()
        gws = live_pods(kube, namespace, "pagefleet.io/service=auto,pagefleet.io/role=gateway")
        ok = len(daemons) == 1 and pod_ready(daemons[0]) and gws and pod_ready(gws[0])
        return gws[0]["status"]["podIP"] if ok else False

    gateway_ip = eventually(one_ready_and_gateway, 180, "1 Ready daemon and the gateway")
    # Idle: the planner holds at min (Steady or waiting for a second scrape), never lower.
    eventually(
        lambda: (
            _autoscaling(get_is(kube, namespace, "auto")).get("reason")
            in ("Steady", "CapacityUnknown")
        ),
        60,
        "a first autoscaler decision on the idle service",
    )
    ready_s = time.monotonic() - t0

    # The load step: open-loop conversations through the gateway until >= 2 pods are Ready.
    t1 = time.monotonic()
    bench_log = log.with_name("bench.log")
    with open(bench_log, "wb") as out:
        bench = subprocess.Popen(
            [
                PAGEFLEET,
                "bench",
                "--url",
                f"http://{gateway_ip}:8080",
                "--model",
                "tiny",
                "-n",
                "2000",
                "--request-rate",
                "2",
                "--max-tokens",
                "16",
                "--no-progress",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def scaled_out() -> bool:
            assert bench.poll() is None, "the load generator exited:\n" + tail(bench_log, 30)
            ready = [p for p in watch.poll() if pod_ready(p)]
            return len(ready) >= 2

        eventually(scaled_out, 120, ">= 2 Ready daemons under load")
    finally:
        os.killpg(bench.pid, signal.SIGTERM)
        bench.wait(timeout=30)
    scale_out_s = time.monotonic() - t1
    obj = get_is(kube, namespace, "auto")
    up = [e for e in events_for(cluster, namespace, "auto") if e["reason"] == "ScaledUp"]
    assert up, "no ScaledUp Event"
    assert up[0]["message"].startswith("unified: ")
    assert "tok/s" in up[0]["message"]  # the inputs behind the decision
    peak = max(len(watch.poll()), _autoscaling(obj).get("desiredReplicas", 0))

    # Load gone: back to 1, one pod at a time, each the one the planner marked.
    t2 = time.monotonic()

    def scaled_in() -> bool:
        alive = watch.poll()
        return (
            len(alive) == 1
            and _autoscaling(get_is(kube, namespace, "auto")).get("desiredReplicas") == 1
        )

    eventually(scaled_in, 120, "back to 1 daemon after the load stopped")
    scale_in_s = time.monotonic() - t2
    assert len(watch.removed) >= max(1, peak - 1), (peak, watch.removed)
    wrong = {pod: cost for pod, cost in watch.removed.items() if cost != "-1000"}
    assert not wrong, f"pods removed without the planner's mark: {wrong}"
    downs = [e for e in events_for(cluster, namespace, "auto") if e["reason"] == "ScaledDown"]
    for pod in watch.removed:
        assert any(pod in e["message"] for e in downs), (pod, [e["message"] for e in downs])

    # The status is written by the next decision: one taken while a removed pod was still
    # terminating reads InputsPartial (that pod answers no scrape) and holds. Wait for a
    # decision on the fleet as it is now.
    def settled() -> dict[str, Any] | bool:
        obj = get_is(kube, namespace, "auto")
        return obj if _autoscaling(obj).get("currentReplicas") == 1 else False

    obj = eventually(settled, 60, "a decision on the scaled-in fleet")
    auto = _autoscaling(obj)
    assert auto["reason"] in ("ScaledDown", "Steady", "ScaleDownStabilizing"), auto
    assert auto["lastScaleTime"] and auto["currentReplicas"] >= 1
    active = condition(obj, "ScalingActive")
    assert active.get("status") == "True", active
    # Deployment replicas are the autoscaler's, not clamped back by the reconciler.
    dep = kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/auto-unified")
    assert dep["spec"]["replicas"] == 1

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'pagefleet_operator_role_desired_replicas{namespace="' + namespace in text
    assert "pagefleet_operator_autoscaler_decisions_total" in text
    operator.check_alive()
    print(
        f"autoscale e2e: first Ready {ready_s:.0f}s, scale-out {scale_out_s:.0f}s, "
        f"scale-in {scale_in_s:.0f}s, removed {sorted(watch.removed)}"
    )
    cluster.kubectl("delete", "infsvc", "auto", "-n", namespace, "--wait=false")
    eventually(
        lambda: live_pods(kube, namespace, "pagefleet.io/service=auto") == [], 120, "cleanup"
    )


def test_an_operator_killed_mid_scale_keeps_the_scale_down_hold(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    autoscaling_operator: tuple[OperatorProcess, int],
    redis_url: str,  # noqa: F811
) -> None:
    """The planner's memory lived only in the operator: one killed (an OOM kill, a node
    lost) while a scale-down was held scaled down on its successor's first decision. The
    successor recalls the count as the window's recommendation from status. Here 3 idle
    pods, minReplicas lowered 3 -> 1: held for idle_release_s (20 s) after the last
    recommendation of 3; the operator is killed and restarted inside that hold."""
    operator, _ = autoscaling_operator
    model = tiny_checkpoint()
    gw_kubeconfig = gateway_kubeconfig(cluster, namespace, "hold")
    auto = {
        "minReplicas": 3,
        "maxReplicas": 3,
        "intervalSeconds": 1,
        "scaleUpWindowSeconds": 0,
        "scaleDownWindowSeconds": 600,
        "prefillTokensPerSecond": 40,
        "decodeTokensPerSecond": 20,
    }
    spec = {
        "model": {"source": {"path": model}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 8},
        "roles": {"unified": {"autoscaling": auto}},
        "router": {"replicas": 1, "env": [{"name": "KUBECONFIG", "value": str(gw_kubeconfig)}]},
        "index": {"redisURL": redis_url},
        "slo": {"ttftMs": 2000, "tpotMs": 500},
    }
    apply_service(cluster, kube, namespace, "hold", spec)
    selector = "pagefleet.io/service=hold,pagefleet.io/role=unified"
    path = f"/apis/pagefleet.io/v1alpha1/namespaces/{namespace}/inferenceservices/hold"
    dep_path = f"/apis/apps/v1/namespaces/{namespace}/deployments/hold-unified"

    def three_ready() -> bool:
        pods = live_pods(kube, namespace, selector)
        return len(pods) == 3 and all(pod_ready(p) for p in pods)

    eventually(three_ready, 240, "3 Ready daemons")
    eventually(
        lambda: _autoscaling(get_is(kube, namespace, "hold")).get("reason") == "Steady",
        60,
        "a decision on the 3 idle pods",
    )
    kube.merge_patch(path, {"spec": {"roles": {"unified": {"autoscaling": {"minReplicas": 1}}}}})
    eventually(
        lambda: (
            _autoscaling(get_is(kube, namespace, "hold")).get("reason") == "ScaleDownStabilizing"
        ),
        15,
        "the scale-down held",
    )
    # A decision stamped after this one is the successor's (stamps have 1 s resolution).
    restart_stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))
    operator.kill()
    operator.start()

    def decided_since_restart() -> dict[str, Any] | None:
        auto = _autoscaling(get_is(kube, namespace, "hold"))
        stamp = auto.get("lastDecisionTime", "")
        fresh = stamp >= restart_stamp and auto.get("reason") != "InputsUnknown"
        return auto if fresh else None

    # Watch the count until a second after the successor's first decision on known inputs
    # (its hold lasts 20 s from its first pass): it must not move.
    seen: list[int] = []
    decided: dict[str, Any] | None = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen.append(kube.get(dep_path)["spec"]["replicas"])
        if decided is not None:
            break
        decided = decided_since_restart()
        time.sleep(0.5)
    assert decided is not None, "no decision by the restarted operator within 60 s"
    assert set(seen) == {3}, f"scaled down right after the restart: {seen}, {decided}"
    assert decided["reason"] == "ScaleDownStabilizing", decided
    operator.check_alive()
    cluster.kubectl("delete", "infsvc", "hold", "-n", namespace, "--wait=false")
    eventually(
        lambda: live_pods(kube, namespace, "pagefleet.io/service=hold") == [], 120, "cleanup"
    )


def test_a_lowered_replica_count_removes_the_pods_the_planner_marks(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    autoscaling_operator: tuple[OperatorProcess, int],
    redis_url: str,  # noqa: F811
) -> None:
    """spec.roles.unified.replicas 3 -> 1: the reconcile pass applied the lower count at
    once and the ReplicaSet chose the two pods to delete (newest first), blind to the
    cache. Now it marks the two holding the least (here: the pods that served nothing,
    not the one a completion warmed), then lowers the count."""
    import asyncio
    import json

    from pagefleet.operator.collect import read_heartbeats
    from pagefleet.operator.naming import DAEMON_PORT, Names

    model = tiny_checkpoint()
    gw_kubeconfig = gateway_kubeconfig(cluster, namespace, "shrink")
    spec = {
        "model": {"source": {"path": model}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 8},
        "roles": {"unified": {"replicas": 3}},
        "router": {"replicas": 1, "env": [{"name": "KUBECONFIG", "value": str(gw_kubeconfig)}]},
        "index": {"redisURL": redis_url},
    }
    apply_service(cluster, kube, namespace, "shrink", spec)
    selector = "pagefleet.io/service=shrink,pagefleet.io/role=unified"
    path = f"/apis/pagefleet.io/v1alpha1/namespaces/{namespace}/inferenceservices/shrink"

    def three_ready() -> list[dict[str, Any]] | bool:
        pods = live_pods(kube, namespace, selector)
        return pods if len(pods) == 3 and all(pod_ready(p) for p in pods) else False

    pods = eventually(three_ready, 240, "3 Ready daemons")
    # Warm one pod's cache: the newest, which the ReplicaSet's own ranking removes first.
    warm = max(pods, key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"]))
    warm_name = warm["metadata"]["name"]
    body = json.dumps({"model": "tiny", "prompt": "the quick brown fox " * 40, "max_tokens": 4})
    req = urllib.request.Request(
        f"http://{warm['status']['podIP']}:{DAEMON_PORT}/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200

    def heartbeats_show_it() -> bool:
        loads = asyncio.run(read_heartbeats(redis_url, Names("shrink", namespace).kv_namespace, 5))
        seen = {p["metadata"]["name"] for p in pods} <= set(loads)
        return seen and loads[warm_name].num_cached_blocks > 0

    eventually(heartbeats_show_it, 30, "every pod's heartbeat, the warm one with cached blocks")

    watch = PodWatch(kube, namespace, selector)
    kube.merge_patch(path, {"spec": {"roles": {"unified": {"replicas": 1}}}})

    def one_left() -> list[dict[str, Any]] | bool:
        alive = watch.poll()
        return alive if len(alive) == 1 else False

    (survivor,) = eventually(one_left, 60, "1 daemon left")
    assert survivor["metadata"]["name"] == warm_name, (warm_name, watch.removed)
    assert len(watch.removed) == 2, watch.removed
    wrong = {pod: cost for pod, cost in watch.removed.items() if cost != "-1000"}
    assert not wrong, f"pods removed without the planner's mark: {wrong}"
    downs = [e for e in events_for(cluster, namespace, "shrink") if e["reason"] == "ScalingDown"]
    assert downs and all(pod in downs[0]["message"] for pod in watch.removed), downs
    autoscaling_operator[0].check_alive()
    cluster.kubectl("delete", "infsvc", "shrink", "-n", namespace, "--wait=false")
    eventually(
        lambda: live_pods(kube, namespace, "pagefleet.io/service=shrink") == [], 120, "cleanup"
    )
