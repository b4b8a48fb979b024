"""An InferenceService over its life on a real control plane: objects stored before a
CRD rule existed must still be deletable once the rule is in place.

The operator here is this module's own (same identity and flags as test_operator.py's).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.cluster import ControlPlane, eventually
from e2e.kube_client import KubeClient
from e2e.operator_process import CRD, OperatorProcess, install_prerequisites
from e2e.test_operator import API, apply, condition, get_is, infsvc

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def operator(
    cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    install_prerequisites(cluster)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    op = OperatorProcess(cluster, log, "--resync-seconds", "3", "-v")
    op.start()
    try:
        yield op
    finally:
        op.stop()
        op.assert_not_refused()


def _crd_without_root_rules() -> dict[str, Any]:
    crd = copy.deepcopy(yaml.safe_load(CRD.read_text()))
    for version in crd["spec"]["versions"]:
        version["schema"]["openAPIV3Schema"].pop("x-kubernetes-validations", None)
    return crd


def test_service_stored_before_the_name_rule_can_still_be_deleted(
    cluster: ControlPlane, kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    """A 60-character name, accepted by a CRD that had no name rule, carries the operator's
    finalizer; after the CRD gains the rule, deleting it must still complete (kopf patches
    the finalizer away, and the API server must not refuse that patch over the name)."""
    name = "n" * 60
    path = f"{API}/namespaces/{namespace}/inferenceservices/{name}"
    spec = {
        "model": {"source": {"path": "tiny"}},
        "roles": {"unified": {"replicas": 0}},
        "router": {"replicas": 0},
        "index": {"redisURL": "redis://127.0.0.1:1/0"},
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(_crd_without_root_rules()))
    try:
        res = apply(cluster, infsvc(name, namespace, spec))
        assert res.returncode == 0, res.stderr
        degraded = eventually(
            lambda: (
                condition(get_is(kube, namespace, name), "Degraded").get("reason") == "InvalidName"
                and get_is(kube, namespace, name)
            ),
            60,
            "Degraded=True/InvalidName on the long name",
        )
        assert "pagefleet.io/finalizer" in degraded["metadata"]["finalizers"]
    finally:
        cluster.kubectl("apply", "-f", str(CRD))
    # The rule is back: a new object with such a name is refused...
    res = apply(cluster, infsvc("m" * 60, namespace, spec))
    assert res.returncode != 0 and "at most 55 characters" in res.stderr, res.stderr
    # ... while the one stored before it is still deleted completely.
    time.sleep(4)  # a resync pass or two with the rule in place
    cluster.kubectl("delete", "infsvc", name, "-n", namespace, "--wait=false")
    eventually(lambda: kube.get_or_none(path) is None, 60, "the old long-named service gone")
    operator.check_alive()
