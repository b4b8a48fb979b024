"""`pagefleet teardown`: delete every InferenceService and wait until they are gone.

The chart runs it as a Helm pre-delete hook, while the operator is still running: kopf keeps
the finalizer `pagefleet.io/finalizer` on each InferenceService (its resync timer needs one)
and releases it when the object is deleted; the children then go with their owner through
Kubernetes garbage collection. Without this, uninstalling the operator first would leave
every InferenceService's pods running unmanaged and its deletion stuck on the finalizer.

An operator that is not running (scaled to 0, crash-looping: no Ready replica) would never
release them, and `helm uninstall` would fail at its timeout with every service stuck in
Terminating. Given the operator's Deployment, the teardown then removes the finalizer
itself: the operator's delete handler only forgets in-memory state, which a stopped
operator does not hold, and garbage collection still takes the children.

A watched namespace deleted before the uninstall holds nothing to tear down (its
InferenceServices went with it); the API server answers a list there with 403 (the
teardown's RoleBinding went too) or 404. Such a namespace is skipped once the teardown has
seen that it no longer exists; a refusal in a namespace that still exists fails as before,
since services there would be left unmanaged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import click

from pagefleet.api.inferenceservice import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)

FINALIZER = "pagefleet.io/finalizer"


class Teardown:
    """Deletes InferenceServices in the given namespaces (None: all) through `api`, a
    `kubernetes.client.CustomObjectsApi` (or anything with the same three methods)."""

    def __init__(
        self,
        api: Any,
        namespaces: list[str] | None,
        operator_running: Callable[[], bool] | None = None,
        namespace_exists: Callable[[str], bool] | None = None,
    ) -> None:
        """``operator_running``: whether an operator replica is Ready now; None: assume so
        (wait for it, never release a finalizer here). ``namespace_exists``: whether a
        namespace is still there (asked only when listing in it was refused); None: assume
        so (a refusal then fails the teardown)."""
        self.api = api
        self.namespaces = namespaces
        self.operator_running = operator_running
        self.namespace_exists = namespace_exists
        self.released: list[str] = []
        self.gone: list[str] = []  # watched namespaces found deleted: nothing to tear down

    def list(self) -> list[dict[str, Any]]:
        if self.namespaces is None:
            items: list[dict[str, Any]] = self.api.list_cluster_custom_object(
                GROUP, VERSION, PLURAL
            )["items"]
            return items
        return [item for ns in self.namespaces for item in self._list_in(ns)]

    def _list_in(self, namespace: str) -> list[dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException

        if namespace in self.gone:
            return []
        try:
            items: list[dict[str, Any]] = self.api.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL
            )["items"]
        except ApiException as exc:
            if exc.status not in (403, 404) or self.namespace_exists is None:
                raise
            if self.namespace_exists(namespace):
                raise  # services there would be left unmanaged: a person must look
            log.warning(
                "namespace %s no longer exists: nothing to tear down there (listing "
                "InferenceServices in it answered %s)",
                namespace,
                exc.status,
            )
            self.gone.append(namespace)
            return []
        return items

    def delete_all(self) -> list[str]:
        from kubernetes.client.exceptions import ApiException

        deleted = []
        for item in self.list():
            meta = item["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            try:
                self.api.delete_namespaced_custom_object(
                    GROUP, VERSION, meta["namespace"], PLURAL, meta["name"]
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
            deleted.append(f"{meta['namespace']}/{meta['name']}")
        return deleted

    def wait_gone(self, timeout_s: float, poll_s: float = 1.0) -> list[dict[str, Any]]:
        """[] once none is left; else what is left after `timeout_s`. While no operator
        runs, the deleted ones' finalizer is released here instead."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = self.list()
            if not left or time.monotonic() > deadline:
                return left
            if self.operator_running is not None and not self.operator_running():
                self.release_finalizers(left)
            time.sleep(poll_s)

    def release_finalizers(self, items: list[dict[str, Any]]) -> None:
        """Remove pagefleet's finalizer from those of ``items`` being deleted (others'
        finalizers are kept: they are their owners' to release)."""
        from kubernetes.client.exceptions import ApiException

        for item in items:
            meta = item["metadata"]
            finalizers = meta.get("finalizers") or []
            if not meta.get("deletionTimestamp") or FINALIZER not in finalizers:
                continue
            keep = [f for f in finalizers if f != FINALIZER]
            # resourceVersion: a finalizer list that changed meanwhile is a 409, retried
            # at the next poll with what the object holds then.
            patch = {
                "metadata": {"finalizers": keep, "resourceVersion": meta.get("resourceVersion")}
            }
            try:
                self.api.patch_namespaced_custom_object(
                    GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], patch
                )
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise
                continue
            ref = f"{meta['namespace']}/{meta['name']}"
            self.released.append(ref)
            log.warning("no operator is running: released %s's finalizer %s", ref, FINALIZER)


