"""Small reads of cluster state that several e2e scenarios share.

They take a `KubeClient` and return plain JSON-shaped data, so a scenario's asserts stay
next to the scenario. Pods being deleted are left out of every list: a scenario that
waits for "2 pods" means two that will stay.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from e2e.kube_client import KubeClient


def tiny_checkpoint() -> str:
    """The path of the seeded tiny checkpoint, built once in a subprocess.

    A subprocess keeps torch out of the test process, which talks only HTTP."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pagefleet.engine.tiny import ensure_tiny_checkpoint as e; print(e('tiny'))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return out.stdout.strip().splitlines()[-1]


def live_pods(kube: KubeClient, ns: str, selector: str) -> list[dict[str, Any]]:
    """Pods matching `selector` that are not terminating."""
    items = kube.get(f"/api/v1/namespaces/{ns}/pods", {"labelSelector": selector})["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def pod_ready(pod: dict[str, Any]) -> bool:
    """True when the kubelet (our node agent) reports the pod's Ready condition True."""
    conds = (pod.get("status") or {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def ready_endpoints(kube: KubeClient, ns: str, service: str) -> list[str]:
    """Sorted addresses the EndpointSlice controller lists as ready for `service`."""
    slices = kube.get(
        f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
        {"labelSelector": f"kubernetes.io/service-name={service}"},
    )["items"]
    return sorted(
        addr
        for s in slices
        for ep in s.get("endpoints") or []
        if (ep.get("conditions") or {}).get("ready")
        for addr in ep["addresses"]
    )
