"""Each InferenceService gets its P/D transfer secret from the reconciler, once, before its
pods: every daemon and the gateway read it (builders.py) to sign and check
kv_transfer_params. Without it, a decode pod reached directly pulls K/V from whatever host a
request names (tests/daemon/test_pd_signed.py)."""

from __future__ import annotations

from pagefleet.operator.kube import KubeError
from pagefleet.operator.reconcile import reconcile

from .fake_kube import FakeKube
from .test_reconcile import SETTINGS, Recorder, body, cond, create_is


def test_the_first_pass_creates_the_secret_before_any_pod_and_never_rewrites_it(
    kube: FakeKube, pd_spec
) -> None:
    create_is(kube, pd_spec)
    reconcile(kube, body(kube), SETTINGS, Recorder())
    secret = kube.obj("Secret", "ml", "llama-kv-transfer")
    assert secret is not None
    value = secret["stringData"]["secret"]
    assert len(value) == 64 and int(value, 16) >= 0  # 32 random bytes, hex
    (ref,) = secret["metadata"]["ownerReferences"]  # goes with the service
    assert (ref["kind"], ref["name"]) == ("InferenceService", "llama")
    created = [(v, k) for v, k, _ in kube.calls if v in ("create", "apply")]
    assert created.index(("create", "Secret")) < created.index(("apply", "Deployment"))
    # A later pass (a resync, a spec edit) keeps the value the running pods read.
    rec = Recorder()
    reconcile(kube, body(kube), SETTINGS, rec)
    assert kube.obj("Secret", "ml", "llama-kv-transfer")["stringData"]["secret"] == value
    assert "Secret" not in " ".join(m for _, _, m in rec.events)
    # A steady resync (nothing to create) asks the API nothing about it.
    kube.calls.clear()
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert ("create", "Secret", "llama-kv-transfer") not in kube.calls


def test_services_get_secrets_of_their_own(kube: FakeKube, unified_spec) -> None:
    for name in ("a", "b"):
        obj = create_is(kube, unified_spec)
        kube.objects.pop(("InferenceService", "ml", "llama"))
        obj["metadata"]["name"] = name
        reconcile(kube, kube.add(obj), SETTINGS, Recorder())
    a, b = (kube.obj("Secret", "ml", f"{n}-kv-transfer") for n in ("a", "b"))
    assert a["stringData"]["secret"] != b["stringData"]["secret"]


def test_an_operator_not_allowed_to_create_secrets_still_serves(
    kube: FakeKube, unified_spec
) -> None:
    # An RBAC from before the grant: the pods run unsigned, as before; not Degraded.
    create_is(kube, unified_spec)
    kube.fail_next["create"] = KubeError(403, 'secrets is forbidden: cannot "create"')
    reconcile(kube, body(kube), SETTINGS, Recorder())
    assert kube.names("Deployment") == ["llama-gateway", "llama-unified"]
    assert kube.names("Secret") == []
    assert cond(kube, "Degraded")["status"] == "False"
