"""Child objects produced for one InferenceService: names, labels, owners, commands, probes."""

from __future__ import annotations

from typing import Any

import pytest
from fake_kube import REDIS

from pagefleet.api.inferenceservice import parse_spec
from pagefleet.operator.builders import (
    BuildSettings,
    Owner,
    SpecError,
    build_children,
    role_replicas,
)

OWNER = Owner(name="llama", namespace="ml", uid="uid-123")
SETTINGS = BuildSettings()


def children(spec: dict[str, Any], **kw: Any) -> dict[tuple[str, str], dict[str, Any]]:
    objs = build_children(parse_spec(spec), OWNER, kw.pop("settings", SETTINGS), **kw)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_unified_children_are_one_role_plus_gateway_and_config(unified_spec):
    objs = children(unified_spec)
    assert sorted(objs) == [
        ("ConfigMap", "llama-config"),
        ("Deployment", "llama-gateway"),
        ("Deployment", "llama-unified"),
        ("NetworkPolicy", "llama-daemons"),
        ("NetworkPolicy", "llama-gateway"),
        ("Role", "llama-gateway"),
        ("RoleBinding", "llama-gateway"),
        ("Service", "llama-gateway"),
        ("Service", "llama-unified"),
        ("ServiceAccount", "llama-gateway"),
    ]
    assert objs[("Deployment", "llama-unified")]["spec"]["replicas"] == 2


def test_pd_children_have_one_deployment_and_headless_service_per_role(pd_spec):
    objs = children(pd_spec)
    deployments = sorted(n for k, n in objs if k == "Deployment")
    assert deployments == ["llama-decode", "llama-gateway", "llama-prefill"]
    for role in ("prefill", "decode"):
        svc = objs[("Service", f"llama-{role}")]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["ports"] == [
            {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
        ]
        assert svc["spec"]["selector"] == {
            "pagefleet.io/service": "llama",
            "app.kubernetes.io/component": role,
        }
    # autoscaled decode starts at minReplicas
    assert objs[("Deployment", "llama-decode")]["spec"]["replicas"] == 2
    gw = objs[("Deployment", "llama-gateway")]["spec"]["template"]["spec"]["containers"][0]
    # requests enter through the decode pool, which pulls prompt KV from prefill
    assert flag(gw["command"], "--service") == "llama-decode"


def test_every_child_has_labels_and_a_controller_owner_reference(pd_spec):
    for (kind, name), obj in children(pd_spec).items():
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "pagefleet"
        assert labels["app.kubernetes.io/instance"] == "llama"
        assert labels["app.kubernetes.io/managed-by"] == "pagefleet-operator"
        assert labels["pagefleet.io/service"] == "llama"
        assert labels["app.kubernetes.io/component"], (kind, name)
        if kind in ("Deployment", "Service"):
            assert labels["pagefleet.io/role"] in ("prefill", "decode", "gateway")
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "pagefleet.io/v1alpha1",
                "kind": "InferenceService",
                "name": "llama",
                "uid": "uid-123",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        if kind == "Deployment":
            sel = obj["spec"]["selector"]["matchLabels"]
            pod_labels = obj["spec"]["template"]["metadata"]["labels"]
            assert sel.items() <= pod_labels.items()


def test_daemon_pod_command_env_and_probes(unified_spec):
    unified_spec["engine"] = {
        "blockSize": 32,
        "maxNumSeqs": 8,
        "enablePrefixCaching": False,
        "numGPUBlocks": 300,
        "longPrefillTokenThreshold": 256,
    }
    unified_spec["model"]["maxModelLen"] = 512
    unified_spec["roles"]["unified"]["env"] = [{"name": "LOG_LEVEL", "value": "debug"}]
    dep = children(unified_spec)[("Deployment", "llama-unified")]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cmd = c["command"]
    assert cmd[:2] == ["pagefleet", "daemon"]
    assert flag(cmd, "--model") == "tiny"
    assert flag(cmd, "--host") == "$(POD_IP)"
    assert flag(cmd, "--port") == "8000"
    assert flag(cmd, "--role") == "unified"
    assert flag(cmd, "--served-model-name") == "tiny-llama"
    assert flag(cmd, "--redis-url") == REDIS
    assert flag(cmd, "--kv-namespace") == "ml/llama"
    assert flag(cmd, "--pod-name") == "$(POD_NAME)"
    assert flag(cmd, "--block-size") == "32"
    assert flag(cmd, "--max-num-seqs") == "8"
    assert "--max-num-batched-tokens" not in cmd  # unset: the role's daemon default
    assert flag(cmd, "--max-model-len") == "512"
    assert flag(cmd, "--kv-cache-memory-mb") == "256"
    assert flag(cmd, "--num-gpu-blocks") == "300"
    assert flag(cmd, "--long-prefill-token-threshold") == "256"
    assert "--no-enable-prefix-caching" in cmd and "--enable-prefix-caching" not in cmd
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["LOG_LEVEL"]["value"] == "debug"
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["image"] == "pagefleet:test"
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"


def test_gateway_command_and_service(unified_spec):
    unified_spec["router"] = {"policy": "least_load", "serviceType": "NodePort"}
    objs = children(unified_spec)
    dep = objs[("Deployment", "llama-gateway")]
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llama-gateway"
    cmd = pod["containers"][0]["command"]
    assert cmd[:2] == ["pagefleet", "gateway"]
    assert flag(cmd, "--port") == "8080"
    assert flag(cmd, "--policy") == "least_load"
    assert flag(cmd, "--discovery") == "k8s"
    assert flag(cmd, "--namespace") == "ml"
    assert flag(cmd, "--service") == "llama-unified"
    assert flag(cmd, "--target-port") == "http"
    assert flag(cmd, "--block-size") == "16"
    assert "--weights" not in cmd
    assert flag(cmd, "--redis-url") == REDIS
    assert flag(cmd, "--model") == "tiny"
    svc = objs[("Service", "llama-gateway")]
    assert svc["spec"]["type"] == "NodePort" and "clusterIP" not in svc["spec"]
    assert svc["spec"]["ports"][0]["name"] == "http"
    rules = objs[("Role", "llama-gateway")]["rules"]
    assert rules == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]


