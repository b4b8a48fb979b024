"""A real Kubernetes control plane on loopback for the e2e suite.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as local processes from
the binaries `scripts/control-plane.sh build` compiled and cached. Each component gets free
ports on 127.0.0.1, so two runs on one machine never collide; everything they write (certs,
keys, etcd data, logs, kubeconfigs) lives in one temporary directory removed on stop.

Authentication is by static bearer token (an admin in `system:masters`) plus ServiceAccount
tokens signed by the apiserver; authorization is RBAC, so a ServiceAccount's kubeconfig
proves exactly the permissions its Roles grant.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import yaml

from pagefleet.dev import process
from pagefleet.dev.process import tail

if TYPE_CHECKING:
    from e2e.node_agent import NodeAgentProcess

logger = logging.getLogger(__name__)

# Pinned together with scripts/control-plane.sh; change both, then run its `gen` verb.
K8S_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.8"
REPO_ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
SERVICE_CIDR = "10.96.0.0/16"


class ControlPlaneError(RuntimeError):
    """The control plane could not be started or did not become ready."""


class BinariesMissingError(ControlPlaneError):
    """The cached control-plane binaries are absent: they must be built first."""


def cache_dir() -> Path:
    """Directory holding the binaries for the pinned version (same rule as the build script)."""
    root = os.environ.get("PAGEFLEET_K8S_CACHE") or str(Path.home() / ".cache/pagefleet/k8s")
    return Path(root) / K8S_VERSION


def find_binaries(bin_dir: Path | None = None) -> dict[str, Path]:
    """Paths of every component; raises BinariesMissingError naming the build command."""
    bin_dir = bin_dir or cache_dir()
    paths = {name: bin_dir / name for name in COMPONENTS}
    missing = [name for name, p in paths.items() if not os.access(p, os.X_OK)]
    if missing:
        raise BinariesMissingError(
            f"control-plane binaries {', '.join(missing)} are missing from {bin_dir}; "
            "build them once with `bash scripts/control-plane.sh build` (20-40 min cold, "
            "cached afterwards), or point PAGEFLEET_K8S_CACHE at an existing cache"
        )
    return paths


def free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1.

    All sockets stay open until every port is chosen, so the kernel cannot hand the same port
    out twice within one call.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(
    what: str, check: Callable[[], bool], timeout_s: float, on_timeout: Callable[[], str]
) -> None:
    """Poll `check` until it returns True; raises ControlPlaneError with context on timeout."""
    start = time.monotonic()
    deadline = start + timeout_s
    delay = 0.05
    while True:
        try:
            if check():
                logger.info("%s ready after %.1fs", what, time.monotonic() - start)
                return
        except ControlPlaneError:
            raise
        except Exception as exc:
            logger.debug("waiting for %s: %s", what, exc)
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"{what} not ready after {timeout_s:.0f}s\n{on_timeout()}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


@dataclass(slots=True)
class Component:
    """One running control-plane process and where its output goes."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path


