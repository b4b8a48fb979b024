"""The role autoscaler's control loop: observe the pods, decide (planner), act, report.

Run by a kopf timer per InferenceService (pagefleet/operator/handlers.py). For each role
with ``autoscaling`` whose interval has passed it

1. lists the role's pods and reads, concurrently, every Ready pod's /metrics and the Redis
   heartbeats (signals.py, collect.py); a pod that does not answer is unknown, never idle;
2. asks the pure planner (planner.py) for the desired replicas, with the state it keeps per
   role in memory (learned capacity, recommendation history, last scale time);
3. before lowering the count, marks the cheapest pod to lose (not Ready, else fewest cached
   blocks in the index, else fewest requests) with ``controller.kubernetes.io/
   pod-deletion-cost`` so the ReplicaSet removes that one (its daemon drains on SIGTERM);
4. writes the Deployment's replicas, ``status.roles[*].autoscaling``, the ``ScalingActive``
   condition, an Event for every change (and for every change of reason), and the
   operator's metrics.

Failures of any input become the ``ScalingActive=False`` condition and hold the count; an
API error is logged and retried at the next tick; nothing here raises into kopf.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from pagefleet.api.inferenceservice import InferenceServiceSpec, RoleSpec, SLOSpec, parse_spec
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.redis_auth import RedisCredentials
from pagefleet.operator.builders import (
    BUNDLED_GATEWAY_USER,
    BuildSettings,
    SpecError,
    resolve_redis_url,
)
from pagefleet.operator.collect import PodTarget, gather_inputs
from pagefleet.operator.kube import (
    DEPLOYMENT,
    INFERENCE_SERVICE,
    POD,
    SECRET,
    KubeAPI,
    KubeError,
)
from pagefleet.operator.metrics import OperatorMetrics
from pagefleet.operator.naming import (
    DAEMON_PORT,
    GATEWAY,
    GATEWAY_PORT,
    LABEL_COMPONENT,
    LABEL_ROLE,
    LABEL_SERVICE,
    Names,
)
from pagefleet.operator.planner import Decision, PlannerConfig, PlannerState, Reason, decide
from pagefleet.operator.promql import role_inputs
from pagefleet.operator.signals import (
    WARMING,
    Arrivals,
    PodReport,
    PodSnapshot,
    RoleInputs,
    delta,
    gateway_arrivals,
    observe_role,
    parse_gateway_metrics,
    restarted,
)
from pagefleet.operator.status import condition
from pagefleet.operator.victims import (
    clear_marks,
    mark_victims,
    pod_ready,
    scale_down_settled,
)

log = logging.getLogger(__name__)

Manifest = dict[str, Any]
Recorder = Callable[[str, str, str], None]

SCALING_ACTIVE = "ScalingActive"
SCALING_FAILED = "ScalingFailed"
# Reasons that mean the planner could not trust its inputs.
_BLIND = {Reason.UNKNOWN_INPUTS, Reason.PARTIAL_INPUTS, Reason.NO_SLO}
# Reasons for keeping the count on known inputs. A load near a boundary moves a steady
# fleet between them every few passes (Steady <-> ScaleDownStabilizing): the status says
# which; an Event per move was one nearly every pass.
_HOLDING = {
    Reason.STEADY.value,
    Reason.UP_WINDOW.value,
    Reason.DOWN_WINDOW.value,
    Reason.WAITING_FOR_REPLICAS.value,
    Reason.CAPACITY_UNKNOWN.value,
}
_MOVES = {
    r.value for r in (Reason.SCALED_UP, Reason.SCALED_DOWN, Reason.BELOW_MIN, Reason.ABOVE_MAX)
}


def _newsworthy(decision: Decision, last_reason: str) -> bool:
    """Post an Event: every change of the count; every other change of reason, except from
    one holding reason (or a change just announced) to a holding reason."""
    reason = decision.reason.value
    if decision.changed:
        return True
    if reason == last_reason:
        return False
    return reason not in _HOLDING or last_reason not in _HOLDING | _MOVES


@dataclass(frozen=True, slots=True)
class AutoscalerSettings:
    """Operator-wide autoscaler knobs (command-line flags)."""

    scrape_timeout_s: float = 2.0
    # Rates and percentiles span this much history (like PromQL's rate[window]): a tick
    # shorter than a request would otherwise read a busy pod as idle between finishes.
    rate_window_s: float = 30.0
    # Query this Prometheus for the inputs instead of scraping every pod (promql.py).
    prometheus_url: str | None = None
    metrics_port: int = DAEMON_PORT
    gateway_metrics_port: int = GATEWAY_PORT  # the gateways' /metrics (arrival counters)
    # Password of the bundled Redis' read-only user (pf-gateway), for services on it; the
    # chart passes it from its Secret (a service on its own Redis: the operator gets the Secret
    # its spec names, see _redis_credentials).
    default_redis_password: str | None = field(default=None, repr=False)


@dataclass(slots=True)
class RoleMemory:
    """What the autoscaler keeps per (namespace, service, role) between ticks."""

    state: PlannerState = field(default_factory=PlannerState)
    # pod uid -> its scrapes within the rate window, oldest first
    snapshots: dict[str, list[PodSnapshot]] = field(default_factory=dict)
    last_decision: float | None = None  # monotonic
    last_reason: str = ""
    last_scale_wall: str | None = None
    # The error of the last pass's failed write (None: it succeeded): one Event per new
    # error, not one per pass while the same refusal lasts.
    last_failure: str | None = None
    # What the learned capacities are capacities at: the SLO targets and the spec's hints
    # they were learned from (None: not known yet, keep them).
    capacity_basis: tuple[float | None, ...] | None = None
    # The latest decision as ScalingActive sees it (every autoscaled role counts, decided
    # in this pass or not): its reason, why it could not be applied, what it could not see.
    reason_note: str = ""
    failure_note: str | None = None
    blind_note: tuple[str, tuple[str, ...]] | None = None


@dataclass(slots=True)
class RoleOutcome:
    role: str
    decision: Decision
    inputs: RoleInputs
    victims: list[str] = field(default_factory=list)  # marked to go, cheapest first
    failure: str | None = None  # the decision could not be applied: why
    last_scale_before: float | None = None  # the planner's last scale time before deciding

    @property
    def victim(self) -> str | None:
        """The cheapest of the pods a scale-down removes."""
        return self.victims[0] if self.victims else None

    @property
    def blind(self) -> bool:
        """The planner could not trust its inputs for a reason a person should see (a pod
        merely on its first scrape is not one)."""
        if self.decision.reason not in _BLIND:
            return False
        if self.decision.reason == Reason.NO_SLO:
            return True
        return any(p.error != WARMING for p in self.inputs.unknown)


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ready_for_s(pod: Manifest, wall: datetime) -> float | None:
    """How long the pod has been Ready (None: not Ready, or no transition time)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") == "True":
            return _rfc3339_age(c.get("lastTransitionTime"), wall)
    return None


