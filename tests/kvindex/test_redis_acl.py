"""Redis credentials on a real redis-server with ACL users: the daemons' user writes the
index, the gateway's read-only user can look up but not write, and nobody else gets in.

The ACL lines are the ones docs/operator.md recommends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aredis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from pagefleet.dev.redis_server import LocalRedis
from pagefleet.kvindex.events import BlockStored, KVEventBatch
from pagefleet.kvindex.hashing import block_hashes
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.redis_auth import (
    DAEMON_ACL_RULES,
    GATEWAY_ACL_RULES,
    RedisCredentials,
    credentials_from_env,
    redact,
    split_password,
)
from pagefleet.kvindex.redis_index import RedisKVIndex

DAEMON_PW = "daemon-secret-7f3a"
GATEWAY_PW = "gateway-secret-91c2"
ACL = [
    "user default off",
    f"user pf-daemon on >{DAEMON_PW} {DAEMON_ACL_RULES}",
    f"user pf-gateway on >{GATEWAY_PW} {GATEWAY_ACL_RULES}",
]


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[LocalRedis]:
    with LocalRedis(acl=ACL) as server:
        yield server


def _index(server: LocalRedis, user: str, password: str, **kw: object) -> RedisKVIndex:
    creds = RedisCredentials(username=user, password=password)
    return RedisKVIndex.from_url(server.url, namespace="acl", credentials=creds, **kw)  # type: ignore[arg-type]


async def test_daemon_writes_gateway_reads_and_cannot_write(acl_redis: LocalRedis) -> None:
    hashes = block_hashes(list(range(64)), 16, namespace="acl")
    daemon = _index(acl_redis, "pf-daemon", DAEMON_PW)
    gateway = _index(acl_redis, "pf-gateway", GATEWAY_PW, auto_gc_interval_s=None)
    try:
        event = BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16
        )
        await daemon.apply("pod-a", KVEventBatch(ts=time.time(), seq=0, events=[event]))
        await daemon.heartbeat("pod-a", PodLoad(running=1), 30.0)
        # The read-only user sees what the daemon wrote.
        assert await gateway.lookup(hashes) == {"pod-a": len(hashes)}
        assert set(await gateway.pods()) == {"pod-a"}
        # ... and cannot change it: no forged heartbeat, no claimed blocks, no FLUSHALL.
        with pytest.raises(ResponseError, match=r"(?i)noperm|can't run this command"):
            await gateway.heartbeat("forged", PodLoad(), 30.0)
        with pytest.raises(ResponseError, match=r"(?i)noperm|can't run this command"):
            await gateway.apply("forged", KVEventBatch(ts=time.time(), seq=0, events=[event]))
        with pytest.raises(NoPermissionError):
            await gateway.client.flushall()
        with pytest.raises(NoPermissionError):
            await gateway.client.set("pf:{ns=acl}:hb:99", b"{}")
        # The daemon user cannot wipe the server either, nor touch keys outside pf:*.
        with pytest.raises(NoPermissionError):
            await daemon.client.flushall()
        with pytest.raises(NoPermissionError):
            await daemon.client.set("other:key", b"1")
        assert await gateway.lookup(hashes) == {"pod-a": len(hashes)}
        assert set(await gateway.pods()) == {"pod-a"}
        # Gateway replicas share placements on pf:* channels (shared_placements.py), and
        # on no other channel.
        channel = gateway.prefix + "placements"
        pubsub = gateway.client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(channel)
        assert await gateway.client.publish(channel, b"x") == 1
        with pytest.raises(NoPermissionError):
            await gateway.client.publish("other-channel", b"x")
        await pubsub.aclose()
    finally:
        await daemon.close()
        await gateway.close()


async def test_no_or_wrong_credentials_are_refused(acl_redis: LocalRedis) -> None:
    anonymous = aredis.Redis.from_url(acl_redis.url)
    wrong = aredis.Redis.from_url(acl_redis.url, username="pf-daemon", password="guess")
    try:
        with pytest.raises((AuthenticationError, ResponseError)):
            await anonymous.set("pf:{ns=acl}:x", b"1")
        with pytest.raises(AuthenticationError):
            await wrong.ping()
    finally:
        await anonymous.aclose()
        await wrong.aclose()


async def test_credentials_from_the_environment_reach_the_server(
    acl_redis: LocalRedis, tmp_path: Path
) -> None:
    pw_file = tmp_path / "password"
    pw_file.write_text(GATEWAY_PW + "\n")  # a mounted Secret often ends with a newline
    env = {"PAGEFLEET_REDIS_USERNAME": "pf-gateway", "PAGEFLEET_REDIS_PASSWORD_FILE": str(pw_file)}
    creds = credentials_from_env(env)
    assert creds.password == GATEWAY_PW and GATEWAY_PW not in repr(creds)
    index = RedisKVIndex.from_url(acl_redis.url, namespace="acl", credentials=creds)
    try:
        assert await index.client.ping()
    finally:
        await index.close()
    with pytest.raises(ValueError, match="PAGEFLEET_REDIS_PASSWORD_FILE"):
        credentials_from_env({"PAGEFLEET_REDIS_PASSWORD_FILE": str(tmp_path / "missing")})


def test_url_helpers_keep_the_password_out_of_logs_and_argv() -> None:
    url = "rediss://pf-daemon:p%40ss@redis.infra:6380/0"
    assert redact(url) == "rediss://pf-daemon:***@redis.infra:6380/0"
    assert split_password(url) == ("rediss://pf-daemon@redis.infra:6380/0", "p@ss")
    assert split_password("redis://:pw@h:1/0") == ("redis://h:1/0", "pw")
    assert split_password("redis://h:1/0") == ("redis://h:1/0", None)
    creds = RedisCredentials(username="u", password="p", ca_file="/ca.pem")
    assert creds.client_kwargs("rediss://h:1") == {
        "username": "u",
        "password": "p",
        "ssl_ca_certs": "/ca.pem",
        "ssl_cert_reqs": "required",
    }
    assert "ssl_ca_certs" not in creds.client_kwargs("redis://h:1")
