"""kopf handlers: every trigger funnels into the same idempotent `reconcile` pass.

- create / update (of spec) / resume: a full pass for that InferenceService;
- a resync timer: a full pass every few seconds, which repairs hand edits of children;
- events of owned Deployments and Services: a deleted child triggers a full pass at once
  (restored within a second, not a resync period); a Deployment status change refreshes the
  InferenceService's status without re-applying anything, except during a role switch,
  when it runs a full pass (new pods turning Ready is what advances the switch).

Handlers are sync (kopf runs them in its thread pool) and serialise per InferenceService
with a lock from the memo, since the timer, a child event and a spec update may race; each
re-reads the InferenceService under that lock, so none works from a body another pass has
since superseded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import kopf

from pagefleet.api.inferenceservice import GROUP, PLURAL, VERSION
from pagefleet.operator.autoscaler import Autoscaler
from pagefleet.operator.builders import BuildSettings
from pagefleet.operator.kube import INFERENCE_SERVICE, KubeAPI, KubeError
from pagefleet.operator.metrics import OperatorMetrics
from pagefleet.operator.naming import LABEL_MANAGED_BY, LABEL_SERVICE, MANAGED_BY
from pagefleet.operator.reconcile import (
    Recorder,
    reconcile,
    refresh_status,
    role_switch_in_progress,
)
from pagefleet.operator.victims import LoadReader

log = logging.getLogger(__name__)

RETRY_DELAY_S = 5.0
# How long a deletion waits for a running timer pass, then how often it looks again.
DELETION_WAIT_S = 0.5
DELETION_POLL_S = 1.0


@dataclass(slots=True)
class _KeyLock:
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0  # holders plus waiters; guarded by KeyedLocks._guard


class KeyedLocks:
    """One lock per (namespace, name), kept only while some handler holds or waits for it.

    Invariant: every handler that holds or waits for a key counts in its entry, so all of
    them share one lock object, and the entry is dropped when the last one leaves. An
    operator that sees many InferenceServices come and go therefore holds no lock for a
    name that no handler is using (a table that only grew kept one per name ever seen)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str], _KeyLock] = {}

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)

    @contextmanager
    def hold(self, key: tuple[str, str]) -> Iterator[None]:
        with self._guard:
            entry = self._locks.setdefault(key, _KeyLock())
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._locks[key]


@dataclass(slots=True)
class OperatorContext:
    """What every handler needs; lives in kopf's memo for the operator's lifetime."""

    kube: KubeAPI
    settings: BuildSettings
    locks: KeyedLocks = field(default_factory=KeyedLocks)
    autoscaler: Autoscaler | None = None
    metrics: OperatorMetrics | None = None

    @property
    def loads(self) -> LoadReader | None:
        """How a pass ranks the pods a lowered count removes: the autoscaler's heartbeat
        reads (without one, every pod's load is unknown and only readiness ranks them)."""
        return self.autoscaler.read_loads if self.autoscaler is not None else None

    def lock(self, namespace: str, name: str) -> AbstractContextManager[None]:
        """Serialises the passes of one InferenceService (``with ctx.lock(ns, name):``)."""
        return self.locks.hold((namespace, name))


def _ctx(memo: kopf.Memo) -> OperatorContext:
    ctx: OperatorContext = memo["ctx"]
    return ctx


def _recorder(body: dict[str, Any]) -> Recorder:
    def record(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)

    return record


def _current(ctx: OperatorContext, namespace: str, name: str) -> dict[str, Any] | None:
    """The InferenceService as stored now, or None when it is gone or being deleted.

    Call with its lock held: the body kopf handed over (or one read before the lock) may
    predate a pass that held the lock meanwhile, and a pass from it would put an older
    spec back on the children or report an older observedGeneration."""
    obj = ctx.kube.get(INFERENCE_SERVICE, namespace, name)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return None  # children go with it through their owner references
    return obj


def _run_pass(ctx: OperatorContext, body: dict[str, Any], handler: str = "reconcile") -> None:
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return  # children go with it through their owner references
    started = time.perf_counter()
    with ctx.lock(meta["namespace"], meta["name"]):
        try:
            current = _current(ctx, meta["namespace"], meta["name"])
            if current is None:
                return
            reconcile(ctx.kube, current, ctx.settings, _recorder(current), ctx.loads)
        except KubeError as exc:
            _count(ctx, handler, started, failed=True)
            # Transient (conflict, throttling, API down): kopf retries the handler later.
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=RETRY_DELAY_S) from exc
    _count(ctx, handler, started)


def _count(ctx: OperatorContext, handler: str, started: float, failed: bool = False) -> None:
    if ctx.metrics is None:
        return
    ctx.metrics.passes.labels(handler).inc()
    ctx.metrics.duration.labels(handler).observe(time.perf_counter() - started)
    if failed:
        ctx.metrics.errors.labels(handler).inc()


