"""Fixtures: a live daemon on 127.0.0.1 (real aiohttp server), with a fake or real engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

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
