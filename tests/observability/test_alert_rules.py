"""The chart's SLO rules, rendered by the real helm and checked by the real promtool.

`promtool check rules` validates every expression; `promtool test rules` runs
slo_rules_test.yaml: the burn-rate alerts fire on a synthetic breach (fast and slow, each
after its `for`), a 40% miss rate only warns, and a healthy series stays quiet.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pagefleet.testing.helm import helm_template, rule_groups

HERE = Path(__file__).resolve().parent


def _promtool() -> str:
    exe = shutil.which("promtool")
    assert exe, "promtool missing: apt-get install prometheus (.ci/run installs it)"
    return exe


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rules")
    (out / "rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    shutil.copy(HERE / "slo_rules_test.yaml", out / "slo_rules_test.yaml")
    return out / "rules.yaml"


def test_promtool_check_rules(rules_file: Path) -> None:
    res = subprocess.run(
        [_promtool(), "check", "rules", str(rules_file)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_promtool_unit_tests_burn_rate_alerts(rules_file: Path) -> None:
    res = subprocess.run(
        [_promtool(), "test", "rules", "slo_rules_test.yaml"],
        capture_output=True,
        text=True,
        cwd=rules_file.parent,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_rules_follow_the_values() -> None:
    groups = rule_groups(
        "--set-string", "alerts.slo.ttftSeconds=0.5", "--set", "alerts.slo.objective=0.99"
    )["groups"]
    rules = {r.get("record") or r["alert"]: r["expr"] for g in groups for r in g["rules"]}
    assert 'le="0.5"' in rules["pagefleet:ttft_slo_error_ratio:rate1h"]
    assert "(14.4 * (1 - 0.99))" in rules["PagefleetTTFTErrorBudgetBurnFast"]


def test_a_target_that_is_no_bucket_is_refused() -> None:
    res = helm_template("--set-string", "alerts.slo.ttftSeconds=1.7", check=False)
    assert res.returncode != 0
    assert "alerts.slo.ttftSeconds" in res.stderr, res.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    """slo_rules_test.yaml shows each alert of the chart firing on its condition and staying
    quiet before its `for` or on a healthy series: an alert added without both is untested."""
    alerts = {r["alert"] for g in rule_groups()["groups"] for r in g["rules"] if "alert" in r}
    cases = [
        case
        for test in yaml.safe_load((HERE / "slo_rules_test.yaml").read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert len(alerts) >= 7
    assert alerts - firing == set(), "alerts never shown firing"
    assert alerts - quiet == set(), "alerts never shown quiet"
