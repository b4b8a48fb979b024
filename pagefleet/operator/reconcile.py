"""One reconciliation pass of one InferenceService: observe, apply, prune, report.

The pass is level-triggered: it never looks at what changed, only at the spec and the
children that exist now. Running it twice in a row changes nothing the second time (server-side
apply of identical manifests keeps every resourceVersion), which is what lets the operator
run it from create/update/resume handlers, a resync timer and child-object events alike.

A role switch (unified <-> prefill + decode) is a rollout, not a swap: the previous roles'
workloads stay, and the gateway keeps routing to them, until every new role has a Ready pod;
then the gateway is moved to the new roles, and once every gateway pod runs that template
(its readiness needs ready endpoints of the pool it routes to) the previous roles are
deleted. Removing them in the pass that created the new ones left no daemon serving for
the new pods' start-up time: the gateway answered 503. Where the previous serving pool has
no Ready pod, nothing is lost by switching at once, and the pass does. Where a new role's
pods wait for resources (the old pods' GPUs) past its Deployment's progress deadline, the
switch goes on too (RoleSwitch.released): waiting longer could not end.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pagefleet.api.inferenceservice import (
    GROUP,
    InferenceServiceSpec,
    name_problem,
    parse_spec,
)
from pagefleet.kvindex.index import PodLoad
from pagefleet.operator.builders import (
    BuildSettings,
    Owner,
    SpecError,
    build_children,
    build_kv_transfer_secret,
    kv_transfer_secret_name,
    role_replicas,
)
from pagefleet.operator.commands import gateway_role
from pagefleet.operator.kube import (
    CHILD_KINDS,
    DEPLOYMENT,
    INFERENCE_SERVICE,
    POD,
    SECRET,
    KubeAPI,
    KubeError,
    kind_of,
)
from pagefleet.operator.naming import GATEWAY, LABEL_ROLE, Names, owned_selector
from pagefleet.operator.podhealth import summarize
from pagefleet.operator.signals import PodReport
from pagefleet.operator.status import (
    ROLE_SWITCH,
    ROLE_SWITCH_STALLED,
    SwitchStall,
    WorkloadState,
    compute_status,
)
from pagefleet.operator.victims import (
    LoadReader,
    clear_marks,
    live_pods,
    mark_victims,
    scale_down_settled,
)

log = logging.getLogger(__name__)

Manifest = dict[str, Any]
# (event type Normal|Warning, reason, message) -> posted as a Kubernetes Event on the
# InferenceService.
Recorder = Callable[[str, str, str], None]
# The Warning of a role switch whose new roles got no resources by their deadline, so the
# old roles were deleted while they still served (RoleSwitch.released).
ROLE_SWITCH_DEADLINE = "RoleSwitchDeadline"
# The Event of a scale-down the spec asked for (its pods marked, then the count lowered).
SCALING_DOWN = "ScalingDown"


@dataclass(slots=True)
class ReconcileResult:
    status: Manifest
    actions: list[tuple[str, str, str]] = field(default_factory=list)  # (verb, kind, name)
    degraded: str | None = None


def _key(obj: Manifest) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


# On every child: a digest of the manifest the operator applied last. A steady pass that
# changes a child whose digest differs from its new manifest's applies a change of the
# operator's own (the last step of a role switch, a new operator version or setting), not
# a repair of someone's edit.
APPLIED_HASH_ANNOTATION = f"{GROUP}/applied-hash"


def _stamped(obj: Manifest) -> tuple[Manifest, str]:
    """`obj` with its own digest as an annotation, and the digest.

    A Deployment's replicas are left out: an autoscaled role's follow the autoscaler
    (the pass keeps them), and a digest that moved with them would rewrite the
    Deployment on every scaling decision."""
    spec = obj.get("spec")
    hashed = obj
    if obj["kind"] == "Deployment" and isinstance(spec, dict):
        hashed = {**obj, "spec": {k: v for k, v in spec.items() if k != "replicas"}}
    digest = hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:16]
    meta = obj["metadata"]
    annotations = {**(meta.get("annotations") or {}), APPLIED_HASH_ANNOTATION: digest}
    return {**obj, "metadata": {**meta, "annotations": annotations}}, digest


def _applied_hash(obj: Manifest) -> str | None:
    annotations: dict[str, str] = obj["metadata"].get("annotations") or {}
    return annotations.get(APPLIED_HASH_ANNOTATION)


def _owned(obj: Any, desired: Any) -> Any:
    """`obj` cut down to the fields the operator sets (those of its `desired` manifest).

    Only a change there is drift. Everything else on a child is written by Kubernetes: a
    Deployment's status moves whenever its pods do, the Deployment controller annotates
    each revision (deployment.kubernetes.io/revision), the API server keeps resourceVersion,
    generation and managedFields and fills defaults, and an apply that only takes back
    ownership of a value another manager set (the autoscaler's replicas, which the pass
    keeps) changes nothing of ours. A list is cut item by item when it has as many items
    as the desired one (containers, ports); else it is kept whole (both sides of the
    comparison come from the API server, so its defaults are on both)."""
    if isinstance(desired, dict):
        if not isinstance(obj, dict):
            return obj
        return {k: _owned(obj.get(k), v) for k, v in desired.items()}
    if isinstance(desired, list) and isinstance(obj, list) and len(obj) == len(desired):
        return [_owned(o, d) for o, d in zip(obj, desired, strict=True)]
    return obj


def _controlled_by(obj: Manifest, uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences", []) or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"spec.{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(parts)


# Every daemon role a spec can name, in the order RolesSpec.items() lists them.
DAEMON_ROLES = ("unified", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class RoleSwitch:
    """A change between unified and prefill + decode whose previous roles still run.

    Invariant: the gateway routes to `old` exactly while `old` still serves (its routed
    pool has a Ready pod), some new role has no Ready pod yet (`waiting`) and the switch
    is not `released`; the old workloads may go only once the gateway serves from the new
    roles on every pod, once they serve nothing anyway, or once released.

    Released: a waiting new role is past its Deployment's progressDeadlineSeconds and its
    pods wait for resources (no node can take them, or its ReplicaSet cannot create them:
    a quota). On a cluster without spare GPUs the old pods hold exactly what the new ones
    wait for, so keeping them would wait forever; the old roles then go, and the service
    serves nothing until the new pods are Ready. New pods that fail for any other reason
    (a crash loop, an image that cannot be pulled) would not start either once the old
    ones went, so then the old roles keep serving and the switch waits for a person."""

    old: tuple[str, ...]
    new: tuple[str, ...]
    waiting: tuple[str, ...]  # new roles without a Ready pod (among those that want one)
    old_serving: bool
    # Waiting new roles whose pods wait for resources; those past their deadline.
    starved: tuple[str, ...] = ()
    overdue: tuple[str, ...] = ()

    @property
    def released(self) -> bool:
        return bool(self.overdue)

    @property
    def routes_old(self) -> bool:
        return self.old_serving and bool(self.waiting) and not self.released

    @property
    def routed(self) -> list[str]:
        return list(self.old if self.routes_old else self.new)

    def may_remove_old(self, gateway: WorkloadState) -> bool:
        return not self.old_serving or self.released or (not self.waiting and gateway.ready_now)

    def message(self, gateway: WorkloadState, ready: dict[str, str]) -> str:
        head = f"switching roles {'+'.join(self.old)} -> {'+'.join(self.new)}: "
        if self.routes_old:
            return head + (
                f"{'+'.join(self.old)} keeps serving until every new role has a Ready pod "
                f"(waiting for {', '.join(f'{r} {ready[r]}' for r in self.waiting)})"
            )
        return head + (
            f"the gateway moves to {'+'.join(self.new)}; {'+'.join(self.old)} is deleted once "
            f"every gateway pod routes there ({gateway.ready}/{gateway.desired} gateway pods "
            f"ready, {gateway.updated} on the new template)"
        )

    def stall(self, names: Names) -> SwitchStall:
        """The words for a switch that Degraded blocks: the old roles stay until a person
        acts, so say what serves meanwhile and the ways out (fix the new roles, revert,
        or size the old pool by hand: nothing else scales it while it is off the spec)."""
        old, new = "+".join(self.old), "+".join(self.new)
        if self.routes_old:
            serving = f"{old} keeps serving and is not deleted"
        else:
            serving = (
                f"gateway pods not yet on the new template keep routing to {old}, "
                "which is not deleted"
            )
        deployments = ", ".join(f"deployment/{names.role(r)}" for r in self.old)
        if self.starved:
            serving += (
                f"; {', '.join(self.starved)} waits for resources {old} may hold: once "
                f"deployment/{names.role(self.starved[0])} passes its progressDeadlineSeconds, "
                f"{old} is deleted to free them (no service until the new pods are Ready)"
            )
        return SwitchStall(
            head=f"switching roles {old} -> {new} is stalled",
            advice=(
                f"{serving}. To finish the switch, fix that (the new pods' events and "
                f"logs say more); to abandon it, set spec.roles back to {old}; meanwhile "
                f"`kubectl -n {names.namespace} scale {deployments} --replicas=N` sizes the "
                "old pool (the operator leaves its replicas alone until the switch ends)"
            ),
        )


def _ready_pods(deploy: Manifest | None) -> int:
    return int(((deploy or {}).get("status") or {}).get("readyReplicas", 0) or 0)


def _past_deadline(deploy: Manifest | None) -> bool:
    """The Deployment controller gave up waiting for progress (progressDeadlineSeconds)."""
    conds = ((deploy or {}).get("status") or {}).get("conditions") or []
    return any(
        c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        for c in conds
    )


def _waits_for_resources(deploy: Manifest | None, pods: list[Manifest]) -> bool:
    """Some pod of the role no node can take (PodScheduled=False, Unschedulable), or its
    ReplicaSet cannot create pods (ReplicaFailure: a ResourceQuota exceeded, say)."""
    conds = ((deploy or {}).get("status") or {}).get("conditions") or []
    if any(c.get("type") == "ReplicaFailure" and c.get("status") == "True" for c in conds):
        return True
    return any(
        c.get("type") == "PodScheduled"
        and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for p in pods
        for c in (p.get("status") or {}).get("conditions") or []
    )


def plan_role_switch(
    spec: InferenceServiceSpec,
    names: Names,
    uid: str,
    existing: dict[tuple[str, str], Manifest],
    current: dict[str, int],
    pods: list[Manifest] | None = None,
) -> RoleSwitch | None:
    """The role switch under way, from the children (and the pods) that exist now; None
    when no role outside the spec still has a Deployment of this InferenceService."""
    new = tuple(role for role, _ in spec.roles.items())
    old = tuple(
        role
        for role in DAEMON_ROLES
        if role not in new
        and _is_role_deployment(existing.get(("Deployment", names.role(role))), role, uid)
    )
    if not old:
        return None
    wanted = {role: role_replicas(rs, current.get(role)) for role, rs in spec.roles.items()}
    waiting = tuple(
        role
        for role in new
        if wanted[role] > 0 and _ready_pods(existing.get(("Deployment", names.role(role)))) < 1
    )
    # The pool the gateway routes to when on the old roles (commands.gateway_role): a
    # prefill pool alone serves no completions.
    serving = gateway_role(list(old)) if {"unified", "decode"} & set(old) else None
    old_serving = (
        serving is not None and _ready_pods(existing.get(("Deployment", names.role(serving)))) >= 1
    )
    by_role: dict[str, list[Manifest]] = {}
    for pod in live_pods(pods or []):
        by_role.setdefault((pod["metadata"].get("labels") or {}).get(LABEL_ROLE, ""), []).append(
            pod
        )
    deploys = {role: existing.get(("Deployment", names.role(role))) for role in waiting}
    starved = tuple(r for r in waiting if _waits_for_resources(deploys[r], by_role.get(r, [])))
    return RoleSwitch(
        old=old,
        new=new,
        waiting=waiting,
        old_serving=old_serving,
        starved=starved,
        overdue=tuple(r for r in starved if _past_deadline(deploys[r])),
    )


def _is_role_deployment(obj: Manifest | None, role: str, uid: str) -> bool:
    if obj is None or not _controlled_by(obj, uid):
        return False
    return bool((obj["metadata"].get("labels") or {}).get(LABEL_ROLE) == role)


def role_switch_in_progress(body: Manifest) -> bool:
    """Whether the last full pass left a role switch under way, advancing or stalled (its
    Progressing reason): then a child's status change is a reason for a full pass, since a
    new role's pod turning Ready is what lets the switch advance."""
    return _progressing_reason(body.get("status") or {}) in (ROLE_SWITCH, ROLE_SWITCH_STALLED)


