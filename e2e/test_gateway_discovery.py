"""The gateway's Kubernetes discovery against a real kube-apiserver: list, then watch.

EndpointSlices are written by hand for a selector-less Service (managed-by is not the
controller's, so kube-controller-manager leaves them alone); the gateway's discovery must
follow every change through its watch: readiness flips, a second slice, a deletion.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from e2e.cluster import ControlPlane
from e2e.kube_client import KubeClient
from pagefleet.gateway.discovery import Endpoint, KubernetesDiscovery

pytestmark = pytest.mark.e2e

SERVICE = "llama-decode"


def _slice(name: str, eps: list[tuple[str, str, bool]]) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/service-name": SERVICE,
                "endpointslice.kubernetes.io/managed-by": "pagefleet-e2e",
            },
        },
        "addressType": "IPv4",
        "ports": [
            {"name": "http", "port": 8000, "protocol": "TCP"},
            {"name": "metrics", "port": 9100, "protocol": "TCP"},
        ],
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": pod},
            }
            for ip, pod, ready in eps
        ],
    }


async def _until(pred: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"discovery never saw: {what}")


async def test_endpointslice_watch_follows_readiness_and_slices(
    cluster: ControlPlane, kube: KubeClient, namespace: str
) -> None:
    base = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
    kube.create(
        f"/api/v1/namespaces/{namespace}/services",
        {"metadata": {"name": SERVICE}, "spec": {"ports": [{"name": "http", "port": 8000}]}},
    )
    kube.create(base, _slice("a", [("10.0.0.1", "pod-1", True), ("10.0.0.2", "pod-2", False)]))
    disc = KubernetesDiscovery(
        namespace, SERVICE, target_port="http", kubeconfig=str(cluster.kubeconfig_path)
    )
    await disc.start()
    try:
        assert disc.endpoints() == [Endpoint("pod-1", "http://10.0.0.1:8000")]
        kube.merge_patch(
            f"{base}/a",
            {
                "endpoints": [
                    {
                        "addresses": ["10.0.0.1"],
                        "conditions": {"ready": True},
                        "targetRef": {"kind": "Pod", "name": "pod-1"},
                    },
                    {
                        "addresses": ["10.0.0.2"],
                        "conditions": {"ready": True},
                        "targetRef": {"kind": "Pod", "name": "pod-2"},
                    },
                ]
            },
        )
        await _until(
            lambda: [e.pod for e in disc.endpoints()] == ["pod-1", "pod-2"], "pod-2 turning ready"
        )
        kube.create(base, _slice("b", [("10.0.0.3", "pod-3", True)]))
        await _until(lambda: len(disc.endpoints()) == 3, "a second slice")
        kube.delete(f"{base}/a")
        await _until(
            lambda: disc.endpoints() == [Endpoint("pod-3", "http://10.0.0.3:8000")],
            "slice a deleted",
        )
    finally:
        await disc.close()