def on_change(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Create, spec update and operator restart: reconcile the InferenceService."""
    _run_pass(_ctx(memo), dict(body))


def on_resync(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Periodic full pass: restores hand-edited children and refreshes status."""
    _run_pass(_ctx(memo), dict(body), handler="resync")


def on_autoscale(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Autoscaler tick: decide the replicas of every autoscaled role whose interval passed.

    Never raises: an input or API failure is reported on the resource and retried next
    tick (kopf's retry backoff would only delay the next decision)."""
    ctx = _ctx(memo)
    raw = dict(body)
    meta = raw["metadata"]
    if ctx.autoscaler is None or meta.get("deletionTimestamp"):
        return
    started = time.perf_counter()
    failed = False
    with ctx.lock(meta["namespace"], meta["name"]):
        try:
            current = _current(ctx, meta["namespace"], meta["name"])
            if current is not None:
                ctx.autoscaler.tick(current, _recorder(current))
        except Exception:  # a bug here must not stop the operator's other handlers
            failed = True
            log.exception("autoscaler tick of %s/%s failed", meta["namespace"], meta["name"])
    _count(ctx, "autoscale", started, failed)


def on_delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Forget the autoscaler's memory and the metric series of a deleted InferenceService."""
    ctx = _ctx(memo)
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    # Under the lock: a tick already past its read of the service would otherwise remember
    # it again after this. Ticks from now on see the deletion and skip it.
    with ctx.lock(namespace, name):
        if ctx.autoscaler is not None:
            ctx.autoscaler.forget(namespace, name)
        if ctx.metrics is not None:
            ctx.metrics.forget(namespace, name)


def on_child_event(
    event: dict[str, Any], namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> None:
    """A Deployment or Service we own changed: restore it if deleted, else refresh status."""
    owner = labels.get(LABEL_SERVICE)
    if not owner or not namespace or event.get("type") not in ("DELETED", "MODIFIED"):
        return
    ctx = _ctx(memo)
    try:
        if event["type"] == "DELETED":
            _run_pass(ctx, {"metadata": {"namespace": namespace, "name": owner}})
            return
        with ctx.lock(namespace, owner):
            parent = _current(ctx, namespace, owner)
            if parent is None:  # garbage-collected with its owner: nothing to do
                return
            if role_switch_in_progress(parent):
                # Without this the switch would advance only at the next resync, twice
                # (gateway moved, then the old roles deleted): a minute at the default.
                reconcile(ctx.kube, parent, ctx.settings, _recorder(parent), ctx.loads)
            else:
                refresh_status(ctx.kube, parent, _recorder(parent))
    except KubeError as exc:
        # Event handlers are not retried; the resync timer catches up.
        log.warning("refreshing %s/%s after a child event failed: %s", namespace, owner, exc)
    except kopf.TemporaryError as exc:
        log.warning(
            "restoring a child of %s/%s failed, resync will retry: %s", namespace, owner, exc
        )


def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in pagefleet.io annotations (status is pruned to our schema)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Our own Events (kopf.event) always post; kopf's per-handler log lines become Events
    # only when they are warnings, so `kubectl describe` shows what happened and why.
    settings.posting.level = logging.WARNING
    # Re-list periodically so a missed watch event cannot leave the operator blind.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # A deleted InferenceService keeps its finalizer until its timers have stopped. Our timers
    # are sync passes in kopf's thread pool: one caught mid-pass cannot be cancelled, and kopf
    # looks again only after `cancellation_polling` (60 s by default), so the deletion and the
    # garbage collection of every child stalled a minute whenever it met a running pass. Our
    # passes take well under a second: wait that long first, then look again every second.
    settings.background.instant_exit_timeout = DELETION_WAIT_S
    settings.background.cancellation_polling = DELETION_POLL_S


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster ServiceAccount first, else $KUBECONFIG / ~/.kube/config (a custom registry
    does not get kopf's default login handlers)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def register(
    registry: kopf.OperatorRegistry, resync_s: float, autoscale_s: float = 5.0
) -> kopf.OperatorRegistry:
    """Attach every handler to `registry` (the resync period is a run-time choice, so the
    decorators are applied here rather than at import)."""
    kopf.on.startup(registry=registry)(configure)
    kopf.on.login(registry=registry)(login)
    for decorate in (
        kopf.on.create(GROUP, VERSION, PLURAL, registry=registry, id="reconcile"),
        kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry, id="reconcile"),
        kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry, id="reconcile"),
    ):
        decorate(on_change)
    kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        interval=resync_s,
        initial_delay=resync_s,
        registry=registry,
        id="resync",
    )(on_resync)
    kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        interval=autoscale_s,
        initial_delay=autoscale_s,
        registry=registry,
        id="autoscale",
    )(on_autoscale)
    kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry, id="forget", optional=True)(on_delete)
    owned = {LABEL_MANAGED_BY: MANAGED_BY}
    for group_version, plural in (("apps/v1", "deployments"), ("v1", "services")):
        kopf.on.event(group_version, plural, labels=owned, registry=registry, id=f"child-{plural}")(
            on_child_event
        )
    return registry
