"""The reconcile pass against an in-memory API: idempotence, rollouts, repair, status."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fake_kube import FakeKube

from pagefleet.operator.builders import BuildSettings
from pagefleet.operator.kube import KubeError
from pagefleet.operator.reconcile import reconcile, refresh_status, role_switch_in_progress

SETTINGS = BuildSettings()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def __call__(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def reasons(self) -> list[str]:
        return [r for _, r, _ in self.events]


def create_is(kube: FakeKube, spec: dict[str, Any]) -> dict[str, Any]:
    return kube.add(
        {
            "apiVersion": "pagefleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ml", "generation": 1},
            "spec": copy.deepcopy(spec),
        }
    )


def body(kube: FakeKube) -> dict[str, Any]:
    obj = kube.obj("InferenceService", "ml", "llama")
    assert obj is not None
    return copy.deepcopy(obj)


def edit_spec(kube: FakeKube, fn) -> None:
    obj = kube.obj("InferenceService", "ml", "llama")
    fn(obj["spec"])
    obj["metadata"]["generation"] += 1


def cond(kube: FakeKube, type_: str) -> dict[str, Any]:
    status = body(kube)["status"]
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_first_pass_creates_everything_and_reports_progress(kube, unified_spec):
    create_is(kube, unified_spec)
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert kube.names("Deployment") == ["llama-gateway", "llama-unified"]
    assert kube.names("Service") == ["llama-gateway", "llama-unified"]
    assert kube.names("ConfigMap") == ["llama-config"]
    assert kube.names("Secret") == ["llama-kv-transfer"]
    assert {v for v, _, _ in result.actions} == {"Created"}
    assert len(rec.events) == 11 and set(rec.reasons()) == {"Created"}
    status = body(kube)["status"]
    assert status["observedGeneration"] == 1
    assert status["url"] == "http://llama-gateway.ml.svc:8080/v1"
    assert cond(kube, "Ready")["status"] == "False"
    assert cond(kube, "Progressing")["status"] == "True"
    assert cond(kube, "Degraded")["status"] == "False"


def test_second_pass_is_a_no_op(kube, unified_spec):
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    snapshot = copy.deepcopy(kube.objects)
    kube.calls.clear()
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert result.actions == [] and rec.events == []
    assert kube.objects == snapshot  # no resourceVersion moved
    assert ("patch_status", "InferenceService", "llama") not in kube.calls


def test_ready_once_deployments_report_ready_pods(kube, unified_spec):
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    kube.mark_deployments_ready()
    status = refresh_status(kube, body(kube), Recorder())
    assert status is not None
    assert cond(kube, "Ready")["status"] == "True"
    assert cond(kube, "UnifiedReady")["status"] == "True"
    assert cond(kube, "Progressing")["status"] == "False"
    st = body(kube)["status"]
    assert st["roles"] == [
        {"name": "unified", "desiredReplicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    ]
    assert st["readyRoles"] == "1/1" and st["replicas"] == "unified:2/2"


def test_spec_change_rolls_out_and_keeps_transition_times(kube, unified_spec):
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    kube.mark_deployments_ready()
    refresh_status(kube, body(kube), Recorder())
    ready_since = cond(kube, "Degraded")["lastTransitionTime"]

    def scale_and_tune(spec):
        spec["roles"]["unified"]["replicas"] = 3
        spec["engine"] = {"maxNumSeqs": 8}

    edit_spec(kube, scale_and_tune)
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert ("Updated", "Deployment", "llama-unified") in result.actions
    dep = kube.obj("Deployment", "ml", "llama-unified")
    assert dep["spec"]["replicas"] == 3
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--max-num-seqs") + 1] == "8"
    assert body(kube)["status"]["observedGeneration"] == 2
    # the Deployment controller has not caught up: not Ready, Progressing
    assert cond(kube, "Ready")["status"] == "False"
    assert cond(kube, "Progressing")["status"] == "True"
    assert cond(kube, "Degraded")["lastTransitionTime"] == ready_since
    assert any("spec generation 2" in m for _, _, m in rec.events)


def test_a_rollout_past_its_deadline_degrades_with_one_warning_event(kube, unified_spec):
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    stuck = "ReplicaSet llama-unified-abc has timed out progressing."
    kube.obj("Deployment", "ml", "llama-unified")["status"] = {
        "observedGeneration": 1,
        "conditions": [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": stuck,
            }
        ],
    }
    rec = Recorder()
    refresh_status(kube, body(kube), rec)  # the Deployment's status change
    reconcile(kube, body(kube), SETTINGS, rec)  # the next resync
    degraded = cond(kube, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "RolloutFailed"
    assert [(t, r) for t, r, _ in rec.events] == [("Warning", "RolloutFailed")]
    assert stuck in rec.events[0][2]


def test_deleted_child_is_restored(kube, unified_spec):
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    kube.objects.pop(("Deployment", "ml", "llama-unified"))
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert result.actions == [("Restored", "Deployment", "llama-unified")]
    assert kube.obj("Deployment", "ml", "llama-unified") is not None
    assert rec.events[0][0] == "Normal" and "was missing" in rec.events[0][2]


def test_hand_edited_child_is_repaired(kube, unified_spec):
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    dep = kube.obj("Deployment", "ml", "llama-unified")
    dep["spec"]["replicas"] = 7
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    result = reconcile(kube, body(kube), SETTINGS, Recorder())
    assert result.actions == [("DriftRepaired", "Deployment", "llama-unified")]
    dep = kube.obj("Deployment", "ml", "llama-unified")
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "pagefleet:test"


def test_a_status_written_by_a_controller_mid_pass_is_no_drift(kube, unified_spec):
    # The Deployment controller writes a Deployment's status (pods became ready) between
    # the pass's list and its apply: the resourceVersion moved, but nobody edited it.
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    apply = kube.apply

    def apply_after_a_status_write(obj):
        if obj["kind"] == "Deployment":
            kube.mark_deployments_ready()
        return apply(obj)

    kube.apply = apply_after_a_status_write  # type: ignore[method-assign]
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert result.actions == [] and rec.events == []


def test_what_the_deployment_controller_writes_mid_pass_is_no_drift(kube, unified_spec):
    # On a real control plane the Deployment controller annotates every Deployment with its
    # revision (deployment.kubernetes.io/revision) soon after it is created, and again on
    # each rollout. Landing between a pass's list and its apply, that write was reported as
    # a DriftRepaired Event ("edited by hand?") on a service nobody had touched.
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    apply = kube.apply

    def apply_after_the_controller(obj):
        if obj["kind"] == "Deployment":
            dep = kube.obj("Deployment", "ml", obj["metadata"]["name"])
            dep["metadata"].setdefault("annotations", {})["deployment.kubernetes.io/revision"] = "1"
            kube.mark_deployments_ready()  # its status moves too, as it does on pods' progress
        return apply(obj)

    kube.apply = apply_after_the_controller  # type: ignore[method-assign]
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert result.actions == [] and rec.events == []
    # A hand edit is still seen and repaired, the controller's annotation kept.
    dep = kube.obj("Deployment", "ml", "llama-unified")
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    result = reconcile(kube, body(kube), SETTINGS, Recorder())
    assert result.actions == [("DriftRepaired", "Deployment", "llama-unified")]
    meta = kube.obj("Deployment", "ml", "llama-unified")["metadata"]
    assert meta["annotations"]["deployment.kubernetes.io/revision"] == "1"


def test_hand_removed_owned_label_is_drift(kube, unified_spec):
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    dep = kube.obj("Deployment", "ml", "llama-unified")
    del dep["metadata"]["labels"]["pagefleet.io/role"]
    result = reconcile(kube, body(kube), SETTINGS, Recorder())
    assert result.actions == [("DriftRepaired", "Deployment", "llama-unified")]


def test_the_pass_after_a_role_switch_reports_no_drift(kube, unified_spec):
    # The pass that deleted the previous roles kept them behind the daemons' NetworkPolicy;
    # the next one (a steady pass: same generation, no switch left) narrowed the policy to
    # the new roles and reported the operator's own rollout step as a hand edit repaired.
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())

    def to_pd(spec):
        spec["roles"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}

    edit_spec(kube, to_pd)
    result = reconcile(kube, body(kube), SETTINGS, Recorder())
    assert ("Deleted", "Deployment", "llama-unified") in result.actions
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert result.actions == [("Updated", "NetworkPolicy", "llama-daemons")]
    assert rec.reasons() == ["Updated"]


def test_an_operator_upgrade_that_changes_a_child_is_no_drift(kube, unified_spec):
    # A new operator version (or new operator settings) builds a child differently; its
    # first pass over an unchanged spec is steady, and reported that as a hand edit.
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    upgraded = BuildSettings(extra_pod_annotations={"example.com/team": "ml"})
    rec = Recorder()
    result = reconcile(kube, body(kube), upgraded, rec)
    assert ("Updated", "Deployment", "llama-unified") in result.actions
    assert "DriftRepaired" not in rec.reasons()


def test_switching_to_prefill_decode_replaces_the_role_workloads(kube, unified_spec):
    # The unified pods never became Ready: nothing serves that a switch could interrupt,
    # so the pass switches at once (the rollout case: the tests below).
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    # A foreign object with our labels but another owner must survive pruning.
    kube.add(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "llama-extra",
                "namespace": "ml",
                "labels": {
                    "pagefleet.io/service": "llama",
                    "app.kubernetes.io/managed-by": "pagefleet-operator",
                },
            },
            "spec": {},
        }
    )

    def to_pd(spec):
        spec["roles"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}

    edit_spec(kube, to_pd)
    result = reconcile(kube, body(kube), SETTINGS, Recorder())
    assert kube.names("Deployment") == ["llama-decode", "llama-gateway", "llama-prefill"]
    assert kube.names("Service") == [
        "llama-decode",
        "llama-extra",
        "llama-gateway",
        "llama-prefill",
    ]
    assert ("Deleted", "Deployment", "llama-unified") in result.actions
    assert ("Deleted", "Service", "llama-unified") in result.actions
    gw = kube.obj("Deployment", "ml", "llama-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gw["command"][gw["command"].index("--service") + 1] == "llama-decode"
    st = body(kube)["status"]
    assert [r["name"] for r in st["roles"]] == ["prefill", "decode"]
    assert {c["type"] for c in st["conditions"]} >= {"PrefillReady", "DecodeReady"}


def set_ready(kube: FakeKube, name: str, ready: int) -> None:
    """What the Deployment controller reports when `ready` of its pods are Ready on the
    current template."""
    dep = kube.obj("Deployment", "ml", name)
    n = dep["spec"].get("replicas", 1)
    dep["status"] = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": n,
        "readyReplicas": ready,
        "updatedReplicas": n,
        "availableReplicas": ready,
    }


def gateway_routes(kube: FakeKube) -> tuple[str, str | None]:
    """(--service, --prefill-service or None) of the gateway's command."""
    dep = kube.obj("Deployment", "ml", "llama-gateway")
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    prefill = cmd[cmd.index("--prefill-service") + 1] if "--prefill-service" in cmd else None
    return cmd[cmd.index("--service") + 1], prefill


