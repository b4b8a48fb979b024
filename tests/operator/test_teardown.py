"""`pagefleet teardown` (the chart's pre-delete hook) against an in-memory API; the real
thing runs in e2e/test_helm.py."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from pagefleet.operator.teardown import Teardown


class FakeCustomObjects:
    """Deleting marks an object terminating; the 'operator' releases it a poll later."""

    def __init__(
        self,
        objs: dict[tuple[str, str], dict[str, Any]],
        release: bool,
        refused: frozenset[str] = frozenset(),
    ) -> None:
        self.objs = objs
        self.release = release
        self.refused = refused  # namespaces where listing answers 403 (no RoleBinding there)
        self.deletes: list[tuple[str, str]] = []

    def _items(self, ns: str | None) -> dict[str, Any]:
        if self.release:  # released by the operator since the last look
            for key in [k for k, o in self.objs.items() if o["metadata"].get("deletionTimestamp")]:
                del self.objs[key]
        return {"items": [o for (n, _), o in self.objs.items() if ns is None or n == ns]}

    def list_cluster_custom_object(self, group: str, version: str, plural: str) -> Any:
        return self._items(None)

    def list_namespaced_custom_object(self, group: str, version: str, ns: str, plural: str) -> Any:
        if ns in self.refused:
            raise ApiException(status=403, reason="Forbidden")
        return self._items(ns)

    def patch_namespaced_custom_object(
        self, group: str, version: str, ns: str, plural: str, name: str, body: Any
    ) -> None:
        meta = self.objs[(ns, name)]["metadata"]
        meta["finalizers"] = body["metadata"]["finalizers"]
        if not meta["finalizers"] and meta.get("deletionTimestamp"):
            del self.objs[(ns, name)]  # the API server removes it with its last finalizer

    def delete_namespaced_custom_object(
        self, group: str, version: str, ns: str, plural: str, name: str
    ) -> None:
        self.deletes.append((ns, name))
        self.objs[(ns, name)]["metadata"]["deletionTimestamp"] = "now"


def _obj(ns: str, name: str) -> dict[str, Any]:
    meta = {"namespace": ns, "name": name, "finalizers": ["pagefleet.io/finalizer"]}
    return {"metadata": meta}


def test_deletes_only_the_watched_namespaces_and_waits() -> None:
    objs = {(ns, n): _obj(ns, n) for ns, n in [("a", "x"), ("a", "y"), ("b", "z")]}
    api = FakeCustomObjects(objs, release=True)
    td = Teardown(api, ["a"])
    assert td.delete_all() == ["a/x", "a/y"]
    assert td.wait_gone(timeout_s=5, poll_s=0.01) == []
    assert list(objs) == [("b", "z")]


def test_reports_what_the_operator_did_not_release() -> None:
    objs = {("a", "x"): _obj("a", "x")}
    api = FakeCustomObjects(objs, release=False)
    td = Teardown(api, None)
    assert td.delete_all() == ["a/x"]
    assert td.delete_all() == []  # already terminating: not deleted twice
    left = td.wait_gone(timeout_s=0.05, poll_s=0.01)
    assert [o["metadata"]["name"] for o in left] == ["x"]
    assert api.deletes == [("a", "x")]


def test_with_no_operator_running_it_releases_only_its_own_finalizer() -> None:
    # Operator scaled to 0 or crash-looping: nobody would release them, and `helm
    # uninstall` failed at its timeout with every service stuck in Terminating.
    objs = {("a", "x"): _obj("a", "x"), ("a", "y"): _obj("a", "y")}
    objs[("a", "y")]["metadata"]["finalizers"].append("example.com/other")
    api = FakeCustomObjects(objs, release=False)
    td = Teardown(api, ["a"], operator_running=lambda: False)
    td.delete_all()
    left = td.wait_gone(timeout_s=0.2, poll_s=0.01)
    assert [o["metadata"]["name"] for o in left] == ["y"]  # held by another's finalizer
    assert left[0]["metadata"]["finalizers"] == ["example.com/other"]
    assert td.released == ["a/x", "a/y"]


def test_while_the_operator_runs_it_releases_nothing() -> None:
    objs = {("a", "x"): _obj("a", "x")}
    api = FakeCustomObjects(objs, release=False)
    td = Teardown(api, ["a"], operator_running=lambda: True)
    td.delete_all()
    assert len(td.wait_gone(timeout_s=0.05, poll_s=0.01)) == 1
    assert objs[("a", "x")]["metadata"]["finalizers"] == ["pagefleet.io/finalizer"]
    assert td.released == []


def test_a_watched_namespace_deleted_already_does_not_fail_the_teardown() -> None:
    # `helm uninstall` failed when a namespace the operator watched had been deleted: the
    # API server refuses the list there (the teardown's RoleBinding went with it), though
    # nothing is left to tear down.
    objs = {("a", "x"): _obj("a", "x")}
    api = FakeCustomObjects(objs, release=True, refused=frozenset({"gone"}))
    asked: list[str] = []

    def exists(ns: str) -> bool:
        asked.append(ns)
        return ns != "gone"

    td = Teardown(api, ["a", "gone"], namespace_exists=exists)
    assert td.delete_all() == ["a/x"]
    assert td.wait_gone(timeout_s=5, poll_s=0.01) == []
    assert td.gone == ["gone"] and asked == ["gone"]  # looked up once, then skipped


def test_a_refusal_in_a_namespace_that_still_exists_fails_the_teardown() -> None:
    # Services there would be left unmanaged with a stuck finalizer: a person must look.
    objs = {("a", "x"): _obj("a", "x")}
    api = FakeCustomObjects(objs, release=True, refused=frozenset({"a"}))
    td = Teardown(api, ["a"], namespace_exists=lambda ns: True)
    with pytest.raises(ApiException) as err:
        td.delete_all()
    assert err.value.status == 403 and api.deletes == []
