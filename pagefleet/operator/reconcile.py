"""One reconciliation pass of one InferenceService: observe, apply, prune, report.

The pass is level-triggered: it never looks at what changed, only at the spec and the
children that exist now. Running it twice in a row changes nothing the second time (server-side
apply of identical manifests keeps every resourceVersion), which is what lets the operator
run it from create/update/resume handlers, a resync timer and child-object events alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pagefleet.api.inferenceservice import InferenceServiceSpec, name_problem, parse_spec
from pagefleet.operator.builders import BuildSettings, Owner, SpecError, build_children
from pagefleet.operator.kube import (
    CHILD_KINDS,
    DEPLOYMENT,
    INFERENCE_SERVICE,
    POD,
    KubeAPI,
    KubeError,
    kind_of,
)
from pagefleet.operator.naming import GATEWAY, Names, owned_selector
from pagefleet.operator.podhealth import summarize
from pagefleet.operator.status import WorkloadState, compute_status

log = logging.getLogger(__name__)

Manifest = dict[str, Any]
# (event type Normal|Warning, reason, message) -> posted as a Kubernetes Event on the
# InferenceService.
Recorder = Callable[[str, str, str], None]


@dataclass(slots=True)
class ReconcileResult:
    status: Manifest
    actions: list[tuple[str, str, str]] = field(default_factory=list)  # (verb, kind, name)
    degraded: str | None = None


def _key(obj: Manifest) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


# Bookkeeping, not content: a change here alone is no drift. A Deployment's status moves
# whenever its pods do, and an apply that only takes back ownership of a value another
# manager set (the autoscaler's or `kubectl scale`'s replicas, which the pass keeps) moves
# managedFields and the resourceVersion while changing nothing.
_SERVER_WRITTEN = ("resourceVersion", "generation", "managedFields")


def _content(obj: Manifest) -> Manifest:
    meta = {k: v for k, v in obj.get("metadata", {}).items() if k not in _SERVER_WRITTEN}
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": meta}


def _controlled_by(obj: Manifest, uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences", []) or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"spec.{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(parts)


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
    kube: KubeAPI, body: Manifest, settings: BuildSettings, record: Recorder
) -> ReconcileResult:
    """Make the children match the spec and write the status.

    Invariant: afterwards every desired child exists with the operator's fields as the spec
    says, no stale role workload of this InferenceService remains, and status reflects
    the Deployments as observed. A spec that cannot be realised, or an API rejection that
    retrying will not fix, sets Degraded instead of raising; transient API errors raise
    KubeError for the caller to retry."""
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
    try:
        desired = build_children(spec, owner, settings, current)
    except SpecError as exc:
        return _degrade(kube, body, exc.reason, str(exc), record)

    result = ReconcileResult(status={})
    applied: dict[tuple[str, str], Manifest] = {}
    try:
        for obj in desired:
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
            ) and _content(before) != _content(after):
                verb = "DriftRepaired" if steady else "Updated"
                result.actions.append((verb, *key))
        for key, obj in existing.items():
            if key in applied or not _controlled_by(obj, uid):
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
    gateway = WorkloadState.from_deployment(GATEWAY, applied.get(("Deployment", names.gateway)))
    problem = summarize(kube.list(POD, namespace, owned_selector(name)))
    result.status = compute_status(
        generation,
        roles,
        gateway,
        names.gateway_url(),
        prev_status,
        pod_problem=problem,
        autoscaled=_autoscaled(spec),
    )
    _record_degraded(prev_status, result.status, record)
    _write_status(kube, body, result.status)
    return result


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
