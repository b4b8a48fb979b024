"""Desired child objects of one InferenceService, as plain manifests.

Pure functions of (spec, identity, settings): the same input always yields the same
objects, so applying them again is a no-op (idempotence lives here, not in the handlers).
The operator server-side-applies every object returned by `build_children`.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from pagefleet.api.inferenceservice import (
    GROUP,
    KIND,
    VERSION,
    IndexSpec,
    InferenceServiceSpec,
    RedisUser,
    ResourceRequirements,
    RoleSpec,
    SecretKeyRef,
)
from pagefleet.kvindex.redis_auth import PASSWORD_ENV, USERNAME_ENV
from pagefleet.operator.commands import (
    GPU_RESOURCE,
    daemon_command,
    gateway_command,
    requests_gpu,
    role_device,
)
from pagefleet.operator.hardening import (
    DAEMON_RESOURCES,
    GATEWAY_RESOURCES,
    api_token_volume,
    cache_env,
    container_security_context,
    cpu_thread_env,
    default_resources,
    kv_stage_volume,
    pod_security_context,
    writable_volumes,
)
from pagefleet.operator.naming import (
    DAEMON_PORT,
    GATEWAY,
    GATEWAY_PORT,
    Names,
    labels,
    selector,
)
from pagefleet.operator.netpol import build_network_policies

Manifest = dict[str, Any]

CONFIG_MOUNT = "/etc/pagefleet"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"


class SpecError(ValueError):
    """The spec passed schema validation but cannot be realised (e.g. no Redis to use), or
    the operator's policy refuses it (an image or a hostPath it does not allow).

    The message is shown to the user in the Degraded condition and an Event; `reason` is
    the condition's reason."""

    def __init__(self, message: str, reason: str = "InvalidSpec") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Owner:
    """Identity of the InferenceService that owns the children."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True, slots=True)
class BuildSettings:
    """Operator-wide knobs that are not part of any one InferenceService."""

    default_redis_url: str | None = None  # the chart's bundled Redis, when installed
    # Secret (in the InferenceService's namespace) with the bundled Redis' ACL passwords:
    # keys daemon-password (user pf-daemon) and gateway-password (read-only pf-gateway).
    default_redis_secret: str | None = None
    extra_pod_annotations: dict[str, str] = field(default_factory=dict)
    # Image policy: when set, spec.image must start with one of these prefixes (e.g.
    # "registry.example.com/pagefleet/"); empty allows any image.
    allowed_image_prefixes: tuple[str, ...] = ()
    # hostPath model sources mount a node directory into the pods: off unless the cluster
    # admin opts in (single-node or pre-seeded clusters).
    allow_host_path: bool = False
    network_policies: bool = True
    # NetworkPolicyPeers allowed to the daemons' port for /metrics (Prometheus, the
    # operator's autoscaler); none means only the gateway reaches the daemons.
    metrics_peers: tuple[dict[str, Any], ...] = ()


def check_policy(spec: InferenceServiceSpec, settings: BuildSettings) -> None:
    """Refuse what the operator's installation does not allow, naming the setting."""
    prefixes = settings.allowed_image_prefixes
    if prefixes and not any(spec.image.startswith(p) for p in prefixes):
        raise SpecError(
            f"image {spec.image!r} is not allowed: this operator only runs images starting "
            f"with {', '.join(repr(p) for p in prefixes)}; use such an image or ask the "
            "cluster admin to extend --allowed-image-prefix (chart: operator.allowedImagePrefixes)",
            reason="ImageNotAllowed",
        )
    if spec.model.source.host_path is not None and not settings.allow_host_path:
        raise SpecError(
            f"model.source.hostPath {spec.model.source.host_path!r} is not allowed: this "
            "operator does not mount node directories; use a persistentVolumeClaim, or ask "
            "the cluster admin to enable --allow-host-path (chart: operator.allowHostPath)",
            reason="HostPathNotAllowed",
        )


def role_replicas(role: RoleSpec, current: int | None) -> int:
    """Replicas to apply for a role.

    Fixed `replicas` win; with `autoscaling` the autoscaler owns the count, so the operator
    keeps the Deployment's current value and only clamps it into [min, max] (a fresh
    Deployment starts at min)."""
    if role.autoscaling is None:
        return 1 if role.replicas is None else role.replicas
    lo, hi = role.autoscaling.min_replicas, role.autoscaling.max_replicas
    if current is None:
        return lo
    return max(lo, min(hi, current))


