"""NetworkPolicies of one InferenceService: who may open connections to its pods.

- daemons: their serving port only from this service's gateway pods (clients, and anything
  else in the cluster, cannot bypass the gateway's authentication and limits), plus the
  configured metrics scrapers on the same port (the daemon serves /metrics there); in a
  prefill/decode deployment the daemons of the service also reach each other (KV pulls);
- gateway: its serving port from anywhere (it is the front door), nothing else.

Egress is left open: daemons and the gateway dial Redis and the API server, which live
elsewhere. Redis is fenced on its own side (the chart's bundled Redis has its own policy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagefleet.operator.naming import (
    DAEMON_PORT,
    GATEWAY,
    GATEWAY_PORT,
    LABEL_COMPONENT,
    LABEL_SERVICE,
    labels,
)

Manifest = dict[str, Any]


def _daemon_selector(service: str, roles: list[str]) -> Manifest:
    return {
        "matchLabels": {LABEL_SERVICE: service},
        "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": sorted(roles)}],
    }


def _port(port: int) -> Manifest:
    return {"port": port, "protocol": "TCP"}


def build_network_policies(
    service: str,
    meta: Callable[[str, dict[str, str]], Manifest],
    roles: list[str],
    metrics_peers: list[Manifest],
) -> list[Manifest]:
    """The daemons' and the gateway's NetworkPolicy. `meta(name, labels)` is the caller's
    metadata factory (namespace, owner reference); `metrics_peers` are NetworkPolicyPeers
    (e.g. Prometheus pods) allowed to the daemons' port."""
    gateway_pods = {"matchLabels": {LABEL_SERVICE: service, LABEL_COMPONENT: GATEWAY}}
    gateway_peer = {"podSelector": gateway_pods}
    daemon_rules: list[Manifest] = [{"from": [gateway_peer], "ports": [_port(DAEMON_PORT)]}]
    if len(roles) > 1:
        peers = {"podSelector": _daemon_selector(service, roles)}
        daemon_rules.append({"from": [peers]})
    if metrics_peers:
        daemon_rules.append({"from": list(metrics_peers), "ports": [_port(DAEMON_PORT)]})
    daemons = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(f"{service}-daemons", labels(service, "network-policy")),
        "spec": {
            "podSelector": _daemon_selector(service, roles),
            "policyTypes": ["Ingress"],
            "ingress": daemon_rules,
        },
    }
    gateway = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(f"{service}-{GATEWAY}", labels(service, "network-policy")),
        "spec": {
            "podSelector": gateway_pods,
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [_port(GATEWAY_PORT)]}],
        },
    }
    return [daemons, gateway]
