"""A small "kubelet" that runs the pods bound to its Node as local processes.

It registers a Node (allocatable cpu/memory/pods, Ready, no taints), renews its Lease, watches
pods with `spec.nodeName=<node>`, and for each pod:

- gives it its own IP from the agent's pod subnet (see below) and passes it as env `POD_IP`;
- runs each container's `command` + `args` (the image is ignored) as a local process in its
  own process group, working directory = the repo root (or `workingDir` if it exists here),
  with env from `env` (value, `$(VAR)` expansion, `valueFrom` fieldRef / configMapKeyRef /
  secretKeyRef / resourceFieldRef) and `envFrom` (configMapRef / secretRef, `prefix`);
  Kubernetes `$(VAR)` expansion applies to command and args, so a container binds its pod
  address with e.g. `args: ["--host", "$(POD_IP)", "--port", "8080"]`;
- reports status: Pending -> Running, podIP/podIPs, hostIP, containerStatuses, conditions;
  Ready=True only once every container's readinessProbe (httpGet, tcpSocket or exec) passes,
  or as soon as it started when it has no probe;
- restarts exited containers per restartPolicy (backoff 1s doubling to 30s), or marks the pod
  Succeeded/Failed;
- finishes deletions: SIGTERM to the process group, SIGKILL after the grace period, then
  deletes the pod object with grace 0.

Pod IPs. Pods need distinct addresses the host can reach, and EndpointSlices may not carry
loopback (127/8) or link-local addresses (the apiserver rejects them). The agent therefore
uses the benchmarking range 198.18.0.0/15 (RFC 2544, never routed on the Internet), which
must be local (an "AnyIP" route, `ip route add local 198.18.0.0/15 dev lo`: every address in
it then binds and answers like 127.0.0.1 does). The agent never adds that route itself: the
e2e run creates a network namespace of its own where it holds (scripts/in-netns.sh), so the
host's network is never touched. Each agent takes a random /24 from the range (so
concurrent runs do not collide); pods get .2, .3, ... and the node itself .1.

Pod logs (stdout+stderr of every container, appended across restarts) go to
`<log-dir>/pods/<namespace>_<pod>/<container>.log`.

Run as a process from the repo root: `python -m e2e.node_agent --kubeconfig K --log-dir D`
(NodeAgentProcess does this for the e2e fixtures). SIGTERM stops every pod and deletes the Node.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ipaddress
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

import yaml

from e2e.kube_client import JSON, KubeAPIError, KubeClient
from pagefleet.dev import process

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
POD_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
LEASE_RENEW_S = 10.0
LEASE_DURATION_S = 40
RESTART_BACKOFF_MAX_S = 30.0
# What the kubelet keeps of a termination message, and of the log tail that stands in for it
# under terminationMessagePolicy FallbackToLogsOnError.
TERMINATION_MESSAGE_MAX_BYTES = 4096
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


class PodNetworkError(RuntimeError):
    """The pod address range is not usable on this host."""


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_pod_network(network: ipaddress.IPv4Network = POD_NETWORK) -> None:
    """Raise PodNetworkError unless every address of `network` binds here.

    Only checks: the route belongs to the run's own network namespace (scripts/in-netns.sh),
    never to the host's, so the agent does not add it.
    """
    probes = (network.network_address + 1, network.broadcast_address - 1)
    if all(_can_bind(str(ip)) for ip in probes):
        return
    raise PodNetworkError(
        f"pod addresses in {network} do not bind here: the e2e suite must run inside a network "
        f"namespace made for the run, where they are local. Run it through "
        f"`scripts/in-netns.sh`, e.g. `flock /tmp/pf-e2e.lock scripts/in-netns.sh "
        f".venv/bin/pytest e2e` or `make e2e` (e2e/README.md)"
    )


def _can_bind(ip: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def random_pod_subnet() -> ipaddress.IPv4Network:
    """A /24 out of POD_NETWORK, chosen at random so concurrent agents rarely share one."""
    subnets = list(POD_NETWORK.subnets(new_prefix=24))
    return random.SystemRandom().choice(subnets)


def expand_vars(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined vars are substituted, `$$` escapes a `$`,
    unknown references are left verbatim (as the kubelet does)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR_REF.sub(sub, text)


def termination_mount(spec: JSON, log_path: Path) -> tuple[list[str], Path | None]:
    """Give one container run its own file at its terminationMessagePath, as the kubelet
    does by bind-mounting a per-container file there.

    Pods are host processes, so the agent runs each in a private mount namespace (root
    only) with an overlay on the path's directory whose upper layer holds a fresh, empty
    file; what the process writes there lands in that file and nowhere else on the host.
    Returns the argv prefix and the host file; ``([], None)`` where this is not possible
    (not root, no such directory), and then only FallbackToLogsOnError gives a message."""
    target = Path(spec.get("terminationMessagePath") or "/dev/termination-log")
    if os.geteuid() != 0 or not target.is_absolute() or not target.parent.is_dir():
        return [], None
    upper = log_path.with_suffix(".termination")
    work = log_path.with_suffix(".termination-work")
    shutil.rmtree(upper, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    upper.mkdir(parents=True)
    work.mkdir()
    host_file = upper / target.name
    host_file.touch()
    opts = f"lowerdir={target.parent},upperdir={upper},workdir={work}"
    # If the overlay cannot be mounted (e.g. the log dir is itself on overlayfs), the
    # container still starts, without a termination file, as it would have before.
    script = f'mount -t overlay overlay -o {opts} {target.parent} 2>/dev/null || true; exec "$@"'
    prefix = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh"]
    return prefix, host_file


def termination_message(c: ContainerRun, exit_code: int) -> str:
    """The message of a run that just ended, by the kubelet's rules: the termination file's
    content (at most 4 KiB); if that is empty, the exit failed and the policy is
    FallbackToLogsOnError, the tail of this run's log (80 lines, 2 KiB)."""
    message = ""
    if c.termination_file is not None:
        try:
            with c.termination_file.open("rb") as f:
                message = f.read(TERMINATION_MESSAGE_MAX_BYTES).decode(errors="replace")
        except OSError:
            message = ""
    policy = c.spec.get("terminationMessagePolicy", "File")
    if not message and exit_code != 0 and policy == "FallbackToLogsOnError":
        try:
            with c.log_path.open("rb") as f:
                f.seek(c.log_offset)
                out = f.read()
        except OSError:
            out = b""
        lines = out.splitlines(keepends=True)[-FALLBACK_LOG_LINES:]
        message = b"".join(lines)[-FALLBACK_LOG_BYTES:].decode(errors="replace")
    return message


