"""Hardening of what the operator builds: pod security, tokens, resources, NetworkPolicies,
and the installation's image / hostPath policy."""

from __future__ import annotations

from typing import Any

import pytest
from test_builders import OWNER, children

from pagefleet.api.inferenceservice import parse_spec
from pagefleet.operator.builders import BuildSettings, SpecError, build_children

PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


def _pods(objs: dict[tuple[str, str], Any]) -> dict[str, dict[str, Any]]:
    return {
        name: obj["spec"]["template"]["spec"]
        for (kind, name), obj in objs.items()
        if kind == "Deployment"
    }


def test_every_pod_runs_non_root_read_only_without_capabilities_or_token(pd_spec):
    pods = _pods(children(pd_spec))
    assert sorted(pods) == ["llama-decode", "llama-gateway", "llama-prefill"]
    for name, pod in pods.items():
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0, name
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        (c,) = pod["containers"]
        csc = c["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False
        assert csc["readOnlyRootFilesystem"] is True
        assert csc["capabilities"] == {"drop": ["ALL"]}
        assert csc["privileged"] is False
        assert csc["runAsNonRoot"] is True
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
        # What must stay writable is an emptyDir with a size cap, and the caches point there.
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for path in ("/tmp", "/var/cache/pagefleet"):
            assert vols[mounts[path]]["emptyDir"]["sizeLimit"], (name, path)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PAGEFLEET_CACHE"] == env["XDG_CACHE_HOME"] == "/var/cache/pagefleet"
        assert env["TRITON_CACHE_DIR"].startswith("/var/cache/pagefleet/")
        # P/D daemons stage KV in a memory-backed, capped /dev/shm; the gateway does not.
        if name == "llama-gateway":
            assert "/dev/shm" not in mounts
        else:
            shm = vols[mounts["/dev/shm"]]["emptyDir"]
            assert shm["medium"] == "Memory" and shm["sizeLimit"], name
        # Every other mount is read-only.
        for m in c["volumeMounts"]:
            if m["mountPath"] not in ("/tmp", "/var/cache/pagefleet", "/dev/shm"):
                assert m["readOnly"] is True, (name, m)


def test_only_the_gateway_gets_an_api_token_and_it_is_projected_short_lived(unified_spec):
    pods = _pods(children(unified_spec))

    def token_sources(pod: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            s["serviceAccountToken"]
            for v in pod["volumes"]
            for s in v.get("projected", {}).get("sources", [])
            if "serviceAccountToken" in s
        ]

    assert token_sources(pods["llama-unified"]) == []
    assert "serviceAccountName" not in pods["llama-unified"]
    gw = pods["llama-gateway"]
    assert gw["serviceAccountName"] == "llama-gateway"
    (tok,) = token_sources(gw)
    assert tok["expirationSeconds"] <= 3700
    (mount,) = [m for m in gw["containers"][0]["volumeMounts"] if m["name"] == "kube-api-access"]
    assert mount == {
        "name": "kube-api-access",
        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
        "readOnly": True,
    }


def test_default_resources_only_when_the_spec_sets_none(unified_spec):
    pods = _pods(children(unified_spec))
    daemon = pods["llama-unified"]["containers"][0]["resources"]
    gateway = pods["llama-gateway"]["containers"][0]["resources"]
    for res in (daemon, gateway):
        assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
        assert "cpu" not in res["limits"]  # no CFS throttling of a latency-bound server
    unified_spec["roles"]["unified"]["resources"] = {"requests": {"memory": "64Gi"}}
    daemon = _pods(children(unified_spec))["llama-unified"]["containers"][0]["resources"]
    # A default memory limit below the user's request would make the pod invalid.
    assert daemon == {"requests": {"memory": "64Gi"}}


def _policies(spec: dict[str, Any], **settings: Any) -> dict[str, dict[str, Any]]:
    objs = children(spec, settings=BuildSettings(**settings))
    return {name: obj["spec"] for (kind, name), obj in objs.items() if kind == "NetworkPolicy"}


def test_network_policies_let_only_the_gateway_and_scrapers_reach_daemons(unified_spec):
    pols = _policies(unified_spec, metrics_peers=(PROMETHEUS,))
    daemons = pols["llama-daemons"]
    assert daemons["policyTypes"] == ["Ingress"]
    assert daemons["podSelector"] == {
        "matchLabels": {"pagefleet.io/service": "llama"},
        "matchExpressions": [
            {"key": "app.kubernetes.io/component", "operator": "In", "values": ["unified"]}
        ],
    }
    assert daemons["ingress"] == [
        {
            "from": [
                {
                    "podSelector": {
                        "matchLabels": {
                            "pagefleet.io/service": "llama",
                            "app.kubernetes.io/component": "gateway",
                        }
                    }
                }
            ],
            "ports": [{"port": 8000, "protocol": "TCP"}],
        },
        {"from": [PROMETHEUS], "ports": [{"port": 8000, "protocol": "TCP"}]},
    ]
    gateway = pols["llama-gateway"]
    assert gateway["ingress"] == [{"ports": [{"port": 8080, "protocol": "TCP"}]}]
    # The selectors select the pods the Deployments make (and only those).
    pods = {
        name: obj["spec"]["template"]["metadata"]["labels"]
        for (kind, name), obj in children(unified_spec).items()
        if kind == "Deployment"
    }
    assert daemons["podSelector"]["matchLabels"].items() <= pods["llama-unified"].items()
    assert pods["llama-unified"]["app.kubernetes.io/component"] == "unified"
    assert gateway["podSelector"]["matchLabels"].items() <= pods["llama-gateway"].items()
    assert not gateway["podSelector"]["matchLabels"].items() <= pods["llama-unified"].items()


def test_disaggregated_daemons_reach_each_other_without_scrapers_by_default(pd_spec):
    daemons = _policies(pd_spec)["llama-daemons"]
    assert len(daemons["ingress"]) == 2  # gateway, peers; no scraper rule configured
    peers = daemons["ingress"][1]
    assert "ports" not in peers  # KV transfer may use its own port
    assert peers["from"][0]["podSelector"]["matchExpressions"][0]["values"] == [
        "decode",
        "prefill",
    ]
    assert _policies(pd_spec, network_policies=False) == {}


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("registry.example.com/pagefleet/pagefleet:1", True),
        ("registry.example.com/pagefleet-evil/x:1", False),
        ("docker.io/attacker/miner:latest", False),
    ],
)
def test_image_allow_list(unified_spec, image, allowed):
    unified_spec["image"] = image
    settings = BuildSettings(allowed_image_prefixes=("registry.example.com/pagefleet/",))
    if allowed:
        build_children(parse_spec(unified_spec), OWNER, settings)
        return
    with pytest.raises(SpecError, match=r"is not allowed.*--allowed-image-prefix") as err:
        build_children(parse_spec(unified_spec), OWNER, settings)
    assert err.value.reason == "ImageNotAllowed"


