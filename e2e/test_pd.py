"""Prefill/decode disaggregation on the real control plane (issue 12).

One prefill + one decode pod of the tiny model and a gateway given both role Services:
completions and streaming chat through the gateway with the openai client, served through
a real KV pull (the decode pod's metrics say so); the prefill pod deleted mid-test ->
requests still succeed (the decode pod prefills locally); status shows both roles. The
service's P/D secret (Secret ``<service>-kv-transfer``) reaches every pod: the pull goes
through signed params, and transfer params sent to the decode pod directly are refused.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from e2e.cluster import ControlPlane, eventually
from e2e.kube_client import KubeClient
from e2e.kube_helpers import live_pods, tiny_checkpoint
from e2e.test_operator import (  # noqa: F401  (module fixture: redis_url)
    PAGEFLEET,
    Operator,
    _wait_ready,
    apply,
    apply_service,
    gateway_kubeconfig,
    infsvc,
    redis_url,
)

pytestmark = pytest.mark.e2e

PROMPT = (
    "The operator turned the long prompt into a prefill on one pod and a decode on another, "
    "and the answer came back as if nothing had happened at all, which was the point"
)


def _metric(ip: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items())
    )


def _post_decode(ip: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"http://{ip}:8000/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _client(gateway_ip: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"http://{gateway_ip}:8080/v1", api_key="unused", max_retries=2)


def test_prefill_decode_serving(
    cluster: ControlPlane,
    kube: KubeClient,
    namespace: str,
    operator: Operator,
    redis_url: str,  # noqa: F811
) -> None:
    model = tiny_checkpoint()
    gw_kubeconfig = gateway_kubeconfig(cluster, namespace, "pd")
    spec = {
        "model": {"source": {"path": model}, "servedModelName": "tiny"},
        "command": [PAGEFLEET],
        "engine": {"kvCacheMemoryMB": 16, "maxNumSeqs": 8, "blockSize": 8},
        "roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        "router": {
            "replicas": 1,
            "pdMinUncachedTokens": 8,
            "env": [{"name": "KUBECONFIG", "value": str(gw_kubeconfig)}],
        },
        "index": {"redisURL": redis_url},
    }
    apply_service(cluster, kube, namespace, "pd", spec)
    obj = _wait_ready(kube, namespace, "pd", timeout_s=240)
    assert obj["status"]["replicas"] == "prefill:1/1 decode:1/1"
    assert [r["name"] for r in obj["status"]["roles"]] == ["prefill", "decode"]
    sel = "pagefleet.io/service=pd,pagefleet.io/role="
    (gw_pod,) = live_pods(kube, namespace, sel + "gateway")
    (decode_pod,) = live_pods(kube, namespace, sel + "decode")
    gateway_ip, decode_ip = gw_pod["status"]["podIP"], decode_pod["status"]["podIP"]
    client = _client(gateway_ip)

    first = eventually(
        lambda: client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0),
        90,
        "a completion via the gateway",
    )
    assert first.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 6
    assert _metric(decode_ip, "pagefleet:kv_transfer_requests_total", outcome="pulled") >= 1
    # The operator made the service's P/D secret, owned by the service.
    secret = cluster.kubectl_json("get", "secret", "pd-kv-transfer", "-n", namespace)
    assert [o["name"] for o in secret["metadata"]["ownerReferences"]] == ["pd"]
    # Params that name a host, sent to the decode pod directly: never pulled. Unsigned,
    # prefilled locally; signed with anything but the fleet's secret, refused.
    forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9,
              "remote_request_id": "h"}  # fmt: skip
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    status, got = _post_decode(decode_ip, {**body, "kv_transfer_params": forged})
    assert status == 200, got
    assert _metric(decode_ip, "pagefleet:kv_transfer_pulls_failed_total", reason="unsigned") == 1
    signed = {**forged, "remote_signature": "0" * 64, "remote_expires_at": 2**40}
    status, err = _post_decode(decode_ip, {**body, "kv_transfer_params": signed})
    assert status == 400 and "remote_signature" in err["error"]["message"], err

    # The prefill pod goes away: the decode pod prefills locally; nobody sees an error.
    (prefill_pod,) = live_pods(kube, namespace, sel + "prefill")
    cluster.kubectl("delete", "pod", prefill_pod["metadata"]["name"], "-n", namespace,
                    "--wait=false")  # fmt: skip
    for i in range(3):
        again = client.completions.create(
            model="tiny", prompt=f"{PROMPT} {i}", max_tokens=8, temperature=0
        )
        assert again.usage.completion_tokens == 8
    same = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert same.choices[0].text == first.choices[0].text
    # The replacement prefill pod comes back and the status shows both roles again.
    obj = _wait_ready(kube, namespace, "pd", timeout_s=240)
    assert obj["status"]["replicas"] == "prefill:1/1 decode:1/1"
    cluster.kubectl("delete", "infsvc", "pd", "-n", namespace, "--wait=false")
    eventually(
        lambda: live_pods(kube, namespace, "pagefleet.io/service=pd") == [], 120, "pods gone"
    )
    operator.check_alive()