def _progressing_reason(status: Manifest) -> str | None:
    conds = status.get("conditions", []) or []
    return next((c.get("reason") for c in conds if c.get("type") == "Progressing"), None)


def observe(kube: KubeAPI, namespace: str, name: str) -> dict[tuple[str, str], Manifest]:
    """Every child that carries this InferenceService's labels, keyed by (kind, name)."""
    out: dict[tuple[str, str], Manifest] = {}
    for kind in CHILD_KINDS:
        for obj in kube.list(kind, namespace, owned_selector(name)):
            obj.setdefault("kind", kind.kind)
            out[_key(obj)] = obj
    return out


def _write_status(kube: KubeAPI, body: Manifest, status: Manifest) -> None:
    if status == (body.get("status") or {}):
        return  # unchanged: no write, no watch event, no churn
    meta = body["metadata"]
    kube.patch_status(INFERENCE_SERVICE, meta["namespace"], meta["name"], status)


def _degrade(
    kube: KubeAPI, body: Manifest, reason: str, message: str, record: Recorder
) -> ReconcileResult:
    meta = body["metadata"]
    status = compute_status(
        generation=meta.get("generation", 0),
        roles=[],
        gateway=None,
        url="",
        previous=body.get("status"),
        degraded_reason=reason,
        degraded_message=message,
    )
    # Keep the last known replica counts and URL: the fleet may well still be serving.
    prev = body.get("status") or {}
    for k in ("roles", "readyRoles", "replicas", "url"):
        if prev.get(k):
            status[k] = prev[k]
    prev_degraded = next(
        (c for c in prev.get("conditions", []) or [] if c.get("type") == "Degraded"), {}
    )
    if prev_degraded.get("message") != message:
        record("Warning", reason, message)
    _write_status(kube, body, status)
    return ReconcileResult(status=status, degraded=message)