def test_gateway_hang_detection_and_limits_reach_its_flags(unified_spec):
    unified_spec["router"] = {
        "firstByteTimeoutSeconds": 5,
        "interChunkTimeoutSeconds": 2.5,
        "maxConcurrency": 64,
    }
    cmd = children(unified_spec)[("Deployment", "llama-gateway")]["spec"]["template"]["spec"][
        "containers"
    ][0]["command"]
    assert flag(cmd, "--first-byte-timeout") == "5"
    assert flag(cmd, "--inter-chunk-timeout") == "2.5"
    assert flag(cmd, "--request-timeout") == "600"
    assert flag(cmd, "--max-concurrency") == "64"
    # The flags exist on the gateway (a typo here would crash-loop every gateway pod).
    from click.testing import CliRunner

    from pagefleet.gateway.cli import command

    help_text = CliRunner().invoke(command, ["--help"]).output
    for name in ("--first-byte-timeout", "--inter-chunk-timeout", "--request-timeout",
                 "--max-concurrency", "--max-model-len"):  # fmt: skip
        assert name in help_text


def test_command_override_is_the_entrypoint(unified_spec):
    unified_spec["command"] = ["/venv/bin/pagefleet"]
    objs = children(unified_spec)
    for name in ("llama-unified", "llama-gateway"):
        cmd = objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]["command"]
        assert cmd[0] == "/venv/bin/pagefleet"


