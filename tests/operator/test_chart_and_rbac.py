"""The Helm chart and the RBAC manifest.

Static checks always run; `helm lint` / `helm template` run when a helm binary is available
(PATH, $HELM, or the cache that `GOBIN=~/.cache/pagefleet/helm go install
helm.sh/helm/v3/cmd/helm@v3.16.4` fills).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagefleet.kvindex.redis_auth import DAEMON_ACL_RULES, GATEWAY_ACL_RULES
from pagefleet.operator.kube import CHILD_KINDS, DEPLOYMENT, SERVICE
from pagefleet.testing.helm import render

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pagefleet"


def _helm() -> str | None:
    for cand in (
        os.environ.get("HELM"),
        shutil.which("helm"),
        str(Path.home() / ".cache/pagefleet/helm/helm"),
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _canon(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, res, verb)
        for r in rules
        for group in r["apiGroups"]
        for res in r["resources"]
        for verb in r["verbs"]
    }


def _manifest_rules() -> set[tuple[str, str, str]]:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "rbac.yaml").read_text()))
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    return _canon(role["rules"])


def test_rbac_manifest_is_consistent_and_bound():
    docs = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy" / "rbac.yaml").read_text())}
    assert set(docs) == {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == docs["ClusterRole"]["metadata"]["name"]
    (subject,) = binding["subjects"]
    assert subject["name"] == docs["ServiceAccount"]["metadata"]["name"]
    assert subject["namespace"] == docs["ServiceAccount"]["metadata"]["namespace"]


def test_rbac_grants_what_the_reconciler_uses_and_no_wildcards():
    rules = _manifest_rules()
    assert not any("*" in part for rule in rules for part in rule)
    group = {"v1": ""}
    for kind in CHILD_KINDS:
        g = group.get(kind.api_version, kind.api_version.split("/")[0])
        # list (observe), create+patch (server-side apply), delete (prune)
        for verb in ("list", "create", "patch", "delete"):
            assert (g, kind.plural, verb) in rules, (kind.plural, verb)
    for kind in (DEPLOYMENT, SERVICE):  # kopf watches these to restore deleted children
        g = group.get(kind.api_version, kind.api_version.split("/")[0])
        assert (g, kind.plural, "watch") in rules
    for verb in ("get", "list", "watch", "patch"):
        assert ("pagefleet.io", "inferenceservices", verb) in rules
    assert ("pagefleet.io", "inferenceservices/status", "patch") in rules
    assert ("", "events", "create") in rules
    # the gateway Role's permissions must be held to be granted (RBAC escalation check)
    for verb in ("get", "list", "watch"):
        assert ("discovery.k8s.io", "endpointslices", verb) in rules
    # nothing the operator never does
    assert ("", "pods", "delete") not in rules
    # Secrets: create only (each service's P/D transfer secret); reading one takes a Role
    # per Secret (redis-secret-role.yaml)
    assert [v for _, r, v in rules if r == "secrets"] == ["create"]
    for verb in ("list", "patch"):  # the autoscaler: role pods, pod-deletion-cost
        assert ("", "pods", verb) in rules


def test_chart_rules_equal_the_rbac_manifest():
    chart = _canon(yaml.safe_load((CHART / "files" / "namespaced-rules.yaml").read_text()))
    chart |= _canon(yaml.safe_load((CHART / "files" / "cluster-rules.yaml").read_text()))
    assert chart == _manifest_rules()


def _uses_optional_old_self(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("optionalOldSelf") is True or any(
            _uses_optional_old_self(v) for v in node.values()
        )
    return isinstance(node, list) and any(_uses_optional_old_self(v) for v in node)


def test_chart_requires_a_kubernetes_that_takes_its_crd():
    # A CEL rule with optionalOldSelf (the name rule) does not compile where the field is
    # unknown or gated off (before 1.30: CRDValidationRatcheting): the API server would
    # refuse the whole CRD.
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    major, minor = (int(x) for x in floor.removeprefix(">=").split(".")[:2])
    crds = [yaml.safe_load(p.read_text()) for p in (CHART / "crds").glob("*.yaml")]
    assert any(_uses_optional_old_self(c) for c in crds)
    assert (major, minor) >= (1, 30), floor


def test_chart_static_files_parse():
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2" and meta["name"] == "pagefleet"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["redis"]["enabled"] is False
    for path in (CHART / "crds").glob("*.yaml"):
        assert yaml.safe_load(path.read_text())["kind"] == "CustomResourceDefinition"
    dashboards = list((CHART / "dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        dash = json.loads(path.read_text())
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        assert any("vllm:time_to_first_token_seconds" in e for e in exprs)
        assert dash["uid"] and dash["title"]


def _template(*args: str) -> list[dict[str, Any]]:
    if _helm() is None:
        pytest.skip("helm binary not available (see this module's docstring to build it)")
    return render(*args)


def test_helm_lint():
    helm = _helm()
    if helm is None:
        pytest.skip("helm binary not available (see this module's docstring to build it)")
    res = subprocess.run(
        [helm, "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_helm_template_default_install():
    docs = _template()
    # The uninstall hook's ServiceAccount, ClusterRole(Binding), Job, and the Role(Binding)
    # that lets it read the operator's Deployment (no Ready replica: it releases the
    # finalizers itself) render too.
    hooks = [d for d in docs if "helm.sh/hook" in d["metadata"].get("annotations", {})]
    assert sorted(d["kind"] for d in hooks) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Job",
        "Role",
        "RoleBinding",
        "ServiceAccount",
    ]
    assert {d["metadata"]["annotations"]["helm.sh/hook"] for d in hooks} == {"pre-delete"}
    (job,) = [d for d in hooks if d["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "pagefleet",
        "teardown",
        "--all-namespaces",
        "--timeout-seconds=300",
        "--operator-deployment=pagefleet-system/pf-pagefleet-operator",
    ]
    (check,) = [d for d in hooks if d["kind"] == "Role"]
    assert check["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments"],
            "resourceNames": ["pf-pagefleet-operator"],
            "verbs": ["get"],
        }
    ]
    operator = [d for d in docs if d["kind"] == "Deployment" and "helm.sh/hook" not in
                d["metadata"].get("annotations", {})]  # fmt: skip
    assert [d["metadata"]["name"] for d in operator] == ["pf-pagefleet-operator"]
    docs = [d for d in docs if d not in hooks]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "Deployment",
        "ServiceAccount",
    ]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:3] == ["pagefleet", "operator", "--all-namespaces"]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert _canon(role["rules"]) == _manifest_rules()
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    json.loads(next(iter(cm["data"].values())))


def test_helm_template_with_redis_namespaces_and_monitoring_apis():
    docs = _template(
        "--set",
        "redis.enabled=true",
        "--set",
        "operator.watchNamespaces={team-a,team-b}",
        "--api-versions",
        "monitoring.coreos.com/v1/PodMonitor",
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
    )
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        if "helm.sh/hook" in d["metadata"].get("annotations", {}):
            continue  # the uninstall hook's own RBAC: test_helm_template_default_install
        if d["metadata"]["name"].endswith("-teardown"):
            continue  # the hook's rights in the watched namespaces: the test below
        by_kind.setdefault(d["kind"], []).append(d)
    assert sorted(r["metadata"]["namespace"] for r in by_kind["Role"]) == ["team-a", "team-b"]
    assert len(by_kind["RoleBinding"]) == 2
    (cluster_role,) = by_kind["ClusterRole"]
    assert ("apps", "deployments", "create") not in _canon(cluster_role["rules"])
    op = next(d for d in by_kind["Deployment"] if d["metadata"]["name"].endswith("-operator"))
    c = op["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=team-a" in c["command"] and "--namespace=team-b" in c["command"]
    assert c["env"][0] == {
        "name": "POD_IP",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    }
    assert c["env"][1:] == [
        {
            "name": "PAGEFLEET_DEFAULT_REDIS_URL",
            "value": "redis://pf-pagefleet-redis.pagefleet-system.svc:6379/0",
        },
        {"name": "PAGEFLEET_DEFAULT_REDIS_SECRET", "value": "pf-pagefleet-redis-auth"},
        {
            "name": "PAGEFLEET_DEFAULT_REDIS_PASSWORD",
            "valueFrom": {
                "secretKeyRef": {"name": "pf-pagefleet-redis-auth", "key": "gateway-password"}
            },
        },
    ]
    assert "--liveness=http://$(POD_IP):8080/healthz" in c["command"]
    assert any(s["metadata"]["name"] == "pf-pagefleet-redis" for s in by_kind["Service"])
    assert by_kind["PodMonitor"][0]["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "pagefleet-operator"
    }
    groups = by_kind["PrometheusRule"][0]["spec"]["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    assert {"PagefleetTTFTErrorBudgetBurnFast", "PagefleetTPOTErrorBudgetBurnSlow"} <= alerts


def test_the_uninstall_hook_creates_nothing_in_a_watched_namespace():
    """Helm creates hook objects when it runs the hook: one in a watched namespace deleted
    since the install failed `helm uninstall` with 'namespaces ... not found'. The hook's
    rights there are release objects instead (gone with the namespace), and it may read
    just those namespaces to see that one is gone."""
    docs = _template("--set", "operator.watchNamespaces={team-a,team-b}")
    hooks = [d for d in docs if "helm.sh/hook" in d["metadata"].get("annotations", {})]
    assert {d["metadata"].get("namespace") for d in hooks} == {"pagefleet-system", None}
    teardown = [d for d in docs if d["metadata"]["name"] == "pf-pagefleet-teardown"]
    in_watched = sorted(
        (d["kind"], d["metadata"]["namespace"]) for d in teardown if d["kind"] != "ServiceAccount"
    )
    assert in_watched == [
        ("Job", "pagefleet-system"),
        ("Role", "team-a"),
        ("Role", "team-b"),
        ("RoleBinding", "team-a"),
        ("RoleBinding", "team-b"),
    ]
    (ns_reader,) = [d for d in hooks if d["kind"] == "ClusterRole"]
    assert ns_reader["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["namespaces"],
            "resourceNames": ["team-a", "team-b"],
            "verbs": ["get"],
        }
    ]


def test_helm_template_security_options_and_bundled_redis_auth():
    """Image allow-list, hostPath off by default, NetworkPolicies with the operator and the
    scrapers as metrics peers; the bundled Redis with generated ACL passwords from a Secret
    (never on a command line) and only fleet pods let in."""
    docs = _template(
        "--set",
        "redis.enabled=true",
        "--set",
        "operator.allowedImagePrefixes={registry.example.com/pagefleet/}",
    )
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    op = by_name[("Deployment", "pf-pagefleet-operator")]
    cmd = op["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--allowed-image-prefix=registry.example.com/pagefleet/" in cmd
    assert "--no-allow-host-path" in cmd and "--network-policies" in cmd
    peers = [json.loads(a.split("=", 1)[1]) for a in cmd if a.startswith("--metrics-peer=")]
    assert {"app.kubernetes.io/component": "operator"}.items() <= peers[0]["podSelector"][
        "matchLabels"
    ].items()
    assert peers[1]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}

    secret = by_name[("Secret", "pf-pagefleet-redis-auth")]["stringData"]
    daemon_pw, gateway_pw = secret["daemon-password"], secret["gateway-password"]
    assert len(daemon_pw) == len(gateway_pw) == 32 and daemon_pw != gateway_pw
    # The very rules tests/kvindex/test_redis_acl.py checks on a real redis-server.
    assert secret["users.acl"].splitlines() == [
        "user default off",
        f"user pf-daemon on >{daemon_pw} {DAEMON_ACL_RULES}",
        f"user pf-gateway on >{gateway_pw} {GATEWAY_ACL_RULES}",
    ]
    redis = by_name[("Deployment", "pf-pagefleet-redis")]["spec"]["template"]["spec"]
    args = redis["containers"][0]["args"]
    assert args[args.index("--aclfile") + 1] == "/etc/redis/acl/users.acl"
    assert not any(daemon_pw in a or gateway_pw in a for a in args)
    assert redis["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    policy = by_name[("NetworkPolicy", "pf-pagefleet-redis")]["spec"]
    assert policy["ingress"] == [
        {
            "from": [
                {
                    "namespaceSelector": {},
                    "podSelector": {
                        "matchLabels": {"app.kubernetes.io/managed-by": "pagefleet-operator"}
                    },
                },
                # The operator: its autoscaler reads the load heartbeats.
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "pagefleet-system"}
                    },
                    "podSelector": {
                        "matchLabels": {
                            "app.kubernetes.io/name": "pagefleet",
                            "app.kubernetes.io/instance": "pf",
                            "app.kubernetes.io/component": "operator",
                        }
                    },
                },
            ],
            "ports": [{"port": 6379, "protocol": "TCP"}],
        }
    ]

    docs = _template("--set", "networkPolicy.enabled=false", "--set", "operator.allowHostPath=true")
    op = next(d for d in docs if d["kind"] == "Deployment")
    cmd = op["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--no-network-policies" in cmd and "--allow-host-path" in cmd
    assert not any(a.startswith("--metrics-peer") for a in cmd)


def test_operator_cli_accepts_the_charts_command_line():
    from pagefleet.operator.cli import command

    docs = _template("--set", "redis.enabled=true", "--set", "operator.allowedImagePrefixes={a/}")
    op = next(d for d in docs if d["kind"] == "Deployment" and "operator" in d["metadata"]["name"])
    cmd = op["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["pagefleet", "operator"]
    params = command.make_context("operator", cmd[2:]).params
    assert params["allowed_image_prefixes"] == ("a/",)
    assert params["allow_host_path"] is False and params["network_policies"] is True
    assert [json.loads(p)["podSelector"] for p in params["metrics_peers"]][1] == {
        "matchLabels": {"app.kubernetes.io/name": "prometheus"}
    }


def test_redis_secret_role_grants_get_on_one_secret_only():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "redis-secret-role.yaml").read_text()))
    role, binding = docs
    assert role["kind"] == "Role" and binding["kind"] == "RoleBinding"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["SECRET"], "verbs": ["get"]}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (sa,) = [d for d in yaml.safe_load_all((ROOT / "deploy" / "rbac.yaml").read_text())
             if d["kind"] == "ServiceAccount"]  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"],
         "namespace": sa["metadata"]["namespace"]}
    ]  # fmt: skip


def test_helm_template_redis_password_secrets_are_one_role_each():
    docs = _template(
        "--set-json",
        'operator.redisPasswordSecrets=[{"namespace":"ml","name":"chat-redis"},'
        '{"namespace":"web","name":"r2"}]',
    )
    docs = [d for d in docs if "helm.sh/hook" not in d["metadata"].get("annotations", {})]
    roles = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Role"
    }
    assert set(roles) == {("ml", "pf-pagefleet-operator-redis-chat-redis"),
                          ("web", "pf-pagefleet-operator-redis-r2")}  # fmt: skip
    for (_, name), role in roles.items():
        (rule,) = role["rules"]
        assert rule["verbs"] == ["get"] and rule["resourceNames"] == [name.rsplit("redis-", 1)[1]]
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert {(b["metadata"]["namespace"], b["roleRef"]["name"]) for b in bindings} == set(roles)
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"
                       and "helm.sh/hook" not in d["metadata"].get("annotations", {})]  # fmt: skip
    assert [r["verbs"] for r in cluster_role["rules"] if "secrets" in r["resources"]] == [
        ["create"]
    ]
