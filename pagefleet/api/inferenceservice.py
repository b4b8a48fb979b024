"""The InferenceService custom resource: spec and status as pydantic models.

These models are the single source of truth for the CRD: ``pagefleet crd`` turns them into
the structural OpenAPI schema the API server enforces, and the operator parses every
object it reconciles with them. The cross-field rules live twice on purpose — as CEL
(``x-kubernetes-validations``, enforced by the API server before anything is stored) and
as pydantic validators with the same messages (so the operator and unit tests agree with
the API server) — and a test keeps the two lists in sync.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

from pagefleet.api.body_budget import DEFAULT_MAX_INFLIGHT_BODY_MB
from pagefleet.api.limits import DEFAULT_MAX_BODY_BYTES
from pagefleet.api.openai import ToolCallParser

GROUP = "pagefleet.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["infsvc"]  # not `isvc`: that one is KServe's

DEFAULT_IMAGE = "ghcr.io/pagefleet/pagefleet:0.1.0"

# A pod's terminationGracePeriodSeconds, daemon and gateway alike: what a rollout or a
# scale-down gives open streams. The operator derives each process' drain from it.
DEFAULT_TERMINATION_GRACE_S = 60
# The least grace that leaves a drain at all after each process' own shutdown steps (the
# daemon keeps 15 s of its grace for those, the gateway 10 s).
MIN_TERMINATION_GRACE_S = 20
MAX_TERMINATION_GRACE_S = 3600


def _finite(value: int | float | str) -> int | float | str:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a resource quantity must be finite, got {value}")
    return value


# Kubernetes resource quantities: a number or a string ("2", 2, 0.5, "500m", "4Gi"), as a
# Pod's resources take them. int-or-string in the CRD would refuse `cpu: 0.5`, which every
# Pod accepts; an untyped field (preserve-unknown-fields) lets the number through, and the
# model checks it.
Quantity = Annotated[
    int | float | str,
    AfterValidator(_finite),
    WithJsonSchema({"x-kubernetes-preserve-unknown-fields": True}),
]


class _Model(BaseModel):
    """camelCase on the wire (Kubernetes convention), snake_case in Python."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
    )


class CelRule:
    """One cross-field rule, enforced by the API server (CEL) and by pydantic alike."""

    __slots__ = ("message", "optional_old_self", "rule")

    def __init__(self, rule: str, message: str, optional_old_self: bool = False) -> None:
        self.rule = rule
        self.message = message
        # Evaluated on create too, with `oldSelf` an optional (empty on create); a rule
        # that reads `oldSelf` without this is evaluated on updates only.
        self.optional_old_self = optional_old_self

    def as_schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "message": self.message}
        if self.optional_old_self:
            out["optionalOldSelf"] = True
        return out


def _cel(*rules: CelRule) -> dict[str, Any]:
    return {"x-kubernetes-validations": [r.as_schema() for r in rules]}


# ----------------------------------------------------------------------------------- name

# Children are named `<name>-<suffix>` (pagefleet.operator.naming), and Services must be
# DNS-1035 labels of at most 63 characters: the longest suffix, "-gateway" (as "-unified"
# and "-prefill"), leaves 55. Label values (the name itself) fit 63 as well. The API server
# allows far more in a custom resource's name (a DNS-1123 subdomain: dots, 253 characters).
# The rule judges creation only (`oldSelf.hasValue()` on every update: a name never changes).
# A root rule is not ratcheted: an object stored before the rule existed would otherwise
# fail it on every write, the finalizer's removal included, and hang in Terminating forever.
MAX_NAME_LENGTH = 55
_DNS1035_LABEL = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_RULE = CelRule(
    f"oldSelf.hasValue() || (self.metadata.name.size() <= {MAX_NAME_LENGTH}"
    f" && self.metadata.name.matches('{_DNS1035_LABEL}'))",
    f"metadata.name must be at most {MAX_NAME_LENGTH} characters of lowercase letters, digits "
    "and '-', starting with a letter and ending with a letter or digit (no '.'): the operator "
    "names the Services it creates after it; recreate the InferenceService under such a name",
    optional_old_self=True,
)


