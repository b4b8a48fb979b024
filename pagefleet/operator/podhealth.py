"""Why the pods of an InferenceService fail to start, from their status as kubelets report it.

A Deployment whose pods crash-loop looks merely "not ready yet" from the Deployment's own
status (readyReplicas stays 0, the rollout deadline is minutes away), so the operator reads
the pods themselves: a container waiting in CrashLoopBackOff after repeated restarts, or one
the kubelet cannot even create (a missing Secret, an image it cannot pull), or a pod no node
can take, is a failure a person must fix. The report carries the kubelet's reason and the
container's last termination message (the daemon writes its fatal start-up error there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagefleet.operator.naming import LABEL_COMPONENT

Manifest = dict[str, Any]

# Restarts before a crash loop counts: one crash can be a transient (Redis not up yet).
CRASH_LOOP_RESTARTS = 2
# Waiting reasons that never resolve without a change by a person.
STUCK_REASONS = frozenset(
    {
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
    }
)
MESSAGE_LIMIT = 512


@dataclass(frozen=True, slots=True)
class PodFailure:
    """One failing pod: `reason` is the kubelet's (or scheduler's) CamelCase reason."""

    component: str
    pod: str
    reason: str
    detail: str

    def describe(self) -> str:
        return f"{self.component} pod {self.pod}: {self.detail}"


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def _container_failure(cs: Manifest) -> tuple[str, str] | None:
    state = cs.get("state") or {}
    restarts = cs.get("restartCount", 0) or 0
    name = cs.get("name", "?")
    waiting = state.get("waiting") or {}
    reason = waiting.get("reason", "")
    if reason in STUCK_REASONS:
        return reason, f"container {name} {reason}: {_one_line(waiting.get('message', ''))}"
    terminated_now = state.get("terminated") or {}
    looping = reason == "CrashLoopBackOff" or terminated_now.get("exitCode", 0) != 0
    if not looping or restarts < CRASH_LOOP_RESTARTS:
        return None
    last = (cs.get("lastState") or {}).get("terminated") or terminated_now
    detail = f"container {name} CrashLoopBackOff (restarted {restarts} times)"
    if last:
        detail += f"; last exit {last.get('exitCode', '?')}"
        message = _one_line(last.get("message", "") or "")
        detail += f": {message}" if message else f" ({last.get('reason', 'Error')})"
    return "CrashLoopBackOff", detail


def pod_failure(pod: Manifest) -> PodFailure | None:
    """The first reason this pod cannot run, or None while it runs or may still start."""
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None  # going away: its state says nothing about the current template
    component = (meta.get("labels") or {}).get(LABEL_COMPONENT, "?")
    name = meta.get("name", "?")
    for cond in status.get("conditions", []) or []:
        if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
            return PodFailure(component, name, "Unschedulable", _one_line(cond.get("message", "")))
    for cs in [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]:
        found = _container_failure(cs)
        if found is not None:
            return PodFailure(component, name, found[0], found[1])
    return None


def summarize(pods: list[Manifest]) -> tuple[str, str] | None:
    """(reason, message) for the Degraded condition, or None when no pod is failing.

    Deterministic (pods by name) so an unchanged situation writes an unchanged status."""
    failures = [f for f in (pod_failure(p) for p in pods) if f is not None]
    if not failures:
        return None
    failures.sort(key=lambda f: (f.component, f.pod))
    first = failures[0]
    message = first.describe()
    if len(failures) > 1:
        message += f" (and {len(failures) - 1} more failing pod(s))"
    return first.reason, message
