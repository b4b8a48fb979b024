"""Session fixtures for the e2e suite: one real control plane + node agent for all tests.

Fixtures (documented in e2e/README.md):
- `cluster` (session): a started `e2e.cluster.ControlPlane` whose node agent runs pods
  (`cluster.node_agent`).
- `node_agent` (session): that `e2e.node_agent.NodeAgentProcess` (pod log paths).
- `kube` (session): an admin `e2e.kube_client.KubeClient`.
- `namespace` (function): a fresh namespace, deleted after the test.
- `operator` (module): a `pagefleet operator` process (3 s resync, verbose) on the cluster,
  the CRD and RBAC installed; each module that asks gets its own, stopped after it and
  checked for refused API calls. A module may define its own (other flags) instead.

The suite runs inside a network namespace made for the run (scripts/in-netns.sh: `lo` up,
the pod range 198.18.0.0/15 local), never in the host's. Started outside one (a plain
`pytest e2e/...`), pytest re-executes itself through scripts/in-netns.sh with the same
arguments before collecting anything.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.cluster import BinariesMissingError, ControlPlane, tail
from e2e.kube_client import KubeAPIError, KubeClient
from e2e.node_agent import NodeAgentProcess, PodNetworkError, check_pod_network
from e2e.operator_process import OperatorProcess, install_prerequisites

LOG_RETENTION_S = 24 * 3600
IN_NETNS = Path(__file__).resolve().parents[1] / "scripts" / "in-netns.sh"


def pytest_configure(config: pytest.Config) -> None:
    """Outside the run's own network namespace, start over inside one (same arguments)."""
    if os.environ.get("PAGEFLEET_NETNS") == "1":
        return
    args = [str(a) for a in config.invocation_params.args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(config.invocation_params.dir)
    os.execv("/bin/bash", ["bash", str(IN_NETNS), sys.executable, "-m", "pytest", *args])


def e2e_log_dir() -> Path:
    """A fresh directory for this run's component and pod logs.

    Not pytest's tmp dir: pytest keeps only its last 3 base dirs per user, and on a machine
    where several suites run at once the logs of a failed e2e run would vanish within
    minutes. Runs older than a day are pruned. PAGEFLEET_E2E_LOGS overrides the root.
    """
    default = Path(tempfile.gettempdir(), "pagefleet-e2e")
    root = Path(os.environ.get("PAGEFLEET_E2E_LOGS") or default)
    root.mkdir(parents=True, exist_ok=True)
    cutoff = time.time() - LOG_RETENTION_S
    for old in root.iterdir():
        if old.is_dir() and old.stat().st_mtime < cutoff:
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=root))


@pytest.fixture(scope="session")
def cluster() -> Iterator[ControlPlane]:
    # Logs outlive the control plane's own work directory so failures can be inspected.
    try:
        check_pod_network()
    except PodNetworkError as exc:
        pytest.fail(str(exc), pytrace=False)
    logs = e2e_log_dir()
    cp = ControlPlane(logs_in=logs / "control-plane")
    missing = None
    try:
        cp.start()
    except BinariesMissingError as exc:
        missing = str(exc)
    if missing is not None:  # fail (never skip) with the build command, outside the except
        pytest.fail(missing, pytrace=False)
    try:
        cp.start_node_agent(log_dir=logs / "node-agent")
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def node_agent(cluster: ControlPlane) -> NodeAgentProcess:
    assert cluster.node_agent is not None
    return cluster.node_agent


@pytest.fixture(scope="session")
def kube(cluster: ControlPlane) -> KubeClient:
    return KubeClient.from_kubeconfig(cluster.kubeconfig_path)


@pytest.fixture(scope="module")
def operator(
    cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    install_prerequisites(cluster)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    op = OperatorProcess(cluster, log, "--resync-seconds", "3", "--verbose")
    op.start()
    try:
        yield op
    finally:
        op.stop()
        op.assert_not_refused()


@pytest.fixture
def namespace(
    cluster: ControlPlane, kube: KubeClient, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A fresh namespace named after the test; its deletion is requested, not awaited."""
    base = "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())
    name = f"{base[:40].strip('-')}-{secrets.token_hex(3)}"
    kube.create("/api/v1/namespaces", {"metadata": {"name": name}})
    try:
        yield name
    finally:
        try:
            kube.delete(f"/api/v1/namespaces/{name}")
        except KubeAPIError as exc:
            if exc.status != 404:
                raise
        cluster.check_alive()
        if cluster.node_agent is not None:
            cluster.node_agent.check_alive()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Attach control-plane and node-agent log tails to a failed e2e test's report."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    cp = getattr(item, "funcargs", {}).get("cluster")
    if not isinstance(cp, ControlPlane):
        return
    errors = cp.logs_tail(lines=8, errors_only=True)
    report.sections.append(("control plane errors (full logs at the paths shown)", errors))
    agent = cp.node_agent
    if agent is not None:
        title = f"node agent log ({agent.log_path}; pod logs under {agent.log_dir / 'pods'})"
        report.sections.append((title, tail(agent.log_path, 40)))