def slo_targets(spec: InferenceServiceSpec) -> SLOSpec:
    """spec.slo, or the default targets when it is unset: the pods' latencies are still
    read at a percentile, though the planner then gets no targets (has_slo is False)."""
    return spec.slo if spec.slo is not None else SLOSpec()


def planner_config(
    role: str, spec: InferenceServiceSpec, has_slo: bool, observation_window_s: float = 30.0
) -> PlannerConfig:
    """The planner's view of one autoscaled role (bounds, windows, SLO, engine limits);
    ``observation_window_s``: the span of the rates and percentiles it is fed."""
    auto = dict(spec.roles.items())[role].autoscaling
    assert auto is not None, f"role {role} has no autoscaling"
    slo = slo_targets(spec)
    return PlannerConfig(
        role=role,
        min_replicas=auto.min_replicas,
        max_replicas=auto.max_replicas,
        ttft_s=slo.ttft_ms / 1000 if has_slo else None,
        tpot_s=slo.tpot_ms / 1000 if has_slo else None,
        slo_quantile=slo.percentile / 100 if has_slo else 0.95,
        max_num_seqs=spec.engine.max_num_seqs,
        target_utilization=auto.target_utilization,
        scale_up_window_s=auto.scale_up_window_seconds,
        scale_down_window_s=auto.scale_down_window_seconds,
        max_step_up=auto.max_scale_up_step,
        max_step_down=auto.max_scale_down_step,
        prefill_capacity_hint=auto.prefill_tokens_per_second,
        decode_capacity_hint=auto.decode_tokens_per_second,
        observation_window_s=observation_window_s,
        startup_s=auto.replica_startup_seconds,
    )


