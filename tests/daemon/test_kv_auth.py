"""A decode pod's KV calls to a prefill pod that requires API keys: wait, pull and release
each present the upstream key, and a pod without one (or with a wrong one) is refused with
a 401 that its log explains once.

The prefill side is the real thing: the KV export routes behind the daemon's auth
middleware, on loopback; a middleware in front records what each call carried.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from aiohttp import web

from pagefleet.daemon import kv_wire
from pagefleet.daemon.kv_transfer import (
    KVExportServer,
    KVPullError,
    KVTransferParams,
    TcpKVTransfer,
)
from pagefleet.dev.process import free_port
from pagefleet.httpauth import ENV_UPSTREAM, AuthPolicy, Credentials

KEY = "sk-kv-peer"
PLAN = SimpleNamespace(
    first_block=0, num_pull_blocks=1, num_blocks=1, block_hashes=[123], token_ids=[1] * 8
)
LAYOUT = SimpleNamespace(num_layers=1, block_size=8, num_kv_heads=1, head_dim=4, dtype="float32")


async def _prefill_pod(seen: list[tuple[str, str | None]]) -> tuple[web.AppRunner, int]:
    @web.middleware
    async def record(request: web.Request, handler):  # type: ignore[no-untyped-def]
        seen.append((request.path, request.headers.get("Authorization")))
        return await handler(request)

    auth = AuthPolicy(Credentials.from_keys([KEY]), component="daemon")
    app = web.Application(middlewares=[record, auth.middleware])
    export = KVExportServer(lambda: None, lambda: None)
    export.settle("h1", exported=True)  # a wait for it answers at once
    export.add_routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def _calls(client: TcpKVTransfer, port: int) -> tuple[bool, str, str]:
    """Release, wait and pull once each: release's result and the two failure reasons
    ("ok" for a wait that returned)."""
    params = KVTransferParams(
        do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port, remote_request_id="h1"
    )
    released = await client.release(params)
    try:
        await client.wait_ready(params, 2.0)
        waited = "ok"
    except KVPullError as exc:
        waited = exc.reason
    with pytest.raises(KVPullError) as pulled:
        await client.pull(params, PLAN, LAYOUT)
    return released, waited, pulled.value.reason


async def test_wait_pull_and_release_present_the_upstream_key(caplog) -> None:
    seen: list[tuple[str, str | None]] = []
    runner, port = await _prefill_pod(seen)
    try:
        client = TcpKVTransfer(timeout_s=3.0, api_key=KEY)
        try:
            _, waited, pulled = await _calls(client, port)
        finally:
            await client.close()
        assert seen == [
            ("/v1/kv/release", f"Bearer {KEY}"),
            ("/v1/kv/wait", f"Bearer {KEY}"),
            ("/v1/kv/pull", f"Bearer {KEY}"),
        ]
        # Past auth: the handle was waited for; the pull reached the (empty) export server.
        assert waited == "ok" and pulled != "http_401"

        # Without a key (or with a wrong one) each call is a 401, explained once in the log.
        for key, why in ((None, "sends no key"), ("sk-wrong", "not one they accept")):
            seen.clear()
            caplog.clear()
            client = TcpKVTransfer(timeout_s=3.0, api_key=key)
            with caplog.at_level(logging.WARNING, "pagefleet.daemon.kv_transfer"):
                try:
                    first = await _calls(client, port)
                    again = await _calls(client, port)
                finally:
                    await client.close()
            assert first == again == (False, "http_401", "http_401")
            assert [a for _, a in seen] == [None if key is None else f"Bearer {key}"] * 6
            warned = [r.getMessage() for r in caplog.records if "401" in r.getMessage()]
            assert len(warned) == 1, warned
            assert ENV_UPSTREAM in warned[0] and why in warned[0]
    finally:
        await runner.cleanup()


async def test_wire_post_refuses_a_header_that_would_split_the_request() -> None:
    for headers in ({"Authorization": "Bearer k\r\nX-Evil: 1"}, {"X\nY": "v"}):
        with pytest.raises(ValueError, match="line break"):
            await kv_wire.post("127.0.0.1", 9, "/v1/kv/pull", b"{}", 1.0, headers)