def test_host_path_models_need_the_operator_setting(unified_spec):
    unified_spec["model"]["source"] = {"path": "/models/llama", "hostPath": "/data/llama"}
    with pytest.raises(SpecError, match=r"hostPath.*persistentVolumeClaim") as err:
        children(unified_spec)
    assert err.value.reason == "HostPathNotAllowed"
    pods = _pods(children(unified_spec, settings=BuildSettings(allow_host_path=True)))
    vols = {v["name"]: v for v in pods["llama-unified"]["volumes"]}
    assert vols["model"]["hostPath"] == {"path": "/data/llama", "type": "Directory"}


def test_bundled_redis_credentials_come_from_its_secret(unified_spec):
    del unified_spec["index"]
    settings = BuildSettings(
        default_redis_url="redis://pf-redis.pagefleet-system.svc:6379/0",
        default_redis_secret="pf-redis-auth",
    )
    objs = children(unified_spec, settings=settings)

    def env(name: str) -> dict[str, Any]:
        c = objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        assert "pf-redis-auth" not in " ".join(c["command"])
        return {
            e["name"]: e.get("valueFrom", {}).get("secretKeyRef") or e.get("value")
            for e in c["env"]
        }

    daemon, gateway = env("llama-unified"), env("llama-gateway")
    assert daemon["PAGEFLEET_REDIS_USERNAME"] == "pf-daemon"
    assert daemon["PAGEFLEET_REDIS_PASSWORD"] == {"name": "pf-redis-auth", "key": "daemon-password"}
    assert gateway["PAGEFLEET_REDIS_USERNAME"] == "pf-gateway"
    assert gateway["PAGEFLEET_REDIS_PASSWORD"] == {
        "name": "pf-redis-auth",
        "key": "gateway-password",
    }
    # A service with its own Redis keeps its own (here: no) credentials.
    unified_spec["index"] = {"redisURL": "redis://mine:6379/0"}
    objs = children(unified_spec, settings=settings)
    assert "PAGEFLEET_REDIS_PASSWORD" not in env("llama-unified")
