"""`pagefleet operator` as a local process with the operator ServiceAccount's identity.

Every operator scenario installs the same prerequisites (the CRD, Established, and the
RBAC of deploy/rbac.yaml) and runs the operator under the ServiceAccount's token, so an
RBAC gap shows as a refusal in its log; `assert_not_refused` fails the scenario on one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from e2e.cluster import ControlPlane, eventually, tail

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "inferenceservices.pagefleet.io.yaml"
PAGEFLEET = str(Path(sys.executable).with_name("pagefleet"))


def install_prerequisites(cluster: ControlPlane) -> None:
    """Apply the CRD, wait until the apiserver serves it, then apply the operator's RBAC."""
    cluster.kubectl("apply", "-f", str(CRD))
    # Polled rather than `kubectl wait`: that fails at once ("<nil> is of the type <nil>")
    # when it reads a just-created CRD before the API server has written any condition.
    name = yaml.safe_load(CRD.read_text())["metadata"]["name"]

    def established() -> bool:
        status = cluster.kubectl_json("get", "crd", name).get("status") or {}
        return any(
            c["type"] == "Established" and c["status"] == "True"
            for c in status.get("conditions") or []
        )

    eventually(established, 60, f"CRD {name} Established")
    cluster.kubectl("apply", "-f", str(ROOT / "deploy" / "rbac.yaml"))


class OperatorProcess:
    """One operator process at a time on one log; `kill()` is SIGKILL (no cleanup, as a
    node failure or an OOM kill), `start()` a fresh process appending to the same log."""

    def __init__(self, cluster: ControlPlane, log: Path, *flags: str) -> None:
        self.kubeconfig = cluster.service_account_kubeconfig(
            "pagefleet-system", "pagefleet-operator"
        )
        self.log = log
        self.argv = [PAGEFLEET, "operator", "--all-namespaces", *flags]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s; a no-op when it is not running."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def check_alive(self) -> None:
        assert self.proc is not None, "the operator was never started"
        if self.proc.poll() is not None:
            raise AssertionError(
                f"the operator exited with {self.proc.returncode}:\n{tail(self.log, 40)}"
            )

    def assert_not_refused(self) -> None:
        """No RBAC refusal in the log. One reads `... is forbidden: User
        "system:serviceaccount:..." cannot`; a 403 for a terminating namespace is not one."""
        refused = [
            line
            for line in self.log.read_text(errors="replace").splitlines()
            if "is forbidden: User" in line
        ]
        assert not refused, "the operator was refused by RBAC:\n" + "\n".join(refused[:20])
