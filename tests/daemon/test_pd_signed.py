"""P/D with the fleet's transfer secret: real prefill and decode daemons and the real gateway.

A decode daemon pulled from whatever ``remote_host:remote_port`` a request's
``kv_transfer_params`` named, presenting its upstream API key there, and wrote what came
back into its prefix cache: anyone who reached the daemon directly (``pagefleet up``, a
daemon without API keys) chose the host. With ``PAGEFLEET_KV_TRANSFER_SECRET`` the prefill
daemon (and the gateway, for the handles it names) signs the params, and the decode daemon
checks them before it connects anywhere: unsigned ones are prefilled locally (a gateway
without the secret, mid-rollout, costs no client an error), altered ones refused (400,
naming the field).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from pagefleet.daemon.metrics import LABELS
from pagefleet.daemon.pd import PDSide
from pagefleet.httpauth import (
    ENV_KV_SECRET,
    ENV_UPSTREAM,
    TransferClaims,
    TransferSigner,
)

from .conftest import live_daemon
from .test_pd_fleet import MODEL, PROMPT, _config, _gateway, _metric

SECRET = "fleet-secret-for-tests"
_FAILED = "pagefleet:kv_transfer_pulls_failed_total"
_OUTCOME = "pagefleet:kv_transfer_requests_total"


class _Listener:
    """A "prefill pod" that records every connection's request head and answers nothing."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            self.heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    async def __aenter__(self) -> _Listener:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]


async def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


def _signed(params: dict[str, Any], secret: str, expires_at: int) -> dict[str, Any]:
    """``params`` signed as a pod of a fleet with ``secret`` would (namespace: MODEL)."""
    claims = TransferClaims(
        handle=params["remote_request_id"], host=params["remote_host"],
        port=params["remote_port"], engine_id=params.get("remote_engine_id"),
        block_ids=params.get("remote_block_ids"), namespace=MODEL, expires_at=expires_at,
    )  # fmt: skip
    sig = TransferSigner(secret.encode()).sign(claims)
    return {**params, "remote_expires_at": expires_at, "remote_signature": sig}


@pytest.mark.timeout(180)
async def test_a_decode_daemon_with_the_fleet_secret_pulls_only_signed_params(monkeypatch) -> None:
    monkeypatch.setenv(ENV_KV_SECRET, SECRET)
    monkeypatch.setenv(ENV_UPSTREAM, "the-decode-pods-upstream-key")
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    async with (
        live_daemon(_config("prefill")) as p,
        live_daemon(_config("decode")) as d,
        _Listener() as evil,
    ):
        # The oracle: the prefill pod serving it whole (the decode pod must not cache it).
        _, want = await _post(p.url, base)
        text = want["choices"][0]["text"]
        forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                  "remote_port": evil.port, "remote_request_id": "h"}  # fmt: skip
        # Unsigned: served by a local prefill, nothing contacted.
        status, got = await _post(d.url, {**base, "kv_transfer_params": forged})
        assert (status, evil.connections) == (200, 0), (status, got, evil.heads)
        assert got["choices"][0]["text"] == text, got
        assert await _metric(d.url, _FAILED, reason="unsigned") == 1
        export = {"do_remote_decode": True, "remote_request_id": f"pd-{uuid.uuid4().hex}"}
        status, pre = await _post(p.url, {**base, "max_tokens": 1, "kv_transfer_params": export})
        assert status == 200, pre
        tp = pre["kv_transfer_params"]
        assert tp["remote_signature"] and tp["remote_expires_at"] > time.time()
        refused = [
            ({**forged, "remote_expires_at": tp["remote_expires_at"]},
             "kv_transfer_params.remote_signature is missing"),
            ({**forged, "remote_signature": tp["remote_signature"]},
             "kv_transfer_params.remote_expires_at is missing"),
            ({**tp, "remote_port": evil.port}, "remote_signature does not verify"),  # redirected
            ({**tp, "remote_expires_at": tp["remote_expires_at"] + 3600},
             "remote_signature does not verify"),  # prolonged
            (_signed(forged, "another fleet's secret", int(time.time()) + 60),
             "remote_signature does not verify"),
        ]  # fmt: skip
        for params, says in refused:
            status, err = await _post(d.url, {**base, "kv_transfer_params": params})
            assert status == 400, (params, err)
            assert err["error"]["param"] == "kv_transfer_params"
            assert says in err["error"]["message"], err
        # The prefill pod's own params, unchanged: pulled, token-exact.
        status, got = await _post(d.url, {**base, "kv_transfer_params": tp})
        assert status == 200 and got["choices"][0]["text"] == text, got
        assert await _metric(d.url, _OUTCOME, outcome="pulled") == 1
        # Expired but truly signed: the handle is gone by then; prefilled here, nothing asked.
        stale = _signed(forged, SECRET, int(time.time()) - 3600)
        status, got = await _post(d.url, {**base, "kv_transfer_params": stale})
        assert status == 200 and got["choices"][0]["text"] == text, got
        assert await _metric(d.url, _FAILED, reason="expired") == 1
        assert (evil.connections, evil.heads) == (0, []), "the decode pod connected anyway"
        # Through the gateway (same secret): the handle it names early, and the prefill
        # pod's answer it readdresses when not early, both verify and are pulled.
        gw, runner, url = await _gateway([p.url], [d.url])
        try:
            for early in (True, False):
                gw.pd.settings.early = early
                before = await _metric(d.url, _OUTCOME, outcome="pulled")
                prompt = f"Told early: {early}. {PROMPT}"  # no prefix of another
                status, got = await _post(url, {**base, "prompt": prompt})
                assert status == 200, got
                _, whole = await _post(p.url, {**base, "prompt": prompt})
                assert got["choices"][0]["text"] == whole["choices"][0]["text"]
                assert await _metric(d.url, _OUTCOME, outcome="pulled") == before + 1, early
        finally:
            await runner.cleanup()
        assert await _metric(d.url, _FAILED) == 2  # the unsigned and the expired one only
        for daemon in (p, d):
            await daemon.daemon.engine_loop.invoke("collect_transfers", float("inf"))
            assert (await daemon.daemon.engine_loop.stats()).kv_usage == 0
            await daemon.daemon.engine_loop.invoke("check_integrity")


async def test_without_a_secret_the_daemon_says_once_that_params_are_not_verified(
    monkeypatch, caplog
) -> None:
    monkeypatch.delenv(ENV_KV_SECRET, raising=False)
    side = PDSide(
        _config("decode"), CollectorRegistry(), LABELS, ["m", "decode", "p"], lambda: None
    )
    with caplog.at_level(logging.WARNING, logger="pagefleet.daemon.pd"):
        await side.start()
        await side.stop()
    said = [r.getMessage() for r in caplog.records if ENV_KV_SECRET in r.getMessage()]
    assert len(said) == 1 and "not verified" in said[0], said
    assert side.signer is None