def resolve_redis_url(spec: InferenceServiceSpec, settings: BuildSettings) -> str:
    url = spec.index.redis_url or settings.default_redis_url
    if not url:
        raise SpecError(
            "no Redis for the prefix index: set spec.index.redisURL, or install the chart "
            "with redis.enabled=true so the operator has a bundled Redis to default to"
        )
    return url


def _meta(owner: Owner, name: str, lbls: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": lbls,
        "ownerReferences": [owner.reference()],
    }


def _resources(res: ResourceRequirements) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if res.requests:
        out["requests"] = {k: str(v) for k, v in res.requests.items()}
    if res.limits:
        out["limits"] = {k: str(v) for k, v in res.limits.items()}
    return out


def _config_data(spec: InferenceServiceSpec, names: Names, routed: list[str]) -> dict[str, str]:
    engine = spec.engine.model_dump(by_alias=True, mode="json")
    engine["model"] = spec.model.model_dump(by_alias=True, mode="json", exclude_none=True)
    # Not `replicas`: that is the Deployment's, and in the hashed config it would roll every
    # gateway pod on a pure scale change.
    router = spec.router.model_dump(by_alias=True, mode="json", include={"policy", "weights"})
    router["services"] = {role: names.role(role) for role in routed}
    return {
        "engine.json": json.dumps(engine, indent=2, sort_keys=True) + "\n",
        "router.json": json.dumps(router, indent=2, sort_keys=True) + "\n",
        # null when spec.slo is unset: the service has no latency targets.
        "slo.json": json.dumps(
            spec.slo.model_dump(by_alias=True, mode="json") if spec.slo is not None else None,
            sort_keys=True,
        )
        + "\n",
    }


def _config_hash(data: dict[str, str], keys: tuple[str, ...]) -> str:
    # Part of the pod template, so a change to the config a component reads rolls exactly
    # that component (engine knobs roll the daemons, router settings the gateway).
    blob = json.dumps({k: data[k] for k in keys}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# Secrets reach the processes as environment variables from secretKeyRefs: never in the
# command line (readable by every local user, copied into the pod spec and logs). Names
# as the daemon/gateway read them (pagefleet.kvindex.redis_auth, pagefleet.httpauth).
API_KEYS_ENV = "PAGEFLEET_API_KEYS"
ADMIN_TOKEN_ENV = "PAGEFLEET_ADMIN_TOKEN"


def _secret_env(name: str, ref: Any) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


# The fleet's P/D transfer secret (pagefleet.httpauth.ENV_KV_SECRET): one per
# InferenceService, the same in every daemon and the gateway; they sign and check
# kv_transfer_params with it. The reconciler creates it before the service's first pods
# (build_kv_transfer_secret). Optional: a pod started before it exists (a service made by
# an older operator) runs without it -- unsigned P/D, as before, with a warning in its log.
KV_TRANSFER_SECRET_ENV = "PAGEFLEET_KV_TRANSFER_SECRET"
KV_TRANSFER_SECRET_KEY = "secret"


def kv_transfer_secret_name(names: Names) -> str:
    return f"{names.service}-kv-transfer"


def build_kv_transfer_secret(owner: Owner, names: Names) -> Manifest:
    """The service's P/D transfer secret: 32 random bytes (hex), owned by the service so it
    goes with it. Created once and never rewritten (the reconciler has create only on
    Secrets): a changed value would split a running fleet into pods that refuse each
    other's signatures."""
    meta = _meta(owner, kv_transfer_secret_name(names), labels(names.service, "kv-transfer"))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "stringData": {KV_TRANSFER_SECRET_KEY: secrets.token_hex(32)},
    }


def _kv_transfer_secret_env(names: Names) -> list[dict[str, Any]]:
    ref = {"name": kv_transfer_secret_name(names), "key": KV_TRANSFER_SECRET_KEY,
           "optional": True}  # fmt: skip
    return [{"name": KV_TRANSFER_SECRET_ENV, "valueFrom": {"secretKeyRef": ref}}]


def _common_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {
            "name": "POD_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
    ]