def test_pvc_model_is_mounted_read_only(unified_spec):
    unified_spec["model"]["source"] = {
        "path": "/models/llama-3-8b",
        "persistentVolumeClaim": {"claimName": "weights"},
    }
    pod = children(unified_spec)[("Deployment", "llama-unified")]["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_redis_password_comes_from_the_secret_never_the_command_line(unified_spec):
    unified_spec["index"]["passwordSecretRef"] = {"name": "redis-auth"}
    unified_spec["index"]["username"] = "pf-daemon"
    objs = children(unified_spec)
    for name in ("llama-unified", "llama-gateway"):
        c = objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        assert flag(c["command"], "--redis-url") == REDIS  # no password spliced in
        assert not any("PASSWORD" in arg for arg in c["command"])
        env = {e["name"]: e for e in c["env"]}
        assert env["PAGEFLEET_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "redis-auth",
            "key": "password",
        }
        assert env["PAGEFLEET_REDIS_USERNAME"]["value"] == "pf-daemon"


def test_gateway_uses_its_read_only_redis_user_and_holds_the_client_keys(unified_spec):
    unified_spec["index"]["passwordSecretRef"] = {"name": "redis-auth"}
    unified_spec["index"]["gatewayUser"] = {
        "username": "pf-gateway",
        "passwordSecretRef": {"name": "redis-ro", "key": "pw"},
    }
    unified_spec["router"] = {"apiKeysSecret": {"name": "keys"}}
    unified_spec["adminTokenSecret"] = {"name": "admin"}
    objs = children(unified_spec)

    def env(name: str) -> dict[str, Any]:
        c = objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        return {
            e["name"]: e.get("valueFrom", {}).get("secretKeyRef") or e.get("value")
            for e in c["env"]
        }

    gw, daemon = env("llama-gateway"), env("llama-unified")
    assert gw["PAGEFLEET_REDIS_USERNAME"] == "pf-gateway"
    assert gw["PAGEFLEET_REDIS_PASSWORD"] == {"name": "redis-ro", "key": "pw"}
    assert gw["PAGEFLEET_API_KEYS"] == {"name": "keys", "key": "api-keys"}
    assert gw["PAGEFLEET_ADMIN_TOKEN"] == {"name": "admin", "key": "token"}
    assert "PAGEFLEET_REDIS_USERNAME" not in daemon  # the default user
    assert daemon["PAGEFLEET_REDIS_PASSWORD"] == {"name": "redis-auth", "key": "password"}
    assert daemon["PAGEFLEET_ADMIN_TOKEN"] == {"name": "admin", "key": "token"}
    # The gateway never forwards client keys, and only it reaches the daemons.
    assert "PAGEFLEET_API_KEYS" not in daemon


def test_scheduling_and_resources(unified_spec):
    unified_spec["roles"]["unified"].update(
        nodeSelector={"gpu": "h100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        resources={"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"}},
    )
    pod = children(unified_spec)[("Deployment", "llama-unified")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": "1", "memory": "32Gi"}
    }


@pytest.mark.parametrize(
    "resources,role_env,threads",
    [
        ({"limits": {"cpu": "500m", "memory": "8Gi"}}, [], "1"),
        ({"limits": {"cpu": 4}}, [], "4"),
        ({"limits": {"cpu": "2.5"}}, [], "3"),
        ({"requests": {"cpu": "8"}}, [], None),  # no limit: the node's idle cores are usable
        ({"limits": {"cpu": "4"}}, [{"name": "OMP_NUM_THREADS", "value": "2"}], "2"),
        ({"limits": {"cpu": "lots"}}, [], None),  # left to the apiserver to refuse
    ],
)
def test_daemon_threads_follow_the_cpu_limit(unified_spec, resources, role_env, threads):
    unified_spec["roles"]["unified"].update(resources=resources, env=role_env)
    pod = children(unified_spec)[("Deployment", "llama-unified")]["spec"]["template"]["spec"]
    env = [e for e in pod["containers"][0]["env"] if e["name"] == "OMP_NUM_THREADS"]
    assert [e["value"] for e in env] == ([threads] if threads else [])


def test_no_redis_anywhere_is_a_spec_error_naming_the_fix(unified_spec):
    del unified_spec["index"]
    with pytest.raises(SpecError, match=r"spec.index.redisURL.*redis.enabled=true"):
        children(unified_spec)
    objs = children(unified_spec, settings=BuildSettings(default_redis_url="redis://bundled:6379"))
    cmd = objs[("Deployment", "llama-unified")]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    assert flag(cmd, "--redis-url") == "redis://bundled:6379"


def test_builders_are_deterministic(pd_spec):
    assert children(pd_spec) == children(pd_spec)


def _hash(objs, name: str) -> str:
    dep = objs[("Deployment", name)]
    return dep["spec"]["template"]["metadata"]["annotations"]["pagefleet.io/config-hash"]


def test_config_change_rolls_only_the_component_that_reads_it(unified_spec):
    before = children(unified_spec)
    unified_spec["router"] = {"weights": {"prefill": 1.0, "queue": 0.25}}
    after = children(unified_spec)
    gw = after[("Deployment", "llama-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert flag(gw["command"], "--weights") == "prefill=1,queue=0.25"
    assert '"queue": 0.25' in after[("ConfigMap", "llama-config")]["data"]["router.json"]
    assert _hash(before, "llama-gateway") != _hash(after, "llama-gateway")
    assert _hash(before, "llama-unified") == _hash(after, "llama-unified")

    unified_spec["engine"] = {"maxNumSeqs": 4}
    tuned = children(unified_spec)
    assert _hash(after, "llama-unified") != _hash(tuned, "llama-unified")
    # the gateway's pod template is untouched by a daemon-only knob: no gateway restart
    assert (
        after[("Deployment", "llama-gateway")]["spec"]["template"]
        == tuned[("Deployment", "llama-gateway")]["spec"]["template"]
    )


@pytest.mark.parametrize(
    ("role", "current", "expected"),
    [
        ({"replicas": 3}, 7, 3),
        ({}, None, 1),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, None, 2),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 4, 4),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 9, 5),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 0, 2),
    ],
)
def test_role_replicas_respects_autoscaler_within_bounds(role, current, expected):
    from pagefleet.api.inferenceservice import RoleSpec

    assert role_replicas(RoleSpec.model_validate(role), current) == expected


