"""The InferenceService's status, computed from its child Deployments.

Conditions follow the Kubernetes convention: `Ready` (every role and the gateway have all
their desired pods ready on the current template), `Progressing` (a rollout or scale is
under way), `Degraded` (something needs a person: a spec the operator cannot realise, an
API error, a Deployment that exceeded its progress deadline), plus `<Role>Ready` per role.
`lastTransitionTime` changes only when a condition's status flips.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pagefleet.operator.naming import GATEWAY

Manifest = dict[str, Any]

# Conditions owned by the autoscaler (pagefleet/operator/autoscaler.py).
AUTOSCALER_CONDITIONS = ("ScalingActive",)
# Progressing's reason while the previous roles' pods still serve during a change between
# unified and prefill/decode (pagefleet/operator/reconcile.py).
ROLE_SWITCH = "RoleSwitch"
# Progressing's reason while such a switch is blocked by what makes the service Degraded
# (a new role past its Deployment's progressDeadlineSeconds, its pods failing): the switch
# keeps the previous roles serving and waits for a person.
ROLE_SWITCH_STALLED = "RoleSwitchStalled"


@dataclass(frozen=True, slots=True)
class SwitchStall:
    """How to word Progressing when a role switch is blocked: `head` names the switch,
    `advice` says what still serves and what a person can do; Degraded's cause goes
    between them."""

    head: str
    advice: str

    def message(self, cause: str) -> str:
        return f"{self.head}: blocked by {cause.rstrip('. ')}; {self.advice}"


@dataclass(slots=True)
class WorkloadState:
    """Replica counts of one Deployment (a role or the gateway)."""

    name: str
    desired: int
    ready: int
    updated: int
    available: int
    rolled_out: bool  # the Deployment controller has seen the current template
    failure: str | None = None  # ProgressDeadlineExceeded / ReplicaFailure message

    @property
    def ready_now(self) -> bool:
        return (
            self.rolled_out
            and self.ready >= self.desired
            and self.updated >= self.desired
            and self.failure is None
        )

    @classmethod
    def from_deployment(cls, name: str, deploy: Manifest | None) -> WorkloadState:
        if deploy is None:
            return cls(name, desired=0, ready=0, updated=0, available=0, rolled_out=False)
        spec, st = deploy.get("spec", {}), deploy.get("status", {}) or {}
        generation = deploy.get("metadata", {}).get("generation", 0)
        failure = None
        for cond in st.get("conditions", []) or []:
            stuck = cond.get("type") == "Progressing" and cond.get("reason") == (
                "ProgressDeadlineExceeded"
            )
            replica_failure = cond.get("type") == "ReplicaFailure" and cond.get("status") == "True"
            if stuck or replica_failure:
                failure = f"{cond.get('reason')}: {cond.get('message', '')}".strip()
        total = st.get("replicas", 0) or 0
        updated = st.get("updatedReplicas", 0) or 0
        desired = spec.get("replicas", 1)
        # Old pods still terminating mean the rollout is not finished yet.
        rolled_out = (st.get("observedGeneration", 0) or 0) >= generation and total <= desired
        return cls(
            name=name,
            desired=desired,
            ready=st.get("readyReplicas", 0) or 0,
            updated=updated,
            available=st.get("availableReplicas", 0) or 0,
            rolled_out=rolled_out,
            failure=failure,
        )


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    type_: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    previous: list[Manifest],
    now: str | None = None,
) -> Manifest:
    """One condition; keeps the previous lastTransitionTime while the status is unchanged."""
    status = "True" if ok else "False"
    stamp = now or _now()
    for old in previous:
        if old.get("type") == type_ and old.get("status") == status:
            stamp = old.get("lastTransitionTime") or stamp
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": stamp,
        "observedGeneration": generation,
    }


def _role_condition_type(role: str) -> str:
    return f"{role.capitalize()}Ready"


def compute_status(
    generation: int,
    roles: list[WorkloadState],
    gateway: WorkloadState | None,
    url: str,
    previous: Manifest | None,
    degraded_reason: str | None = None,
    degraded_message: str = "",
    pod_problem: tuple[str, str] | None = None,
    autoscaled: Collection[str] | None = None,
    role_switch: str | None = None,
    role_switch_stalled: SwitchStall | None = None,
) -> Manifest:
    """Full status of one InferenceService (a JSON merge patch replaces it as a whole).

    ``role_switch``: why the previous roles' workloads are still there (a role switch is
    under way); it makes Progressing True with reason RoleSwitch unless Degraded. When
    Degraded, Progressing is False with reason RoleSwitchStalled and the message
    ``role_switch_stalled`` (what still serves, what to do) followed by Degraded's cause.

    Degraded comes from, in order: the caller's reason (spec or API problems), failing pods
    (`pod_problem`: the kubelet's reason and the container's last words), a Deployment that
    exceeded its progress deadline. The autoscaler's parts of `previous` are kept for the
    roles in `autoscaled` (None: unknown, keep them all)."""
    prev_conds: list[Manifest] = list((previous or {}).get("conditions", []) or [])
    conds: list[Manifest] = []
    failures = [w for w in [*roles, *([gateway] if gateway else [])] if w.failure]
    if degraded_reason is None and pod_problem is not None:
        degraded_reason, degraded_message = pod_problem
    if degraded_reason is None and failures:
        degraded_reason = "RolloutFailed"
        degraded_message = "; ".join(f"{w.name}: {w.failure}" for w in failures)
    degraded = degraded_reason is not None

    for w in roles:
        conds.append(
            condition(
                _role_condition_type(w.name),
                w.ready_now,
                "PodsReady" if w.ready_now else "PodsNotReady",
                f"{w.ready}/{w.desired} pods ready, {w.updated} on the current template",
                generation,
                prev_conds,
            )
        )
    workloads = [*roles, *([gateway] if gateway else [])]
    all_ready = bool(roles) and gateway is not None and all(w.ready_now for w in workloads)
    waiting = [w for w in workloads if not w.ready_now]
    progressing = not degraded and (bool(waiting) or role_switch is not None)
    if progressing and role_switch is not None:
        reason, message = ROLE_SWITCH, role_switch
    elif progressing:
        reason = "RollingOut"
        message = "waiting for " + ", ".join(
            f"{w.name} ({w.ready}/{w.desired} ready)" for w in waiting
        )
    elif degraded and role_switch is not None:
        reason = ROLE_SWITCH_STALLED
        stall = role_switch_stalled or SwitchStall(role_switch, "see Degraded")
        message = stall.message(degraded_message)
    elif degraded:
        reason, message = "Stalled", "blocked: see Degraded"
    else:
        reason, message = "Complete", "all workloads on the current spec"
    conds.append(condition("Progressing", progressing, reason, message, generation, prev_conds))
    conds.append(
        condition(
            "Degraded",
            degraded,
            degraded_reason or "AsExpected",
            degraded_message if degraded else "",
            generation,
            prev_conds,
        )
    )
    ready = all_ready and not degraded and role_switch is None
    conds.append(
        condition(
            "Ready",
            ready,
            "AllReplicasReady" if ready else ("Degraded" if degraded else "Progressing"),
            "every role and the gateway are ready" if ready else "not every pod is ready yet",
            generation,
            prev_conds,
        )
    )
    # The autoscaler's own condition and per-role decisions are written by its timer, not
    # derived from Deployments: carry them over so a reconcile pass does not erase them.
    # Once no role autoscales, nothing would ever update them again: drop them.
    if autoscaled is None or autoscaled:
        conds += [c for c in prev_conds if c.get("type") in AUTOSCALER_CONDITIONS]
    prev_roles = {r.get("name"): r for r in (previous or {}).get("roles", []) or []}
    role_entries: list[Manifest] = []
    for w in roles:
        entry: Manifest = {
            "name": w.name,
            "desiredReplicas": w.desired,
            "readyReplicas": w.ready,
            "updatedReplicas": w.updated,
        }
        if prev_roles.get(w.name, {}).get("autoscaling") and (
            autoscaled is None or w.name in autoscaled
        ):
            entry["autoscaling"] = prev_roles[w.name]["autoscaling"]
        role_entries.append(entry)
    return {
        "observedGeneration": generation,
        "conditions": conds,
        "roles": role_entries,
        "readyRoles": f"{sum(w.ready_now for w in roles)}/{len(roles)}",
        "replicas": " ".join(f"{w.name}:{w.ready}/{w.desired}" for w in roles),
        "url": url,
    }


__all__ = [
    "GATEWAY",
    "ROLE_SWITCH",
    "ROLE_SWITCH_STALLED",
    "SwitchStall",
    "WorkloadState",
    "compute_status",
    "condition",
]
