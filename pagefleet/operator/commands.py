"""The command lines of the daemon and gateway containers.

Kept in one place because they are the seam to two other components: when a daemon or
gateway flag changes, this file is the only one to adjust. `$(VAR)` references are expanded
by the kubelet (and by the e2e node agent) from the container's env.
"""

from __future__ import annotations

from pagefleet.api.inferenceservice import EngineDevice, InferenceServiceSpec, RoleSpec
from pagefleet.operator.naming import DAEMON_PORT, GATEWAY_PORT, Names

POD_IP = "$(POD_IP)"
POD_NAME = "$(POD_NAME)"


# Shutdown budgets within a pod's terminationGracePeriodSeconds, so that each process ends
# on its own terms (open requests finished or aborted with a last chunk, stacks logged if
# stuck) before the kubelet's SIGKILL cuts everything at the grace.
# Daemon: it is gone within --shutdown-timeout (plus 2 s of exit backstop); this leaves the
# rest of the grace for that backstop and the signal's delivery.
DAEMON_EXIT_MARGIN_S = 5
# Daemon: what its shutdown needs after the drain (pagefleet.daemon.cli.AFTER_DRAIN_S:
# aborted requests' last chunks, the index goodbye, the engine's stop).
DAEMON_AFTER_DRAIN_S = 10
# Gateway: it is gone within --drain-timeout plus 5 s (pagefleet.gateway.cli CLEANUP_S +
# EXIT_S); 5 s more of margin for a loaded node.
GATEWAY_AFTER_DRAIN_S = 10


def daemon_stop_flags(grace_s: int) -> list[str]:
    """--shutdown-timeout and --drain-timeout that fit a daemon pod's grace: open requests
    get as long as the grace allows, and the process exits before the SIGKILL."""
    shutdown_s = grace_s - DAEMON_EXIT_MARGIN_S
    return [
        "--shutdown-timeout", str(shutdown_s),
        "--drain-timeout", str(max(0, shutdown_s - DAEMON_AFTER_DRAIN_S)),
    ]  # fmt: skip


def gateway_drain_s(grace_s: int) -> int:
    """The gateway's --drain-timeout within its pod's grace (its cleanup and exit after)."""
    return max(0, grace_s - GATEWAY_AFTER_DRAIN_S)


def served_model_name(spec: InferenceServiceSpec, names: Names) -> str:
    return spec.model.served_model_name or names.service


GPU_RESOURCE = "nvidia.com/gpu"


def requests_gpu(role_spec: RoleSpec) -> bool:
    """Whether the role's pods ask the scheduler for an NVIDIA GPU (request or limit > 0)."""
    res = role_spec.resources
    for side in (res.requests, res.limits):
        value = side.get(GPU_RESOURCE)
        if value is not None and str(value).strip() not in ("0", ""):
            return True
    return False


def role_device(spec: InferenceServiceSpec, role_spec: RoleSpec) -> str:
    """The daemon's --device for a role: the spec's choice, or with `auto` cuda exactly when
    the role requests a GPU (a CPU-only role must never be told cuda: it would not start)."""
    device = spec.engine.device
    if device is EngineDevice.AUTO:
        return "cuda" if requests_gpu(role_spec) else "cpu"
    return device.value


def _device_flags(spec: InferenceServiceSpec, device: str) -> list[str]:
    eng = spec.engine
    dtype = spec.model.dtype.value
    if device != "cuda":
        return [
            "--device",
            device,
            "--dtype",
            dtype,
            "--kv-cache-memory-mb",
            str(eng.kv_cache_memory_mb),
        ]
    # On a GPU, `auto` means bfloat16 (checkpoints are often stored in float32, which halves
    # throughput and KV capacity there); an explicit dtype is kept.
    return [
        "--device", "cuda",
        "--dtype", "bfloat16" if dtype == "auto" else dtype,
        "--attention-backend", "triton",
        "--gpu-memory-utilization", f"{eng.gpu_memory_utilization:g}",
    ]  # fmt: skip


