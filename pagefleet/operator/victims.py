"""Which pods a scale-down removes: the planner's choice, written where the ReplicaSet reads it.

Lowering a Deployment's replicas lets its ReplicaSet pick the pods to delete by its own
ranking (newest first among equals), which knows nothing of the prefix cache. Every
scale-down the operator makes (the autoscaler's decisions, a lowered ``replicas`` or
``autoscaling.maxReplicas``) therefore first marks the cheapest pods with a low
``controller.kubernetes.io/pod-deletion-cost`` (not Ready, else fewest cached blocks in the
index, else fewest running and waiting requests), then lowers the count. A mark left by a
scale-down that did not happen is removed once the role is steady again, or it would make
that pod the first to go in the next scale-down by anyone, whatever it holds by then.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pagefleet.api.inferenceservice import InferenceServiceSpec
from pagefleet.kvindex.index import PodLoad
from pagefleet.operator.kube import POD, KubeAPI, KubeError
from pagefleet.operator.signals import PodReport, cheapest_pods

log = logging.getLogger(__name__)

Manifest = dict[str, Any]

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# The cheapest pods get this cost; every other pod has the default 0 (or ours removed).
VICTIM_COST = "-1000"


class LoadReader(Protocol):
    """The index's heartbeats of one InferenceService's pods (pod name -> load), or None
    when they cannot be read (the autoscaler reads them with the service's credentials)."""

    def __call__(
        self, namespace: str, name: str, spec: InferenceServiceSpec
    ) -> Mapping[str, PodLoad] | None:
        """Heartbeats keyed by pod name; None when Redis cannot be read."""
        ...


def pod_ready(pod: Manifest) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def live_pods(pods: Iterable[Manifest]) -> list[Manifest]:
    """Pods not already being deleted: neither capacity nor a candidate any more."""
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def mark_victims(
    kube: KubeAPI,
    namespace: str,
    pods: list[Manifest],
    reports: Iterable[PodReport],
    count: int,
) -> list[str]:
    """Annotate the ``count`` cheapest of ``pods`` with a low deletion cost and clear our
    mark on the others; the victims, cheapest first. ``reports`` carry what is known of
    each pod's load (a pod without one ranks after those with one). Raises KubeError: the
    caller must not lower the count when the marks could not be written."""
    ready = {p["metadata"]["name"]: pod_ready(p) for p in pods}
    by_name = {r.name: r for r in reports}
    victims = cheapest_pods([by_name.get(n) or PodReport(n) for n in ready], ready, count)
    for pod in pods:
        pname = pod["metadata"]["name"]
        marked = (pod["metadata"].get("annotations") or {}).get(DELETION_COST)
        if pname in victims and marked != VICTIM_COST:
            patch = {"metadata": {"annotations": {DELETION_COST: VICTIM_COST}}}
            kube.merge_patch(POD, namespace, pname, patch)
        elif pname not in victims and marked == VICTIM_COST:
            patch = {"metadata": {"annotations": {DELETION_COST: None}}}
            kube.merge_patch(POD, namespace, pname, patch)
    return victims


def clear_marks(kube: KubeAPI, namespace: str, owner: str, pods: list[Manifest]) -> None:
    """Remove our deletion-cost mark from every pod; best effort (the next pass retries),
    never in the way of a pass's own writes."""
    for pod in pods:
        if (pod["metadata"].get("annotations") or {}).get(DELETION_COST) != VICTIM_COST:
            continue
        patch = {"metadata": {"annotations": {DELETION_COST: None}}}
        try:
            kube.merge_patch(POD, namespace, pod["metadata"]["name"], patch)
        except KubeError as exc:
            log.warning(
                "%s/%s: clearing the deletion cost of pod %s failed, retrying next pass: %s",
                namespace, owner, pod["metadata"]["name"], exc,
            )  # fmt: skip


def scale_down_settled(replicas: int, desired: int, pods: list[Manifest]) -> bool:
    """No scale-down asked for (``desired`` >= ``replicas``) and none under way (no live
    pod beyond the count): a mark on any pod is then one left by a scale-down that did not
    happen."""
    return desired >= replicas and len(live_pods(pods)) <= replicas
