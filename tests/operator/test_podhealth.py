"""Failing pods make the InferenceService Degraded with the kubelet's reason and the
container's last termination message; recovery clears it."""

from __future__ import annotations

from typing import Any

import pytest
from test_reconcile import SETTINGS, Recorder, body, cond, create_is

from pagefleet.operator.podhealth import pod_failure, summarize
from pagefleet.operator.reconcile import reconcile, refresh_status

CAUSE = "the engine failed to start: model '/models/nope' is neither a checkpoint directory"


def pod(
    name: str,
    component: str = "unified",
    waiting: dict[str, Any] | None = None,
    restarts: int = 0,
    last: dict[str, Any] | None = None,
    running: bool = False,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    state: dict[str, Any] = {"running": {}} if running else {"waiting": waiting or {}}
    status: dict[str, Any] = {
        "conditions": conditions or [],
        "containerStatuses": [
            {
                "name": "daemon",
                "restartCount": restarts,
                "state": state,
                "lastState": {"terminated": last} if last else {},
            }
        ],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ml",
            "labels": {
                "pagefleet.io/service": "llama",
                "app.kubernetes.io/managed-by": "pagefleet-operator",
                "app.kubernetes.io/component": component,
            },
        },
        "status": status,
    }


CRASHING = {
    "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"},
    "restarts": 4,
    "last": {"exitCode": 1, "reason": "Error", "message": CAUSE + "\n"},
}


def test_crash_loop_reports_reason_restarts_and_last_words():
    f = pod_failure(pod("llama-unified-a", **CRASHING))
    assert f is not None and f.reason == "CrashLoopBackOff"
    assert f.describe() == (
        "unified pod llama-unified-a: container daemon CrashLoopBackOff (restarted 4 times); "
        f"last exit 1: {CAUSE}"
    )


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"running": True, "restarts": 7}, None),  # recovered: running again
        ({"waiting": {"reason": "ContainerCreating"}}, None),
        ({"waiting": {"reason": "CrashLoopBackOff"}, "restarts": 1}, None),  # one crash
        (
            {"waiting": {"reason": "CreateContainerConfigError", "message": "no secret k"}},
            "CreateContainerConfigError",
        ),
        ({"waiting": {"reason": "ImagePullBackOff", "message": "no image"}}, "ImagePullBackOff"),
        (
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                    }
                ]
            },
            "Unschedulable",
        ),
    ],
)
def test_which_pod_states_count_as_failing(kw, reason):
    f = pod_failure(pod("p", **kw))
    assert (f.reason if f else None) == reason


def test_summary_is_deterministic_and_counts_the_others():
    pods = [pod("llama-unified-b", **CRASHING), pod("llama-unified-a", **CRASHING)]
    pods.append(pod("ok", running=True))
    reason, message = summarize(pods)
    assert reason == "CrashLoopBackOff"
    assert message.startswith("unified pod llama-unified-a:")
    assert message.endswith("(and 1 more failing pod(s))")
    assert summarize(list(reversed(pods))) == (reason, message)
    long = dict(CRASHING, last={"exitCode": 1, "message": "x" * 5000})
    assert len(summarize([pod("p", **long)])[1]) < 700


def test_crash_looping_pods_degrade_the_service_then_recovery_clears_it(kube, unified_spec):
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert cond(kube, "Degraded")["status"] == "False"
    kube.add(pod("llama-unified-a", **CRASHING))
    rec = Recorder()
    reconcile(kube, body(kube), SETTINGS, rec)
    degraded = cond(kube, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "CrashLoopBackOff"
    assert CAUSE in degraded["message"] and "llama-unified-a" in degraded["message"]
    assert cond(kube, "Ready")["status"] == "False"
    assert cond(kube, "Progressing")["reason"] == "Stalled"
    assert ("Warning", "CrashLoopBackOff") in [(t, r) for t, r, _ in rec.events]
    # Another restart: the message follows, no second Warning Event.
    kube.obj("Pod", "ml", "llama-unified-a")["status"]["containerStatuses"][0]["restartCount"] = 5
    rec = Recorder()
    reconcile(kube, body(kube), SETTINGS, rec)
    assert "restarted 5 times" in cond(kube, "Degraded")["message"]
    assert "CrashLoopBackOff" not in rec.reasons()
    # Fixed (e.g. the model path): the pod runs, Deployments ready, Degraded clears.
    kube.objects[("Pod", "ml", "llama-unified-a")] = pod("llama-unified-a", running=True)
    kube.mark_deployments_ready()
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert cond(kube, "Degraded")["status"] == "False"
    assert cond(kube, "Ready")["status"] == "True"


def test_status_refresh_between_passes_also_sees_failing_pods(kube, unified_spec):
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    kube.add(pod("llama-gateway-x", component="gateway", **CRASHING))
    refresh_status(kube, body(kube), Recorder())
    degraded = cond(kube, "Degraded")
    assert degraded["status"] == "True"
    assert degraded["message"].startswith("gateway pod llama-gateway-x:")


def test_failing_pods_first_seen_by_a_status_refresh_still_post_one_warning(kube, unified_spec):
    # A child event's refresh may be the first to see the failing pod and set Degraded;
    # the full pass after it then sees the same reason and stays quiet. The Warning Event
    # must come from whichever saw it first, once.
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    kube.add(pod("llama-unified-a", **CRASHING))
    rec = Recorder()
    refresh_status(kube, body(kube), rec)
    reconcile(kube, body(kube), SETTINGS, rec)
    assert cond(kube, "Degraded")["reason"] == "CrashLoopBackOff"
    assert [(t, r) for t, r, _ in rec.events] == [("Warning", "CrashLoopBackOff")]