BUNDLED_DAEMON_USER = "pf-daemon"
BUNDLED_GATEWAY_USER = "pf-gateway"


def effective_index(spec: InferenceServiceSpec, settings: BuildSettings) -> IndexSpec:
    """The index settings the pods get: the spec's, or, for a service on the bundled Redis
    that names no credentials, the bundled Redis' ACL users from its Secret."""
    index = spec.index
    if index.redis_url or index.password_secret_ref or not settings.default_redis_secret:
        return index
    secret = settings.default_redis_secret
    return index.model_copy(
        update={
            "username": BUNDLED_DAEMON_USER,
            "password_secret_ref": SecretKeyRef(name=secret, key="daemon-password"),
            "gateway_user": index.gateway_user
            or RedisUser(
                username=BUNDLED_GATEWAY_USER,
                password_secret_ref=SecretKeyRef(name=secret, key="gateway-password"),
            ),
        }
    )


def _daemon_secret_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """Redis credentials of the daemons (they write the index) and the admin token."""
    env: list[dict[str, Any]] = []
    if spec.index.username:
        env.append({"name": USERNAME_ENV, "value": spec.index.username})
    if spec.index.password_secret_ref is not None:
        env.append(_secret_env(PASSWORD_ENV, spec.index.password_secret_ref))
    if spec.admin_token_secret is not None:
        env.append(_secret_env(ADMIN_TOKEN_ENV, spec.admin_token_secret))
    return env


def _gateway_secret_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The gateway's Redis user (the read-only one when set), client keys, admin token.

    Client keys go to the gateway only: it never forwards a client's key, and the
    NetworkPolicy lets nothing but the gateway reach the daemons' port."""
    env: list[dict[str, Any]] = []
    user = spec.index.gateway_user
    if user is not None:
        env.append({"name": USERNAME_ENV, "value": user.username})
        if user.password_secret_ref is not None:
            env.append(_secret_env(PASSWORD_ENV, user.password_secret_ref))
    else:
        env += [e for e in _daemon_secret_env(spec) if e["name"] != ADMIN_TOKEN_ENV]
    if spec.router.api_keys_secret is not None:
        env.append(_secret_env(API_KEYS_ENV, spec.router.api_keys_secret))
    if spec.admin_token_secret is not None:
        env.append(_secret_env(ADMIN_TOKEN_ENV, spec.admin_token_secret))
    return env


def _merge_env(base: list[Manifest], extra: list[Manifest]) -> list[Manifest]:
    """`base` with `extra` merged in by name: a name in both keeps base's position with
    extra's value, new names follow in order. The API server (server-side apply keys env
    by name) refuses a container that lists one name twice."""
    out = list(base)
    index = {e["name"]: i for i, e in enumerate(out)}
    for e in extra:
        if e["name"] in index:
            out[index[e["name"]]] = e
        else:
            index[e["name"]] = len(out)
            out.append(e)
    return out


def _volumes(spec: InferenceServiceSpec, names: Names) -> tuple[list[Manifest], list[Manifest]]:
    volumes: list[Manifest] = [{"name": "config", "configMap": {"name": names.config}}]
    mounts: list[Manifest] = [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    scratch_volumes, scratch_mounts = writable_volumes()
    volumes += scratch_volumes
    mounts += scratch_mounts
    src = spec.model.source
    if src.persistent_volume_claim is not None:
        pvc = src.persistent_volume_claim
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": pvc.read_only},
            }
        )
    elif src.host_path is not None:
        volumes.append({"name": "model", "hostPath": {"path": src.host_path, "type": "Directory"}})
    if volumes[-1]["name"] == "model":
        mounts.append({"name": "model", "mountPath": src.mount_path, "readOnly": True})
    return volumes, mounts