def deployment_ready(apps: Any, ref: str) -> Callable[[], bool]:
    """Whether Deployment ``ref`` ("namespace/name") has a Ready replica; a missing one has
    none. Any other API error counts as running (do not release on a doubt)."""
    namespace, _, name = ref.partition("/")

    def running() -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            dep = apps.read_namespaced_deployment(name, namespace)
        except ApiException as exc:
            return exc.status != 404
        return bool(dep.status and dep.status.ready_replicas)

    return running


def namespace_exists(core: Any) -> Callable[[str], bool]:
    """Whether a namespace exists, read through ``core`` (a ``kubernetes.client.CoreV1Api``).
    Only a 404 says it does not; any other error counts as existing (do not skip a namespace
    on a doubt)."""

    def exists(namespace: str) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            core.read_namespace(namespace)
        except ApiException as exc:
            return exc.status != 404
        return True

    return exists


@click.command("teardown")
@click.option(
    "--namespace", "-n", "namespaces", multiple=True, help="Only this namespace (repeatable)."
)
@click.option("--all-namespaces", "-A", is_flag=True, help="Every namespace.")
@click.option(
    "--timeout-seconds",
    type=click.FloatRange(min=1.0),
    default=300.0,
    show_default=True,
    help="How long to wait for the operator to release them.",
)
@click.option(
    "--operator-deployment",
    default=None,
    help="NAMESPACE/NAME of the operator's Deployment: while it has no Ready replica, the "
    "teardown releases the services' finalizer itself instead of waiting for nobody.",
)
def command(
    namespaces: tuple[str, ...],
    all_namespaces: bool,
    timeout_seconds: float,
    operator_deployment: str | None,
) -> None:
    """Delete every InferenceService and wait for the operator to release them (the chart's
    pre-delete hook, so `helm uninstall` leaves nothing stuck or unmanaged)."""
    from kubernetes import client, config

    if bool(namespaces) == all_namespaces:
        raise click.UsageError("pass either --namespace NS (repeatable) or --all-namespaces")
    if operator_deployment is not None and operator_deployment.count("/") != 1:
        raise click.BadParameter(
            f"{operator_deployment!r}: expected NAMESPACE/NAME", param_hint="--operator-deployment"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    running = (
        None
        if operator_deployment is None
        else deployment_ready(client.AppsV1Api(), operator_deployment)
    )
    teardown = Teardown(
        client.CustomObjectsApi(),
        list(namespaces) or None,
        running,
        namespace_exists(client.CoreV1Api()),
    )
    deleted = teardown.delete_all()
    log.info("deleted %d InferenceService(s): %s", len(deleted), ", ".join(deleted) or "-")
    left = teardown.wait_gone(timeout_seconds)
    if left:
        stuck = ", ".join(
            f"{i['metadata']['namespace']}/{i['metadata']['name']} "
            f"(finalizers {i['metadata'].get('finalizers')})"
            for i in left
        )
        raise click.ClickException(
            f"still present after {timeout_seconds:.0f}s: {stuck}. The operator releases "
            "them; check that its pod runs (kubectl get pods -l "
            "app.kubernetes.io/component=operator -A) and its log."
        )
    log.info("every InferenceService is gone")
