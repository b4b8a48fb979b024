"""The chart with what users really set: release names up to Helm's 53 characters, and the
bundled Redis behind its NetworkPolicy reached by everything that reads it."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pagefleet.testing.helm import helm_template, render

# Helm's own limit for a release name.
LONGEST = "team-alpha-inference-serving-production-eu-west-1-abc"
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _render(release: str, *args: str) -> list[dict[str, Any]]:
    return render(*args, release=release)


@pytest.mark.parametrize("release", [LONGEST, "pf", "my-pagefleet"])
def test_names_fit_kubernetes_limits_for_any_release_name(release: str) -> None:
    """A Service name is a DNS label (63 characters) and so is a Job's (its pods carry it
    as the job-name label); with a 45-53 character release name the bundled Redis's Service
    failed to install and the uninstall hook's Job failed to create, so `helm uninstall`
    failed."""
    assert len(LONGEST) == 53
    docs = _render(release, "--set", "redis.enabled=true")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind, name in names:
        assert len(name) <= 253, (kind, name)
        if kind in ("Service", "Job"):
            assert len(name) <= 63 and DNS_LABEL.match(name), (kind, name)
    (svc,) = [n for k, n in names if k == "Service"]
    (op,) = [
        d for d in docs if d["metadata"]["name"].endswith("-operator") and d["kind"] == "Deployment"
    ]
    env = {
        e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    # The operator's default Redis is that very Service.
    assert env["PAGEFLEET_DEFAULT_REDIS_URL"] == f"redis://{svc}.pagefleet-system.svc:6379/0"
    assert len({n for _, n in names if n.endswith("-teardown")}) == 1


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what this chart uses
    return selector.get("matchLabels", {}).items() <= labels.items()


def test_the_operator_may_reach_the_bundled_redis() -> None:
    """The autoscaler reads the daemons' load heartbeats from the bundled Redis (the chart
    gives it the read-only password for that). The Redis NetworkPolicy let in only the
    operator's pods, not the operator itself: where policies are enforced its reads timed
    out and the autoscaler went blind (ScalingActive=False)."""
    docs = _render("pf", "--set", "redis.enabled=true")
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    (op,) = [d for d in docs if d["kind"] == "Deployment" and "operator" in d["metadata"]["name"]]
    op_labels = op["spec"]["template"]["metadata"]["labels"]
    release_ns = {"kubernetes.io/metadata.name": "pagefleet-system"}
    (rule,) = policy["spec"]["ingress"]
    assert any(
        _selects(peer.get("podSelector", {}), op_labels)
        and _selects(peer.get("namespaceSelector", {}), release_ns)
        for peer in rule["from"]
    ), rule["from"]
    assert {"port": 6379, "protocol": "TCP"} in rule["ports"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # The operator serves its liveness probe on 8080: the same port for its metrics
        # cannot bind (the schema's own description said "not 8080", unenforced).
        (["--set", "operator.metrics.port=8080"], "operator.metrics.port"),
        # The operator refuses a peer with other keys at start (a crash loop, not a
        # helm error): a typo must fail at install.
        (["--set-json", 'networkPolicy.metricsFrom=[{"podSelectr":{}}]'], "podSelectr"),
        (["--set-json", "networkPolicy.metricsFrom=[{}]"], "networkPolicy.metricsFrom.0"),
    ],
    ids=["metrics-on-liveness-port", "peer-typo", "empty-peer"],
)
def test_values_the_operator_would_crash_on_are_refused(args: list[str], message: str) -> None:
    res = helm_template(*args, check=False)
    assert res.returncode != 0
    assert "values don't meet the specifications of the schema" in res.stderr, res.stderr
    assert message in res.stderr, res.stderr


def test_the_default_metrics_peers_still_pass() -> None:
    assert helm_template("--set", "operator.metrics.port=9091").returncode == 0
    peers = '[{"namespaceSelector":{}},{"ipBlock":{"cidr":"10.0.0.0/8"}}]'
    assert helm_template("--set-json", f"networkPolicy.metricsFrom={peers}").returncode == 0


def test_inference_services_outside_the_watched_namespaces_are_refused() -> None:
    """The chart's inferenceServices go into the release namespace; with watchNamespaces
    leaving it out no operator ever reconciled them: they installed fine and never served."""
    spec = '[{"name":"tiny","spec":{"model":{"source":{"path":"tiny"}}}}]'
    res = helm_template(
        "--set", "operator.watchNamespaces={team-a}", "--set-json", f"inferenceServices={spec}",
        check=False,
    )  # fmt: skip
    assert res.returncode != 0
    assert "inferenceServices" in res.stderr and "pagefleet-system" in res.stderr, res.stderr
    watched = ("--set", "operator.watchNamespaces={team-a,pagefleet-system}")
    for extra in (watched, ()):
        assert helm_template(*extra, "--set-json", f"inferenceServices={spec}").returncode == 0