def _http_probe(path: str, period: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def _deployment(
    owner: Owner,
    name: str,
    component: str,
    role_label: str,
    replicas: int,
    container: Manifest,
    volumes: list[Manifest],
    config_hash: str,
    settings: BuildSettings,
    grace_s: int,
    scheduling: RoleSpec | None = None,
    port: int = DAEMON_PORT,
) -> Manifest:
    lbls = labels(owner.name, component, role_label)
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        # Lets in-flight streams finish when a rollout or scale-down removes a pod; the
        # process' drain is derived from the same value (commands.py), so it ends first.
        "terminationGracePeriodSeconds": grace_s,
        "enableServiceLinks": False,
        # No API token unless a builder adds one explicitly (the gateway's projected one).
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
    }
    if scheduling is not None:
        if scheduling.node_selector:
            pod_spec["nodeSelector"] = dict(scheduling.node_selector)
        if scheduling.tolerations:
            pod_spec["tolerations"] = [
                t.model_dump(by_alias=True, exclude_none=True) for t in scheduling.tolerations
            ]
    annotations = {
        CONFIG_HASH_ANNOTATION: config_hash,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
        **settings.extra_pod_annotations,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, name, lbls),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(owner.name, component)},
            "strategy": {
                "type": "RollingUpdate",
                # Keep serving capacity during a rollout: add one new pod before removing one.
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {"labels": lbls, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def _service(
    owner: Owner, name: str, component: str, role_label: str, port: int, headless: bool
) -> Manifest:
    spec: dict[str, Any] = {
        "selector": selector(owner.name, component),
        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, name, labels(owner.name, component, role_label)),
        "spec": spec,
    }


def build_role(
    spec: InferenceServiceSpec,
    owner: Owner,
    role: str,
    role_spec: RoleSpec,
    redis_url: str,
    config_hash: str,
    settings: BuildSettings,
    current_replicas: int | None = None,
) -> list[Manifest]:
    """Deployment + headless Service of one daemon role."""
    names = Names(owner.name, owner.namespace)
    volumes, mounts = _volumes(spec, names)
    if role in ("prefill", "decode"):
        stage_volume, stage_mount = kv_stage_volume()
        volumes, mounts = [*volumes, stage_volume], [*mounts, stage_mount]
    env = _merge_env(
        _common_env(spec) + _daemon_secret_env(spec) + _kv_transfer_secret_env(names) + cache_env(),
        [e.model_dump() for e in role_spec.env],
    )
    container: Manifest = {
        "name": "daemon",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy.value,
        "command": daemon_command(spec, names, role, redis_url, role_spec),
        "env": env,
        "securityContext": container_security_context(),
        # The daemon writes its fatal start-up error to /dev/termination-log; anything that
        # dies without a word still leaves the tail of its log as the message.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "ports": [{"name": "http", "containerPort": DAEMON_PORT, "protocol": "TCP"}],
        "readinessProbe": _http_probe("/ready", period=5, failures=3),
        "livenessProbe": _http_probe("/health", period=10, failures=3),
        # Loading weights can take minutes; liveness starts counting only once /health answers.
        "startupProbe": _http_probe("/health", period=5, failures=120),
        "volumeMounts": mounts,
    }
    resources = default_resources(_resources(role_spec.resources), DAEMON_RESOURCES)
    if role_device(spec, role_spec) == "cuda" and not requests_gpu(role_spec):
        # engine.device: cuda on a role that names no GPU: without the resource the
        # scheduler places the pod anywhere and the device plugin exposes no GPU to it.
        resources = {**resources, "limits": {**resources.get("limits", {}), GPU_RESOURCE: "1"}}
    container["resources"] = resources
    container["env"] = env + cpu_thread_env(resources, env)
    deploy = _deployment(
        owner,
        names.role(role),
        component=role,
        role_label=role,
        replicas=role_replicas(role_spec, current_replicas),
        container=container,
        volumes=volumes,
        config_hash=config_hash,
        settings=settings,
        grace_s=role_spec.termination_grace_period_seconds,
        scheduling=role_spec,
    )
    svc = _service(owner, names.role(role), role, role, DAEMON_PORT, headless=True)
    return [deploy, svc]


def build_gateway(
    spec: InferenceServiceSpec,
    owner: Owner,
    redis_url: str,
    config_hash: str,
    settings: BuildSettings,
    roles: list[str] | None = None,
) -> list[Manifest]:
    """The gateway's ServiceAccount + Role + RoleBinding (it watches EndpointSlices),
    Deployment and Service. ``roles``: the role pools it routes to (None: the spec's)."""
    names = Names(owner.name, owner.namespace)
    if roles is None:
        roles = [role for role, _ in spec.roles.items()]
    volumes, mounts = _volumes(spec, names)
    lbls = labels(owner.name, GATEWAY, GATEWAY)
    container: Manifest = {
        "name": "gateway",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy.value,
        "command": gateway_command(spec, names, roles, redis_url),
        "env": _merge_env(
            _common_env(spec)
            + _gateway_secret_env(spec)
            + _kv_transfer_secret_env(names)
            + cache_env(),
            [e.model_dump() for e in spec.router.env],
        ),
        "securityContext": container_security_context(),
        # The daemon writes its fatal start-up error to /dev/termination-log; anything that
        # dies without a word still leaves the tail of its log as the message.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "readinessProbe": _http_probe("/ready", period=5, failures=3),
        "livenessProbe": _http_probe("/health", period=10, failures=3),
        "volumeMounts": mounts,
    }
    container["resources"] = default_resources(_resources(spec.router.resources), GATEWAY_RESOURCES)
    token_volume, token_mount = api_token_volume()
    volumes = [*volumes, token_volume]
    container["volumeMounts"] = [*mounts, token_mount]
    deploy = _deployment(
        owner,
        names.gateway,
        component=GATEWAY,
        role_label=GATEWAY,
        replicas=spec.router.replicas,
        container=container,
        volumes=volumes,
        config_hash=config_hash,
        settings=settings,
        grace_s=spec.router.termination_grace_period_seconds,
        port=GATEWAY_PORT,
    )
    deploy["spec"]["template"]["spec"]["serviceAccountName"] = names.gateway
    svc = _service(owner, names.gateway, GATEWAY, GATEWAY, GATEWAY_PORT, headless=False)
    svc["spec"]["type"] = spec.router.service_type.value
    sa: Manifest = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(owner, names.gateway, lbls),
    }
    role: Manifest = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(owner, names.gateway, lbls),
        "rules": [
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }
    binding: Manifest = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(owner, names.gateway, lbls),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": names.gateway,
        },
        "subjects": [
            {"kind": "ServiceAccount", "name": names.gateway, "namespace": owner.namespace}
        ],
    }
    return [sa, role, binding, deploy, svc]