def reconcile(
    kube: KubeAPI,
    body: Manifest,
    settings: BuildSettings,
    record: Recorder,
    loads: LoadReader | None = None,
) -> ReconcileResult:
    """Make the children match the spec and write the status.

    Invariant: afterwards every desired child exists with the operator's fields as the spec
    says, no stale role workload of this InferenceService remains, and status reflects
    the Deployments as observed. A spec that cannot be realised, or an API rejection that
    retrying will not fix, sets Degraded instead of raising; transient API errors raise
    KubeError for the caller to retry.

    A role whose count the spec lowers (``replicas``, or ``autoscaling.maxReplicas`` below
    the current count) loses the pods the autoscaler would pick: they are marked first
    (victims.py), ranked by the heartbeats ``loads`` reads, and then the count is lowered."""
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    generation = meta.get("generation", 0)
    names = Names(name, namespace)
    owner = Owner(name, namespace, uid)
    prev_status = body.get("status") or {}
    steady = prev_status.get("observedGeneration") == generation

    problem = name_problem(name)
    if problem is not None:  # stored before the CRD had the rule: no child could be valid
        return _degrade(kube, body, "InvalidName", problem, record)
    try:
        spec: InferenceServiceSpec = parse_spec(body.get("spec") or {})
    except ValidationError as exc:
        return _degrade(kube, body, "InvalidSpec", _validation_message(exc), record)

    existing = observe(kube, namespace, name)
    current = {
        role: existing[("Deployment", names.role(role))]["spec"].get("replicas", 1)
        for role, _ in spec.roles.items()
        if ("Deployment", names.role(role)) in existing
    }
    all_pods = kube.list(POD, namespace, owned_selector(name))
    switch = plan_role_switch(spec, names, uid, existing, current, all_pods)
    # A role switch moves the gateway and its config in a later pass of the same
    # generation: that is the rollout going on, not a hand edit being repaired.
    steady = steady and switch is None
    try:
        desired = build_children(
            spec,
            owner,
            settings,
            current,
            routed_roles=switch.routed if switch else None,
            old_roles=list(switch.old) if switch else None,
        )
    except SpecError as exc:
        return _degrade(kube, body, exc.reason, str(exc), record)

    result = ReconcileResult(status={})
    applied: dict[tuple[str, str], Manifest] = {}
    try:
        # Only on a pass that creates a child: a pod can start only after one, and a steady
        # resync then costs no API call (the operator cannot read the Secret to check).
        creating = any(_key(built) not in existing for built in desired)
        if creating and _ensure_kv_transfer_secret(kube, owner, names):
            result.actions.append(("Created", "Secret", kv_transfer_secret_name(names)))
        _mark_scale_downs(kube, body, spec, names, desired, existing, all_pods, loads, record)
        for built in desired:
            obj, digest = _stamped(built)
            key = _key(obj)
            before = existing.get(key)
            after = kube.apply(obj)
            after.setdefault("kind", obj["kind"])
            applied[key] = after
            if before is None:
                verb = "Restored" if steady else "Created"
                result.actions.append((verb, *key))
            elif before["metadata"].get("resourceVersion") != after["metadata"].get(
                "resourceVersion"
            ) and _owned(before, obj) != _owned(after, obj):
                # Drift: the operator wants what it applied last, and the child differed.
                repaired = steady and _applied_hash(before) == digest
                result.actions.append(("DriftRepaired" if repaired else "Updated", *key))
        gateway_now = WorkloadState.from_deployment(
            GATEWAY, applied.get(("Deployment", names.gateway))
        )
        keep: set[tuple[str, str]] = set()
        if switch is not None and not switch.may_remove_old(gateway_now):
            keep = {(kind, names.role(r)) for r in switch.old for kind in ("Deployment", "Service")}
        for key, obj in existing.items():
            if key in applied or key in keep or not _controlled_by(obj, uid):
                continue
            kube.delete(kind_of(obj), namespace, key[1])
            result.actions.append(("Deleted", *key))
    except KubeError as exc:
        if exc.transient:
            raise
        return _degrade(kube, body, "ApplyFailed", str(exc), record)

    why = {
        "Created": "created {kind} {name}",
        "Updated": "updated {kind} {name} to spec generation " + str(generation),
        "Restored": "{kind} {name} was missing; recreated it from the spec",
        "DriftRepaired": "{kind} {name} differed from the spec (edited by hand?); restored it",
        "Deleted": "deleted {kind} {name}: no longer part of the spec",
    }
    for verb, kind, child in result.actions:
        record("Normal", verb, why[verb].format(kind=kind, name=child))
        log.info("%s/%s: %s %s %s", namespace, name, verb, kind, child)

    roles = [
        WorkloadState.from_deployment(role, applied.get(("Deployment", names.role(role))))
        for role, _ in spec.roles.items()
    ]
    switching, stall = None, None
    if switch is not None and keep:
        ready = {w.name: f"{w.ready}/{w.desired} ready" for w in roles}
        switching = switch.message(gateway_now, ready)
        stall = switch.stall(names)
    problem = summarize(all_pods)
    result.status = compute_status(
        generation,
        roles,
        gateway_now,
        names.gateway_url(),
        prev_status,
        pod_problem=problem,
        autoscaled=_autoscaled(spec),
        role_switch=switching,
        role_switch_stalled=stall,
    )
    _record_role_switch(prev_status, result.status, switch, switching, record)
    _record_degraded(prev_status, result.status, record)
    _write_status(kube, body, result.status)
    return result