def progressing(kube: FakeKube) -> tuple[str, str]:
    c = cond(kube, "Progressing")
    return c["reason"], c["message"]


def test_a_role_switch_keeps_the_old_pool_serving_until_the_new_roles_are_ready(kube, unified_spec):
    # unified -> prefill + decode deleted the unified Deployment in the pass that created
    # the new ones: for the new pods' start-up time no daemon served and the gateway
    # answered 503.
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    kube.mark_deployments_ready()
    refresh_status(kube, body(kube), Recorder())
    gateway_version = kube.obj("Deployment", "ml", "llama-gateway")["metadata"]["resourceVersion"]

    def to_pd(spec):
        spec["roles"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}

    edit_spec(kube, to_pd)
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert kube.names("Deployment") == [
        "llama-decode",
        "llama-gateway",
        "llama-prefill",
        "llama-unified",
    ]
    assert "llama-unified" in kube.names("Service")
    assert not [a for a in result.actions if a[0] == "Deleted"]
    # The gateway is not touched: every gateway pod keeps routing to the unified pool.
    assert gateway_routes(kube) == ("llama-unified", None)
    gateway = kube.obj("Deployment", "ml", "llama-gateway")
    assert gateway["metadata"]["resourceVersion"] == gateway_version
    # The unified pods stay behind the daemons' NetworkPolicy while they run.
    policy = kube.obj("NetworkPolicy", "ml", "llama-daemons")
    assert policy["spec"]["podSelector"]["matchExpressions"][0]["values"] == [
        "decode",
        "prefill",
        "unified",
    ]
    reason, message = progressing(kube)
    assert reason == "RoleSwitch"
    assert "unified keeps serving" in message and "decode 0/2 ready" in message
    assert cond(kube, "Ready")["status"] == "False"
    assert ("Normal", "RoleSwitch") in [(t, r) for t, r, _ in rec.events]

    # Passes while the new pods start: nothing moves, no Event repeated.
    set_ready(kube, "llama-prefill", 1)
    rec = Recorder()
    assert reconcile(kube, body(kube), SETTINGS, rec).actions == []
    assert gateway_routes(kube) == ("llama-unified", None)
    assert rec.events == []

    # Every new role has a Ready pod: the gateway moves to P/D, unified still serves the
    # gateway pods that have not rolled yet.
    set_ready(kube, "llama-decode", 1)
    result = reconcile(kube, body(kube), SETTINGS, Recorder())
    assert ("Updated", "Deployment", "llama-gateway") in result.actions
    assert gateway_routes(kube) == ("llama-decode", "llama-prefill")
    assert "llama-unified" in kube.names("Deployment")
    reason, message = progressing(kube)
    assert reason == "RoleSwitch" and "the gateway moves to prefill+decode" in message

    # Every gateway pod routes to P/D: unified goes, and the switch is over.
    set_ready(kube, "llama-gateway", 1)
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert ("Deleted", "Deployment", "llama-unified") in result.actions
    assert ("Deleted", "Service", "llama-unified") in result.actions
    assert kube.names("Deployment") == ["llama-decode", "llama-gateway", "llama-prefill"]
    assert "RoleSwitchComplete" in rec.reasons()
    assert progressing(kube)[0] == "RollingOut"  # decode 1/2 ready
    policy = kube.obj("NetworkPolicy", "ml", "llama-daemons")
    assert "unified" in policy["spec"]["podSelector"]["matchExpressions"][0]["values"]
    reconcile(kube, body(kube), SETTINGS, Recorder())  # the pass the deletion triggers
    policy = kube.obj("NetworkPolicy", "ml", "llama-daemons")
    assert policy["spec"]["podSelector"]["matchExpressions"][0]["values"] == ["decode", "prefill"]


