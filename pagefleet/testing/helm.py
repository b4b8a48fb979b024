"""The real helm binary and the chart, for tests: find helm, render the chart, extract rules.

helm is looked up in $HELM, PATH, then ~/.cache/pagefleet/helm/helm, where
``bash scripts/control-plane.sh build`` (part of ``make test``) puts it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pagefleet"
MONITORING_APIS = (
    "monitoring.coreos.com/v1/PodMonitor",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)


def find_helm() -> str | None:
    for cand in (
        os.environ.get("HELM"),
        shutil.which("helm"),
        str(Path.home() / ".cache/pagefleet/helm/helm"),
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def require_helm() -> str:
    helm = find_helm()
    if helm is None:
        raise RuntimeError(
            "no helm binary: run `bash scripts/control-plane.sh build` (it caches helm in "
            "~/.cache/pagefleet/helm/) or put helm on PATH / in $HELM"
        )
    return helm


def helm_template(
    *args: str, monitoring: bool = False, check: bool = True, release: str = "pf"
) -> subprocess.CompletedProcess[str]:
    """`helm template RELEASE helm/pagefleet -n pagefleet-system ARGS` (optionally with the
    prometheus-operator APIs declared, so the PodMonitor and PrometheusRule render)."""
    cmd = [require_helm(), "template", release, str(CHART), "-n", "pagefleet-system"]
    cmd += ["--kube-version", "1.31.0"]
    if monitoring:
        for api in MONITORING_APIS:
            cmd += ["--api-versions", api]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60, check=check)


def render(*args: str, monitoring: bool = False, release: str = "pf") -> list[dict[str, Any]]:
    """The chart's rendered objects."""
    out = helm_template(*args, monitoring=monitoring, release=release).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def rule_groups(*args: str) -> dict[str, Any]:
    """The PrometheusRule's spec, i.e. a Prometheus rule file ({groups: [...]})."""
    (rule,) = [d for d in render(*args, monitoring=True) if d["kind"] == "PrometheusRule"]
    spec: dict[str, Any] = rule["spec"]
    return spec
