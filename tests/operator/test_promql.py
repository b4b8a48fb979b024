"""The autoscaler's Prometheus mode (``--prometheus-url``) against a server that answers
something other than a Prometheus instant vector: whatever it says makes the role's pods
unknown with a condition, never an exception out of the pass. (A real Prometheus is in
test_autoscaler.py.)"""

from __future__ import annotations

import pytest
from fake_kube import FakeKube
from fake_prometheus import FakePrometheus, vector
from test_autoscaler import NS, Clock, make_prometheus, replicas, scaling_active, tick, world

from pagefleet.operator.autoscaler import Autoscaler, AutoscalerSettings
from pagefleet.operator.builders import BuildSettings
from pagefleet.operator.metrics import OperatorMetrics


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b'"ok"',
        b"null",
        b'{"status": "success"}',
        b'{"status": "success", "data": {"resultType": "vector", "result": {"a": 1}}}',
        b'{"status": "success", "data": {"result": [{"metric": {"pod": "chat-a"}}]}}',
    ],
)
def test_a_prometheus_answering_other_json_holds_with_a_condition(redis: str, body: bytes) -> None:
    """A --prometheus-url that answers JSON of another shape (a list, a string, a success
    without data) raised out of the pass (AttributeError, KeyError): no decision, no
    condition, only a traceback in the operator's log every tick."""
    prom = FakePrometheus()
    try:
        prom.body = body
        kube, clock, events = FakeKube(), Clock(), []
        world(kube, redis, 2, [("chat-a", "127.0.0.2")])
        scaler = make_prometheus(kube, clock, prom.url)
        (out,) = tick(scaler, kube, events)
    finally:
        prom.close()
    assert replicas(kube) == 2 and out.decision.reason.value == "InputsUnknown"
    cond = scaling_active(kube)
    assert cond["status"] == "False" and f"Prometheus {prom.url}" in cond["message"], cond


def test_prometheus_mode_releases_an_idle_marked_pod_like_the_scrape_mode(redis: str) -> None:
    """The planner shortens the scale-down hold to idle_release_s (20 s) when the pod a
    scale-down removes holds no request. The scrape mode tells it that pod's requests;
    the Prometheus mode never did (victim_requests None), so with the same idle fleet it
    held the whole scale-down window (300 s here) where the scrape mode scaled down after
    20 s."""
    pods = ["chat-a", "chat-b", "chat-c"]
    per_pod_gen = {"rate": 85.0}  # generated tokens/s per pod

    def answer(query: str) -> bytes:
        if "histogram_quantile" in query:
            return vector({})  # no request finished: no percentile
        if "generation_tokens" in query:
            return vector(dict.fromkeys(pods, per_pod_gen["rate"]))
        return vector(dict.fromkeys(pods, 0.0))  # no prompts, nothing running, KV empty

    prom = FakePrometheus()
    prom.answer = answer
    try:
        kube, clock, events = FakeKube(), Clock(), []
        world(
            kube, redis, 3, [(p, f"127.0.0.{i + 2}") for i, p in enumerate(pods)],
            scaleDownWindowSeconds=300, decodeTokensPerSecond=100, replicaStartupSeconds=0,
        )  # fmt: skip
        scaler = make_prometheus(kube, clock, prom.url)
        (out,) = tick(scaler, kube, events)  # 255 tok/s at 100 per replica: 3 fit it
        assert out.decision.reason.value == "Steady", out.decision.message
        per_pod_gen["rate"] = 0.0  # the load is gone
        clock.t += 25
        (out,) = tick(scaler, kube, events)
    finally:
        prom.close()
    assert out.inputs.observation.victim_requests == 0
    assert out.decision.reason.value == "ScaledDown", out.decision.message
    assert replicas(kube) == 2


@pytest.mark.parametrize(("ready_for_s", "alarm"), [(3, False), (600, True)])
def test_a_pod_prometheus_has_not_scraped_yet_is_warming_not_a_problem(
    redis: str, ready_for_s: int, alarm: bool
) -> None:
    """After a scale-up, a pod Ready for seconds has no series in Prometheus yet (its first
    scrape, then rate() wants two samples in the window). The scrape mode calls that
    warming up: held, but no alarm. The Prometheus mode called it a problem: a Warning
    Event and ScalingActive=False after every scale-up, for up to a window or two. A pod
    Ready for long without series is still one (a PodMonitor that misses it)."""
    from datetime import UTC, datetime, timedelta

    def answer(query: str) -> bytes:
        if "histogram_quantile" in query:
            return vector({})
        return vector({"chat-a": 0.0})  # chat-b: no series

    prom = FakePrometheus()
    prom.answer = answer
    try:
        kube, clock, events = FakeKube(), Clock(), []
        world(kube, redis, 2, [("chat-a", "127.0.0.2"), ("chat-b", "127.0.0.3")])
        since = datetime.now(UTC) - timedelta(seconds=ready_for_s)
        pod = kube.obj("Pod", NS, "chat-b")
        assert pod is not None
        pod["status"]["conditions"][0]["lastTransitionTime"] = since.strftime("%Y-%m-%dT%H:%M:%SZ")
        scaler = make_prometheus(kube, clock, prom.url)
        (out,) = tick(scaler, kube, events)
    finally:
        prom.close()
    assert replicas(kube) == 2  # held either way: chat-b's load is not known
    assert out.inputs.observation.unknown_pods == 1
    cond = scaling_active(kube)
    assert (cond["status"] == "False") is alarm, cond
    assert any(t == "Warning" for t, _, _ in events) is alarm, events


def test_a_wrong_prometheus_url_says_what_answered(redis: str) -> None:
    """A --prometheus-url with a path that is not Prometheus' (here /prometheus on a server
    without it; in a cluster, Grafana or the UI's /graph) answers a 404 page. The condition
    said only "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"; it now gives
    the HTTP status, what came back and what the flag should be."""
    prom = FakePrometheus()
    try:
        kube, clock, events = FakeKube(), Clock(), []
        world(kube, redis, 2, [("chat-a", "127.0.0.2")])
        wrong = f"{prom.url}/prometheus"
        scaler = Autoscaler(
            kube,
            BuildSettings(),
            AutoscalerSettings(scrape_timeout_s=1.0, prometheus_url=wrong),
            OperatorMetrics(),
            clock=clock,
        )
        (out,) = tick(scaler, kube, events)
    finally:
        prom.close()
    assert replicas(kube) == 2 and out.decision.reason.value == "InputsUnknown"
    message = scaling_active(kube)["message"]
    assert f"Prometheus {wrong}" in message
    assert "HTTP 404" in message and "Not Found" in message, message
    assert "--prometheus-url" in message, message
