"""Fixtures: a live daemon on 127.0.0.1 (real aiohttp server), with a fake or real engine."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pagefleet.daemon.app import Daemon
from pagefleet.daemon.config import DaemonConfig
from pagefleet.engine.tiny import ensure_tiny_checkpoint
from pagefleet.tokenizer import Tokenizer


@dataclass
class LiveDaemon:
    daemon: Daemon
    url: str  # http://127.0.0.1:PORT

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@asynccontextmanager
async def live_daemon(
    config: DaemonConfig, engine_factory: Callable[..., Any] | None = None, index: Any = None
) -> AsyncIterator[LiveDaemon]:
    """Start a Daemon exactly as `pagefleet daemon` does (AppRunner, handler cancellation)."""
    kwargs: dict[str, Any] = {"index": index}
    if engine_factory is not None:
        kwargs["engine_factory"] = engine_factory
    daemon = Daemon(config, **kwargs)
    runner = web.AppRunner(daemon.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", config.port)
    await site.start()
    try:
        await daemon.start()
        yield LiveDaemon(daemon, f"http://127.0.0.1:{config.port}")
    finally:
        await daemon.drain(grace_s=2.0)
        await daemon.stop()
        await runner.cleanup()


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(ensure_tiny_checkpoint("tiny"))


async def wait_daemon_ready(
    s: aiohttp.ClientSession, base: str, proc: subprocess.Popen, timeout_s: float = 120.0
) -> None:
    """Poll ``base``/ready until 200; fail at once if the daemon process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"daemon exited early with {proc.returncode}")
        try:
            async with s.get(f"{base}/ready") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    pytest.fail("daemon never became ready")