@dataclass(slots=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1.

    Use as a context manager (or call start()/stop()). After start(): `server` is the HTTPS
    URL, `kubeconfig_path` an admin kubeconfig, `kubectl(...)` runs the matching kubectl.
    Set `keep_workdir` (or PAGEFLEET_E2E_KEEP=1) to keep certs, data and logs after stop().
    """

    bin_dir: Path | None = None
    # Component logs go here when given (e.g. a pytest tmp dir that outlives the run);
    # otherwise into the work directory, which stop() removes.
    logs_in: Path | None = None
    keep_workdir: bool = field(default_factory=lambda: os.environ.get("PAGEFLEET_E2E_KEEP") == "1")
    ready_timeout_s: float = 90.0

    workdir: Path = field(init=False)
    log_dir: Path = field(init=False)
    admin_token: str = field(init=False)
    ports: Ports = field(init=False)
    _bins: dict[str, Path] = field(init=False, default_factory=dict)
    node_agent: NodeAgentProcess | None = field(init=False, default=None)
    _components: list[Component] = field(init=False, default_factory=list)
    _started: bool = field(init=False, default=False)

    # -- public API -------------------------------------------------------------------------

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def ca_path(self) -> Path:
        """CA bundle that verifies the apiserver's serving certificate."""
        return self.workdir / "pki" / "ca.crt"

    @property
    def kubeconfig_path(self) -> Path:
        """Admin kubeconfig (token of a `system:masters` user)."""
        return self.workdir / "kubeconfig"

    @property
    def kubectl_path(self) -> Path:
        return self._bins["kubectl"]

    def start(self) -> ControlPlane:
        """Start every component and return once the cluster can run pods.

        Ready means: apiserver /readyz passes (RBAC bootstrap roles exist), the controller
        manager and scheduler report healthy, and the `default` ServiceAccount exists in
        namespace `default` (pods are refused before it does).
        """
        if self._started:
            raise ControlPlaneError("ControlPlane.start() called twice; create a new instance")
        self._bins = find_binaries(self.bin_dir)
        self.workdir = Path(tempfile.mkdtemp(prefix="pagefleet-k8s-"))
        self.log_dir = self.logs_in or self.workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ports = Ports(*free_ports(5))
        self.admin_token = secrets.token_hex(16)
        self._started = True
        t0 = time.monotonic()
        try:
            self._write_pki()
            self._start_etcd()
            self._start_apiserver()
            wait_for(
                "kube-apiserver /readyz",
                lambda: self._get(self.server + "/readyz", verify=True) == 200,
                self.ready_timeout_s,
                lambda: self.logs_tail(("etcd", "kube-apiserver")),
            )
            self._write_kubeconfig(self.kubeconfig_path, "admin", self.admin_token)
            self._start_controller_manager()
            self._start_scheduler()
            for name, port in (
                ("kube-controller-manager", self.ports.controller_manager),
                ("kube-scheduler", self.ports.scheduler),
            ):
                wait_for(
                    f"{name} /healthz",
                    lambda port=port: self._get(f"https://127.0.0.1:{port}/healthz") == 200,
                    self.ready_timeout_s,
                    lambda name=name: self.logs_tail((name,)),
                )
            wait_for(
                "ServiceAccount default/default",
                lambda: (
                    self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0
                ),
                self.ready_timeout_s,
                lambda: self.logs_tail(("kube-controller-manager",)),
            )
        except BaseException:
            self.stop()
            raise
        logger.info("control plane %s ready in %.1fs", self.server, time.monotonic() - t0)
        return self

    def start_node_agent(self, log_dir: Path | None = None) -> NodeAgentProcess:
        """Start the node agent (a Node that runs pods as local processes) on this cluster.

        Returns once the Node is Ready; stop() stops it (and its pods) first.
        """
        from e2e.node_agent import NodeAgentProcess

        if self.node_agent is not None:
            raise ControlPlaneError("a node agent is already running on this control plane")
        agent = NodeAgentProcess(self.kubeconfig_path, log_dir or self.workdir / "node-agent")
        agent.start()
        self.node_agent = agent
        return agent

    def stop(self) -> None:
        """Stop the node agent, then components in reverse start order; remove the workdir."""
        if self.node_agent is not None:
            self.node_agent.stop()
            self.node_agent = None
        for comp in reversed(self._components):
            process.stop(comp.proc, grace_s=10.0)
        self._components.clear()
        if self._started and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self._started:
            logger.warning("kept control-plane workdir %s", self.workdir)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout_s: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster (admin unless `kubeconfig` is given).

        With check=True a non-zero exit raises ControlPlaneError carrying kubectl's stderr.
        """
        cmd = [str(self.kubectl_path), f"--kubeconfig={kubeconfig or self.kubeconfig_path}"]
        cmd += list(args)
        res = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if check and res.returncode != 0:
            raise ControlPlaneError(
                f"kubectl {' '.join(args)} exited {res.returncode}:\n{res.stderr or res.stdout}"
            )
        return res

    def kubectl_json(self, *args: str, kubeconfig: Path | None = None) -> Any:
        """Run `kubectl ... -o json` and return the parsed object."""
        return json.loads(self.kubectl(*args, "-o", "json", kubeconfig=kubeconfig).stdout)

    def kubeconfig_for_token(self, token: str, name: str, namespace: str = "default") -> Path:
        """Write a kubeconfig that authenticates with `token`; returns its path.

        `name` becomes the file name and user entry, so use one per identity.
        """
        path = self.workdir / f"kubeconfig-{name}"
        self._write_kubeconfig(path, name, token, namespace)
        return path

    def service_account_token(self, namespace: str, name: str, duration_s: int = 7200) -> str:
        """A bound token for ServiceAccount `namespace/name` from the TokenRequest API."""
        res = self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration_s}s")
        return res.stdout.strip()

    def service_account_kubeconfig(self, namespace: str, name: str) -> Path:
        """Kubeconfig acting as ServiceAccount `namespace/name` (which must already exist).

        RBAC applies to it exactly as in a real cluster: it can do what its (Cluster)Roles
        grant and nothing more.
        """
        token = self.service_account_token(namespace, name)
        return self.kubeconfig_for_token(token, f"sa-{namespace}-{name}", namespace)

    def api_client(self, kubeconfig: Path | None = None) -> Any:
        """A `kubernetes.client.ApiClient` for this cluster (admin unless `kubeconfig`)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig_path))

    def log_path(self, component: str) -> Path:
        return self.log_dir / f"{component}.log"

    def logs_tail(
        self, components: Iterable[str] | None = None, lines: int = 30, errors_only: bool = False
    ) -> str:
        """The last lines of each component's log, for failure messages."""
        names = components or [c.name for c in self._components]
        return "\n".join(
            f"--- {n} ({self.log_path(n)}) ---\n{tail(self.log_path(n), lines, errors_only)}"
            for n in names
        )

    def check_alive(self) -> None:
        """Raise ControlPlaneError naming any component that has exited."""
        dead = [c for c in self._components if c.proc.poll() is not None]
        if dead:
            names = [f"{c.name} (exit {c.proc.returncode})" for c in dead]
            raise ControlPlaneError(
                f"control-plane component exited: {', '.join(names)}\n"
                + self.logs_tail(c.name for c in dead)
            )

    # -- internals --------------------------------------------------------------------------

    def _openssl(self, *args: str) -> None:
        res = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise ControlPlaneError(f"openssl {' '.join(args)} failed:\n{res.stderr}")

    def _write_pki(self) -> None:
        """A throwaway CA, the apiserver serving cert it signs, and the SA signing key.

        P-256 keys instead of RSA: generating them is near-instant, and the apiserver accepts
        ECDSA for both serving and ServiceAccount signing (ES256).
        """
        if shutil.which("openssl") is None:
            raise ControlPlaneError(
                "openssl is required to create the control plane's certificates; "
                "install it (apt-get install openssl)"
            )
        pki = self.workdir / "pki"
        pki.mkdir()
        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
        self._openssl(
            "req", "-x509", *ec, "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
            "-days", "3", "-subj", "/CN=pagefleet-e2e-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        self._openssl(
            "req", *ec, "-keyout", str(pki / "apiserver.key"), "-out", str(pki / "apiserver.csr"),
            "-subj", "/CN=kube-apiserver",
        )  # fmt: skip
        # The in-cluster names matter for pods that use the ServiceAccount CA bundle.
        (pki / "apiserver.ext").write_text(
            "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
            "DNS:kubernetes.default,DNS:kubernetes.default.svc,"
            "DNS:kubernetes.default.svc.cluster.local\n"
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            "authorityKeyIdentifier=keyid\n"
        )
        self._openssl(
            "x509", "-req", "-in", str(pki / "apiserver.csr"), "-CA", str(pki / "ca.crt"),
            "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3",
            "-extfile", str(pki / "apiserver.ext"), "-out", str(pki / "apiserver.crt"),
        )  # fmt: skip
        self._openssl(
            "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-out", str(pki / "sa.key"),
        )  # fmt: skip
        self._openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
        # Static token file: token,user,uid,"groups".
        (pki / "tokens.csv").write_text(f'{self.admin_token},admin,admin-uid,"system:masters"\n')

    def _spawn(self, name: str, args: list[str]) -> None:
        log_path = self.log_path(name)
        log_path.unlink(missing_ok=True)
        # Own process group (stop() signals the whole tree); dies with pytest.
        proc = process.spawn([str(self._bins[name]), *args], log_path, cwd=self.workdir)
        self._components.append(Component(name, proc, log_path))

    def _start_etcd(self) -> None:
        client = f"http://127.0.0.1:{self.ports.etcd_client}"
        peer = f"http://127.0.0.1:{self.ports.etcd_peer}"
        self._spawn(
            "etcd",
            [
                "--name=e2e",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=e2e={peer}",
                "--log-level=warn",
                # Test data is disposable; skipping fsync keeps etcd off the disk's critical path.
                "--unsafe-no-fsync=true",
                "--auto-compaction-retention=1",
                "--quota-backend-bytes=1073741824",
            ],
        )

    def _start_apiserver(self) -> None:
        pki = self.workdir / "pki"
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{self.ports.etcd_client}",
                "--bind-address=127.0.0.1",
                # Without it the apiserver advertises the default-route interface's address.
                "--advertise-address=127.0.0.1",
                # A loopback endpoint for the `kubernetes` Service would be invalid; skip it.
                "--endpoint-reconciler-type=none",
                f"--secure-port={self.ports.apiserver}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--profiling=false",
                "--v=1",
            ],
        )

    def _component_common(self, port: int) -> list[str]:
        kc = str(self.kubeconfig_path)
        return [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'pki' / 'serving'}",
            "--profiling=false",
            "--v=1",
        ]

    def _start_controller_manager(self) -> None:
        pki = self.workdir / "pki"
        self._spawn(
            "kube-controller-manager",
            [
                *self._component_common(self.ports.controller_manager),
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                # Each controller acts as its own ServiceAccount, so RBAC is exercised as in a
                # real cluster rather than everything running as admin.
                "--use-service-account-credentials=true",
                # The node agent renews its Lease, but a starved CI box must never see its only
                # node tainted and its pods evicted mid-test.
                "--controllers=*,-node-lifecycle-controller",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
            ],
        )

    def _start_scheduler(self) -> None:
        self._spawn("kube-scheduler", self._component_common(self.ports.scheduler))

    def _get(self, url: str, verify: bool = False) -> int:
        self.check_alive()
        ctx = ssl.create_default_context(cafile=str(self.ca_path)) if verify else _insecure()
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.admin_token}"})
        try:
            opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx)
            )
            with opener.open(req, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def _write_kubeconfig(
        self, path: Path, user: str, token: str, namespace: str = "default"
    ) -> None:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "pagefleet-e2e",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_path)},
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {
                    "name": user,
                    "context": {"cluster": "pagefleet-e2e", "user": user, "namespace": namespace},
                }
            ],
            "current-context": user,
        }
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        path.chmod(0o600)


