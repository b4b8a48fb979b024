"""values.yaml, values.schema.json and the chart README's values table stay in step, and the
real helm refuses bad values with a message naming the value."""

from __future__ import annotations

import pytest

from pagefleet.dev import chart_docs
from pagefleet.dev.dashboards import TPOT_SLO_CHOICES, TTFT_SLO_CHOICES
from pagefleet.testing.helm import CHART, helm_template, require_helm


def test_every_value_is_in_the_schema_with_a_description() -> None:
    schema, values = chart_docs.load()
    documented = dict(chart_docs.schema_leaves(schema))
    in_values = list(chart_docs.value_leaves(values, schema))
    missing = [p for p in in_values if p not in documented]
    assert not missing, f"values.yaml has values values.schema.json lacks: {missing}"
    for path, sub in documented.items():
        assert sub.get("description"), f"{path}: no description in values.schema.json"
        chart_docs.lookup(values, path)  # KeyError: documented but not in values.yaml
    assert schema["additionalProperties"] is False


def test_readme_table_is_generated_from_the_schema() -> None:
    readme = CHART / "README.md"
    assert readme.read_text() == chart_docs.rewrite_readme(readme), (
        "helm/pagefleet/README.md is stale: run `python -m pagefleet.dev.chart_docs`"
    )


def test_slo_targets_are_the_dashboard_buckets() -> None:
    schema, _ = chart_docs.load()
    slo = schema["properties"]["alerts"]["properties"]["slo"]["properties"]
    assert tuple(slo["ttftSeconds"]["enum"]) == TTFT_SLO_CHOICES
    assert tuple(slo["tpotSeconds"]["enum"]) == TPOT_SLO_CHOICES


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "operator.resyncSeconds=0"], "operator.resyncSeconds: Must be greater than"),
        (["--set", "redis.enabled=maybe"], "redis.enabled: Invalid type. Expected: boolean"),
        (["--set", "operator.replicas=2"], "Additional property replicas is not allowed"),
        (
            ["--set-string", "alerts.slo.ttftSeconds=1.7"],
            "alerts.slo.ttftSeconds: alerts.slo.ttftSeconds",
        ),
        (
            ["--set", "metrics.podMonitor.interval=soon"],
            "metrics.podMonitor.interval: Does not match",
        ),
        (["--set", "operator.watchNamespaces={Team_A}"], "operator.watchNamespaces.0: Does not"),
        # PromQL reads an integer with a leading zero as octal: 010 would be a factor of 8.
        (["--set-string", "alerts.fastBurn.factor=010"], "alerts.fastBurn.factor"),
    ],
    ids=[
        "resync-zero",
        "not-bool",
        "unknown-key",
        "ttft-not-a-bucket",
        "duration",
        "ns-name",
        "octal-factor",
    ],
)
def test_bad_values_fail_with_the_value_named(args: list[str], message: str) -> None:
    res = helm_template(*args, check=False)
    assert res.returncode != 0
    assert "values don't meet the specifications of the schema" in res.stderr, res.stderr
    assert message in res.stderr, res.stderr


def test_default_values_pass_the_schema() -> None:
    require_helm()
    assert helm_template(monitoring=True).returncode == 0


def test_autoscaler_prometheus_url_reaches_the_operator() -> None:
    from pagefleet.testing.helm import render

    url = "http://prometheus-operated.monitoring.svc:9090"
    docs = render("--set", f"operator.prometheusURL={url}")
    op = next(d for d in docs if d["kind"] == "Deployment")
    env = op["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "PAGEFLEET_PROMETHEUS_URL", "value": url} in env
    default = next(d for d in render() if d["kind"] == "Deployment")
    names = [e["name"] for e in default["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert "PAGEFLEET_PROMETHEUS_URL" not in names
    bad = helm_template("--set", "operator.prometheusURL=prometheus:9090", check=False)
    assert "operator.prometheusURL: Does not match pattern" in bad.stderr, bad.stderr