def _ensure_kv_transfer_secret(kube: KubeAPI, owner: Owner, names: Names) -> bool:
    """Create the service's P/D transfer secret if it does not exist; True when created.

    Runs before the pass applies a new child: a pod started without the Secret runs
    unsigned P/D until it restarts. A POST (409 once it exists): the operator may create
    Secrets but not read them. Refused (an RBAC from before this grant): the pods run
    unsigned, as before, so the service is not degraded for it; the log says what to do."""
    try:
        return kube.create(SECRET, build_kv_transfer_secret(owner, names))
    except KubeError as exc:
        if exc.transient or exc.status not in (401, 403):
            raise
        log.warning(
            "%s/%s: cannot create Secret %s (%s): its P/D transfer params go unsigned; "
            "grant the operator create on secrets (deploy/rbac.yaml, the chart's rules)",
            names.namespace, names.service, kv_transfer_secret_name(names), exc,
        )  # fmt: skip
        return False


def _mark_scale_downs(
    kube: KubeAPI,
    body: Manifest,
    spec: InferenceServiceSpec,
    names: Names,
    desired: list[Manifest],
    existing: dict[tuple[str, str], Manifest],
    pods: list[Manifest],
    loads: LoadReader | None,
    record: Recorder,
) -> None:
    """Before a pass lowers a role's replicas, mark the pods that should go (the
    autoscaler's choice: applying the lower count alone let the ReplicaSet pick them,
    the pods with the warmest caches as likely as any); on a role with no scale-down
    asked for or under way, clear a mark left by one that did not happen (a failed write,
    a spec reverted before the next pass)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    wanted = {
        obj["metadata"]["name"]: int(obj["spec"].get("replicas", 1))
        for obj in desired
        if obj["kind"] == "Deployment"
    }
    read: Mapping[str, PodLoad] | None = None
    heartbeats_read = False
    for role, _ in spec.roles.items():
        deploy = existing.get(("Deployment", names.role(role)))
        if deploy is None or names.role(role) not in wanted:
            continue
        now = int((deploy.get("spec") or {}).get("replicas", 1))
        target = wanted[names.role(role)]
        role_pods = live_pods(
            p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_ROLE) == role
        )
        if scale_down_settled(now, target, role_pods):
            clear_marks(kube, namespace, name, role_pods)
            continue
        if target >= now:
            continue
        if not heartbeats_read:
            read = loads(namespace, name, spec) if loads is not None else None
            heartbeats_read = True
        reports = [
            PodReport(n, load=(read or {}).get(n))
            for n in (p["metadata"]["name"] for p in role_pods)
        ]
        victims = mark_victims(kube, namespace, role_pods, reports, now - target)
        unknown = "" if read is not None else " (their loads unknown: Redis not read)"
        message = (
            f"{role}: {now} -> {target} replicas (spec); removing pod"
            f"{'s' if len(victims) > 1 else ''} {', '.join(victims)} (cheapest){unknown}"
        )
        record("Normal", SCALING_DOWN, message)
        log.info("%s/%s: %s", namespace, name, message)


def _record_role_switch(
    prev_status: Manifest,
    status: Manifest,
    switch: RoleSwitch | None,
    switching: str | None,
    record: Recorder,
) -> None:
    """One Event when a role switch starts keeping the previous roles, one Warning when it
    turns stalled, one when it ends (not one per pass: the status message carries the
    progress, and a stalled switch is still the same switch)."""
    was = role_switch_in_progress({"status": prev_status})
    stalled = _progressing_reason(status) == ROLE_SWITCH_STALLED
    if switching is not None and not was:
        record("Normal", ROLE_SWITCH, switching)
    if stalled and _progressing_reason(prev_status) != ROLE_SWITCH_STALLED:
        record("Warning", ROLE_SWITCH_STALLED, _progressing_message(status))
    if switch is not None and switching is None and switch.released and switch.old_serving:
        record(
            "Warning",
            ROLE_SWITCH_DEADLINE,
            f"{', '.join(switch.overdue)} got no resources within its progressDeadlineSeconds "
            f"while {'+'.join(switch.old)} held them: deleted {'+'.join(switch.old)} to free "
            f"them; nothing serves until {'+'.join(switch.new)} has Ready pods",
        )
    elif switch is not None and switching is None:
        record(
            "Normal",
            "RoleSwitchComplete",
            f"now serving from {'+'.join(switch.new)}; deleted {'+'.join(switch.old)}",
        )


def _progressing_message(status: Manifest) -> str:
    conds = status.get("conditions", []) or []
    return next((c.get("message", "") for c in conds if c.get("type") == "Progressing"), "")


def _autoscaled(spec: InferenceServiceSpec) -> set[str]:
    return {role for role, rs in spec.roles.items() if rs.autoscaling is not None}


def _degraded(status: Manifest) -> Manifest:
    return next((c for c in status.get("conditions", []) or [] if c.get("type") == "Degraded"), {})


def _record_degraded(prev_status: Manifest, status: Manifest, record: Recorder) -> None:
    """A Warning Event when the workloads turn Degraded (failing pods, a rollout past its
    deadline) or turn Degraded for another reason; not on every pass or restart (the
    message carries the restart count)."""
    now, prev = _degraded(status), _degraded(prev_status)
    if now.get("status") != "True":
        return
    if prev.get("status") != "True" or prev.get("reason") != now.get("reason"):
        record("Warning", now.get("reason", ""), now.get("message", ""))


def refresh_status(kube: KubeAPI, body: Manifest, record: Recorder) -> Manifest | None:
    """Recompute status from the Deployments without applying anything (cheap; used on
    child Deployment status changes between full passes). None when the spec is invalid.

    Posts a new Degraded reason's Warning as a full pass would: a refresh that sets Degraded
    first leaves the next pass nothing new to report."""
    meta = body["metadata"]
    names = Names(meta["name"], meta["namespace"])
    try:
        spec = parse_spec(body.get("spec") or {})
    except ValidationError:
        return None
    prev = body.get("status") or {}
    if prev.get("observedGeneration") != meta.get("generation"):
        return None  # a full pass for the new generation is due; let it write the status
    if any(
        c.get("type") == "Degraded" and c.get("status") == "True"
        for c in prev.get("conditions", []) or []
    ):
        return None  # only a full pass may clear Degraded
    if role_switch_in_progress(body):
        return None  # only a full pass knows what the switch waits for, and advances it
    deploys = {
        d["metadata"]["name"]: d
        for d in kube.list(DEPLOYMENT, meta["namespace"], owned_selector(meta["name"]))
    }
    roles = [
        WorkloadState.from_deployment(role, deploys.get(names.role(role)))
        for role, _ in spec.roles.items()
    ]
    gateway = WorkloadState.from_deployment(GATEWAY, deploys.get(names.gateway))
    problem = summarize(kube.list(POD, meta["namespace"], owned_selector(meta["name"])))
    status = compute_status(
        meta.get("generation", 0),
        roles,
        gateway,
        names.gateway_url(),
        prev,
        pod_problem=problem,
        autoscaled=_autoscaled(spec),
    )
    _record_degraded(prev, status, record)
    _write_status(kube, body, status)
    return status
