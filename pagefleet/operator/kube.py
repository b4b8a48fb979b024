"""The few Kubernetes API calls the operator makes, behind one small interface.

`KubeAPI` is what the reconciler needs: list owned children by label, server-side apply,
delete, and write the InferenceService's status. `RestKube` implements it over the official
client's REST layer (raw dicts in and out, no model classes); tests use an in-memory fake.
Server-side apply with a fixed field manager and force makes every apply idempotent and
takes back any field a person edited by hand.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from pagefleet.api.inferenceservice import GROUP, PLURAL, VERSION
from pagefleet.operator.naming import FIELD_MANAGER

log = logging.getLogger(__name__)

Manifest = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Kind:
    api_version: str
    kind: str
    plural: str

    def collection_path(self, namespace: str) -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        return f"{prefix}/namespaces/{namespace}/{self.plural}"


DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
SERVICE = Kind("v1", "Service", "services")
CONFIG_MAP = Kind("v1", "ConfigMap", "configmaps")
SERVICE_ACCOUNT = Kind("v1", "ServiceAccount", "serviceaccounts")
ROLE = Kind("rbac.authorization.k8s.io/v1", "Role", "roles")
ROLE_BINDING = Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings")
# Read only (never applied or pruned): the pods' status says why a workload does not start.
POD = Kind("v1", "Pod", "pods")
NETWORK_POLICY = Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies")
INFERENCE_SERVICE = Kind(f"{GROUP}/{VERSION}", "InferenceService", PLURAL)
POD = Kind("v1", "Pod", "pods")  # read and annotated by the autoscaler, never applied
# Never listed, applied or pruned: the autoscaler gets the password of a service's own
# Redis from the Secret its spec names (a Role per Secret), and the reconciler creates
# each service's P/D transfer secret once (create only: it can read no Secret back).
SECRET = Kind("v1", "Secret", "secrets")

CHILD_KINDS: tuple[Kind, ...] = (
    CONFIG_MAP,
    SERVICE_ACCOUNT,
    ROLE,
    ROLE_BINDING,
    SERVICE,
    DEPLOYMENT,
    NETWORK_POLICY,
)
_BY_KIND = {k.kind: k for k in (*CHILD_KINDS, INFERENCE_SERVICE)}


def kind_of(obj: Manifest) -> Kind:
    try:
        return _BY_KIND[obj["kind"]]
    except KeyError:
        raise ValueError(
            f"the operator does not manage objects of kind {obj.get('kind')!r}"
        ) from None


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status (0 when no response came back)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        return self.status in (0, 409, 429) or self.status >= 500


class KubeAPI(Protocol):
    def list(self, kind: Kind, namespace: str, selector: dict[str, str]) -> list[Manifest]: ...

    def apply(self, obj: Manifest) -> Manifest: ...

    def create(self, kind: Kind, obj: Manifest) -> bool: ...

    def delete(self, kind: Kind, namespace: str, name: str) -> bool: ...

    def get(self, kind: Kind, namespace: str, name: str) -> Manifest | None: ...

    def patch_status(self, kind: Kind, namespace: str, name: str, status: Manifest) -> None: ...

    def merge_patch(self, kind: Kind, namespace: str, name: str, patch: Manifest) -> Manifest: ...


def label_selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


class RestKube:
    """`KubeAPI` over `kubernetes.client.ApiClient` (kubeconfig or in-cluster config)."""

    def __init__(self, api_client: Any | None = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self._api = api_client

    def _call(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json", "Content-Type": content_type}
        # A dict body: the REST layer serialises it once for JSON and structured-YAML
        # content types (a pre-serialised string would be JSON-encoded a second time).
        try:
            req = self._api.param_serialize(
                method=method,
                resource_path=path,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            resp = self._api.call_api(*req, _request_timeout=30)
            data = resp.read() if hasattr(resp, "read") else resp.data
            if resp.status >= 400:
                raise KubeError(resp.status, _api_message(resp.status, data))
        except ApiException as exc:
            raise KubeError(exc.status or 0, _api_message(exc.status, exc.body)) from exc
        except OSError as exc:
            raise KubeError(0, f"{method} {path}: {exc}") from exc
        return json.loads(data) if data else {}

    def list(self, kind: Kind, namespace: str, selector: dict[str, str]) -> list[Manifest]:
        out = self._call(
            "GET",
            kind.collection_path(namespace),
            query=[("labelSelector", label_selector(selector))],
        )
        items: list[Manifest] = out.get("items", [])
        for item in items:  # list items carry no apiVersion/kind
            item.setdefault("apiVersion", kind.api_version)
            item.setdefault("kind", kind.kind)
        return items

    def get(self, kind: Kind, namespace: str, name: str) -> Manifest | None:
        try:
            return self._call("GET", f"{kind.collection_path(namespace)}/{name}")
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, obj: Manifest) -> Manifest:
        kind = kind_of(obj)
        meta = obj["metadata"]
        return self._call(
            "PATCH",
            f"{kind.collection_path(meta['namespace'])}/{meta['name']}",
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    def create(self, kind: Kind, obj: Manifest) -> bool:
        """POST ``obj``; False when an object of that name exists already (409), which is
        left as it is."""
        try:
            self._call("POST", kind.collection_path(obj["metadata"]["namespace"]), body=obj)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        try:
            self._call(
                "DELETE",
                f"{kind.collection_path(namespace)}/{name}",
                body={"propagationPolicy": "Background"},
            )
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def patch_status(self, kind: Kind, namespace: str, name: str, status: Manifest) -> None:
        self._call(
            "PATCH",
            f"{kind.collection_path(namespace)}/{name}/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    def merge_patch(self, kind: Kind, namespace: str, name: str, patch: Manifest) -> Manifest:
        """JSON merge patch of a few fields (the autoscaler's replicas and pod annotations)."""
        out: Manifest = self._call(
            "PATCH",
            f"{kind.collection_path(namespace)}/{name}",
            body=patch,
            content_type="application/merge-patch+json",
        )
        return out


def _api_message(status: int | None, body: Any) -> str:
    if isinstance(body, bytes | bytearray):
        body = body.decode("utf-8", "replace")
    try:
        parsed = json.loads(body) if isinstance(body, str) else body
        if isinstance(parsed, dict) and parsed.get("message"):
            return f"HTTP {status}: {parsed['message']}"
    except (TypeError, ValueError):
        pass
    return f"HTTP {status}: {body}"