def test_a_switch_back_to_unified_keeps_prefill_decode_serving_meanwhile(kube, pd_spec):
    create_is(kube, pd_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    kube.mark_deployments_ready()

    def to_unified(spec):
        spec["roles"] = {"unified": {"replicas": 1}}

    edit_spec(kube, to_unified)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert gateway_routes(kube) == ("llama-decode", "llama-prefill")
    assert {"llama-prefill", "llama-decode"} <= set(kube.names("Deployment"))
    assert refresh_status(kube, body(kube), Recorder()) is None  # a full pass's business
    assert progressing(kube)[0] == "RoleSwitch"
    set_ready(kube, "llama-unified", 1)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert gateway_routes(kube) == ("llama-unified", None)
    set_ready(kube, "llama-gateway", 1)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert kube.names("Deployment") == ["llama-gateway", "llama-unified"]
    assert cond(kube, "Ready")["status"] == "True"


def test_a_new_role_scaled_to_zero_does_not_hold_the_switch_forever(kube, unified_spec):
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    kube.mark_deployments_ready()

    def to_pd(spec):
        spec["roles"] = {"prefill": {"replicas": 0}, "decode": {"replicas": 1}}

    edit_spec(kube, to_pd)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    set_ready(kube, "llama-decode", 1)  # prefill wants no pod: decode alone is enough
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert gateway_routes(kube) == ("llama-decode", "llama-prefill")


def past_deadline(kube: FakeKube, name: str) -> str:
    """What the Deployment controller reports once `name` made no progress for its
    progressDeadlineSeconds (600 s unless set): no Ready pod, Progressing False."""
    set_ready(kube, name, 0)
    stuck = f"ReplicaSet {name}-5d4f has timed out progressing"
    kube.obj("Deployment", "ml", name)["status"]["conditions"] = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": stuck + ".",
        }
    ]
    return stuck