def name_problem(name: str) -> str | None:
    """NAME_RULE's message when `name` breaks it, else None (the API server checks the same
    rule at creation; the operator checks again for objects stored before the rule)."""
    if len(name) <= MAX_NAME_LENGTH and re.fullmatch(_DNS1035_LABEL, name):
        return None
    return f"{NAME_RULE.message} (got {name!r}, {len(name)} characters)"


# ---------------------------------------------------------------------------------- model


class PVCSource(_Model):
    claim_name: str = Field(min_length=1)
    """Name of a PersistentVolumeClaim in the InferenceService's namespace that holds the
    model."""
    read_only: bool = True
    """Mount the claim read-only."""


# Directories the operator mounts its own volumes at in the daemon and gateway containers
# (pagefleet.operator.hardening and builders; a test keeps the two in sync). The model
# volume may sit at none of them, nor above or below one: the kubelet cannot mount two
# volumes at one path, and server-side apply refuses a container that lists it twice.
RESERVED_MOUNT_PATHS = (
    "/tmp",
    "/var/cache/pagefleet",
    "/etc/pagefleet",
    "/dev/shm",
    "/var/run/secrets/kubernetes.io/serviceaccount",
)
# An absolute path in its plain form: no empty, `.` or `..` segment, no trailing slash.
# ([.] rather than a backslash escape, which a CEL string literal would not take.)
_PLAIN_PATH = "^(/([^/.][^/]*|[.][^/.][^/]*|[.][.][^/]+))+$"
MOUNT_PATH_PLAIN = CelRule(
    f"self.mountPath.matches('{_PLAIN_PATH}')",
    "model.source.mountPath must be an absolute directory path without empty, '.' or '..' "
    "segments or a trailing '/' (e.g. /models)",
)
MOUNT_PATH_FREE = CelRule(
    "!(has(self.persistentVolumeClaim) || has(self.hostPath)) || ["
    + ", ".join(f"'{p}'" for p in RESERVED_MOUNT_PATHS)
    + "].all(r, self.mountPath != r && !self.mountPath.startsWith(r + '/')"
    " && !r.startsWith(self.mountPath + '/'))",
    "model.source.mountPath must not be, contain or lie under a directory the operator "
    "mounts its own volumes at (" + ", ".join(RESERVED_MOUNT_PATHS) + "); use e.g. /models",
)


def _overlaps(a: str, b: str) -> bool:
    """Whether directory `a` is `b`, or lies under or above it."""
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


class ModelSource(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            CelRule(
                "!(has(self.persistentVolumeClaim) && has(self.hostPath))",
                "model.source: set at most one of persistentVolumeClaim and hostPath",
            ),
            CelRule(
                "!(has(self.persistentVolumeClaim) || has(self.hostPath))"
                " || self.path == self.mountPath || self.path.startsWith(self.mountPath + '/')",
                "model.source.path must lie under model.source.mountPath when a volume "
                "(persistentVolumeClaim or hostPath) is mounted",
            ),
            MOUNT_PATH_PLAIN,
            MOUNT_PATH_FREE,
        )
    )

    path: str = Field(min_length=1, max_length=4096)
    """Directory of the Hugging Face checkpoint as the daemon sees it (config.json,
    *.safetensors, tokenizer files), a GGUF file (or a directory holding one), or a
    built-in preset name such as `tiny` or `smollm2-135m`."""
    persistent_volume_claim: PVCSource | None = None
    """Mount this PersistentVolumeClaim at mountPath (read-only by default)."""
    host_path: str | None = None
    """Mount this directory of the node at mountPath (single-node or pre-seeded nodes)."""
    mount_path: str = Field(default="/models", min_length=1, max_length=4096, pattern="^/")
    """Where the model volume is mounted in the daemon and gateway containers."""

    @model_validator(mode="after")
    def _one_volume(self) -> ModelSource:
        if self.persistent_volume_claim is not None and self.host_path is not None:
            raise ValueError("model.source: set at most one of persistentVolumeClaim and hostPath")
        has_volume = self.persistent_volume_claim is not None or self.host_path is not None
        inside = self.path == self.mount_path or self.path.startswith(self.mount_path + "/")
        if has_volume and not inside:
            raise ValueError(
                "model.source.path must lie under model.source.mountPath when a volume "
                "(persistentVolumeClaim or hostPath) is mounted"
            )
        if re.fullmatch(_PLAIN_PATH, self.mount_path) is None:
            raise ValueError(MOUNT_PATH_PLAIN.message)
        if has_volume and any(_overlaps(self.mount_path, r) for r in RESERVED_MOUNT_PATHS):
            raise ValueError(MOUNT_PATH_FREE.message)
        return self


