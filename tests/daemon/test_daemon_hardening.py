"""The daemon exposed on its own (issue 14): API keys, the admin token, and clients that
hang up while the daemon writes to them."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from pagefleet.daemon.app import Daemon
from pagefleet.httpauth import Credentials

from .conftest import live_daemon
from .fake_engine import FakeEngine, fake_config, fake_engine_factory


async def _status(s: aiohttp.ClientSession, method: str, url: str, token: str | None, **kw) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with s.request(method, url, headers=headers, **kw) as r:
        if r.status >= 400:
            body = await r.json()
            assert isinstance(body["error"]["message"], str), body
        return r.status


async def test_keys_and_admin_token(tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("PAGEFLEET_API_KEYS", "client-1")
    monkeypatch.setenv("PAGEFLEET_ADMIN_TOKEN", "admin-1")
    engines: list[FakeEngine] = []
    async with live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, engines)) as d:
        u = d.url
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        async with aiohttp.ClientSession() as s:
            assert await _status(s, "POST", u + "/v1/completions", None, json=body) == 401
            assert await _status(s, "POST", u + "/v1/completions", "nope", json=body) == 401
            assert await _status(s, "POST", u + "/v1/completions", "client-1", json=body) == 200
            # Admin endpoints: the client key does not open them, the admin token does.
            for method, path in (("POST", "/reset_prefix_cache"), ("GET", "/get_server_info")):
                assert await _status(s, method, u + path, None) == 401
                assert await _status(s, method, u + path, "client-1") == 401
                # (the scripted engine has no prefix cache to reset: 500 there, not 401)
                assert await _status(s, method, u + path, "admin-1") not in (401, 403)
            for path in ("/health", "/ready", "/metrics", "/openapi.json"):
                assert await _status(s, "GET", u + path, None) == 200


async def test_admin_closed_when_only_client_keys_are_set(tiny_tokenizer):
    creds = Credentials.from_keys(["c"])
    daemon = Daemon(fake_config(), fake_engine_factory(tiny_tokenizer, []), credentials=creds)
    refused = daemon.auth.check("/reset_prefix_cache", "c")
    assert refused is not None and refused.status == 403
    assert daemon.auth.check("/v1/completions", "c") is None
    assert daemon.auth.check("/v1/completions", None) is not None
    # Nothing configured: open as before.
    open_daemon = Daemon(
        fake_config(), fake_engine_factory(tiny_tokenizer, []), credentials=Credentials()
    )
    assert open_daemon.auth.check("/reset_prefix_cache", None) is None


async def test_write_to_a_closed_client_is_a_quiet_disconnect(tiny_tokenizer, caplog):
    """Without handler cancellation (the window where the client is gone but the handler
    still runs), the next write fails: that must abort the request, free its slot, and log
    nothing at ERROR (it used to log a stack trace)."""
    engines: list[FakeEngine] = []
    daemon = Daemon(fake_config(), fake_engine_factory(tiny_tokenizer, engines, step_delay_s=0.02))
    runner = web.AppRunner(daemon.app, handler_cancellation=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", daemon.config.port)
    await site.start()
    caplog.set_level(logging.DEBUG)
    try:
        await daemon.start()
        url = f"http://127.0.0.1:{daemon.config.port}/v1/completions"
        async with aiohttp.ClientSession() as s:
            for stream in (True, False):
                body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 60, "stream": stream}
                resp = await s.post(url, json=body) if stream else None
                if resp is not None:
                    await resp.content.readline()
                    resp.close()  # hang up mid-stream
                else:
                    task = asyncio.ensure_future(s.post(url, json=body))
                    await asyncio.sleep(0.2)
                    task.cancel()  # hang up before the answer
                for _ in range(200):
                    if daemon.admission.inflight == 0 and not engines[0].has_unfinished():
                        break
                    await asyncio.sleep(0.02)
                assert daemon.admission.inflight == 0
                assert not engines[0].has_unfinished()
        assert len(engines[0].aborted) >= 1
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
    finally:
        await daemon.drain(grace_s=1.0)
        await daemon.stop()
        await runner.cleanup()