class ContainerConfigError(Exception):
    """A container cannot start yet: a referenced ConfigMap/Secret/key is missing."""


@dataclass(slots=True)
class ProbeState:
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0


@dataclass(slots=True)
class ContainerRun:
    """One container of a pod and the local process standing in for it."""

    name: str
    spec: JSON
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: str | None = None
    restart_count: int = 0
    ready: bool = False
    last_terminated: JSON | None = None
    terminated: JSON | None = None  # set when it will not be restarted
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    next_start_at: float = 0.0
    backoff_s: float = 1.0
    probe: ProbeState = field(default_factory=ProbeState)
    log_offset: int = 0  # where this run's output starts in log_path (appended across runs)
    termination_file: Path | None = None  # this run's file behind terminationMessagePath


@dataclass(slots=True)
class PodRun:
    """What the agent tracks for one pod UID."""

    uid: str
    namespace: str
    name: str
    ip: str
    containers: list[ContainerRun]
    start_time: str
    pod: JSON
    kill_deadline: float | None = None
    conditions_since: dict[str, tuple[str, str]] = field(default_factory=dict)
    last_status: JSON | None = None
    unsupported: str = ""


class NodeAgent:
    """Runs pods bound to `node_name` as local processes until `stop()`."""

    def __init__(
        self,
        client: KubeClient,
        node_name: str,
        subnet: ipaddress.IPv4Network,
        log_dir: Path,
        workdir: Path = REPO_ROOT,
        tick_s: float = 0.2,
    ) -> None:
        if not subnet.subnet_of(POD_NETWORK):  # type: ignore[arg-type]
            raise ValueError(f"pod subnet {subnet} must lie inside {POD_NETWORK}")
        self.client = client
        self.node_name = node_name
        self.subnet = subnet
        self.node_ip = str(subnet.network_address + 1)
        self.log_dir = log_dir
        self.workdir = workdir
        self.tick_s = tick_s
        self._pods_seen: dict[str, JSON] = {}  # uid -> latest object from the watch
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._runs: dict[str, PodRun] = {}
        self._next_ip = 2
        self._lease_renewed = 0.0

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Register the node, then reconcile until stop(); always kills every pod on exit."""
        check_pod_network()
        self._register_node()
        watcher = threading.Thread(target=self._watch_pods, name="pod-watch", daemon=True)
        watcher.start()
        try:
            while not self._stop.is_set():
                self._renew_lease()
                self._reconcile_all()
                self._wake.wait(self.tick_s)
                self._wake.clear()
        finally:
            for run in list(self._runs.values()):
                for c in run.containers:
                    self._kill(c, grace_s=5.0)
            with contextlib.suppress(Exception):
                self.client.delete(f"/api/v1/nodes/{self.node_name}")
            logger.info("node agent %s stopped", self.node_name)

    # -- node ------------------------------------------------------------------------------

    def _register_node(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "pagefleet.io/e2e-node-agent": "true",
                },
            },
            "spec": {"podCIDR": str(self.subnet), "podCIDRs": [str(self.subnet)]},
        }
        try:
            self.client.create("/api/v1/nodes", node)
        except KubeAPIError as exc:
            if exc.status != 409:
                raise
        ts = now_rfc3339()
        resources = {"cpu": "32", "memory": "256Gi", "pods": "110", "ephemeral-storage": "100Gi"}

        def cond(type_: str, status: str, reason: str) -> JSON:
            return {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": "pagefleet e2e node agent",
                "lastHeartbeatTime": ts,
                "lastTransitionTime": ts,
            }

        status = {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                cond("Ready", "True", "KubeletReady"),
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": self.node_ip},
                {"type": "Hostname", "address": self.node_name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": "pagefleet-e2e",
                "systemUUID": "pagefleet-e2e",
                "bootID": "pagefleet-e2e",
                "kernelVersion": os.uname().release,
                "osImage": "local processes",
                "containerRuntimeVersion": "local://0",
                "kubeletVersion": "pagefleet-e2e-node-agent",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
        self.client.merge_patch(f"/api/v1/nodes/{self.node_name}/status", {"status": status})
        # Admission (TaintNodesByCondition) taints every new Node not-ready; normally the
        # node-lifecycle controller lifts it, but that controller is off in this cluster.
        node_obj = self.client.get(f"/api/v1/nodes/{self.node_name}")
        taints = node_obj["spec"].get("taints") or []
        kept = [t for t in taints if t["key"] != "node.kubernetes.io/not-ready"]
        if kept != taints:
            self.client.merge_patch(f"/api/v1/nodes/{self.node_name}", {"spec": {"taints": kept}})
        logger.info("registered node %s (pods in %s)", self.node_name, self.subnet)

    def _renew_lease(self) -> None:
        if time.monotonic() - self._lease_renewed < LEASE_RENEW_S:
            return
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node_name}"
        spec = {
            "holderIdentity": self.node_name,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "renewTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        }
        try:
            if self.client.get_or_none(path) is None:
                self.client.create(
                    "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                    {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": self.node_name, "namespace": "kube-node-lease"},
                        "spec": spec,
                    },
                )
            else:
                self.client.merge_patch(path, {"spec": spec})
            self._lease_renewed = time.monotonic()
        except KubeAPIError as exc:
            logger.warning("lease renewal failed, retrying next tick: %s", exc)

    # -- pod watch -------------------------------------------------------------------------

    def _watch_pods(self) -> None:
        query = {"fieldSelector": f"spec.nodeName={self.node_name}"}
        rv = ""
        while not self._stop.is_set():
            try:
                if not rv:
                    listing = self.client.get("/api/v1/pods", query)
                    with self._lock:
                        self._pods_seen = {p["metadata"]["uid"]: p for p in listing["items"]}
                    rv = listing["metadata"]["resourceVersion"]
                    self._wake.set()
                for ev in self.client.watch("/api/v1/pods", {**query, "resourceVersion": rv}, 30):
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        rv = ""  # usually 410 Gone: relist
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    if ev["type"] == "BOOKMARK":
                        continue
                    with self._lock:
                        if ev["type"] == "DELETED":
                            self._pods_seen.pop(obj["metadata"]["uid"], None)
                        else:
                            self._pods_seen[obj["metadata"]["uid"]] = obj
                    self._wake.set()
                    if self._stop.is_set():
                        return
            except Exception as exc:
                if self._stop.is_set():
                    return
                logger.warning("pod watch failed, relisting: %s", exc)
                rv = ""
                time.sleep(0.5)

    # -- reconcile -------------------------------------------------------------------------

    def _reconcile_all(self) -> None:
        with self._lock:
            seen = dict(self._pods_seen)
        for uid, pod in seen.items():
            run = self._runs.get(uid)
            if run is None:
                if pod["metadata"].get("deletionTimestamp") or pod.get("status", {}).get(
                    "phase"
                ) in ("Succeeded", "Failed"):
                    # Never started here (e.g. left over from an earlier agent): just finish it.
                    if pod["metadata"].get("deletionTimestamp"):
                        self._finish_delete(uid, pod)
                    continue
                run = self._admit(pod)
            run.pod = pod
            try:
                self._reconcile(run)
            except Exception:
                logger.exception("reconciling pod %s/%s failed", run.namespace, run.name)
        # Pods gone from the API (force-deleted): their processes must not linger.
        for uid in [u for u in self._runs if u not in seen]:
            run = self._runs.pop(uid)
            for c in run.containers:
                self._kill(c, grace_s=2.0)

    def _allocate_ip(self) -> str:
        used = {r.ip for r in self._runs.values()}
        hosts = self.subnet.num_addresses - 2
        for _ in range(hosts):
            # Walk forward rather than reuse the lowest free address: a just-freed IP may
            # still sit in an EndpointSlice for a moment.
            candidate = str(self.subnet.network_address + self._next_ip)
            self._next_ip = self._next_ip + 1 if self._next_ip < hosts else 2
            if candidate not in used:
                return candidate
        raise RuntimeError(f"pod subnet {self.subnet} is exhausted ({len(used)} pods)")

    def _admit(self, pod: JSON) -> PodRun:
        meta = pod["metadata"]
        pod_dir = self.log_dir / "pods" / f"{meta['namespace']}_{meta['name']}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        containers = [
            ContainerRun(name=c["name"], spec=c, log_path=pod_dir / f"{c['name']}.log")
            for c in pod["spec"]["containers"]
        ]
        run = PodRun(
            uid=meta["uid"],
            namespace=meta["namespace"],
            name=meta["name"],
            ip=self._allocate_ip(),
            containers=containers,
            start_time=now_rfc3339(),
            pod=pod,
        )
        if pod["spec"].get("initContainers"):
            run.unsupported = "init containers are not supported by the e2e node agent"
        self._runs[run.uid] = run
        logger.info("admitted pod %s/%s at %s", run.namespace, run.name, run.ip)
        return run

    def _reconcile(self, run: PodRun) -> None:
        pod = run.pod
        if pod["metadata"].get("deletionTimestamp"):
            self._terminate(run)
            return
        policy = pod["spec"].get("restartPolicy", "Always")
        now = time.monotonic()
        for c in run.containers:
            if run.unsupported:
                c.waiting_reason, c.waiting_message = "CreateContainerError", run.unsupported
                continue
            if c.proc is not None and c.proc.poll() is not None:
                self._on_exit(c, policy, now)
            if c.proc is None and c.terminated is None and now >= c.next_start_at:
                self._start(run, c)
            if c.proc is not None:
                self._probe(run, c, now)
        self._report(run)

    def _on_exit(self, c: ContainerRun, policy: str, now: float) -> None:
        assert c.proc is not None
        code = c.proc.returncode
        # A negative return code is death by signal; report it as the shell would (128+n).
        exit_code = 128 - code if code < 0 else code
        state = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": now_rfc3339(),
        }
        message = termination_message(c, exit_code)
        if message:
            state["message"] = message
        c.proc = None
        c.ready = False
        c.probe = ProbeState()
        restart = policy == "Always" or (policy == "OnFailure" and exit_code != 0)
        if restart:
            c.last_terminated = state
            c.restart_count += 1
            c.waiting_reason = "CrashLoopBackOff"
            c.waiting_message = f"exited {exit_code}; restarting in {c.backoff_s:.0f}s"
            c.next_start_at = now + c.backoff_s
            c.backoff_s = min(c.backoff_s * 2, RESTART_BACKOFF_MAX_S)
        else:
            c.terminated = state
        logger.info("container %s exited %d (restart=%s)", c.name, exit_code, restart)

    def _start(self, run: PodRun, c: ContainerRun) -> None:
        try:
            env = self._container_env(run, c.spec)
            kubeconfig = self._service_account_kubeconfig(run)
        except ContainerConfigError as exc:
            c.waiting_reason, c.waiting_message = "CreateContainerConfigError", str(exc)
            c.next_start_at = time.monotonic() + 1.0
            return
        argv = [expand_vars(a, env) for a in [*c.spec.get("command", []), *c.spec.get("args", [])]]
        if not argv:
            c.waiting_reason = "RunContainerError"
            c.waiting_message = "no command: the e2e node agent runs `command`/`args`, not images"
            c.next_start_at = time.monotonic() + 5.0
            return
        wd = c.spec.get("workingDir")
        cwd = Path(wd) if wd and Path(wd).is_dir() else self.workdir
        wrapper, c.termination_file = termination_mount(c.spec, c.log_path)
        with c.log_path.open("ab") as log:
            log.write(f"--- {now_rfc3339()} start: {argv}\n".encode())
            c.log_offset = log.tell()
        try:
            # Own process group; dies with the agent even if it is SIGKILLed.
            c.proc = process.spawn(
                [*wrapper, *argv],
                c.log_path,
                cwd=cwd,
                env=self._process_env(env, kubeconfig),
            )
        except OSError as exc:
            c.waiting_reason = "RunContainerError"
            c.waiting_message = f"cannot run {argv[0]!r}: {exc}"
            c.next_start_at = time.monotonic() + c.backoff_s
            c.backoff_s = min(c.backoff_s * 2, RESTART_BACKOFF_MAX_S)
            with c.log_path.open("ab") as log:
                log.write(f"{c.waiting_message}\n".encode())
            return
        c.started_at = now_rfc3339()
        c.waiting_reason = c.waiting_message = ""
        probe = c.spec.get("readinessProbe")
        c.probe = ProbeState(next_at=time.monotonic() + (probe or {}).get("initialDelaySeconds", 0))
        c.ready = probe is None
        logger.info("started %s/%s[%s] pid %d", run.namespace, run.name, c.name, c.proc.pid)

    # -- env -------------------------------------------------------------------------------

    def _container_env(self, run: PodRun, spec: JSON) -> dict[str, str]:
        """The container's environment as the kubelet would build it (envFrom, then env)."""
        # POD_IP first, so env values and args can reference $(POD_IP) without declaring it.
        env: dict[str, str] = {"POD_IP": run.ip}
        ns = run.namespace
        for src in spec.get("envFrom", []):
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                ref = src["configMapRef"]
                data = self._config_map(ns, ref["name"], ref.get("optional", False))
            elif "secretRef" in src:
                ref = src["secretRef"]
                data = self._secret(ns, ref["name"], ref.get("optional", False))
            else:
                continue
            env.update({prefix + k: v for k, v in data.items()})
        for var in spec.get("env", []):
            name = var["name"]
            if "valueFrom" in var:
                value = self._value_from(run, spec, var["valueFrom"])
                if value is None:
                    continue
                env[name] = value
            else:
                env[name] = expand_vars(var.get("value", ""), env)
        return env

    def _service_account_kubeconfig(self, run: PodRun) -> Path | None:
        """A kubeconfig holding a token for the pod's ServiceAccount, bound to the pod.

        Stands in for the projected token volume (which needs a mount namespace): clients
        fall back to $KUBECONFIG when the in-cluster token file is absent, so a pod talks to
        the apiserver with exactly its ServiceAccount's RBAC.
        """
        spec = run.pod["spec"]
        projected = any(
            "serviceAccountToken" in src
            for vol in spec.get("volumes", [])
            for src in (vol.get("projected") or {}).get("sources", [])
        )
        # automountServiceAccountToken: false means no token, unless the pod asks for one
        # explicitly through a projected serviceAccountToken volume.
        if spec.get("automountServiceAccountToken") is False and not projected:
            return None
        path = self.log_dir / "pods" / f"{run.namespace}_{run.name}" / "kubeconfig"
        if path.exists():
            return path
        sa = run.pod["spec"].get("serviceAccountName") or "default"
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 7200,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": run.name,
                    "uid": run.uid,
                },
            },
        }
        try:
            resp = self.client.create(
                f"/api/v1/namespaces/{run.namespace}/serviceaccounts/{sa}/token", request
            )
        except KubeAPIError as exc:
            raise ContainerConfigError(f"token for serviceaccount {sa!r}: {exc}") from exc
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "cluster",
                    "cluster": {
                        "server": self.client.config.server,
                        "certificate-authority": self.client.config.ca_path,
                    },
                }
            ],
            "users": [{"name": sa, "user": {"token": resp["status"]["token"]}}],
            "contexts": [
                {
                    "name": sa,
                    "context": {"cluster": "cluster", "user": sa, "namespace": run.namespace},
                }
            ],
            "current-context": sa,
        }
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        path.chmod(0o600)
        return path

    @staticmethod
    def _process_env(env: dict[str, str], kubeconfig: Path | None) -> dict[str, str]:
        # Inherit the host environment (PATH, the venv, model caches), but never the
        # agent's own credentials.
        base = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        if kubeconfig is not None:
            base["KUBECONFIG"] = str(kubeconfig)
        return {**base, **env}

    def _value_from(self, run: PodRun, spec: JSON, src: JSON) -> str | None:
        ns = run.namespace
        if "fieldRef" in src:
            return self._field_ref(run, src["fieldRef"]["fieldPath"])
        if "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            data = self._config_map(ns, ref["name"], ref.get("optional", False))
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            data = self._secret(ns, ref["name"], ref.get("optional", False))
        elif "resourceFieldRef" in src:
            res = src["resourceFieldRef"]["resource"]  # e.g. limits.cpu
            kind, _, name = res.partition(".")
            return str(spec.get("resources", {}).get(kind, {}).get(name, "0"))
        else:
            raise ContainerConfigError(f"unsupported valueFrom {sorted(src)}")
        if ref["key"] in data:
            return data[ref["key"]]
        if ref.get("optional", False):
            return None
        raise ContainerConfigError(f"key {ref['key']!r} not found in {ref['name']!r}")

    def _field_ref(self, run: PodRun, path: str) -> str:
        meta = run.pod["metadata"]
        simple = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"],
            "spec.nodeName": self.node_name,
            "spec.serviceAccountName": run.pod["spec"].get("serviceAccountName", "default"),
            "status.podIP": run.ip,
            "status.podIPs": run.ip,
            "status.hostIP": self.node_ip,
            "status.hostIPs": self.node_ip,
        }
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return str(meta.get(m.group(1), {}).get(m.group(2), ""))
        raise ContainerConfigError(f"unsupported fieldRef {path!r}")

    def _config_map(self, ns: str, name: str, optional: bool) -> dict[str, str]:
        obj = self.client.get_or_none(f"/api/v1/namespaces/{ns}/configmaps/{name}")
        if obj is None:
            if optional:
                return {}
            raise ContainerConfigError(f'configmap "{name}" not found')
        return dict(obj.get("data") or {})

    def _secret(self, ns: str, name: str, optional: bool) -> dict[str, str]:
        obj = self.client.get_or_none(f"/api/v1/namespaces/{ns}/secrets/{name}")
        if obj is None:
            if optional:
                return {}
            raise ContainerConfigError(f'secret "{name}" not found')
        data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        data.update(obj.get("stringData") or {})
        return data

    # -- probes ----------------------------------------------------------------------------

    def _probe(self, run: PodRun, c: ContainerRun, now: float) -> None:
        spec = c.spec.get("readinessProbe")
        if spec is None or now < c.probe.next_at:
            return
        c.probe.next_at = now + spec.get("periodSeconds", 10)
        ok = self._run_probe(run, c, spec)
        if ok:
            c.probe.successes += 1
            c.probe.failures = 0
            if c.probe.successes >= spec.get("successThreshold", 1):
                c.ready = True
        else:
            c.probe.failures += 1
            c.probe.successes = 0
            if c.probe.failures >= spec.get("failureThreshold", 3):
                c.ready = False

    def _port(self, c: ContainerRun, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports", []):
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"container {c.name} has no port named {port!r}")

    def _run_probe(self, run: PodRun, c: ContainerRun, spec: JSON) -> bool:
        timeout = float(spec.get("timeoutSeconds", 1))
        try:
            if "httpGet" in spec:
                http = spec["httpGet"]
                host = http.get("host") or run.ip
                scheme = http.get("scheme", "HTTP").lower()
                url = f"{scheme}://{host}:{self._port(c, http['port'])}{http.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in http.get("httpHeaders", [])}
                req = urllib.request.Request(url, headers=headers)
                # No proxy: probes go straight to the pod, whatever HTTP(S)_PROXY says.
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(req, timeout=timeout) as resp:
                    return 200 <= resp.status < 400
            if "tcpSocket" in spec:
                port = self._port(c, spec["tcpSocket"]["port"])
                with socket.create_connection((run.ip, port), timeout=timeout):
                    return True
            if "exec" in spec:
                env = {**os.environ, "POD_IP": run.ip}
                res = subprocess.run(
                    spec["exec"]["command"], env=env, capture_output=True, timeout=timeout
                )
                return res.returncode == 0
        except (OSError, urllib.error.URLError, subprocess.TimeoutExpired, ValueError):
            return False
        return False

    # -- termination -----------------------------------------------------------------------

    def _kill(self, c: ContainerRun, grace_s: float) -> None:
        proc = c.proc
        if proc is None:
            return
        process.stop(proc, grace_s)
        c.proc = None
        c.ready = False

    def _terminate(self, run: PodRun) -> None:
        """Graceful stop without blocking the loop: SIGTERM now, SIGKILL at the deadline."""
        now = time.monotonic()
        if run.kill_deadline is None:
            grace = run.pod["metadata"].get("deletionGracePeriodSeconds")
            if grace is None:
                grace = run.pod["spec"].get("terminationGracePeriodSeconds", 30)
            run.kill_deadline = now + float(grace)
            for c in run.containers:
                c.ready = False
                if c.proc is not None:
                    process.signal_group(c.proc, signal.SIGTERM)
            self._report(run)  # Ready=False right away, as the kubelet does
        alive = [c for c in run.containers if c.proc is not None and c.proc.poll() is None]
        if alive and now < run.kill_deadline:
            return
        for c in run.containers:
            self._kill(c, grace_s=0.0)
        self._finish_delete(run.uid, run.pod)
        self._runs.pop(run.uid, None)
        logger.info("pod %s/%s terminated", run.namespace, run.name)

    def _finish_delete(self, uid: str, pod: JSON) -> None:
        meta = pod["metadata"]
        try:
            self.client.delete(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
            )
        except KubeAPIError as exc:
            if exc.status not in (404, 409):
                raise

    # -- status ----------------------------------------------------------------------------

    def _condition(self, run: PodRun, type_: str, ok: bool, reason: str = "") -> JSON:
        status = "True" if ok else "False"
        prev = run.conditions_since.get(type_)
        if prev is None or prev[0] != status:
            run.conditions_since[type_] = (status, now_rfc3339())
        cond: JSON = {
            "type": type_,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": run.conditions_since[type_][1],
        }
        if reason:
            cond["reason"] = reason
        return cond

    def _container_status(self, c: ContainerRun) -> JSON:
        if c.proc is not None:
            state: JSON = {"running": {"startedAt": c.started_at}}
        elif c.terminated is not None:
            state = {"terminated": c.terminated}
        else:
            state = {"waiting": {"reason": c.waiting_reason, "message": c.waiting_message}}
        status: JSON = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": "",
            "containerID": f"local://{c.proc.pid}" if c.proc is not None else "",
            "ready": c.ready and c.proc is not None,
            "started": c.proc is not None,
            "restartCount": c.restart_count,
            "state": state,
            "lastState": {"terminated": c.last_terminated} if c.last_terminated else {},
        }
        return status

    def _phase(self, run: PodRun) -> str:
        if all(c.terminated is not None for c in run.containers):
            ok = all(c.terminated and c.terminated["exitCode"] == 0 for c in run.containers)
            return "Succeeded" if ok else "Failed"
        if any(c.proc is not None or c.restart_count or c.terminated for c in run.containers):
            return "Running"
        return "Pending"

    def _report(self, run: PodRun) -> None:
        statuses = [self._container_status(c) for c in run.containers]
        deleting = run.kill_deadline is not None
        ready = not deleting and all(s["ready"] for s in statuses)
        status = {
            "phase": self._phase(run),
            "hostIP": self.node_ip,
            "hostIPs": [{"ip": self.node_ip}],
            "podIP": run.ip,
            "podIPs": [{"ip": run.ip}],
            "startTime": run.start_time,
            "conditions": [
                self._condition(run, "PodReadyToStartContainers", True),
                self._condition(run, "Initialized", True),
                self._condition(run, "Ready", ready, "" if ready else "ContainersNotReady"),
                self._condition(
                    run, "ContainersReady", ready, "" if ready else "ContainersNotReady"
                ),
                self._condition(run, "PodScheduled", True),
            ],
            "containerStatuses": statuses,
        }
        if status == run.last_status:
            return
        path = f"/api/v1/namespaces/{run.namespace}/pods/{run.name}/status"
        try:
            self.client.merge_patch(path, {"status": status})
            run.last_status = status
        except KubeAPIError as exc:
            if exc.status != 404:
                logger.warning("status update for %s/%s failed: %s", run.namespace, run.name, exc)