class Dtype(StrEnum):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class ModelSpec(_Model):
    source: ModelSource
    """Where the checkpoint comes from."""
    served_model_name: str | None = Field(default=None, min_length=1)
    """Model name clients send in the OpenAI `model` field; defaults to the
    InferenceService's name."""
    dtype: Dtype = Dtype.AUTO
    """Weight and activation dtype (`auto` takes the checkpoint's)."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Longest prompt + completion in tokens; defaults to the model's context length."""


# --------------------------------------------------------------------------------- engine


class EngineDevice(StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class EngineSpec(_Model):
    device: EngineDevice = EngineDevice.AUTO
    """Where the daemons run the model: `cuda` (bfloat16 by default, Triton attention, KV
    pool sized by gpuMemoryUtilization), `cpu`, or `auto`: cuda for a role whose resources
    name `nvidia.com/gpu`, cpu otherwise."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """On cuda: share of the GPU's total memory this daemon may fill (weights, activations
    and the KV pool, which gets what is left of it after loading); numGPUBlocks overrides."""
    block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV block (also the granularity of prefix matching in the index)."""
    kv_cache_memory_mb: int = Field(default=256, ge=1, alias="kvCacheMemoryMB")
    """Memory for the paged KV cache per daemon, in MiB (on cpu; on cuda the pool is sized by
    gpuMemoryUtilization)."""
    num_gpu_blocks: int | None = Field(default=None, ge=1, alias="numGPUBlocks")
    """KV cache size in blocks per daemon; overrides kvCacheMemoryMB when set."""
    max_num_seqs: int = Field(default=64, ge=1)
    """Most sequences in one engine step (running batch size)."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Token budget of one engine step (prefill chunks plus decodes). Unset: each role's
    daemon default, 2048 for unified and prefill, 2 x maxNumSeqs for decode (its new
    prompts join a few at a time instead of one long step that stalls every stream)."""
    long_prefill_token_threshold: int = Field(default=256, ge=0)
    """Most prompt tokens one request prefills per step (chunked prefill; 0: no cap, a
    prompt up to the step budget in one step). Requests that arrive while a long prompt
    prefills join at its next chunk instead of waiting out the whole prompt."""
    enable_prefix_caching: bool = True
    """Reuse cached KV blocks of identical prompt prefixes."""
    tool_call_parser: ToolCallParser = "none"
    """How the daemons read tool calls out of the model's text when a chat request has tools
    and tool_choice "auto": `hermes` (<tool_call>{...}</tool_call>), `llama3_json` (the
    whole output one JSON call), `pythonic` ([f(a=1), g()]), `mistral` ([TOOL_CALLS] then
    the calls), or `none` (the text is returned as content). Pick the format the model was
    trained to write; a forced tool_choice works with any."""


# ---------------------------------------------------------------------------------- roles


class AutoscalingSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            CelRule(
                "self.minReplicas <= self.maxReplicas",
                "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
            )
        )
    )

    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas the autoscaler may leave running."""
    max_replicas: int = Field(ge=1)
    """Most replicas the autoscaler may start."""
    interval_seconds: float = Field(default=15.0, ge=1)
    """How often the autoscaler decides for this role (never more often than the
    operator's --autoscale-seconds timer)."""
    scale_up_window_seconds: float = Field(default=30.0, ge=0)
    """After any scaling of the role, leave it alone this long (new replicas need time to
    show their effect in the metrics)."""
    scale_down_window_seconds: float = Field(default=300.0, ge=0)
    """A scale-down goes no lower than the highest recommendation of this window, so a
    dip shorter than it removes nothing (no flapping on a steady, noisy load)."""
    max_scale_up_step: int = Field(default=2, ge=1)
    """Most replicas added by one decision."""
    max_scale_down_step: int = Field(default=1, ge=1)
    """Most replicas removed by one decision."""
    target_utilization: float = Field(default=1.0, gt=0, le=1)
    """Share of a replica's learned capacity at the SLO to plan for. That capacity already
    is what one replica serves while the SLO's percentile holds (learned from the pods),
    and scale-up leads rising load by replicaStartupSeconds, so 1.0 needs no extra margin;
    lower it for headroom against bursts shorter than a replica's start-up."""
    replica_startup_seconds: float = Field(default=60.0, ge=0)
    """How long a new replica takes from being asked for to serving (scheduling, image,
    model load). Scale-up plans for the load this far ahead on a rising trend; 0 turns
    the forecast off."""
    prefill_tokens_per_second: float | None = Field(default=None, gt=0)
    """Starting estimate of one replica's uncached prompt tokens/s at the TTFT target; the
    autoscaler corrects it from what the pods report. Unset: learned from scratch."""
    decode_tokens_per_second: float | None = Field(default=None, gt=0)
    """Starting estimate of one replica's generated tokens/s at the TPOT target."""

    @model_validator(mode="after")
    def _min_le_max(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas must not exceed autoscaling.maxReplicas")
        return self


class ResourceRequirements(_Model):
    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Minimum resources per pod (e.g. cpu: 2, memory: 8Gi, nvidia.com/gpu: 1)."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources per pod."""


TOLERATION_RULES = (
    CelRule(
        "(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
        "toleration: an empty key needs operator Exists (it then tolerates every taint); "
        "set key, or operator: Exists",
    ),
    CelRule(
        "!(has(self.operator) && self.operator == 'Exists') || !has(self.value)"
        " || self.value == ''",
        "toleration: value must be empty when operator is Exists (use operator: Equal to "
        "match a value)",
    ),
    CelRule(
        "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "toleration: tolerationSeconds applies only to effect NoExecute",
    ),
)


class Toleration(_Model):
    """Checked as the API server checks a pod's tolerations, so that a bad one is refused
    with the InferenceService rather than with every Deployment built from it."""

    model_config = ConfigDict(json_schema_extra=_cel(*TOLERATION_RULES))

    key: str | None = None
    """Taint key the toleration applies to; empty with operator Exists matches all."""
    operator: str | None = Field(default=None, pattern="^(Exists|Equal)$")
    """Exists or Equal (default Equal)."""
    value: str | None = None
    """Taint value to match when operator is Equal."""
    effect: str | None = Field(default=None, pattern="^(NoSchedule|PreferNoSchedule|NoExecute)$")
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: int | None = None
    """How long a NoExecute toleration keeps the pod bound after the taint appears."""

    @model_validator(mode="after")
    def _as_the_api_server(self) -> Toleration:
        broken = (  # one per rule, in TOLERATION_RULES' order
            not self.key and self.operator != "Exists",
            self.operator == "Exists" and bool(self.value),
            self.toleration_seconds is not None and self.effect != "NoExecute",
        )
        for rule, wrong in zip(TOLERATION_RULES, broken, strict=True):
            if wrong:
                raise ValueError(rule.message)
        return self


class EnvVar(_Model):
    name: str = Field(min_length=1, max_length=256)
    """Environment variable name."""
    value: str = ""
    """Environment variable value."""


# Variables the operator itself sets from the pod's identity or from Secrets the spec names
# elsewhere: a user value would break the daemon's identity in the index or bypass the
# secretKeyRef (the names pagefleet.operator.builders and pagefleet.kvindex.redis_auth use).
RESERVED_ENV_NAMES = (
    "POD_IP",
    "POD_NAME",
    "POD_NAMESPACE",
    "PAGEFLEET_API_KEYS",
    "PAGEFLEET_ADMIN_TOKEN",
    "PAGEFLEET_REDIS_USERNAME",
    "PAGEFLEET_REDIS_PASSWORD",
    "PAGEFLEET_KV_TRANSFER_SECRET",
)
MAX_ENV = 128  # bounds the CEL rules' cost (the API server refuses an unbounded estimate)
ENV_UNIQUE = CelRule(
    "self.all(e, self.exists_one(f, f.name == e.name))",
    "env: each variable name may appear only once",
)
ENV_RESERVED = CelRule(
    "self.all(e, !(e.name in [" + ", ".join(f"'{n}'" for n in RESERVED_ENV_NAMES) + "]))",
    "env: " + ", ".join(RESERVED_ENV_NAMES) + " are set by the operator; set credentials "
    "with index.passwordSecretRef, index.username, router.apiKeysSecret or adminTokenSecret",
)


def _check_env(env: list[EnvVar]) -> list[EnvVar]:
    names = [e.name for e in env]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{ENV_UNIQUE.message} (repeated: {', '.join(repeated)})")
    reserved = [n for n in names if n in RESERVED_ENV_NAMES]
    if reserved:
        raise ValueError(f"{ENV_RESERVED.message} (got: {', '.join(reserved)})")
    return env


# Extra variables of a container; the operator's own defaults (cache directories, TMPDIR)
# give way to a user value of the same name.
EnvList = Annotated[
    list[EnvVar],
    AfterValidator(_check_env),
    Field(max_length=MAX_ENV, json_schema_extra=_cel(ENV_UNIQUE, ENV_RESERVED)),
]


class RoleSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            CelRule(
                "!(has(self.replicas) && has(self.autoscaling))",
                "a role sets either replicas or autoscaling, not both",
            )
        )
    )

    replicas: int | None = Field(default=None, ge=0)
    """Fixed number of daemon pods (1 when neither replicas nor autoscaling is set)."""
    autoscaling: AutoscalingSpec | None = None
    """Let the autoscaler choose the replicas within these bounds (instead of replicas)."""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    """CPU, memory and accelerator requests/limits of each daemon pod."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Schedule the role's pods only on nodes with these labels."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the role's pods tolerate (e.g. dedicated GPU nodes)."""
    env: EnvList = Field(default_factory=list)
    """Extra environment variables for the daemon container (a name the operator sets too,
    such as HF_HOME or TMPDIR, takes the value given here)."""
    cost_per_hour: float | None = Field(default=None, ge=0)
    """Dollars per hour one of this role's pods costs; its daemons then report cost per 1M
    input and output tokens on /metrics (pagefleet:cost_per_million_*_tokens_dollars)."""
    termination_grace_period_seconds: int = Field(
        default=DEFAULT_TERMINATION_GRACE_S,
        ge=MIN_TERMINATION_GRACE_S,
        le=MAX_TERMINATION_GRACE_S,
    )
    """Seconds a daemon pod gets to stop when a rollout or scale-down removes it. Its daemon
    exits within this less 5 s (--shutdown-timeout), and lets open requests finish for this
    less 15 s (--drain-timeout) before it aborts them; raise it for generations that stream
    longer than that."""

    @model_validator(mode="after")
    def _replicas_xor_autoscaling(self) -> RoleSpec:
        if self.replicas is not None and self.autoscaling is not None:
            raise ValueError("a role sets either replicas or autoscaling, not both")
        return self


class RolesSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            CelRule(
                "has(self.unified) != (has(self.prefill) || has(self.decode))",
                "roles: set either unified, or prefill and decode (disaggregated), not both",
            ),
            CelRule(
                "has(self.prefill) == has(self.decode)",
                "roles: prefill and decode must be set together",
            ),
        )
    )

    unified: RoleSpec | None = None
    """One pool of daemons doing both prefill and decode."""
    prefill: RoleSpec | None = None
    """Daemons that compute prompt KV and hand it to decode daemons (with decode)."""
    decode: RoleSpec | None = None
    """Daemons that pull prompt KV from prefill daemons and generate tokens (with prefill)."""

    @model_validator(mode="after")
    def _one_mode(self) -> RolesSpec:
        disagg = self.prefill is not None or self.decode is not None
        if (self.unified is not None) == disagg:
            raise ValueError(
                "roles: set either unified, or prefill and decode (disaggregated), not both"
            )
        if (self.prefill is None) != (self.decode is None):
            raise ValueError("roles: prefill and decode must be set together")
        return self

    def items(self) -> list[tuple[str, RoleSpec]]:
        """(role name, spec) of every role that is set, in a fixed order."""
        out = [("unified", self.unified), ("prefill", self.prefill), ("decode", self.decode)]
        return [(name, spec) for name, spec in out if spec is not None]


