"""Pod hardening applied to every workload the operator builds.

The pods run a Python server that needs no privileges: a fixed non-root user, no Linux
capabilities, no privilege escalation, the runtime's default seccomp profile and a
read-only root filesystem. What the processes must write (temporary files, compiler and
model caches) goes to size-capped emptyDir volumes, so a compromised process cannot alter
the image and a runaway cache cannot fill the node's disk.
"""

from __future__ import annotations

import math
from typing import Any

Manifest = dict[str, Any]

# The conventional "nonroot" uid/gid of distroless-style images; any non-zero id works as
# long as the image's files are world-readable.
RUN_AS_USER = 65532
TMP_MOUNT = "/tmp"
CACHE_MOUNT = "/var/cache/pagefleet"
TMP_SIZE_LIMIT = "1Gi"
CACHE_SIZE_LIMIT = "4Gi"

# Requests/limits when the spec sets none: the scheduler needs requests to place pods and
# the kubelet a memory limit to contain a leak. No CPU limit: CFS throttling of a
# latency-bound server costs far more tail latency than it protects.
DAEMON_RESOURCES: Manifest = {
    "requests": {"cpu": "1", "memory": "2Gi"},
    "limits": {"memory": "8Gi"},
}
GATEWAY_RESOURCES: Manifest = {
    "requests": {"cpu": "250m", "memory": "512Mi"},
    "limits": {"memory": "2Gi"},
}


def pod_security_context() -> Manifest:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> Manifest:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def writable_volumes() -> tuple[list[Manifest], list[Manifest]]:
    """emptyDir volumes and mounts for what a read-only root filesystem cannot hold."""
    volumes = [
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
        {"name": "cache", "emptyDir": {"sizeLimit": CACHE_SIZE_LIMIT}},
    ]
    mounts = [
        {"name": "tmp", "mountPath": TMP_MOUNT},
        {"name": "cache", "mountPath": CACHE_MOUNT},
    ]
    return volumes, mounts


# P/D daemons stage a prompt's KV in shared memory between their HTTP and engine processes
# (daemon --kv-stage-dir, default /dev/shm; pagefleet/daemon/kv_stage.py). A container's
# own /dev/shm is 64 MB, less than one long prompt's KV on most models, which would send
# every transfer through the engine pipe instead. Memory-backed: it counts against the
# pod's memory limit, so it is capped.
KV_STAGE_MOUNT = "/dev/shm"
KV_STAGE_SIZE_LIMIT = "1Gi"


def kv_stage_volume() -> tuple[Manifest, Manifest]:
    """The memory-backed emptyDir and its mount at /dev/shm for a prefill or decode pod."""
    limit = KV_STAGE_SIZE_LIMIT
    volume = {"name": "kv-stage", "emptyDir": {"medium": "Memory", "sizeLimit": limit}}
    return volume, {"name": "kv-stage", "mountPath": KV_STAGE_MOUNT}


def cache_env() -> list[Manifest]:
    """Point every cache the processes may write (tiny presets, Hugging Face, Triton and
    torch compile caches) into the writable cache volume instead of $HOME."""
    return [
        {"name": "PAGEFLEET_CACHE", "value": CACHE_MOUNT},
        {"name": "XDG_CACHE_HOME", "value": CACHE_MOUNT},
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_MOUNT}/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_MOUNT}/inductor"},
        {"name": "TMPDIR", "value": TMP_MOUNT},
    ]


def cpu_thread_env(resources: Manifest, user_env: list[Manifest]) -> list[Manifest]:
    """OMP_NUM_THREADS = the CPU limit rounded up, when the pod has a CPU limit and the
    role's own env does not set it.

    torch starts one thread per CPU of the node; under a CFS quota of fewer CPUs those
    threads preempt each other and a decode step runs several times slower (measured: a
    2-thread engine on a contended 2-core machine spent 5x the CPU of a 1-thread one). A
    pod with no CPU limit may use the node's idle cores, so it keeps torch's default.
    """
    limit = (resources.get("limits") or {}).get("cpu")
    if limit is None or any(e.get("name") == "OMP_NUM_THREADS" for e in user_env):
        return []
    try:
        threads = max(1, math.ceil(cpu_cores(limit)))
    except ValueError:
        return []  # the apiserver refuses the Deployment with its own message
    return [{"name": "OMP_NUM_THREADS", "value": str(threads)}]


def cpu_cores(quantity: str | int | float) -> float:
    """A Kubernetes CPU quantity ("2", "1.5", "500m", 3) in cores; ValueError otherwise."""
    text = str(quantity).strip()
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise ValueError(
            f"CPU quantity {quantity!r} is not a number of cores or millicores (e.g. 2, 500m)"
        ) from None


def default_resources(given: Manifest, defaults: Manifest) -> Manifest:
    """The spec's resources, or the defaults when the spec sets neither requests nor
    limits (filling only one side could contradict a value the user chose)."""
    if given:
        return given
    return {side: dict(values) for side, values in defaults.items()}


SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def api_token_volume() -> tuple[Manifest, Manifest]:
    """An explicit, short-lived, read-only API token for a pod that needs the API (the
    gateway watches EndpointSlices), in place of the automounted one: every pod sets
    automountServiceAccountToken: false, so only a pod built with this volume holds a
    token at all. Same files and path as the automount, so clients find it unchanged."""
    volume = {
        "name": "kube-api-access",
        "projected": {
            "defaultMode": 0o444,
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {
                    "configMap": {
                        "name": "kube-root-ca.crt",
                        "items": [{"key": "ca.crt", "path": "ca.crt"}],
                    }
                },
                {
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "namespace",
                                "fieldRef": {"fieldPath": "metadata.namespace"},
                            }
                        ]
                    }
                },
            ],
        },
    }
    mount = {"name": "kube-api-access", "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True}
    return volume, mount