def _insecure() -> ssl.SSLContext:
    # Controller-manager and scheduler serve self-signed certs on loopback; only liveness is
    # checked against them.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def eventually(
    check: Callable[[], Any],
    timeout_s: float = 60.0,
    what: str = "condition",
    interval_s: float = 0.2,
) -> Any:
    """Poll `check` until it returns a truthy value and return that value.

    On timeout raises AssertionError naming `what` and the last value (or exception) seen,
    which is what a test wants to report.
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached after {timeout_s:.0f}s; last seen: {last!r}")
        time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    """`python -m e2e.cluster`: run the control plane + node agent until Ctrl-C.

    Prints the admin kubeconfig path, so `kubectl --kubeconfig ...` works from another shell
    (entered into the run's network namespace with the printed `nsenter` command).
    `--once` stops right after everything is ready (a start-up timing check).
    """
    import argparse
    import threading

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--once", action="store_true", help="exit as soon as it is ready")
    parser.add_argument("--no-node", action="store_true", help="do not start the node agent")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t0 = time.monotonic()
    with ControlPlane() as cp:
        t_cp = time.monotonic() - t0
        if not args.no_node:
            cp.start_node_agent()
        t_all = time.monotonic() - t0
        print(f"control plane ready in {t_cp:.1f}s, with node agent in {t_all:.1f}s", flush=True)
        print(f"export KUBECONFIG={cp.kubeconfig_path}", flush=True)
        if os.environ.get("PAGEFLEET_NETNS") == "1":
            # Its 127.0.0.1 is the run's own network namespace: enter it to reach the API.
            print(f"# from another shell: nsenter --net=/proc/{os.getpid()}/ns/net", flush=True)
        if not args.once:
            stop = threading.Event()
            # Both set explicitly: a shell starts background jobs with SIGINT ignored, and
            # Python would then never raise KeyboardInterrupt.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            while not stop.wait(1.0):
                cp.check_alive()
    print(json.dumps({"control_plane_ready_s": round(t_cp, 2), "with_node_s": round(t_all, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