# --------------------------------------------------------------------------------- router


class RoutingPolicy(StrEnum):
    CACHE_AWARE = "cache_aware"
    LEAST_LOAD = "least_load"
    ROUND_ROBIN = "round_robin"
    SESSION = "session"


class ServiceType(StrEnum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class APIKeysSecretRef(_Model):
    name: str = Field(min_length=1)
    """Secret in the InferenceService's namespace."""
    key: str = Field(default="api-keys", min_length=1)
    """Key in the Secret whose value is the client API keys, comma separated."""


class AdminTokenSecretRef(_Model):
    name: str = Field(min_length=1)
    """Secret in the InferenceService's namespace."""
    key: str = Field(default="token", min_length=1)
    """Key in the Secret whose value is the admin token."""


class RouterSpec(_Model):
    replicas: int = Field(default=1, ge=0)
    """Gateway pods (the gateway is stateless; its prefix view lives in the index)."""
    policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    """How the gateway picks a daemon for each request."""
    weights: dict[str, float] = Field(default_factory=dict)
    """Cost weights of the cache_aware policy by name, passed to the gateway's --weights
    (e.g. prefill: 1, queue: 0.25, kv: 0.5, imbalance_abs: 4)."""
    service_type: ServiceType = ServiceType.CLUSTER_IP
    """Type of the gateway Service."""
    pd_min_uncached_tokens: int = Field(default=256, ge=0)
    """Prefill/decode roles only: the gateway prefills a request on a prefill pod when the
    chosen decode pod would otherwise compute at least this many prompt tokens (its cached
    prefix aside); shorter ones the decode pod prefills itself (--pd-min-uncached-tokens)."""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    """CPU and memory requests/limits of each gateway pod."""
    env: EnvList = Field(default_factory=list)
    """Extra environment variables for the gateway container (a name the operator sets too
    takes the value given here)."""
    api_keys_secret: APIKeysSecretRef | None = None
    """Secret with the client API keys: the gateway then answers 401 to requests without
    `Authorization: Bearer <key>` (/health, /ready, /metrics stay open). Unset: no keys."""
    first_byte_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    """Streams: seconds from forwarding a request to its first byte; past it the daemon
    counts as hung, is skipped for a while, and the request moves to another daemon."""
    inter_chunk_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Streams: the longest silence between two chunks; past it the daemon counts as hung and
    the client gets an error event (never a stream that merely stops)."""
    request_timeout_seconds: float = Field(default=600.0, gt=0, le=86400)
    """Non-streamed requests: seconds for the whole answer (raise it for long generations
    that are not streamed: past it the client gets a 504)."""
    max_concurrency: int = Field(default=1024, ge=1)
    """Requests each gateway pod serves at once; past it, 429 with Retry-After."""
    body_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Seconds a request body may take to arrive after its headers; past it, a 408 (raise
    it for clients that upload long prompts over slow links)."""
    client_write_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Seconds a client may leave sent bytes unread before the gateway cuts it (and a
    stream's daemon request with it)."""
    keepalive_timeout_seconds: float = Field(default=75.0, gt=0, le=86400)
    """Seconds an idle client connection, or one still sending its headers, is kept open;
    keep it above the idle timeout of a load balancer in front (GCP's: 600 s), else the
    gateway closes connections the balancer still reuses."""
    max_response_bytes: int = Field(default=256 << 20, ge=1024, le=1 << 32)
    """Largest non-streamed answer, in bytes, a gateway pod holds to relay; past it, a 502
    (streams are passed through, not held). Each held answer costs that much memory."""
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024, le=1 << 30)
    """Largest request body, in bytes, for the gateway and every daemon alike (their
    --max-body-bytes); past it, a 413. Raise it for long prompts sent as token ids or large
    chat histories (a 128k-token prompt as JSON token ids is about 1 MB). Each body being
    read costs that much memory; changing it rolls the daemons and the gateway."""
    max_inflight_body_mb: int = Field(default=DEFAULT_MAX_INFLIGHT_BODY_MB, ge=1, le=1 << 20)
    """MiB of request bodies each gateway pod and each daemon holds at once (never less
    than one body of maxBodyBytes); a request that would pass it is a 503 with Retry-After,
    decided before its body is read (their --max-inflight-body-mb). Under a flood of large
    bodies a pod's memory grew by about 1.5 times this: size its memory limit to fit."""
    termination_grace_period_seconds: int = Field(
        default=DEFAULT_TERMINATION_GRACE_S,
        ge=MIN_TERMINATION_GRACE_S,
        le=MAX_TERMINATION_GRACE_S,
    )
    """Seconds a gateway pod gets to stop when a rollout (any router change) or a scale-down
    removes it. Its open streams may finish for this less 10 s (--drain-timeout); longer
    ones are cut. Raise it for generations that stream longer than that."""


# ---------------------------------------------------------------------------------- index


class SecretKeyRef(_Model):
    name: str = Field(min_length=1)
    """Secret in the InferenceService's namespace."""
    key: str = Field(default="password", min_length=1)
    """Key in the Secret whose value is the Redis password."""


class RedisUser(_Model):
    username: str = Field(min_length=1)
    """Redis ACL user."""
    password_secret_ref: SecretKeyRef | None = None
    """Secret holding that user's password."""


class IndexSpec(_Model):
    redis_url: str | None = Field(default=None, pattern="^rediss?://", alias="redisURL")
    """Redis of the global prefix index, e.g. redis://redis.infra:6379/0 (rediss:// for
    TLS); empty means the bundled Redis the operator was installed with. Never put a
    password in the URL: use passwordSecretRef."""
    username: str | None = Field(default=None, min_length=1)
    """Redis ACL user of the daemons (they write the index); unset: the default user."""
    password_secret_ref: SecretKeyRef | None = None
    """Secret holding the Redis password (kept out of the spec and the pod command)."""
    gateway_user: RedisUser | None = None
    """A read-only Redis ACL user for the gateway, which only looks up (see
    docs/operator.md for the ACL line); unset: the gateway uses the daemons' user."""


# ------------------------------------------------------------------------------------ SLO


class SLOSpec(_Model):
    ttft_ms: float = Field(default=2000.0, gt=0)
    """Target time to first token, in milliseconds, at the given percentile."""
    tpot_ms: float = Field(default=100.0, gt=0)
    """Target time per output token (inter-token latency), in milliseconds."""
    percentile: float = Field(default=95.0, ge=50, le=99.99)
    """Latency percentile the targets apply to (e.g. 95 for p95)."""


# ---------------------------------------------------------------------------------- spec


class PullPolicy(StrEnum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class InferenceServiceSpec(_Model):
    """Desired state of one served model: its daemons, gateway, index and SLOs."""

    model: ModelSpec
    """The model to serve."""
    image: str = Field(default=DEFAULT_IMAGE, min_length=1)
    """Container image with the pagefleet command (daemon and gateway)."""
    image_pull_policy: PullPolicy = PullPolicy.IF_NOT_PRESENT
    """When the kubelet pulls the image."""
    command: list[str] = Field(default_factory=lambda: ["pagefleet"], min_length=1)
    """Entrypoint that runs `pagefleet` in the image (override when it is elsewhere, e.g.
    a virtualenv's bin/pagefleet)."""
    engine: EngineSpec = Field(default_factory=EngineSpec)
    """Paged KV engine knobs shared by every role."""
    roles: RolesSpec = Field(default_factory=lambda: RolesSpec(unified=RoleSpec()))
    """Daemon pools: unified, or prefill + decode."""
    router: RouterSpec = Field(default_factory=RouterSpec)
    """The cache-aware gateway in front of the daemons."""
    index: IndexSpec = Field(default_factory=IndexSpec)
    """The Redis-backed global prefix index."""
    slo: SLOSpec | None = None
    """Latency targets the autoscaler holds autoscaled roles to. Unset: no targets, and the
    autoscaler holds each autoscaled role at its count (reason SLOMissing); `slo: {}` takes
    the default targets."""
    admin_token_secret: AdminTokenSecretRef | None = None
    """Secret with the admin token that the gateway and the daemons require on their
    admin endpoints (/reset_prefix_cache, /get_server_info). Unset: a gateway with API keys
    refuses them; a daemon's are reachable from the gateway only (NetworkPolicy)."""


# --------------------------------------------------------------------------------- status


class Condition(_Model):
    type: str
    """Ready, Progressing, Degraded, or <Role>Ready."""
    status: str = Field(pattern="^(True|False|Unknown)$")
    """True, False or Unknown."""
    reason: str = ""
    """One CamelCase word for machines."""
    message: str = ""
    """What happened and, when something is wrong, what to do."""
    last_transition_time: str | None = None
    """When status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The spec generation this condition describes."""


class AutoscalingStatus(_Model):
    desired_replicas: int = 0
    """Replicas the autoscaler's last decision asked for."""
    current_replicas: int = 0
    """Replicas the role's Deployment asked for when it decided."""
    recommended_replicas: int | None = None
    """What the measured load alone asks for, before windows, steps and bounds."""
    last_scale_time: str | None = None
    """When the autoscaler last changed the replicas (RFC 3339)."""
    last_decision_time: str | None = None
    """When the autoscaler last decided (RFC 3339)."""
    reason: str = ""
    """ScaledUp, ScaledDown, Steady, ScaleUpStabilizing, ScaleDownStabilizing,
    WaitingForReplicas, InputsUnknown, InputsPartial, SLOMissing or CapacityUnknown."""
    message: str = ""
    """The decision with the inputs it was made from."""
    prefill_tokens_per_second: float | None = None
    """Learned uncached prompt tokens/s one replica does at the TTFT target."""
    decode_tokens_per_second: float | None = None
    """Learned generated tokens/s one replica does at the TPOT target."""


class RoleStatus(_Model):
    name: str
    """Role name: unified, prefill or decode."""
    desired_replicas: int = 0
    """Replicas the role's Deployment asks for."""
    ready_replicas: int = 0
    """Pods passing their readiness probe."""
    updated_replicas: int = 0
    """Pods running the current pod template."""
    autoscaling: AutoscalingStatus | None = None
    """The autoscaler's last decision for this role (roles with spec autoscaling only)."""


class InferenceServiceStatus(_Model):
    observed_generation: int | None = None
    """The metadata.generation the operator last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Progressing, Degraded and one <Role>Ready per role."""
    roles: list[RoleStatus] = Field(default_factory=list)
    """Per-role replica counts from the role Deployments."""
    ready_roles: str = ""
    """Ready roles over roles, e.g. 1/1 (for kubectl get)."""
    replicas: str = ""
    """Ready/desired pods per role, e.g. prefill:1/1 decode:2/2 (for kubectl get)."""
    url: str = ""
    """In-cluster OpenAI-compatible base URL of the gateway."""


def parse_spec(spec: dict[str, Any]) -> InferenceServiceSpec:
    """Validate a spec dict as stored by the API server (camelCase keys)."""
    return InferenceServiceSpec.model_validate(spec)