def switch_to_pd_from_serving_unified(kube: FakeKube, unified_spec: dict[str, Any]) -> None:
    create_is(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    kube.mark_deployments_ready()

    def to_pd(spec):
        spec["roles"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}

    edit_spec(kube, to_pd)


def test_a_role_switch_whose_new_role_never_gets_ready_says_it_is_stalled(kube, unified_spec):
    # The decode pods never became Ready (no GPU node, a readiness that never passes): the
    # switch kept unified serving, which is right, but Progressing fell to a bare "Stalled"
    # that named no switch and no way out, and every resync posted the RoleSwitch Event
    # again (its "already announced" check looked for Progressing=RoleSwitch only).
    switch_to_pd_from_serving_unified(kube, unified_spec)
    rec = Recorder()
    reconcile(kube, body(kube), SETTINGS, rec)
    set_ready(kube, "llama-prefill", 1)
    stuck = past_deadline(kube, "llama-decode")
    for _ in range(3):  # the child event's pass and two resyncs
        assert role_switch_in_progress(body(kube))  # child events keep running full passes
        reconcile(kube, body(kube), SETTINGS, rec)
    c = cond(kube, "Progressing")
    assert (c["status"], c["reason"]) == ("False", "RoleSwitchStalled")
    assert "unified -> prefill+decode" in c["message"] and stuck in c["message"]
    assert "unified keeps serving" in c["message"]
    assert "spec.roles back to unified" in c["message"]  # a way out
    assert "deployment/llama-unified" in c["message"]
    degraded = cond(kube, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RolloutFailed")
    assert cond(kube, "Ready")["status"] == "False"
    # Never cut service on a stuck switch.
    assert "llama-unified" in kube.names("Deployment") and "llama-unified" in kube.names("Service")
    assert gateway_routes(kube) == ("llama-unified", None)
    # One Event per announcement, not one per pass.
    assert rec.reasons().count("RoleSwitch") == 1
    stalled = [(t, m) for t, r, m in rec.events if r == "RoleSwitchStalled"]
    assert len(stalled) == 1 and stalled[0][0] == "Warning" and stuck in stalled[0][1]
    assert rec.reasons().count("RolloutFailed") == 1

    # Fixed (a GPU node joined): decode turns Ready, the switch resumes on its own.
    set_ready(kube, "llama-decode", 1)
    rec = Recorder()
    reconcile(kube, body(kube), SETTINGS, rec)
    assert gateway_routes(kube) == ("llama-decode", "llama-prefill")
    assert progressing(kube)[0] == "RoleSwitch"
    assert cond(kube, "Degraded")["status"] == "False"
    assert "RoleSwitch" not in rec.reasons() and "RoleSwitchStalled" not in rec.reasons()
    set_ready(kube, "llama-gateway", 1)
    reconcile(kube, body(kube), SETTINGS, rec)
    assert "llama-unified" not in kube.names("Deployment")
    assert "RoleSwitchComplete" in rec.reasons()


def test_reverting_a_stalled_switch_drops_the_new_roles_and_keeps_serving(kube, unified_spec):
    # The way out the stalled message offers: spec.roles back to unified.
    switch_to_pd_from_serving_unified(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    past_deadline(kube, "llama-decode")
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert progressing(kube)[0] == "RoleSwitchStalled"
    unified_version = kube.obj("Deployment", "ml", "llama-unified")["metadata"]["resourceVersion"]
    edit_spec(kube, lambda spec: spec.update(roles=unified_spec["roles"]))
    rec = Recorder()
    reconcile(kube, body(kube), SETTINGS, rec)
    assert kube.names("Deployment") == ["llama-gateway", "llama-unified"]
    assert kube.obj("Deployment", "ml", "llama-unified")["metadata"]["resourceVersion"] == (
        unified_version
    )  # its pods were never touched: no gap in service
    assert gateway_routes(kube) == ("llama-unified", None)
    assert "RoleSwitchComplete" in rec.reasons()
    assert cond(kube, "Degraded")["status"] == "False"
    assert cond(kube, "Ready")["status"] == "True"


def test_a_role_switch_to_crash_looping_pods_is_stalled_at_once(kube, unified_spec):
    # A crash loop needs a person as surely as a passed deadline; the pods say so long
    # before the Deployment's 600 s run out.
    from test_podhealth import CRASHING, pod

    switch_to_pd_from_serving_unified(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    kube.add(pod("llama-decode-a", component="decode", **CRASHING))
    rec = Recorder()
    reconcile(kube, body(kube), SETTINGS, rec)
    reconcile(kube, body(kube), SETTINGS, rec)
    reason, message = progressing(kube)
    assert reason == "RoleSwitchStalled" and "llama-decode-a" in message
    assert cond(kube, "Degraded")["reason"] == "CrashLoopBackOff"
    assert gateway_routes(kube) == ("llama-unified", None)
    assert [(t, r) for t, r, _ in rec.events] == [
        ("Warning", "RoleSwitchStalled"),
        ("Warning", "CrashLoopBackOff"),
    ]


def unschedulable_pod(kube: FakeKube, name: str, role: str) -> None:
    """A pod of `role` that no node can take: every GPU is held (by the old roles' pods)."""
    from test_podhealth import pod

    obj = pod(
        name,
        component=role,
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
            }
        ],
    )
    obj["metadata"]["labels"]["pagefleet.io/role"] = role
    kube.add(obj)


def test_a_switch_whose_new_pods_wait_for_the_old_pods_gpus_ends_at_the_deadline(
    kube, unified_spec
):
    # A cluster without a spare GPU: the decode pods wait for the GPUs the unified pods
    # hold, and the unified pods were kept until decode had a Ready pod. Neither could
    # move: the switch stayed stalled for ever, the old pool sized by hand the only way out.
    switch_to_pd_from_serving_unified(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    set_ready(kube, "llama-prefill", 1)
    unschedulable_pod(kube, "llama-decode-a", "decode")
    rec = Recorder()
    reconcile(kube, body(kube), SETTINGS, rec)
    # Before the deadline: unified keeps serving, and the status says what comes next.
    assert "llama-unified" in kube.names("Deployment")
    assert gateway_routes(kube) == ("llama-unified", None)
    reason, message = progressing(kube)
    assert reason == "RoleSwitchStalled" and "Insufficient nvidia.com/gpu" in message
    assert "passes its progressDeadlineSeconds, unified is deleted" in message

    past_deadline(kube, "llama-decode")
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert ("Deleted", "Deployment", "llama-unified") in result.actions
    assert ("Deleted", "Service", "llama-unified") in result.actions
    assert gateway_routes(kube) == ("llama-decode", "llama-prefill")
    warned = [(t, m) for t, r, m in rec.events if r == "RoleSwitchDeadline"]
    assert len(warned) == 1 and warned[0][0] == "Warning" and "deleted unified" in warned[0][1]
    assert "RoleSwitchComplete" not in rec.reasons()
    assert not role_switch_in_progress(body(kube))


def test_a_switch_to_failing_pods_keeps_the_old_pool_past_the_deadline(kube, unified_spec):
    # Only pods waiting for resources release the old pool: crash-looping new pods would
    # not start with the old pool gone either, so deleting it would only cut service.
    from test_podhealth import CRASHING, pod

    switch_to_pd_from_serving_unified(kube, unified_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    crashing = pod("llama-decode-a", component="decode", **CRASHING)
    crashing["metadata"]["labels"]["pagefleet.io/role"] = "decode"
    kube.add(crashing)
    past_deadline(kube, "llama-decode")
    for _ in range(2):
        reconcile(kube, body(kube), SETTINGS, Recorder())
    assert "llama-unified" in kube.names("Deployment")
    assert gateway_routes(kube) == ("llama-unified", None)
    assert progressing(kube)[0] == "RoleSwitchStalled"
    assert "progressDeadlineSeconds, unified is deleted" not in progressing(kube)[1]


def test_autoscaler_status_lasts_only_while_a_role_autoscales(kube, pd_spec):
    create_is(kube, pd_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    # What the autoscaler's tick writes for the autoscaled decode role.
    st = kube.obj("InferenceService", "ml", "llama")["status"]
    decision = {"desiredReplicas": 3, "reason": "ScaledUp", "message": "load"}
    next(r for r in st["roles"] if r["name"] == "decode")["autoscaling"] = decision
    st["conditions"].append(
        {"type": "ScalingActive", "status": "True", "reason": "Active", "message": "decode"}
    )
    kube.mark_deployments_ready()
    refresh_status(kube, body(kube), Recorder())
    reconcile(kube, body(kube), SETTINGS, Recorder())
    st = body(kube)["status"]
    assert next(r for r in st["roles"] if r["name"] == "decode")["autoscaling"] == decision
    assert "ScalingActive" in [c["type"] for c in st["conditions"]]

    def fixed(spec):
        spec["roles"]["decode"] = {"replicas": 2}

    edit_spec(kube, fixed)  # no role autoscales any more: its last decision is history
    reconcile(kube, body(kube), SETTINGS, Recorder())
    st = body(kube)["status"]
    assert [r for r in st["roles"] if "autoscaling" in r] == []
    assert "ScalingActive" not in [c["type"] for c in st["conditions"]]


def test_autoscaled_role_keeps_the_autoscalers_count(kube, pd_spec):
    create_is(kube, pd_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert kube.obj("Deployment", "ml", "llama-decode")["spec"]["replicas"] == 2
    kube.obj("Deployment", "ml", "llama-decode")["spec"]["replicas"] = 3  # the autoscaler
    result = reconcile(kube, body(kube), SETTINGS, Recorder())
    assert result.actions == []
    assert kube.obj("Deployment", "ml", "llama-decode")["spec"]["replicas"] == 3
    kube.obj("Deployment", "ml", "llama-decode")["spec"]["replicas"] = 10  # beyond max
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert kube.obj("Deployment", "ml", "llama-decode")["spec"]["replicas"] == 4


def test_unrealisable_spec_sets_degraded_without_raising(kube, unified_spec):
    del unified_spec["index"]
    create_is(kube, unified_spec)
    rec = Recorder()
    result = reconcile(kube, body(kube), SETTINGS, rec)
    assert result.degraded and "spec.index.redisURL" in result.degraded
    assert kube.names("Deployment") == []
    assert cond(kube, "Degraded")["status"] == "True"
    assert cond(kube, "Degraded")["reason"] == "InvalidSpec"
    assert cond(kube, "Ready")["status"] == "False"
    assert rec.events[0][:2] == ("Warning", "InvalidSpec")
    # the same problem again is not re-announced (no Event flood from the resync timer)
    rec2 = Recorder()
    reconcile(kube, body(kube), SETTINGS, rec2)
    assert rec2.events == []
    # fixing the spec clears Degraded
    edit_spec(kube, lambda s: s.update(index={"redisURL": "redis://r:6379"}))
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert cond(kube, "Degraded")["status"] == "False"
    assert kube.names("Deployment") == ["llama-gateway", "llama-unified"]


def test_schema_escape_is_degraded_not_a_crash(kube, unified_spec):
    unified_spec["roles"]["unified"]["autoscaling"] = {"maxReplicas": 2}  # CEL would refuse
    create_is(kube, unified_spec)
    result = reconcile(kube, body(kube), SETTINGS, Recorder())
    assert "either replicas or autoscaling" in (result.degraded or "")


def test_api_rejection_is_degraded_and_transient_errors_raise(kube, unified_spec):
    create_is(kube, unified_spec)
    kube.fail_next["apply"] = KubeError(422, 'HTTP 422: quantities must match "^([+-]?[0-9.]+)"')
    result = reconcile(kube, body(kube), SETTINGS, Recorder())
    assert cond(kube, "Degraded")["reason"] == "ApplyFailed"
    assert "422" in (result.degraded or "")
    kube.fail_next["apply"] = KubeError(503, "HTTP 503: etcd leader changed")
    with pytest.raises(KubeError):
        reconcile(kube, body(kube), SETTINGS, Recorder())
    # and the next good pass recovers
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert cond(kube, "Degraded")["status"] == "False"


@pytest.mark.parametrize("name", ["llama.v3", "m" * 56, "Llama"])
def test_a_name_no_child_could_carry_is_degraded_before_anything_is_applied(
    kube, unified_spec, name
):
    kube.add(
        {
            "apiVersion": "pagefleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ml", "generation": 1},
            "spec": copy.deepcopy(unified_spec),
        }
    )
    rec = Recorder()
    result = reconcile(kube, copy.deepcopy(kube.obj("InferenceService", "ml", name)), SETTINGS, rec)
    assert result.degraded and "at most 55 characters" in result.degraded
    assert kube.names("Deployment") == [] and kube.names("Service") == []
    status = kube.obj("InferenceService", "ml", name)["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidName")
    assert rec.reasons() == ["InvalidName"]
