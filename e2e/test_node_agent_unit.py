"""Fast checks of the node agent's pure parts (env building, `$(VAR)` expansion, IP
allocation, the pod network). The same behaviour is exercised for real in test_cluster.py."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from pathlib import Path

import pytest

from e2e.kube_client import JSON, KubeAPIError
from e2e.node_agent import (
    POD_NETWORK,
    ContainerConfigError,
    ContainerRun,
    NodeAgent,
    check_pod_network,
    expand_vars,
    random_pod_subnet,
    termination_message,
    termination_mount,
)


class FakeClient:
    """Serves fixed ConfigMaps/Secrets by path; anything else is a 404."""

    def __init__(self, objects: dict[str, JSON]) -> None:
        self.objects = objects

    def get_or_none(self, path: str) -> JSON | None:
        return self.objects.get(path)

    def get(self, path: str) -> JSON:
        if path not in self.objects:
            raise KubeAPIError("GET", path, 404, "{}")
        return self.objects[path]


def make_agent(tmp_path: Path, objects: dict[str, JSON] | None = None) -> NodeAgent:
    subnet = ipaddress.IPv4Network("198.18.7.0/24")
    return NodeAgent(FakeClient(objects or {}), "n1", subnet, tmp_path)  # type: ignore[arg-type]


def pod(containers: list[JSON]) -> JSON:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
        "spec": {"containers": containers, "serviceAccountName": "sa"},
    }


def test_expand_vars_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand_vars("$(A)-$(B)", env) == "1-two"
    assert expand_vars("$(MISSING)", env) == "$(MISSING)"
    assert expand_vars("$$(A)", env) == "$(A)"
    assert expand_vars("cost $5 and $(A)", env) == "cost $5 and 1"


def test_container_env_order_sources_and_downward_api(tmp_path: Path) -> None:
    objects = {
        "/api/v1/namespaces/ns/configmaps/cm": {"data": {"k": "from-cm", "SHARED": "cm"}},
        "/api/v1/namespaces/ns/secrets/s": {"data": {"pw": "c2VjcmV0"}},  # "secret"
    }
    agent = make_agent(tmp_path, objects)
    spec = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
            {
                "name": "OPT",
                "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "x", "optional": True}},
            },
            {"name": "URL", "value": "http://$(IP):8000/$(CM_SHARED)"},
        ],
    }
    run = agent._admit(pod([spec]))
    env = agent._container_env(run, spec)
    assert env == {
        "CM_k": "from-cm",
        "CM_SHARED": "cm",
        "NAME": "p",
        "IP": run.ip,
        "APP": "x",
        "K": "from-cm",
        "PW": "secret",
        "URL": f"http://{run.ip}:8000/cm",
        "POD_IP": run.ip,
    }


def test_missing_configmap_is_a_config_error(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    spec = {"name": "c", "envFrom": [{"configMapRef": {"name": "absent"}}]}
    run = agent._admit(pod([spec]))
    with pytest.raises(ContainerConfigError, match='configmap "absent" not found'):
        agent._container_env(run, spec)


def test_ip_allocation_is_distinct_and_walks_forward(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)

    def named(name: str) -> JSON:
        return {**pod([{"name": "c"}]), "metadata": {"name": name, "namespace": "ns", "uid": name}}

    runs = [agent._admit(named(f"u{i}")) for i in range(3)]
    assert [r.ip for r in runs] == ["198.18.7.2", "198.18.7.3", "198.18.7.4"]
    del agent._runs["u0"]
    # A freed address is not handed out again straight away.
    nxt = agent._admit(named("q"))
    assert nxt.ip == "198.18.7.5"


def test_random_subnet_is_inside_pod_network() -> None:
    for _ in range(20):
        net = random_pod_subnet()
        assert net.prefixlen == 24 and net.subnet_of(POD_NETWORK)


def test_pod_network_addresses_bind_locally() -> None:
    check_pod_network()
    ip = "198.19.254.9"
    with socket.socket() as srv:
        srv.bind((ip, 0))
        srv.listen()
        with socket.create_connection(srv.getsockname(), timeout=2):
            conn, _ = srv.accept()
            conn.close()


def test_termination_message_file_is_per_container_and_private(tmp_path: Path) -> None:
    """The container writes /dev/termination-log; the agent reads it from that container's
    own file, and the host's /dev is untouched (a kubelet's bind mount, done with a private
    mount namespace since pods are host processes)."""
    spec: JSON = {"name": "c", "terminationMessagePath": "/dev/termination-log"}
    log = tmp_path / "c.log"
    prefix, host_file = termination_mount(spec, log)
    if os.geteuid() != 0:  # no mount namespace without root: no file, logs only
        assert (prefix, host_file) == ([], None)
        return
    assert host_file is not None and host_file.read_bytes() == b""
    script = "echo 'model /m does not exist' > /dev/termination-log; exit 3"
    assert subprocess.run([*prefix, "sh", "-c", script], check=False).returncode == 3
    assert not Path("/dev/termination-log").exists()
    run = ContainerRun(name="c", spec=spec, log_path=log, termination_file=host_file)
    assert termination_message(run, 3) == "model /m does not exist\n"
    # The next run starts with an empty file again.
    _, again = termination_mount(spec, log)
    assert again == host_file and host_file.read_bytes() == b""


def test_fallback_to_logs_on_error_takes_this_runs_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    log.write_bytes(b"old run\n" + b"".join(b"line %d\n" % i for i in range(200)))
    spec: JSON = {"name": "c", "terminationMessagePolicy": "FallbackToLogsOnError"}
    run = ContainerRun(name="c", spec=spec, log_path=log, log_offset=len(b"old run\n"))
    msg = termination_message(run, 1)
    assert msg.endswith("line 199\n") and "old run" not in msg
    assert len(msg.splitlines()) == 80
    assert termination_message(run, 0) == ""  # only failures fall back to the log
    run.spec = {"name": "c"}  # policy File (the default): no file, no message
    assert termination_message(run, 1) == ""
