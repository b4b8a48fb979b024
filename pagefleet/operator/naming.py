"""Names and labels of the objects the operator owns.

Every child carries the same label set so the operator, the gateway and dashboards can
select them; the selectors of Deployments are immutable, so they use only labels that
never change for the life of a child (service name, component).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.api.inferenceservice import GROUP

MANAGED_BY = "pagefleet-operator"
FIELD_MANAGER = "pagefleet-operator"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = f"{GROUP}/service"
LABEL_ROLE = f"{GROUP}/role"

GATEWAY = "gateway"
DAEMON_PORT = 8000
GATEWAY_PORT = 8080


@dataclass(frozen=True, slots=True)
class Names:
    """Child object names of one InferenceService (all DNS-1035 labels within 63
    characters for a name that passes pagefleet.api.inferenceservice.NAME_RULE, which
    the CRD and reconcile enforce)."""

    service: str
    namespace: str

    def role(self, role: str) -> str:
        return f"{self.service}-{role}"

    @property
    def gateway(self) -> str:
        return f"{self.service}-{GATEWAY}"

    @property
    def config(self) -> str:
        return f"{self.service}-config"

    @property
    def kv_namespace(self) -> str:
        return f"{self.namespace}/{self.service}"

    def gateway_url(self) -> str:
        return f"http://{self.gateway}.{self.namespace}.svc:{GATEWAY_PORT}/v1"


def owned_selector(service: str) -> dict[str, str]:
    """Labels that select every object owned by one InferenceService."""
    return {LABEL_SERVICE: service, LABEL_MANAGED_BY: MANAGED_BY}


def labels(service: str, component: str, role: str | None = None) -> dict[str, str]:
    """The common label set of one child object."""
    out = {
        LABEL_NAME: "pagefleet",
        LABEL_INSTANCE: service,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_SERVICE: service,
    }
    if role is not None:
        out[LABEL_ROLE] = role
    return out


def selector(service: str, component: str) -> dict[str, str]:
    """Immutable pod selector of a Deployment / Service."""
    return {LABEL_SERVICE: service, LABEL_COMPONENT: component}
