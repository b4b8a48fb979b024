"""`pagefleet teardown`: delete every InferenceService and wait until they are gone.

The chart runs it as a Helm pre-delete hook, while the operator is still running: kopf keeps
the finalizer `pagefleet.io/finalizer` on each InferenceService (its resync timer needs one)
and releases it when the object is deleted; the children then go with their owner through
Kubernetes garbage collection. Without this, uninstalling the operator first would leave
every InferenceService's pods running unmanaged and its deletion stuck on the finalizer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import click

from pagefleet.api.inferenceservice import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)


class Teardown:
    """Deletes InferenceServices in the given namespaces (None: all) through `api`, a
    `kubernetes.client.CustomObjectsApi` (or anything with the same three methods)."""

    def __init__(self, api: Any, namespaces: list[str] | None) -> None:
        self.api = api
        self.namespaces = namespaces

    def list(self) -> list[dict[str, Any]]:
        if self.namespaces is None:
            items: list[dict[str, Any]] = self.api.list_cluster_custom_object(
                GROUP, VERSION, PLURAL
            )["items"]
            return items
        return [
            item
            for ns in self.namespaces
            for item in self.api.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
        ]

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
        """[] once none is left; else what is left after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = self.list()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(poll_s)


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
def command(namespaces: tuple[str, ...], all_namespaces: bool, timeout_seconds: float) -> None:
    """Delete every InferenceService and wait for the operator to release them (the chart's
    pre-delete hook, so `helm uninstall` leaves nothing stuck or unmanaged)."""
    from kubernetes import client, config

    if bool(namespaces) == all_namespaces:
        raise click.UsageError("pass either --namespace NS (repeatable) or --all-namespaces")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    teardown = Teardown(client.CustomObjectsApi(), list(namespaces) or None)
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