def _rfc3339_age(stamp: object, wall: datetime) -> float | None:
    """Seconds from an RFC 3339 UTC stamp (as _now_rfc3339 writes) to ``wall``; None when
    it is not one. Never negative (a clock stepped back)."""
    try:
        then = datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None
    return max(0.0, (wall - then).total_seconds())


def _positive(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and value > 0 else None


def recalled_memory(auto: Manifest | None, current: int, now: float, wall: datetime) -> RoleMemory:
    """A role's memory when this operator has none (it restarted), from what an earlier one
    wrote to ``status.roles[*].autoscaling``: the last scale time (so the scale-up window
    still runs), the learned capacities, and the current count as the scale-down window's
    one recommendation, made now (the fleet was sized by recommendations this process never
    saw; without it the first pass of a dip scaled down at once). ``auto`` None: the role
    never autoscaled, there is nothing to recall."""
    if not auto:
        return RoleMemory()
    age = _rfc3339_age(auto.get("lastScaleTime"), wall)
    state = PlannerState(
        last_scale_time=None if age is None else now - age,
        prefill_capacity=_positive(auto.get("prefillTokensPerSecond")),
        decode_capacity=_positive(auto.get("decodeTokensPerSecond")),
        history=((now, current),),
    )
    stamp = auto.get("lastScaleTime") if age is not None else None
    return RoleMemory(state=state, last_scale_wall=None if stamp is None else str(stamp))


class Autoscaler:
    """The loop's memory and actions; one per operator (lives in the handlers' context)."""

    def __init__(
        self,
        kube: KubeAPI,
        build: BuildSettings,
        settings: AutoscalerSettings | None = None,
        metrics: OperatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.build = build
        self.settings = settings or AutoscalerSettings()
        self.metrics = metrics
        self.clock = clock
        self.memory: dict[tuple[str, str, str], RoleMemory] = {}
        # (namespace, service) -> gateway pod uid -> its latest scrape
        self.gateway_scrapes: dict[tuple[str, str], dict[str, PodSnapshot]] = {}

    def forget(self, namespace: str, name: str) -> None:
        """Drop the memory of a deleted InferenceService."""
        for key in [k for k in self.memory if k[:2] == (namespace, name)]:
            del self.memory[key]
        self.gateway_scrapes.pop((namespace, name), None)

    def _forget_roles(self, namespace: str, name: str, autoscaled: set[str]) -> None:
        """Drop the memory and metric series of roles that no longer autoscale (removed,
        or given fixed replicas): they were kept, and exported, until the service was
        deleted, and a role that autoscales again must start from what it sees then."""
        for key in [k for k in self.memory if k[:2] == (namespace, name)]:
            if key[2] not in autoscaled:
                del self.memory[key]
                if self.metrics is not None:
                    self.metrics.forget(namespace, name, key[2])

    # ------------------------------------------------------------------------------------

    def tick(self, body: Manifest, record: Recorder) -> list[RoleOutcome]:
        """One autoscaler pass over one InferenceService (see module docstring)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        try:
            spec = parse_spec(body.get("spec") or {})
        except ValidationError:
            return []  # the reconciler reports an invalid spec as Degraded
        auto_roles = [(r, s) for r, s in spec.roles.items() if s.autoscaling is not None]
        self._forget_roles(namespace, name, {r for r, _ in auto_roles})
        if not auto_roles:
            # Nothing reads the gateways' arrivals now; a scrape kept until the service is
            # deleted would be the baseline of the first rate when a role autoscales again,
            # however long ago it was taken.
            self.gateway_scrapes.pop((namespace, name), None)
            return []
        now = self.clock()
        due = [
            (r, s)
            for r, s in auto_roles
            if (m := self.memory.get((namespace, name, r))) is None
            or m.last_decision is None
            or now - m.last_decision >= s.autoscaling.interval_seconds - 0.05  # type: ignore[union-attr]
        ]
        if not due:
            return []
        has_slo = spec.slo is not None
        names = Names(name, namespace)
        try:
            redis_url: str | None = resolve_redis_url(spec, self.build)
        except SpecError:
            redis_url = None
        credentials, redis_note = self._redis_credentials(namespace, spec)
        if redis_note is not None:
            redis_url = None

        try:
            deploy_list = self._list(DEPLOYMENT, namespace, name)
            pod_list = self._list(POD, namespace, name)
        except KubeError as exc:
            # Transient (API busy, namespace going away): decide at the next tick.
            log.warning("%s/%s: autoscaler cannot list its workloads: %s", namespace, name, exc)
            return []
        deploys = {d["metadata"]["name"]: d for d in deploy_list}
        pods_by_role: dict[str, list[Manifest]] = {}
        gateways: list[Manifest] = []
        for pod in pod_list:
            if pod["metadata"].get("deletionTimestamp"):
                continue  # already leaving: neither capacity nor a candidate
            pod_labels = pod["metadata"].get("labels") or {}
            if pod_labels.get(LABEL_COMPONENT) == GATEWAY:
                gateways.append(pod)
                continue
            role = pod_labels.get(LABEL_ROLE, "")
            pods_by_role.setdefault(role, []).append(pod)

        prom = self.settings.prometheus_url
        targets = [
            PodTarget(p["metadata"]["name"], f"http://{ip}:{self.settings.metrics_port}/metrics")
            for r, _ in due
            for p in pods_by_role.get(r, [])
            if not prom and pod_ready(p) and (ip := (p.get("status") or {}).get("podIP"))
        ]
        targets += [
            PodTarget(
                p["metadata"]["name"],
                f"http://{ip}:{self.settings.gateway_metrics_port}/metrics",
                parse_gateway_metrics,
            )
            for p in gateways
            if not prom and pod_ready(p) and (ip := (p.get("status") or {}).get("podIP"))
        ]
        scrapes, loads, redis_err = asyncio.run(
            gather_inputs(
                targets,
                redis_url,
                names.kv_namespace,
                self.settings.scrape_timeout_s,
                credentials,
            )
        )
        redis_err = redis_note or redis_err
        arrivals = None if prom else self._arrivals(namespace, name, gateways, scrapes)
        from_prometheus: dict[str, RoleInputs] = {}
        if prom:
            # Heartbeats only rank pods for scale-down here; the load comes from Prometheus.
            cached = {p: load.num_cached_blocks for p, load in (loads or {}).items()}
            redis_err = None
            from_prometheus = self._query_prometheus(
                prom, namespace, names, spec, due, deploys, pods_by_role, cached
            )

        outcomes: list[RoleOutcome] = []
        for role, role_spec in due:
            deploy = deploys.get(names.role(role))
            if deploy is None:
                continue  # the reconciler creates it; decide once it exists
            self._recall(namespace, name, role, body, deploy, now)
            if role in from_prometheus:
                outcome = self._decide(
                    namespace, name, role, spec, has_slo, from_prometheus[role], now
                )
                self._act(
                    namespace, name, names, deploy, pods_by_role.get(role, []), outcome, record
                )
                outcomes.append(outcome)
                continue
            outcome = self._decide_role(
                namespace,
                name,
                role,
                role_spec,
                spec,
                has_slo,
                deploy,
                pods_by_role.get(role, []),
                scrapes,
                loads,
                redis_err,
                now,
                arrivals,
            )
            self._act(namespace, name, names, deploy, pods_by_role.get(role, []), outcome, record)
            outcomes.append(outcome)
        if outcomes:
            self._write_status(namespace, name, outcomes, redis_err)
        return outcomes

    # ------------------------------------------------------------------------------------

    def _recall(
        self, namespace: str, name: str, role: str, body: Manifest, deploy: Manifest, now: float
    ) -> None:
        """Give a role this operator has no memory of the one its status records."""
        key = (namespace, name, role)
        if key in self.memory:
            return
        entries = (body.get("status") or {}).get("roles") or []
        entry = next((r for r in entries if isinstance(r, dict) and r.get("name") == role), {})
        auto = entry.get("autoscaling")
        current = int((deploy.get("spec") or {}).get("replicas", 1))
        wall = datetime.now(UTC)
        self.memory[key] = recalled_memory(
            auto if isinstance(auto, dict) else None, current, now, wall
        )

    def _redis_credentials(
        self, namespace: str, spec: InferenceServiceSpec
    ) -> tuple[RedisCredentials | None, str | None]:
        """(credentials for reading the heartbeats, or why they cannot be read).

        A service on the bundled Redis (no redisURL of its own) is read as its read-only
        ACL user with the password the operator was started with. A service on its own
        Redis is read as the user its gateway uses (``index.gatewayUser`` when set: the
        read-only one; else ``index.username``), with the password from the Secret the spec
        names (``passwordSecretRef {name, key}`` in the service's namespace): the operator
        gets that one Secret by name and keeps the password in memory only."""
        index = spec.index
        if index.redis_url is None and self.build.default_redis_secret:
            if self.settings.default_redis_password is None:
                return None, (
                    "the bundled Redis needs a password and the operator has none: set "
                    "PAGEFLEET_DEFAULT_REDIS_PASSWORD to the gateway-password of Secret "
                    f"{self.build.default_redis_secret} (the Helm chart does)"
                )
            return RedisCredentials(
                username=BUNDLED_GATEWAY_USER, password=self.settings.default_redis_password
            ), None
        user = index.gateway_user
        username, ref = (
            (user.username, user.password_secret_ref)
            if user is not None
            else (index.username, index.password_secret_ref)
        )
        if ref is None:
            return (RedisCredentials(username=username) if username else None), None
        password, problem = self._secret_value(namespace, ref.name, ref.key)
        if problem is not None:
            field_ = "gatewayUser.passwordSecretRef" if user is not None else "passwordSecretRef"
            return None, (
                f"spec.index.{field_} ({ref.name}/{ref.key}): {problem}; the load heartbeats "
                "cannot be read from this Redis, so the replica count is held"
            )
        return RedisCredentials(username=username, password=password), None

    def _secret_value(self, namespace: str, name: str, key: str) -> tuple[str, str | None]:
        """(the decoded value of ``key`` in Secret ``namespace/name``, or what is wrong:
        missing, no such key, not readable). Never puts the value into a message."""
        try:
            secret = self.kube.get(SECRET, namespace, name)
        except KubeError as exc:
            return "", (
                f"cannot read Secret {namespace}/{name} (HTTP {exc.status}); grant the operator "
                "get on this one Secret: deploy/redis-secret-role.yaml, or the chart's "
                "operator.redisPasswordSecrets"
            )
        if secret is None:
            return "", f"Secret {namespace}/{name} does not exist"
        data = secret.get("data") or {}
        if key in data:
            try:
                return base64.b64decode(data[key], validate=True).decode(), None
            except (ValueError, UnicodeDecodeError):
                return "", f"key {key!r} of Secret {namespace}/{name} is not base64 UTF-8"
        string_data = secret.get("stringData") or {}
        if key in string_data:
            return str(string_data[key]), None
        return "", f"Secret {namespace}/{name} has no key {key!r}"

    def _list(self, kind: Any, namespace: str, name: str) -> list[Manifest]:
        return self.kube.list(kind, namespace, {LABEL_SERVICE: name})

    def _decide_role(
        self,
        namespace: str,
        name: str,
        role: str,
        role_spec: RoleSpec,
        spec: InferenceServiceSpec,
        has_slo: bool,
        deploy: Manifest,
        pods: list[Manifest],
        scrapes: dict[str, Any],
        loads: dict[str, Any] | None,
        redis_err: str | None,
        now: float,
        arrivals: Arrivals | None = None,
    ) -> RoleOutcome:
        mem = self.memory.setdefault((namespace, name, role), RoleMemory())
        reports: list[PodReport] = []
        seen: dict[str, list[PodSnapshot]] = {}
        for pod in pods:
            if not pod_ready(pod):
                continue
            pname, uid = (
                pod["metadata"]["name"],
                pod["metadata"].get("uid", pod["metadata"]["name"]),
            )
            report = PodReport(pname)
            scrape = scrapes.get(pname)
            if scrape is None or scrape.snapshot is None:
                report.error = scrape.error if scrape else "no pod IP"
            else:
                new = scrape.snapshot
                horizon = new.t - self.settings.rate_window_s
                history = mem.snapshots.get(uid, [])
                if history and restarted(history[-1], new):
                    # Rates span only the new process: every delta from an older scrape
                    # would go backwards (unknown for the whole window) or be diluted.
                    history = []
                # At least the previous scrape, when the window is shorter than a tick.
                kept = [s for s in history if s.t >= horizon] or history[-1:]
                seen[uid] = [*kept, new]
                report.delta = delta(kept[0], new) if kept else None
                if report.delta is None:
                    report.error = WARMING
            if loads is None:
                report.error = report.error or (redis_err or "heartbeats unknown")
            else:
                report.load = loads.get(pname)
                if report.load is None:
                    report.error = report.error or "no live heartbeat in Redis"
            reports.append(report)
        mem.snapshots = seen
        current = int((deploy.get("spec") or {}).get("replicas", 1))
        ready = sum(1 for p in pods if pod_ready(p))
        inputs = observe_role(current, ready, reports, slo_targets(spec).percentile, arrivals, role)
        return self._decide(namespace, name, role, spec, has_slo, inputs, now)

    def _arrivals(
        self, namespace: str, name: str, gateways: list[Manifest], scrapes: dict[str, Any]
    ) -> Arrivals | None:
        """The gateways' arrival rates since the previous tick (the leading signal), or None
        when any Ready gateway pod is not known at both scrapes (no partial sums: a missing
        gateway would read as a drop)."""
        before = self.gateway_scrapes.get((namespace, name), {})
        latest: dict[str, PodSnapshot] = {}
        pairs: list[tuple[PodSnapshot, PodSnapshot]] = []
        complete = True
        for pod in gateways:
            if not pod_ready(pod):
                continue
            uid = pod["metadata"].get("uid", pod["metadata"]["name"])
            scrape = scrapes.get(pod["metadata"]["name"])
            if scrape is None or scrape.snapshot is None:
                complete = False
                continue
            latest[uid] = scrape.snapshot
            if uid in before:
                pairs.append((before[uid], scrape.snapshot))
            else:
                complete = False
        self.gateway_scrapes[(namespace, name)] = latest
        return gateway_arrivals(pairs) if complete else None

    def _decide(
        self,
        namespace: str,
        name: str,
        role: str,
        spec: InferenceServiceSpec,
        has_slo: bool,
        inputs: RoleInputs,
        now: float,
    ) -> RoleOutcome:
        mem = self.memory.setdefault((namespace, name, role), RoleMemory())
        cfg = planner_config(role, spec, has_slo, self.settings.rate_window_s)
        basis = (
            cfg.ttft_s,
            cfg.tpot_s,
            cfg.slo_quantile,
            cfg.prefill_capacity_hint,
            cfg.decode_capacity_hint,
        )
        if mem.capacity_basis is not None and basis != mem.capacity_basis:
            # A capacity at the old SLO is wrong at the new one, and the learned figure
            # began as the old hint (an edited hint was never used): start from the spec.
            mem.state = replace(mem.state, prefill_capacity=None, decode_capacity=None)
        mem.capacity_basis = basis
        before = mem.state.last_scale_time
        decision = decide(cfg, inputs.observation, mem.state, now)
        mem.state = decision.state
        mem.last_decision = now
        return RoleOutcome(role, decision, inputs, last_scale_before=before)

    def _query_prometheus(
        self,
        url: str,
        namespace: str,
        names: Names,
        spec: InferenceServiceSpec,
        due: list[tuple[str, RoleSpec]],
        deploys: dict[str, Manifest],
        pods_by_role: dict[str, list[Manifest]],
        cached: dict[str, int],
    ) -> dict[str, RoleInputs]:
        roles = [r for r, _ in due if names.role(r) in deploys]
        # Pods Ready for less than this may have no series yet: Prometheus discovers and
        # scrapes a new pod within its scrape interval, and rate() wants two samples in the
        # window; a window that works at all spans two scrape intervals.
        warmup_s = max(60.0, 2 * self.settings.rate_window_s)
        wall = datetime.now(UTC)
        warming = {
            p["metadata"]["name"]
            for pods in pods_by_role.values()
            for p in pods
            if (age := _ready_for_s(p, wall)) is not None and age < warmup_s
        }

        async def all_roles() -> list[RoleInputs]:
            return await asyncio.gather(
                *(
                    role_inputs(
                        url,
                        namespace,
                        r,
                        int((deploys[names.role(r)].get("spec") or {}).get("replicas", 1)),
                        [p["metadata"]["name"] for p in pods_by_role.get(r, []) if pod_ready(p)],
                        self.settings.rate_window_s,
                        slo_targets(spec).percentile,
                        self.settings.scrape_timeout_s,
                        cached,
                        warming,
                    )
                    for r in roles
                )
            )

        return dict(zip(roles, asyncio.run(all_roles()), strict=True))

    def _act(
        self,
        namespace: str,
        name: str,
        names: Names,
        deploy: Manifest,
        pods: list[Manifest],
        outcome: RoleOutcome,
        record: Recorder,
    ) -> None:
        obs, d = outcome.inputs.observation, outcome.decision
        mem = self.memory[(namespace, name, outcome.role)]
        deploy_name = names.role(outcome.role)
        try:
            if d.desired < obs.current:
                outcome.victims = mark_victims(
                    self.kube, namespace, pods, outcome.inputs.pods, obs.current - d.desired
                )
            if d.desired != obs.current:
                self.kube.merge_patch(
                    DEPLOYMENT, namespace, deploy_name, {"spec": {"replicas": d.desired}}
                )
                mem.last_scale_wall = _now_rfc3339()
        except KubeError as exc:
            # Not applied: the count did not move, so neither did the last scale time; all
            # else the pass learned stands (the scale-down window's recommendations above
            # all: without them the next dip scaled down at once).
            mem.state = replace(d.state, last_scale_time=outcome.last_scale_before)
            log.warning("%s/%s %s: scaling failed: %s", namespace, name, outcome.role, exc)
            outcome.failure = (
                f"{outcome.role}: applying {obs.current} -> {d.desired} replicas failed "
                f"(HTTP {exc.status}): {exc}; retrying every pass"
            )
            if str(exc) != mem.last_failure:
                record("Warning", SCALING_FAILED, f"{outcome.role}: {exc}")
            mem.last_failure = str(exc)
            return
        mem.last_failure = None
        if scale_down_settled(obs.current, d.desired, pods):
            # A mark left by a scale-down that did not happen (its write failed).
            clear_marks(self.kube, namespace, name, pods)
        if self.metrics is not None:
            self.metrics.record_decision(namespace, name, outcome.role, obs, d)
        victim = ""
        if outcome.victims:
            plural = "s" if len(outcome.victims) > 1 else ""
            victim = f"; removing pod{plural} {', '.join(outcome.victims)} (cheapest)"
        if _newsworthy(d, mem.last_reason):
            kind = "Warning" if outcome.blind else "Normal"
            record(kind, d.reason.value, f"{outcome.role}: {d.message}{victim}")
        mem.last_reason = d.reason.value
        log.info(
            "%s/%s %s: %s -> %s %s: %s%s",
            namespace,
            name,
            outcome.role,
            obs.current,
            d.desired,
            d.reason.value,
            d.message,
            victim,
        )

    def read_loads(
        self, namespace: str, name: str, spec: InferenceServiceSpec
    ) -> dict[str, PodLoad] | None:
        """The index's heartbeats of a service's pods (pod name -> load), read as a tick
        reads them; None when they cannot be read. The reconcile pass ranks the pods that
        a lowered ``replicas`` or ``maxReplicas`` removes by these (victims.LoadReader)."""
        try:
            redis_url = resolve_redis_url(spec, self.build)
        except SpecError:
            return None
        credentials, note = self._redis_credentials(namespace, spec)
        if note is not None:
            return None
        _, loads, err = asyncio.run(
            gather_inputs(
                [],
                redis_url,
                Names(name, namespace).kv_namespace,
                self.settings.scrape_timeout_s,
                credentials,
            )
        )
        if err is not None:
            log.warning("%s/%s: heartbeats for a scale-down: %s", namespace, name, err)
        return loads

    def _write_status(
        self, namespace: str, name: str, outcomes: list[RoleOutcome], redis_err: str | None
    ) -> None:
        try:
            fresh = self.kube.get(INFERENCE_SERVICE, namespace, name)
            if fresh is None:
                return
            status = dict(fresh.get("status") or {})
            roles = [dict(r) for r in status.get("roles", []) or []]
            stamp = _now_rfc3339()
            for out in outcomes:
                mem = self.memory[(namespace, name, out.role)]
                entry = next((r for r in roles if r.get("name") == out.role), None)
                if entry is None:
                    entry = {"name": out.role}
                    roles.append(entry)
                d, obs = out.decision, out.inputs.observation
                auto: Manifest = {
                    "desiredReplicas": d.desired,
                    "currentReplicas": obs.current,
                    "lastDecisionTime": stamp,
                    "reason": d.reason.value,
                    "message": d.message[:1000],
                }
                if d.recommendation is not None:
                    auto["recommendedReplicas"] = d.recommendation
                if mem.last_scale_wall:
                    auto["lastScaleTime"] = mem.last_scale_wall
                if d.state.prefill_capacity is not None:
                    auto["prefillTokensPerSecond"] = round(d.state.prefill_capacity, 3)
                if d.state.decode_capacity is not None:
                    auto["decodeTokensPerSecond"] = round(d.state.decode_capacity, 3)
                entry["autoscaling"] = auto
            status["roles"] = roles
            for out in outcomes:
                mem = self.memory[(namespace, name, out.role)]
                mem.failure_note = out.failure
                mem.blind_note = _blind_note(out, redis_err)
                mem.reason_note = out.decision.reason.value
            latest = sorted((k[2], m) for k, m in self.memory.items() if k[:2] == (namespace, name))
            status["conditions"] = self._conditions(status, latest, fresh)
            if status != (fresh.get("status") or {}):
                self.kube.patch_status(INFERENCE_SERVICE, namespace, name, status)
        except KubeError as exc:
            log.warning("%s/%s: writing the autoscaler status failed: %s", namespace, name, exc)

    def _conditions(
        self, status: Manifest, roles: list[tuple[str, RoleMemory]], fresh: Manifest
    ) -> list[Manifest]:
        """ScalingActive over every autoscaled role's latest decision (not only the roles
        decided in this pass: roles on different intervals flapped it)."""
        prev = list(status.get("conditions", []) or [])
        failed = [m.failure_note for _, m in roles if m.failure_note]
        blind = [m.blind_note for _, m in roles if m.blind_note]
        if failed:
            # What it decided is not what the Deployments ask for: that first.
            reason, message = SCALING_FAILED, "; ".join(failed)[:1500]
        elif blind:
            reason = blind[0][0]
            problems = [p for _, role_problems in blind for p in role_problems]
            message = "; ".join(dict.fromkeys(problems))[:1500]
        else:
            reason = "Active"
            message = ", ".join(f"{role}: {m.reason_note}" for role, m in roles if m.reason_note)
        cond = condition(
            SCALING_ACTIVE,
            not blind and not failed,
            reason,
            message,
            fresh["metadata"].get("generation", 0),
            prev,
        )
        return [c for c in prev if c.get("type") != SCALING_ACTIVE] + [cond]


def _blind_note(out: RoleOutcome, redis_err: str | None) -> tuple[str, tuple[str, ...]] | None:
    """(reason, problems) of a decision on inputs it could not trust, for ScalingActive."""
    if not out.blind:
        return None
    errs = [f"{p.name}: {p.error}" for p in out.inputs.unknown if p.error]
    problems = [*([redis_err] if redis_err else []), f"{out.role}: {out.decision.message}"]
    return out.decision.reason.value, (*problems, *errs[:3])
