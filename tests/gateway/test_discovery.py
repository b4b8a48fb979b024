"""Endpoint discovery: static lists and EndpointSlice parsing / watch folding."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from aiohttp import web

from pagefleet.dev.process import free_port
from pagefleet.gateway.discovery import (
    Endpoint,
    KubernetesDiscovery,
    StaticDiscovery,
    parse_endpoint_slice,
    pod_name_for_url,
)
from pagefleet.gateway.policies import make_policy
from pagefleet.gateway.router import Router


def _slice(name: str, endpoints: list[dict], ports: list[dict] | None = None) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "llama"}},
        "addressType": "IPv4",
        "ports": ports
        if ports is not None
        else [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def _ep(ip: str, pod: str, ready: bool | None = True, terminating: bool | None = None) -> dict:
    cond: dict = {}
    if ready is not None:
        cond["ready"] = ready
    if terminating is not None:
        cond["terminating"] = terminating
    return {
        "addresses": [ip],
        "conditions": cond,
        "targetRef": {"kind": "Pod", "name": pod, "namespace": "default"},
    }


def test_static_discovery_names_pods_by_host_port() -> None:
    d = StaticDiscovery(["127.0.0.1:8001", "http://10.0.0.2:9000/", " "])
    assert d.endpoints() == [
        Endpoint("127.0.0.1:8001", "http://127.0.0.1:8001"),
        Endpoint("10.0.0.2:9000", "http://10.0.0.2:9000"),
    ]
    assert pod_name_for_url("http://localhost:1234/v1") == "localhost:1234"
    with pytest.raises(ValueError, match="explicit host and port"):
        pod_name_for_url("http://example.com")
    with pytest.raises(ValueError, match="at least one endpoint"):
        StaticDiscovery([])


def test_parse_keeps_only_ready_not_terminating_endpoints() -> None:
    s = _slice(
        "llama-abc",
        [
            _ep("10.1.0.5", "llama-0"),
            _ep("10.1.0.6", "llama-1", ready=False),
            _ep("10.1.0.7", "llama-2", ready=True, terminating=True),
            _ep("10.1.0.8", "llama-3", ready=None),  # unset ready means ready
        ],
    )
    assert parse_endpoint_slice(s) == [
        Endpoint("llama-0", "http://10.1.0.5:8000"),
        Endpoint("llama-3", "http://10.1.0.8:8000"),
    ]


def test_parse_picks_port_by_name_or_number_and_handles_ipv6_and_snake_case() -> None:
    ports = [{"name": "http", "port": 8000}, {"name": "metrics", "port": 9090}]
    s = _slice("x", [_ep("10.1.0.5", "p0")], ports)
    assert parse_endpoint_slice(s, "metrics") == [Endpoint("p0", "http://10.1.0.5:9090")]
    assert parse_endpoint_slice(s, 8000) == [Endpoint("p0", "http://10.1.0.5:8000")]
    assert parse_endpoint_slice(s, "grpc") == []
    assert parse_endpoint_slice(s, 1234) == []
    with pytest.raises(ValueError, match="several ports"):
        parse_endpoint_slice(s)
    v6 = {
        "address_type": "IPv6",
        "ports": [{"port": 8000}],
        "endpoints": [
            {"addresses": ["fd00::5"], "conditions": {"ready": True}, "target_ref": {"name": "p6"}}
        ],
    }
    assert parse_endpoint_slice(v6) == [Endpoint("p6", "http://[fd00::5]:8000")]
    no_ref = _slice("y", [{"addresses": ["10.9.9.9"], "conditions": {"ready": True}}])
    assert parse_endpoint_slice(no_ref) == [Endpoint("10.9.9.9", "http://10.9.9.9:8000")]


def test_watch_events_fold_into_a_snapshot_across_slices() -> None:
    d = KubernetesDiscovery("default", "llama", target_port="http")
    d.apply_event("ADDED", _slice("a", [_ep("10.0.0.1", "p1"), _ep("10.0.0.2", "p2")]))
    d.apply_event("ADDED", _slice("b", [_ep("10.0.0.3", "p3")]))
    assert [e.pod for e in d.endpoints()] == ["p1", "p2", "p3"]
    # p2 turns unready.
    d.apply_event(
        "MODIFIED", _slice("a", [_ep("10.0.0.1", "p1"), _ep("10.0.0.2", "p2", ready=False)])
    )
    assert [e.pod for e in d.endpoints()] == ["p1", "p3"]
    d.apply_event("DELETED", _slice("b", []))
    assert d.endpoints() == [Endpoint("p1", "http://10.0.0.1:8000")]


def test_kubernetes_client_objects_serialize_into_the_parser() -> None:
    """The watch hands us kubernetes client models; check the real serializer's output."""
    from kubernetes import client

    obj = client.V1EndpointSlice(
        address_type="IPv4",
        metadata=client.V1ObjectMeta(name="svc-1"),
        ports=[client.DiscoveryV1EndpointPort(name="http", port=8000)],
        endpoints=[
            client.V1Endpoint(
                addresses=["10.2.0.1"],
                conditions=client.V1EndpointConditions(ready=True),
                target_ref=client.V1ObjectReference(name="pod-a"),
            ),
            client.V1Endpoint(
                addresses=["10.2.0.2"],
                conditions=client.V1EndpointConditions(ready=False),
                target_ref=client.V1ObjectReference(name="pod-b"),
            ),
        ],
    )
    as_dict = client.ApiClient().sanitize_for_serialization(obj)
    assert parse_endpoint_slice(as_dict, "http") == [Endpoint("pod-a", "http://10.2.0.1:8000")]


