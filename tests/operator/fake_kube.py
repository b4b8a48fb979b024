"""An in-memory `KubeAPI` for fast reconcile tests (the e2e suite runs the real apiserver).

Apply approximates server-side apply for a single field manager: the applied top-level
sections (metadata labels/ownerReferences, spec, data, rules, roleRef, subjects) replace
the stored ones, everything else (status, foreign annotations) is kept, and the
resourceVersion (and, for a changed spec, the generation) moves only when something changed.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from typing import Any

from pagefleet.operator.kube import Kind, KubeError, kind_of

Manifest = dict[str, Any]
REDIS = "redis://redis.infra:6379/0"
_APPLIED_META = ("labels", "ownerReferences", "annotations")


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], Manifest] = {}
        self.calls: list[tuple[str, str, str]] = []  # (verb, kind, name)
        self.fail_next: dict[str, KubeError] = {}  # verb -> error raised once
        self._rv = itertools.count(1)

    # -- helpers for tests ------------------------------------------------------------------

    def add(self, obj: Manifest) -> Manifest:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._rv))
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = obj
        return obj

    def obj(self, kind: str, namespace: str, name: str) -> Manifest | None:
        return self.objects.get((kind, namespace, name))

    def names(self, kind: str) -> list[str]:
        return sorted(n for (k, _, n) in self.objects if k == kind)

    def mark_deployments_ready(self) -> None:
        """What the Deployment controller and kubelets would report once pods are Ready."""
        for (kind, _, _), obj in self.objects.items():
            if kind != "Deployment":
                continue
            n = obj["spec"].get("replicas", 1)
            obj["status"] = {
                "observedGeneration": obj["metadata"]["generation"],
                "replicas": n,
                "readyReplicas": n,
                "updatedReplicas": n,
                "availableReplicas": n,
            }
            obj["metadata"]["resourceVersion"] = str(next(self._rv))

    def _maybe_fail(self, verb: str) -> None:
        err = self.fail_next.pop(verb, None)
        if err is not None:
            raise err

    # -- KubeAPI -----------------------------------------------------------------------------

    def list(self, kind: Kind, namespace: str, selector: dict[str, str]) -> list[Manifest]:
        self.calls.append(("list", kind.kind, ""))
        out = []
        for (k, ns, _), obj in self.objects.items():
            labels = obj["metadata"].get("labels", {}) or {}
            if (
                k == kind.kind
                and ns == namespace
                and all(labels.get(a) == b for a, b in selector.items())
            ):
                out.append(copy.deepcopy(obj))
        return out

    def get(self, kind: Kind, namespace: str, name: str) -> Manifest | None:
        found = self.objects.get((kind.kind, namespace, name))
        return copy.deepcopy(found) if found else None

    def apply(self, obj: Manifest) -> Manifest:
        self._maybe_fail("apply")
        kind_of(obj)
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        self.calls.append(("apply", obj["kind"], meta["name"]))
        current = self.objects.get(key)
        if current is None:
            return copy.deepcopy(self.add(obj))
        merged = copy.deepcopy(current)
        for field in _APPLIED_META:
            if field == "annotations" and field in meta:
                # Keyed by annotation: other managers' annotations stay.
                annotations = merged["metadata"].setdefault("annotations", {})
                annotations.update(copy.deepcopy(meta[field]))
            elif field in meta:
                merged["metadata"][field] = copy.deepcopy(meta[field])
        for section, value in obj.items():
            if section not in ("metadata", "status", "apiVersion", "kind"):
                merged[section] = copy.deepcopy(value)
        if merged != current:
            if merged.get("spec") != current.get("spec"):
                merged["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            merged["metadata"]["resourceVersion"] = str(next(self._rv))
            self.objects[key] = merged
        return copy.deepcopy(self.objects[key])

    def create(self, kind: Kind, obj: Manifest) -> bool:
        self._maybe_fail("create")
        meta = obj["metadata"]
        self.calls.append(("create", kind.kind, meta["name"]))
        if (kind.kind, meta["namespace"], meta["name"]) in self.objects:
            return False
        self.add({**obj, "kind": kind.kind})
        return True

    def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        self.calls.append(("delete", kind.kind, name))
        return self.objects.pop((kind.kind, namespace, name), None) is not None

    def patch_status(self, kind: Kind, namespace: str, name: str, status: Manifest) -> None:
        self._maybe_fail("patch_status")
        self.calls.append(("patch_status", kind.kind, name))
        obj = self.objects[(kind.kind, namespace, name)]
        obj["status"] = copy.deepcopy(status)
        obj["metadata"]["resourceVersion"] = str(next(self._rv))

    def merge_patch(self, kind: Kind, namespace: str, name: str, patch: Manifest) -> Manifest:
        self._maybe_fail("merge_patch")
        self.calls.append(("merge_patch", kind.kind, name))
        key = (kind.kind, namespace, name)
        if key not in self.objects:
            raise KubeError(404, f"{kind.kind} {namespace}/{name} not found")
        merged = _merge(copy.deepcopy(self.objects[key]), patch)
        if merged.get("spec") != self.objects[key].get("spec"):
            merged["metadata"]["generation"] = merged["metadata"].get("generation", 1) + 1
        merged["metadata"]["resourceVersion"] = str(next(self._rv))
        self.objects[key] = merged
        return copy.deepcopy(merged)


def _merge(target: Manifest, patch: Manifest) -> Manifest:
    """RFC 7386 JSON merge patch."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            target[k] = _merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)
    return target
