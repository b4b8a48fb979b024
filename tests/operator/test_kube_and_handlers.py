"""The REST layer against kmock's HTTP server, and the kopf handlers' wiring.

kmock serves real HTTP on 127.0.0.1, so these check the requests the operator actually puts on
the wire (server-side apply's URL, query and content type; label selectors; status merge
patches; 404 handling). The e2e suite runs the same code against a real kube-apiserver.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from typing import Any

import kmock
import kopf
import pytest
from fake_kube import REDIS, FakeKube
from kubernetes import client

from pagefleet.operator import handlers
from pagefleet.operator.builders import BuildSettings
from pagefleet.operator.handlers import OperatorContext, register
from pagefleet.operator.kube import (
    DEPLOYMENT,
    INFERENCE_SERVICE,
    SERVICE,
    KubeError,
    RestKube,
)
from pagefleet.operator.metrics import OperatorMetrics
from pagefleet.operator.reconcile import reconcile

pytestmark = pytest.mark.kmock(cls=kmock.KubernetesScaffold)


def rest(server: Any) -> RestKube:
    cfg = client.Configuration()
    cfg.host = str(server.url).rstrip("/")
    return RestKube(client.ApiClient(cfg))


async def test_apply_is_a_forced_server_side_apply(kmock):
    ssa = kmock["patch /apis/apps/v1/namespaces/ml/deployments/llama-unified"] << {
        "kind": "Deployment",
        "metadata": {"name": "llama-unified", "resourceVersion": "7"},
    }
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llama-unified", "namespace": "ml"},
        "spec": {"replicas": 2},
    }
    out = await asyncio.to_thread(rest(kmock).apply, obj)
    assert out["metadata"]["resourceVersion"] == "7"
    req = ssa[0]
    assert req.params == {"fieldManager": "pagefleet-operator", "force": "true"}
    assert req.headers["Content-Type"] == "application/apply-patch+yaml"
    assert req.data == obj


async def test_list_selects_by_labels_and_fills_kind(kmock):
    lst = kmock["get /api/v1/namespaces/ml/services"] << {
        "items": [{"metadata": {"name": "llama-unified"}}]
    }
    items = await asyncio.to_thread(
        rest(kmock).list, SERVICE, "ml", {"pagefleet.io/service": "llama", "a": "b"}
    )
    assert items == [{"metadata": {"name": "llama-unified"}, "apiVersion": "v1", "kind": "Service"}]
    assert lst[0].params == {"labelSelector": "a=b,pagefleet.io/service=llama"}


async def test_status_is_a_merge_patch_of_the_status_subresource(kmock):
    path = "/apis/pagefleet.io/v1alpha1/namespaces/ml/inferenceservices/llama/status"
    st = kmock[f"patch {path}"] << {}
    await asyncio.to_thread(
        rest(kmock).patch_status, INFERENCE_SERVICE, "ml", "llama", {"url": "http://x"}
    )
    assert st[0].headers["Content-Type"] == "application/merge-patch+json"
    assert json.loads(st[0].body) == {"status": {"url": "http://x"}}


async def test_missing_objects_and_errors(kmock):
    kmock["get /apis/apps/v1/namespaces/ml/deployments/gone"] << 404
    kmock["delete /apis/apps/v1/namespaces/ml/deployments/gone"] << 404
    (
        kmock["get /apis/apps/v1/namespaces/ml/deployments"]
        << 503
        << {
            "kind": "Status",
            "message": "etcdserver: leader changed",
        }
    )
    kube = rest(kmock)
    assert await asyncio.to_thread(kube.get, DEPLOYMENT, "ml", "gone") is None
    assert await asyncio.to_thread(kube.delete, DEPLOYMENT, "ml", "gone") is False
    with pytest.raises(KubeError) as err:
        await asyncio.to_thread(kube.list, DEPLOYMENT, "ml", {"x": "y"})
    assert err.value.status == 503 and err.value.transient
    assert "leader changed" in str(err.value)


# -- handlers --------------------------------------------------------------------------


def _registered(registry: kopf.OperatorRegistry) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for handler in registry._spawning.get_all_handlers():
        out[handler.id] = handler
    for handler in registry._changing.get_all_handlers():
        out.setdefault(handler.id, handler)
    for handler in registry._watching.get_all_handlers():
        out[handler.id] = handler
    return out


def test_register_wires_every_trigger():
    registry = register(kopf.OperatorRegistry(), resync_s=7)
    found = _registered(registry)
    assert {"reconcile", "resync", "child-deployments", "child-services"} <= found.keys()
    assert found["resync"].interval == 7
    activities = {h.fn for h in registry._activities.get_all_handlers()}
    assert {handlers.configure, handlers.login} <= activities
    assert found["child-deployments"].labels == {
        "app.kubernetes.io/managed-by": "pagefleet-operator"
    }
    triggers = {
        (h.reason, h.field, h.initial)
        for h in registry._changing.get_all_handlers()
        if h.fn is handlers.on_change
    }
    spec_field = ("spec",)
    assert triggers == {("create", None, None), ("update", spec_field, None), (None, None, True)}


def test_a_deletion_does_not_wait_a_minute_for_a_timer_mid_pass():
    # kopf keeps the finalizer until the timers stop; a sync pass caught mid-run cannot be
    # cancelled, and with kopf's defaults the next look came 60 s later (the CI run where
    # the children's garbage collection missed its 60 s).
    settings = kopf.OperatorSettings()
    assert settings.background.cancellation_polling == 60  # the default this guards against
    handlers.configure(settings=settings)
    assert settings.background.cancellation_polling <= 1.0
    wait = settings.background.instant_exit_timeout
    assert wait is not None and 0 < wait <= 1.0


@pytest.fixture
def recorded(monkeypatch) -> list[tuple[str, str, str]]:
    events: list[tuple[str, str, str]] = []

    def recorder(body):
        return lambda t, r, m: events.append((t, r, m))

    # kopf.event needs a running operator's posting queue; record instead.
    monkeypatch.setattr(handlers, "_recorder", recorder)
    return events


@pytest.fixture
def ctx(recorded) -> OperatorContext:
    return OperatorContext(kube=FakeKube(), settings=BuildSettings())


def _add_is(kube: FakeKube) -> dict[str, Any]:
    return kube.add(
        {
            "apiVersion": "pagefleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ml", "generation": 1},
            "spec": {
                "model": {"source": {"path": "tiny"}},
                "roles": {"unified": {"replicas": 1}},
                "index": {"redisURL": REDIS},
            },
        }
    )


def test_on_change_reconciles_and_skips_objects_being_deleted(ctx):
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    body = _add_is(kube)
    handlers.on_change(body=kopf.Body(copy.deepcopy(body)), memo=kopf.Memo(ctx=ctx))
    assert kube.names("Deployment") == ["llama-gateway", "llama-unified"]
    dying = copy.deepcopy(kube.obj("InferenceService", "ml", "llama"))
    dying["metadata"]["deletionTimestamp"] = "2026-11-29T00:00:00Z"
    kube.objects.pop(("Deployment", "ml", "llama-unified"))
    handlers.on_resync(body=kopf.Body(dying), memo=kopf.Memo(ctx=ctx))
    assert kube.names("Deployment") == ["llama-gateway"]  # nothing recreated for a dying owner


def test_child_deletion_event_restores_and_modification_refreshes_status(ctx, recorded):
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    _add_is(kube)
    handlers.on_change(
        body=kopf.Body(copy.deepcopy(kube.obj("InferenceService", "ml", "llama"))),
        memo=kopf.Memo(ctx=ctx),
    )
    labels = {"pagefleet.io/service": "llama"}
    kube.objects.pop(("Deployment", "ml", "llama-unified"))
    handlers.on_child_event(
        event={"type": "DELETED"}, namespace="ml", labels=labels, memo=kopf.Memo(ctx=ctx)
    )
    assert kube.obj("Deployment", "ml", "llama-unified") is not None
    assert ("Normal", "Restored") in [(t, r) for t, r, _ in recorded]

    kube.mark_deployments_ready()
    handlers.on_child_event(
        event={"type": "MODIFIED"}, namespace="ml", labels=labels, memo=kopf.Memo(ctx=ctx)
    )
    status = kube.obj("InferenceService", "ml", "llama")["status"]
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["status"] == "True"


def _routed_service(kube: FakeKube) -> str:
    cmd = kube.obj("Deployment", "ml", "llama-gateway")["spec"]["template"]["spec"]
    cmd = cmd["containers"][0]["command"]
    return str(cmd[cmd.index("--service") + 1])


def test_a_role_switch_advances_on_child_events_not_only_on_resync(ctx):
    # The switch waits for new pods to turn Ready, which reaches the operator as Deployment
    # status events: a mere status refresh left it to the resync timer (30 s), twice.
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    memo = kopf.Memo(ctx=ctx)
    handlers.on_change(body=kopf.Body(copy.deepcopy(_add_is(kube))), memo=memo)
    kube.mark_deployments_ready()
    obj = kube.obj("InferenceService", "ml", "llama")
    obj["spec"]["roles"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    obj["metadata"]["generation"] += 1
    handlers.on_change(body=kopf.Body(copy.deepcopy(obj)), memo=memo)
    assert _routed_service(kube) == "llama-unified"
    event = {"event": {"type": "MODIFIED"}, "namespace": "ml", "memo": memo}
    labels = {"pagefleet.io/service": "llama"}
    kube.mark_deployments_ready()  # the new pods are Ready
    handlers.on_child_event(**event, labels=labels)
    assert _routed_service(kube) == "llama-decode"
    kube.mark_deployments_ready()  # the gateway pods rolled
    handlers.on_child_event(**event, labels=labels)
    assert kube.names("Deployment") == ["llama-decode", "llama-gateway", "llama-prefill"]


def _max_num_seqs(kube: FakeKube) -> str:
    deploy = kube.obj("Deployment", "ml", "llama-unified")
    cmd = deploy["spec"]["template"]["spec"]["containers"][0]["command"]
    return cmd[cmd.index("--max-num-seqs") + 1]


def _edit(kube: FakeKube, max_num_seqs: int) -> dict[str, Any]:
    obj = kube.obj("InferenceService", "ml", "llama")
    obj["spec"]["engine"] = {"maxNumSeqs": max_num_seqs}
    obj["metadata"]["generation"] += 1
    return copy.deepcopy(obj)


def test_a_pass_from_a_stale_body_uses_the_stored_spec(ctx):
    # kopf hands a timer the body it had when the timer fired; an update pass for a newer
    # generation may hold the lock meanwhile. The late pass must not roll the pods back.
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    memo = kopf.Memo(ctx=ctx)
    _add_is(kube)
    stale = copy.deepcopy(_edit(kube, 16))
    handlers.on_change(body=kopf.Body(copy.deepcopy(stale)), memo=memo)
    handlers.on_change(body=kopf.Body(_edit(kube, 32)), memo=memo)
    assert _max_num_seqs(kube) == "32"
    handlers.on_resync(body=kopf.Body(stale), memo=memo)
    assert _max_num_seqs(kube) == "32"
    assert kube.obj("InferenceService", "ml", "llama")["status"]["observedGeneration"] == 3


def test_a_status_refresh_that_waited_on_the_lock_reports_the_newer_generation(ctx):
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    memo = kopf.Memo(ctx=ctx)
    _add_is(kube)
    handlers.on_change(body=kopf.Body(_edit(kube, 16)), memo=memo)
    kube.mark_deployments_ready()
    read_parent = threading.Event()
    get = kube.get

    def watched_get(kind, namespace, name):
        out = get(kind, namespace, name)
        if kind is INFERENCE_SERVICE:
            read_parent.set()
        return out

    kube.get = watched_get  # type: ignore[method-assign]
    held = contextlib.ExitStack()
    held.enter_context(ctx.lock("ml", "llama"))  # an update pass is running
    event = threading.Thread(
        target=handlers.on_child_event,
        kwargs={
            "event": {"type": "MODIFIED"},
            "namespace": "ml",
            "labels": {"pagefleet.io/service": "llama"},
            "memo": memo,
        },
    )
    event.start()
    read_parent.wait(0.5)  # (before the fix the handler read its parent here, unlocked)
    reconcile(kube, _edit(kube, 32), ctx.settings, lambda *_: None)  # the update pass
    assert kube.obj("InferenceService", "ml", "llama")["status"]["observedGeneration"] == 3
    held.close()
    event.join(5)
    status = kube.obj("InferenceService", "ml", "llama")["status"]
    assert status["observedGeneration"] == 3
    assert {c["observedGeneration"] for c in status["conditions"]} == {3}


class _SlowAutoscaler:
    """Remembers each service it ticks, a moment into the tick (as scraping pods takes)."""

    def __init__(self) -> None:
        self.memory: dict[tuple[str, str], int] = {}
        self.ticking = threading.Event()

    def tick(self, body: dict[str, Any], record: Any) -> None:
        self.ticking.set()
        time.sleep(0.2)
        meta = body["metadata"]
        self.memory[(meta["namespace"], meta["name"])] = 1

    def forget(self, namespace: str, name: str) -> None:
        self.memory.pop((namespace, name), None)


def test_a_deletion_during_an_autoscaler_tick_still_forgets_the_service(ctx):
    # The tick read its body before the deletion; forgetting meanwhile must not be undone
    # by the tick's end, or the memory of a deleted service lingers (and a new service of
    # the same name starts from it).
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    autoscaler = _SlowAutoscaler()
    ctx.autoscaler = autoscaler  # type: ignore[assignment]
    memo = kopf.Memo(ctx=ctx)
    body = _add_is(kube)
    tick = threading.Thread(
        target=handlers.on_autoscale, kwargs={"body": kopf.Body(copy.deepcopy(body)), "memo": memo}
    )
    tick.start()
    assert autoscaler.ticking.wait(5)
    kube.obj("InferenceService", "ml", "llama")["metadata"]["deletionTimestamp"] = (
        "2026-12-03T00:00:00Z"
    )
    dying = copy.deepcopy(kube.obj("InferenceService", "ml", "llama"))
    handlers.on_delete(body=kopf.Body(dying), memo=memo)
    tick.join(5)
    assert autoscaler.memory == {}


def _named_is(kube: FakeKube, name: str) -> dict[str, Any]:
    body = _add_is(kube)
    kube.objects.pop(("InferenceService", "ml", "llama"))
    body["metadata"]["name"] = name
    return kube.add(body)


def test_services_that_come_and_go_leave_no_lock_behind(ctx):
    # The per-service locks lived in a table that only grew: an operator on a cluster
    # that creates and deletes many InferenceServices kept one lock per name ever seen.
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    memo = kopf.Memo(ctx=ctx)
    for i in range(20):
        body = _named_is(kube, f"batch-{i}")
        handlers.on_change(body=kopf.Body(copy.deepcopy(body)), memo=memo)
        handlers.on_resync(body=kopf.Body(copy.deepcopy(body)), memo=memo)
        body["metadata"]["deletionTimestamp"] = "2026-12-03T00:00:00Z"
        handlers.on_delete(body=kopf.Body(body), memo=memo)
    assert len(ctx.locks) == 0


def test_a_lock_in_use_is_not_dropped_under_its_waiters(ctx):
    # Dropping a service's lock while a pass holds it would hand the next handler a fresh
    # lock, and two passes of one service would run at once.
    memo = kopf.Memo(ctx=ctx)
    dying = _add_is(ctx.kube)
    dying["metadata"]["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    inside: list[str] = []
    held = contextlib.ExitStack()
    held.enter_context(ctx.lock("ml", "llama"))  # a pass is running

    def second_pass() -> None:
        with ctx.lock("ml", "llama"):
            inside.append("second")

    delete = threading.Thread(
        target=handlers.on_delete, kwargs={"body": kopf.Body(dying), "memo": memo}
    )
    other = threading.Thread(target=second_pass)
    delete.start()
    other.start()
    time.sleep(0.2)
    assert delete.is_alive() and inside == []  # both wait for the running pass
    assert len(ctx.locks) == 1
    held.close()
    delete.join(5)
    other.join(5)
    assert inside == ["second"] and len(ctx.locks) == 0


def _series(metrics: OperatorMetrics, service: str) -> list[str]:
    return [
        s.name
        for family in metrics.registry.collect()
        for s in family.samples
        if s.labels.get("service") == service
    ]


def test_a_deleted_service_leaves_no_metric_series(ctx):
    # Its last desired replicas, inputs and capacities would be exported (and graphed,
    # and alerted on) until the operator restarts.
    metrics = ctx.metrics = OperatorMetrics()
    for service in ("llama", "other"):
        role = ("ml", service, "unified")
        metrics.desired.labels(*role).set(3)
        metrics.inputs.labels(*role, "kv_usage").set(0.5)
        metrics.capacity.labels(*role, "decode").set(900)
        metrics.decisions.labels(*role, "ScaledUp").inc()
    metrics.passes.labels("reconcile").inc()
    dying = _add_is(ctx.kube)
    handlers.on_delete(body=kopf.Body(dying), memo=kopf.Memo(ctx=ctx))
    assert _series(metrics, "llama") == []
    assert len(_series(metrics, "other")) == len(set(_series(metrics, "other"))) >= 4
    assert "pagefleet_operator_reconciles_total" in [
        s.name for f in metrics.registry.collect() for s in f.samples
    ]


def test_transient_api_errors_become_kopf_retries(ctx):
    kube: FakeKube = ctx.kube  # type: ignore[assignment]
    body = _add_is(kube)
    kube.fail_next["apply"] = KubeError(409, "HTTP 409: conflict")
    with pytest.raises(kopf.TemporaryError):
        handlers.on_change(body=kopf.Body(copy.deepcopy(body)), memo=kopf.Memo(ctx=ctx))


def test_operator_cli_requires_a_watch_scope():
    from click.testing import CliRunner

    from pagefleet.operator.cli import command

    result = CliRunner().invoke(command, [])
    assert result.exit_code == 2
    assert "--namespace NS" in result.output and "--all-namespaces" in result.output
    result = CliRunner().invoke(command, ["-n", "a", "--all-namespaces"])
    assert result.exit_code == 2