def _subcommand_args(cmd: list[str], sub: str) -> list[str]:
    args = cmd[cmd.index(sub) + 1 :]
    return [a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "llama-x") for a in args]


def test_daemon_and_gateway_clis_accept_the_operators_command_lines(pd_spec):
    """The seam to the daemon and gateway: their real click commands parse what we build."""
    from pagefleet.daemon.cli import command as daemon_cli
    from pagefleet.gateway.cli import command as gateway_cli

    pd_spec["router"] = {"weights": {"prefill": 1.0, "queue": 0.25}}
    pd_spec["model"]["maxModelLen"] = 256
    pd_spec["roles"]["decode"]["costPerHour"] = 2.75  # per role: prefill sets none
    objs = children(pd_spec)
    for role in ("prefill", "decode"):
        cmd = objs[("Deployment", f"llama-{role}")]["spec"]["template"]["spec"]["containers"][0][
            "command"
        ]
        ctx = daemon_cli.make_context("daemon", _subcommand_args(cmd, "daemon"))
        assert ctx.params["role"] == role and ctx.params["max_model_len"] == 256
        assert ctx.params["cost_per_hour"] == (2.75 if role == "decode" else 0.0)
        assert ctx.params["kv_namespace"] == "ml/llama"
    gw = objs[("Deployment", "llama-gateway")]["spec"]["template"]["spec"]["containers"][0]
    ctx = gateway_cli.make_context("gateway", _subcommand_args(gw["command"], "gateway"))
    assert ctx.params["discovery"] == "k8s" and ctx.params["service"] == "llama-decode"
    assert ctx.params["weights"] == "prefill=1,queue=0.25"
    # P/D: the gateway runs remote prefills on the prefill Service's pods.
    assert ctx.params["prefill_service"] == "llama-prefill"
    assert ctx.params["pd_min_uncached_tokens"] == 256
    pd_spec["router"] = {"pdMinUncachedTokens": 64}
    gw = children(pd_spec)[("Deployment", "llama-gateway")]["spec"]["template"]["spec"]
    args = _subcommand_args(gw["containers"][0]["command"], "gateway")
    assert gateway_cli.make_context("gateway", args).params["pd_min_uncached_tokens"] == 64
    for policy in ("cache_aware", "least_load", "round_robin", "session"):
        pd_spec["router"] = {"policy": policy}
        gw = children(pd_spec)[("Deployment", "llama-gateway")]
        args = _subcommand_args(
            gw["spec"]["template"]["spec"]["containers"][0]["command"], "gateway"
        )
        assert gateway_cli.make_context("gateway", args).params["policy"] == policy