def daemon_command(
    spec: InferenceServiceSpec,
    names: Names,
    role: str,
    redis_url: str,
    role_spec: RoleSpec | None = None,
) -> list[str]:
    """`pagefleet daemon ...` for one role; every engine knob of the spec becomes a flag so a
    knob change changes the pod template and rolls the role out. The device (and with it
    dtype, attention backend and KV sizing) follows `role_device`."""
    eng = spec.engine
    device = role_device(spec, role_spec or RoleSpec())
    cmd = [
        *spec.command,
        "daemon",
        "--model",
        spec.model.source.path,
        "--host",
        POD_IP,
        "--port",
        str(DAEMON_PORT),
        "--role",
        role,
        "--served-model-name",
        served_model_name(spec, names),
        "--redis-url",
        redis_url,
        "--kv-namespace",
        names.kv_namespace,
        "--pod-name",
        POD_NAME,
        *_device_flags(spec, device),
        "--block-size",
        str(eng.block_size),
        "--max-num-seqs",
        str(eng.max_num_seqs),
        "--long-prefill-token-threshold",
        str(eng.long_prefill_token_threshold),
        "--enable-prefix-caching" if eng.enable_prefix_caching else "--no-enable-prefix-caching",
        # The gateway's limit too (gateway_command): a body the gateway lets through must
        # not meet a smaller limit here (the client would get the daemon's 413 as a 502).
        "--max-body-bytes",
        str(spec.router.max_body_bytes),
        # One budget per pod for the bodies it holds at once, gateway and daemons alike:
        # a daemon behind a gateway sees the same flood the gateway let through.
        "--max-inflight-body-mb",
        str(spec.router.max_inflight_body_mb),
        *daemon_stop_flags((role_spec or RoleSpec()).termination_grace_period_seconds),
    ]
    if eng.max_num_batched_tokens is not None:  # else the role's own default (decode: lower)
        cmd += ["--max-num-batched-tokens", str(eng.max_num_batched_tokens)]
    if spec.model.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.model.max_model_len)]
    if eng.num_gpu_blocks is not None:
        cmd += ["--num-gpu-blocks", str(eng.num_gpu_blocks)]
    if eng.tool_call_parser != "none":
        cmd += ["--tool-call-parser", eng.tool_call_parser]
    if role_spec is not None and role_spec.cost_per_hour:
        cmd += ["--cost-per-hour", f"{role_spec.cost_per_hour:g}"]
    return cmd


def gateway_role(roles: list[str]) -> str:
    """The role whose Service the gateway routes to: the decode pool when disaggregated
    (decode daemons pull prompt KV from prefill daemons), else the unified pool."""
    return "decode" if "decode" in roles else roles[0]


def gateway_command(
    spec: InferenceServiceSpec, names: Names, roles: list[str], redis_url: str
) -> list[str]:
    """`pagefleet gateway ...` discovering the routed role Service's ready endpoints."""
    cmd = [
        *spec.command,
        "gateway",
        "--host",
        POD_IP,
        "--port",
        str(GATEWAY_PORT),
        "--policy",
        spec.router.policy.value,
        "--discovery",
        "k8s",
        "--namespace",
        names.namespace,
        "--service",
        names.role(gateway_role(roles)),
        "--target-port",
        "http",
        "--redis-url",
        redis_url,
        "--kv-namespace",
        names.kv_namespace,
        "--model",
        spec.model.source.path,
        "--served-model-name",
        served_model_name(spec, names),
        "--block-size",
        str(spec.engine.block_size),
    ]
    r = spec.router
    cmd += [
        "--first-byte-timeout", f"{r.first_byte_timeout_seconds:g}",
        "--inter-chunk-timeout", f"{r.inter_chunk_timeout_seconds:g}",
        "--request-timeout", f"{r.request_timeout_seconds:g}",
        "--max-concurrency", str(r.max_concurrency),
        "--body-timeout", f"{r.body_timeout_seconds:g}",
        "--client-write-timeout", f"{r.client_write_timeout_seconds:g}",
        "--keepalive-timeout", f"{r.keepalive_timeout_seconds:g}",
        "--max-response-bytes", str(r.max_response_bytes),
        "--max-body-bytes", str(r.max_body_bytes),
        "--max-inflight-body-mb", str(r.max_inflight_body_mb),
        "--drain-timeout", str(gateway_drain_s(r.termination_grace_period_seconds)),
    ]  # fmt: skip
    if spec.model.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.router.weights:
        weights = ",".join(f"{k}={v:g}" for k, v in sorted(spec.router.weights.items()))
        cmd += ["--weights", weights]
    if "prefill" in roles:
        # P/D: the decode Service is the main pool; the prefill one runs remote prefills.
        cmd += [
            "--prefill-service",
            names.role("prefill"),
            "--pd-min-uncached-tokens",
            str(spec.router.pd_min_uncached_tokens),
        ]
    return cmd