@dataclass
class NodeAgentProcess:
    """Runs the agent as a child process (what the e2e fixtures use).

    A separate process keeps the agent's loop off the test's GIL and makes its crash visible
    (check_alive) instead of silently stalling pods.
    """

    kubeconfig: Path
    log_dir: Path
    node_name: str = "pagefleet-node"
    subnet: ipaddress.IPv4Network = field(default_factory=random_pod_subnet)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        """The agent's own log (admissions, starts, exits, API errors)."""
        return self.log_dir / "node-agent.log"

    def pod_log_path(self, namespace: str, pod: str, container: str) -> Path:
        """File holding stdout+stderr of `container` in pod `namespace/pod`."""
        return self.log_dir / "pods" / f"{namespace}_{pod}" / f"{container}.log"

    def start(self, timeout_s: float = 30.0) -> NodeAgentProcess:
        """Start the agent and return once its Node is registered and Ready."""
        check_pod_network()
        self.proc = process.spawn(
            [
                sys.executable,
                "-m",
                "e2e.node_agent",
                f"--kubeconfig={self.kubeconfig}",
                f"--node-name={self.node_name}",
                f"--subnet={self.subnet}",
                f"--log-dir={self.log_dir}",
            ],
            self.log_path,
            cwd=REPO_ROOT,
        )
        client = KubeClient.from_kubeconfig(self.kubeconfig)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            node = client.get_or_none(f"/api/v1/nodes/{self.node_name}")
            conds = (node or {}).get("status", {}).get("conditions", [])
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
            if ready and not (node or {}).get("spec", {}).get("taints"):
                return self
            time.sleep(0.1)
        raise RuntimeError(
            f"node {self.node_name} not Ready after {timeout_s}s; see {self.log_path}"
        )

    def check_alive(self) -> None:
        """Raise if the agent process has exited (its log tail says why)."""
        if self.proc is not None and self.proc.poll() is not None:
            tail_text = process.tail(self.log_path, 30)
            raise RuntimeError(f"node agent exited {self.proc.returncode}:\n{tail_text}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM: the agent stops its pods and deletes its Node; SIGKILL after `grace_s`."""
        if self.proc is None:
            return
        process.stop(self.proc, grace_s)
        self.proc = None

    def __enter__(self) -> NodeAgentProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--node-name", default="pagefleet-node")
    parser.add_argument("--subnet", type=ipaddress.IPv4Network, default=None)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    agent = NodeAgent(
        KubeClient.from_kubeconfig(args.kubeconfig),
        args.node_name,
        args.subnet or random_pod_subnet(),
        args.log_dir,
        args.workdir,
    )
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    agent.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "POD_NETWORK",
    "NodeAgent",
    "NodeAgentProcess",
    "PodNetworkError",
    "check_pod_network",
    "expand_vars",
    "random_pod_subnet",
]