# -- probing: not routed vs unreachable ----------------------------------------------------


def _silent_listener() -> socket.socket:
    """A port whose connections the kernel accepts and nobody ever answers (a frozen pod)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


class _ReadyServer:
    """A pod whose /ready answers 200, or holds every probe unanswered while ``silent``."""

    def __init__(self) -> None:
        self.silent = False
        self.runner: web.AppRunner | None = None
        self.pod = ""

    async def ready(self, request: web.Request) -> web.Response:
        while self.silent:
            await asyncio.sleep(0.02)
        return web.json_response({"status": "ready"})

    async def start(self) -> _ReadyServer:
        app = web.Application()
        app.router.add_get("/ready", self.ready)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.pod = f"127.0.0.1:{port}"
        return self


async def test_missed_probes_stop_routing_but_release_requests_only_after_the_silence() -> None:
    sock = _silent_listener()
    frozen = f"127.0.0.1:{sock.getsockname()[1]}"
    busy = await _ReadyServer().start()
    d = StaticDiscovery(
        [frozen, busy.pod], probe_interval_s=3600, probe_timeout_s=0.3, dead_after_s=3.0
    )
    told: list[str] = []
    d.subscribe_unreachable(told.append)
    pods = lambda: [e.pod for e in d.endpoints()]  # noqa: E731
    try:
        t_start = time.monotonic()
        await d.start()  # the first probe
        await d.probe_all()
        # Two misses: no new request goes there, but a busy pod's open requests go on.
        assert pods() == [busy.pod] and told == []
        # Every pod silent (the gateway's own loop saturated misses them all at once):
        # still routed to, rather than a 503 for every new request.
        busy.silent = True
        await d.probe_all()
        await d.probe_all()
        assert pods() == [frozen, busy.pod] and told == []
        busy.silent = False
        await asyncio.sleep(max(0.0, t_start + 3.0 - time.monotonic()))
        await d.probe_all()  # silent for 3 s and more since start-up: frozen
        assert told == [frozen]
        assert pods() == [busy.pod]
        await d.probe_all()
        assert len(told) == 1  # once per outage
        # Unreachable pods are not routed to even when nothing else is left.
        busy.silent = True
        await d.probe_all()
        await d.probe_all()
        assert pods() == [busy.pod]
    finally:
        busy.silent = False
        await d.close()
        sock.close()
        assert busy.runner is not None
        await busy.runner.cleanup()


async def test_refused_probes_release_requests_at_once() -> None:
    """Nothing listens: the pod is dead whatever ``dead_after_s`` says."""
    port = free_port()
    d = StaticDiscovery(
        [f"127.0.0.1:{port}"], probe_interval_s=3600, probe_timeout_s=1.0, dead_after_s=3600
    )
    told: list[str] = []
    d.subscribe_unreachable(told.append)
    try:
        await d.start()
        assert told == []
        await d.probe_all()
        assert told == [f"127.0.0.1:{port}"] and d.is_unreachable(f"127.0.0.1:{port}")
    finally:
        await d.close()


async def test_a_request_sent_to_a_pod_already_declared_unreachable_is_released_at_once() -> None:
    """A pod declared unreachable after the request was routed (its retry list, a decode pod
    chosen before a remote prefill) got the signal before the request watched it: the
    request then waited on a frozen pod for its whole timeout (600 s non-streamed)."""
    port = free_port()
    pod = f"127.0.0.1:{port}"
    d = StaticDiscovery([pod], probe_interval_s=3600, probe_timeout_s=1.0, unhealthy_after=1)
    router = Router(discovery=d, policy=make_policy("round_robin"))
    try:
        await router.start()  # its first probe is refused
        released: list[str] = []
        unwatch = router.watch(pod, lambda: released.append(pod))
        assert released == [pod]
        unwatch()
    finally:
        await router.close()