def build_config_map(
    spec: InferenceServiceSpec, owner: Owner, routed: list[str] | None = None
) -> Manifest:
    """``routed``: the role pools the gateway routes to (None: the spec's)."""
    names = Names(owner.name, owner.namespace)
    if routed is None:
        routed = [role for role, _ in spec.roles.items()]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, names.config, labels(owner.name, "config")),
        "data": _config_data(spec, names, routed),
    }


def build_children(
    spec: InferenceServiceSpec,
    owner: Owner,
    settings: BuildSettings,
    current_replicas: dict[str, int] | None = None,
    routed_roles: list[str] | None = None,
    old_roles: list[str] | None = None,
) -> list[Manifest]:
    """Every child of one InferenceService, in apply order (config and RBAC before the
    workloads that reference them). Raises SpecError when the spec cannot be realised.

    During a role switch (unified <-> prefill/decode) ``routed_roles`` are the pools the
    gateway routes to (None: the spec's roles) and ``old_roles`` the previous roles whose
    pods still run: they stay behind the daemons' NetworkPolicy until they are removed.
    Neither adds a role workload: the old ones are kept as they are, not rebuilt."""
    check_policy(spec, settings)
    redis_url = resolve_redis_url(spec, settings)
    spec = spec.model_copy(update={"index": effective_index(spec, settings)})
    spec_roles = [role for role, _ in spec.roles.items()]
    routed = spec_roles if routed_roles is None else routed_roles
    fenced = spec_roles + [r for r in (old_roles or []) if r not in spec_roles]
    config = build_config_map(spec, owner, routed)
    daemon_hash = _config_hash(config["data"], ("engine.json",))
    gateway_hash = _config_hash(config["data"], ("router.json",))
    current = current_replicas or {}
    out: list[Manifest] = [config]
    gateway = build_gateway(spec, owner, redis_url, gateway_hash, settings, routed)
    out += gateway[:3]  # ServiceAccount, Role, RoleBinding
    for role, role_spec in spec.roles.items():
        out += build_role(
            spec, owner, role, role_spec, redis_url, daemon_hash, settings, current.get(role)
        )
    out += gateway[3:]
    if settings.network_policies:
        out += build_network_policies(
            owner.name,
            lambda name, lbls: _meta(owner, name, lbls),
            fenced,
            list(settings.metrics_peers),
        )
    return out
