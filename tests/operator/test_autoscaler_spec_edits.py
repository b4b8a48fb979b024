"""Spec edits while the autoscaler runs (Prometheus mode with exact figures from a stand-in
Prometheus, the in-memory API)."""

from __future__ import annotations

from typing import Any

import pytest
from fake_kube import FakeKube
from fake_prometheus import FakePrometheus, vector
from test_autoscaler import NAME, NS, Clock, make_prometheus, scaling_active, status_of, tick, world


def test_a_new_slo_or_capacity_hint_replaces_the_capacity_learned_for_the_old_one(
    redis: str,
) -> None:
    """The learned per-replica capacity is a capacity at the SLO: learned for a TTFT target
    of 500 ms, it is wrong for 1000 ms. And the first pass with data copies the spec's
    hint into the learned figure, so an edited prefillTokensPerSecond (new, faster
    hardware, say) was never used: the old figure stayed until the operator restarted."""
    pods = ["chat-a", "chat-b"]
    load = {"prompt": 0.0, "waiting": 0.0, "ttft": None}

    def answer(query: str) -> bytes:
        if "histogram_quantile" in query:
            ttft = load["ttft"]
            if ttft is not None and "time_to_first_token" in query:
                return vector({"": ttft})
            return vector({})
        if "prompt_tokens" in query:
            return vector(dict.fromkeys(pods, load["prompt"]))
        if "num_requests_waiting" in query:
            return vector(dict.fromkeys(pods, load["waiting"]))
        return vector(dict.fromkeys(pods, 0.0))

    def learned() -> float:
        auto: dict[str, Any] = status_of(kube)["roles"][0]["autoscaling"]
        return float(auto["prefillTokensPerSecond"])

    def spec_auto() -> dict[str, Any]:
        obj = kube.obj("InferenceService", NS, NAME)
        assert obj is not None
        auto: dict[str, Any] = obj["spec"]["roles"]["unified"]["autoscaling"]
        return auto

    prom = FakePrometheus()
    prom.answer = answer
    try:
        kube, clock, events = FakeKube(), Clock(), []
        world(
            kube, redis, 2, [(p, f"127.0.0.{i + 2}") for i, p in enumerate(pods)],
            decodeTokensPerSecond=10_000, replicaStartupSeconds=0,
        )  # fmt: skip
        scaler = make_prometheus(kube, clock, prom.url)

        def idle_pass() -> float:
            load.update(prompt=0.0, waiting=0.0, ttft=None)
            clock.t += 5
            tick(scaler, kube, events)
            return learned()

        # A miss while requests queue, at 900 tok/s per replica rated 1000: the replicas
        # ran flat out at 900 (TTFT target 500 ms).
        load.update(prompt=900.0, waiting=1.0, ttft=1.0)
        tick(scaler, kube, events)
        assert learned() == pytest.approx(900.0)
        assert idle_pass() == pytest.approx(900.0)  # an idle pass teaches nothing

        obj = kube.obj("InferenceService", NS, NAME)
        assert obj is not None
        obj["spec"]["slo"]["ttftMs"] = 1000  # a looser target: 900 was for 500 ms
        assert idle_pass() == pytest.approx(1000.0)  # the hint, until a pass teaches more

        spec_auto()["prefillTokensPerSecond"] = 2000  # faster replicas, the user says
        assert idle_pass() == pytest.approx(2000.0)
    finally:
        prom.close()


def test_roles_on_different_intervals_do_not_flap_the_condition(redis: str) -> None:
    """ScalingActive was computed from the roles decided in this pass only. With prefill
    every 3 s and decode every 1 s, a prefill problem (its pod has no series in Prometheus)
    set it False on prefill's passes and the decode-only passes between set it True again:
    a condition (and any alert on it) flapping while the problem lasted."""
    auto = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "scaleUpWindowSeconds": 0,
        "scaleDownWindowSeconds": 0,
        "prefillTokensPerSecond": 1000,
        "decodeTokensPerSecond": 1000,
    }
    spec = {
        "model": {"source": {"path": "tiny"}},
        "roles": {
            "prefill": {"autoscaling": {**auto, "intervalSeconds": 3}},
            "decode": {"autoscaling": {**auto, "intervalSeconds": 1}},
        },
        "index": {"redisURL": redis},
        "slo": {"ttftMs": 500, "tpotMs": 100, "percentile": 95},
    }
    kube, clock, events = FakeKube(), Clock(), []
    kube.add(
        {"kind": "InferenceService", "metadata": {"name": NAME, "namespace": NS}, "spec": spec}
    )
    for role, pod, ip in (("prefill", "chat-p0", "127.0.0.2"), ("decode", "chat-d0", "127.0.0.3")):
        labels = {"pagefleet.io/service": NAME, "pagefleet.io/role": role}
        kube.add(
            {
                "kind": "Deployment",
                "metadata": {"name": f"{NAME}-{role}", "namespace": NS, "labels": labels},
                "spec": {"replicas": 1},
            }
        )
        kube.add(
            {
                "kind": "Pod",
                "metadata": {"name": pod, "namespace": NS, "labels": labels},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
            }
        )

    def answer(query: str) -> bytes:
        if "histogram_quantile" in query:
            return vector({})
        return vector({"chat-d0": 0.0})  # chat-p0: not scraped (a PodMonitor misses it)

    prom = FakePrometheus()
    prom.answer = answer
    try:
        scaler = make_prometheus(kube, clock, prom.url)
        seen = []
        for _ in range(6):
            roles = sorted(o.role for o in tick(scaler, kube, events))
            cond = scaling_active(kube)
            seen.append((roles, cond["status"]))
            clock.t += 1
    finally:
        prom.close()
    assert {s for _, s in seen} == {"False"}, seen
    assert "chat-p0" in scaling_active(kube)["message"]