def gateway_config(spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The GatewayConfig the real `pagefleet gateway` command builds from the operator's
    command line: click's parsing and the gateway's own validation both run; only the
    serving is left out."""
    from click.testing import CliRunner

    from pagefleet.gateway import cli as gateway_cli

    seen: list[Any] = []

    async def capture(config: Any, **_: Any) -> None:
        seen.append(config)

    monkeypatch.setattr(gateway_cli, "serve", capture)
    gw = children(spec)[("Deployment", "llama-gateway")]["spec"]["template"]["spec"]
    args = _subcommand_args(gw["containers"][0]["command"], "gateway")
    result = CliRunner().invoke(gateway_cli.command, args)
    assert result.exit_code == 0, result.output
    (config,) = seen
    return config


def test_router_spec_sets_every_gateway_limit_an_operator_user_needs(unified_spec, monkeypatch):
    # Operator-built gateways always ran with the gateway's defaults for the body, client
    # write and keep-alive timeouts and the non-streamed answer cap: behind a load balancer
    # with a 600 s idle timeout (GCP) the gateway's 75 s keep-alive closed connections under
    # it, and a slow client upload over 30 s was a 408, with no way to change either.
    unified_spec["router"] = {
        "requestTimeoutSeconds": 3600,
        "maxConcurrency": 64,
        "bodyTimeoutSeconds": 120,
        "clientWriteTimeoutSeconds": 45.5,
        "keepaliveTimeoutSeconds": 620,
        "maxResponseBytes": 1 << 30,
        "maxInflightBodyMb": 512,
    }
    config = gateway_config(unified_spec, monkeypatch)
    assert config.max_inflight_body_mb == 512
    assert config.request_timeout_s == 3600 and config.max_concurrency == 64
    assert config.body_timeout_s == 120 and config.client_write_timeout_s == 45.5
    assert config.keepalive_timeout_s == 620 and config.max_response_bytes == 1 << 30


def test_router_spec_defaults_are_the_gateways_own(unified_spec, monkeypatch):
    from pagefleet.gateway.cli import GatewayConfig

    config = gateway_config(unified_spec, monkeypatch)
    defaults = GatewayConfig(discovery="k8s", service="x")
    for field in (
        "request_timeout_s",
        "first_byte_timeout_s",
        "inter_chunk_timeout_s",
        "max_concurrency",
        "body_timeout_s",
        "client_write_timeout_s",
        "keepalive_timeout_s",
        "max_response_bytes",
        "max_inflight_body_mb",
    ):
        assert getattr(config, field) == getattr(defaults, field), field


@pytest.mark.parametrize(
    ("router", "why"),
    [
        ({"bodyTimeoutSeconds": 0}, "greater than 0"),
        ({"clientWriteTimeoutSeconds": -1}, "greater than 0"),
        ({"clientWriteTimeoutSeconds": 3601}, "less than or equal to 3600"),
        ({"keepaliveTimeoutSeconds": 0}, "greater than 0"),
        ({"keepaliveTimeoutSeconds": 86401}, "less than or equal to 86400"),
        # The gateway refuses less than 1 KiB: a pod would crash-loop on it.
        ({"maxResponseBytes": 1023}, "greater than or equal to 1024"),
        ({"maxConcurrency": 0}, "greater than or equal to 1"),
    ],
)
def test_router_limits_out_of_range_are_refused_at_the_spec(unified_spec, router, why):
    unified_spec["router"] = router
    with pytest.raises(ValueError, match=f"router.{next(iter(router))}\n.*{why}"):
        parse_spec(unified_spec)


def test_tool_call_parser_reaches_the_daemons_and_defaults_to_none(unified_spec):
    """engine.toolCallParser is the daemon's --tool-call-parser, parsed by its real CLI; a
    name the daemon does not know is refused at the spec, not in a crash-looping pod."""
    from pagefleet.daemon.cli import command as daemon_cli

    def parser_of(spec: dict[str, Any]) -> str:
        dep = children(spec)[("Deployment", "llama-unified")]
        cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        ctx = daemon_cli.make_context("daemon", _subcommand_args(cmd, "daemon"))
        return ctx.params["tool_call_parser"]

    assert parser_of(unified_spec) == "none"
    unified_spec.setdefault("engine", {})["toolCallParser"] = "hermes"
    assert parser_of(unified_spec) == "hermes"
    unified_spec["engine"]["toolCallParser"] = "mistral"
    assert parser_of(unified_spec) == "mistral"
    unified_spec["engine"]["toolCallParser"] = "qwen9"
    with pytest.raises(ValueError, match="toolCallParser"):
        parse_spec(unified_spec)


def test_scaling_the_gateway_does_not_roll_its_pods(unified_spec):
    before = children(unified_spec)
    unified_spec["router"] = {"replicas": 3}
    after = children(unified_spec)
    assert after[("Deployment", "llama-gateway")]["spec"]["replicas"] == 3
    assert (
        before[("Deployment", "llama-gateway")]["spec"]["template"]
        == after[("Deployment", "llama-gateway")]["spec"]["template"]
    )


def test_gguf_preset_source_reaches_daemon_and_gateway(unified_spec):
    """model.source.path may name the real-model preset: both commands carry it, and the
    gateway's torch-free tokenizer registry knows it (the daemon's loader resolves it)."""
    from pagefleet.presets import TOKENIZER_PRESETS

    unified_spec["model"]["source"] = {"path": "smollm2-135m"}
    objs = children(unified_spec)
    daemon = objs[("Deployment", "llama-unified")]["spec"]["template"]["spec"]["containers"][0]
    gateway = objs[("Deployment", "llama-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert flag(daemon["command"], "--model") == "smollm2-135m"
    assert flag(gateway["command"], "--model") == "smollm2-135m"
    assert "smollm2-135m" in TOKENIZER_PRESETS


def _daemon(objs: dict[tuple[str, str], dict[str, Any]], role: str) -> dict[str, Any]:
    return objs[("Deployment", f"llama-{role}")]["spec"]["template"]["spec"]["containers"][0]


def test_a_role_requesting_a_gpu_runs_cuda_bf16_triton_sized_by_utilization(pd_spec):
    """engine.device auto: the GPU role gets the CUDA flags, the CPU-only role keeps CPU."""
    from pagefleet.daemon.cli import command as daemon_cli

    pd_spec["roles"]["decode"]["resources"] = {"requests": {"nvidia.com/gpu": "1"}}
    pd_spec["engine"] = {"gpuMemoryUtilization": 0.85, "kvCacheMemoryMB": 512}
    objs = children(pd_spec)
    gpu = _daemon(objs, "decode")["command"]
    assert flag(gpu, "--device") == "cuda"
    assert flag(gpu, "--dtype") == "bfloat16"
    assert flag(gpu, "--attention-backend") == "triton"
    assert flag(gpu, "--gpu-memory-utilization") == "0.85"
    assert "--kv-cache-memory-mb" not in gpu
    params = daemon_cli.make_context("daemon", _subcommand_args(gpu, "daemon")).params
    assert params["device"] == "cuda" and params["gpu_memory_utilization"] == 0.85
    cpu = _daemon(objs, "prefill")["command"]
    assert flag(cpu, "--device") == "cpu" and flag(cpu, "--dtype") == "auto"
    assert flag(cpu, "--kv-cache-memory-mb") == "512"
    assert "--attention-backend" not in cpu and "--gpu-memory-utilization" not in cpu
    # The user's resources are left exactly as written.
    assert _daemon(objs, "decode")["resources"] == {"requests": {"nvidia.com/gpu": "1"}}


def test_gpu_limit_of_zero_is_not_a_gpu_and_explicit_dtype_wins(unified_spec):
    unified_spec["roles"]["unified"]["resources"] = {"limits": {"nvidia.com/gpu": 0}}
    assert flag(_daemon(children(unified_spec), "unified")["command"], "--device") == "cpu"
    unified_spec["roles"]["unified"]["resources"] = {"limits": {"nvidia.com/gpu": 2}}
    unified_spec["model"]["dtype"] = "float16"
    cmd = _daemon(children(unified_spec), "unified")["command"]
    assert flag(cmd, "--device") == "cuda" and flag(cmd, "--dtype") == "float16"


def test_engine_device_overrides_the_resources(unified_spec):
    # cuda on a role naming no GPU: the pod must ask for one, or it gets none.
    unified_spec["engine"] = {"device": "cuda"}
    daemon = _daemon(children(unified_spec), "unified")
    assert flag(daemon["command"], "--device") == "cuda"
    assert daemon["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # cpu on a GPU role: the user's choice stands, nothing is added.
    unified_spec["engine"] = {"device": "cpu"}
    unified_spec["roles"]["unified"]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    daemon = _daemon(children(unified_spec), "unified")
    assert flag(daemon["command"], "--device") == "cpu"
    assert daemon["resources"] == {"limits": {"nvidia.com/gpu": "1"}}


def test_engine_device_rejects_unknown_values(unified_spec):
    from pydantic import ValidationError

    unified_spec["engine"] = {"device": "tpu"}
    with pytest.raises(ValidationError, match="device"):
        parse_spec(unified_spec)
    unified_spec["engine"] = {"gpuMemoryUtilization": 1.5}
    with pytest.raises(ValidationError, match="gpuMemoryUtilization"):
        parse_spec(unified_spec)


def daemon_config(spec: dict[str, Any], role: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """(DaemonConfig, shutdown timeout) the real `pagefleet daemon` command builds from the
    operator's command line for `role`: click's parsing and the config's validation run;
    only the serving is left out."""
    from click.testing import CliRunner

    from pagefleet.daemon import cli as daemon_cli

    seen: list[Any] = []

    async def capture(config: Any, shutdown_timeout_s: float | None = None) -> None:
        seen.append((config, shutdown_timeout_s))

    monkeypatch.setattr(daemon_cli, "serve", capture)
    pod = children(spec)[("Deployment", f"llama-{role}")]["spec"]["template"]["spec"]
    args = _subcommand_args(pod["containers"][0]["command"], "daemon")
    result = CliRunner().invoke(daemon_cli.command, args)
    assert result.exit_code == 0, result.output
    (out,) = seen
    return out


def test_max_body_bytes_reaches_the_gateway_and_every_daemon_alike(pd_spec, monkeypatch):
    # Operator-built daemons and gateways always ran with the 4 MiB default: a long prompt
    # sent as token ids (128k tokens is about 1 MB of JSON, a long chat history more) got a
    # 413 with no field to raise it. One field sets both: a gateway limit above the daemons'
    # would only turn the gateway's 413 into the daemon's, relayed.
    pd_spec["router"] = {"maxBodyBytes": 16 << 20, "maxInflightBodyMb": 96}
    gw = gateway_config(pd_spec, monkeypatch)
    assert (gw.max_body_bytes, gw.max_inflight_body_mb) == (16 << 20, 96)
    for role in ("prefill", "decode"):
        config, _ = daemon_config(pd_spec, role, monkeypatch)
        assert config.max_body_bytes == 16 << 20, role
        # The body budget too: without it a daemon kept its 256 MiB default whatever the
        # spec said.
        assert config.max_inflight_body_mb == 96, role


def test_max_body_bytes_default_is_the_daemons_and_gateways_own(unified_spec, monkeypatch):
    from pagefleet.api.limits import DEFAULT_MAX_BODY_BYTES

    assert gateway_config(unified_spec, monkeypatch).max_body_bytes == DEFAULT_MAX_BODY_BYTES
    config, _ = daemon_config(unified_spec, "unified", monkeypatch)
    assert config.max_body_bytes == DEFAULT_MAX_BODY_BYTES


@pytest.mark.parametrize(
    ("value", "why"),
    [(1023, "greater than or equal to 1024"), ((1 << 30) + 1, "less than or equal to")],
)
def test_max_body_bytes_out_of_range_is_refused_at_the_spec(unified_spec, value, why):
    # Below 1 KiB both processes refuse to start: the pods would crash-loop on it.
    unified_spec["router"] = {"maxBodyBytes": value}
    with pytest.raises(ValueError, match=f"router.maxBodyBytes\n.*{why}"):
        parse_spec(unified_spec)


def _pod(objs: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    pod: dict[str, Any] = objs[("Deployment", name)]["spec"]["template"]["spec"]
    return pod


def test_each_process_drains_within_its_pods_termination_grace(pd_spec, monkeypatch):
    # Operator-built pods had a fixed 60 s grace while the gateway drained for its default
    # 20 s: every router change rolled the gateway and cut streams longer than 20 s, and
    # nothing in the spec could give long generations more.
    from pagefleet.daemon.cli import AFTER_DRAIN_S, EXIT_BACKSTOP_S, drain_within_deadline
    from pagefleet.gateway.cli import CLEANUP_S, EXIT_S

    pd_spec["roles"]["decode"]["terminationGracePeriodSeconds"] = 900
    pd_spec["router"] = {"terminationGracePeriodSeconds": 600}
    objs = children(pd_spec)
    assert _pod(objs, "llama-decode")["terminationGracePeriodSeconds"] == 900
    assert _pod(objs, "llama-prefill")["terminationGracePeriodSeconds"] == 60  # its own
    assert _pod(objs, "llama-gateway")["terminationGracePeriodSeconds"] == 600
    for role, grace in (("decode", 900), ("prefill", 60)):
        config, shutdown_s = daemon_config(pd_spec, role, monkeypatch)
        # The daemon is gone (stacks logged if stuck) before the kubelet's SIGKILL ...
        assert shutdown_s + EXIT_BACKSTOP_S < grace, role
        # ... and its drain is all the grace allows, never cut short by its own deadline.
        assert config.drain_timeout_s == drain_within_deadline(10**6, shutdown_s), role
        assert config.drain_timeout_s == grace - 5 - AFTER_DRAIN_S, role
    gateway = gateway_config(pd_spec, monkeypatch)
    assert gateway.drain_timeout_s + CLEANUP_S + EXIT_S < 600
    assert gateway.drain_timeout_s == 590


def test_default_grace_gives_gateway_streams_more_than_the_old_20_s(unified_spec, monkeypatch):
    objs = children(unified_spec)
    assert _pod(objs, "llama-unified")["terminationGracePeriodSeconds"] == 60
    assert _pod(objs, "llama-gateway")["terminationGracePeriodSeconds"] == 60
    assert gateway_config(unified_spec, monkeypatch).drain_timeout_s == 50
    config, shutdown_s = daemon_config(unified_spec, "unified", monkeypatch)
    assert (config.drain_timeout_s, shutdown_s) == (45, 55)


@pytest.mark.parametrize(
    ("where", "value", "why"),
    [
        ("router", 19, "greater than or equal to 20"),
        ("router", 3601, "less than or equal to 3600"),
        ("unified", 10, "greater than or equal to 20"),
    ],
)
def test_termination_grace_out_of_range_is_refused_at_the_spec(unified_spec, where, value, why):
    # Under 20 s the processes' own shutdown steps leave no drain at all.
    if where == "router":
        unified_spec["router"] = {"terminationGracePeriodSeconds": value}
    else:
        unified_spec["roles"]["unified"]["terminationGracePeriodSeconds"] = value
    with pytest.raises(ValueError, match=f"terminationGracePeriodSeconds\n.*{why}"):
        parse_spec(unified_spec)
