"""Fetch the autoscaler's raw inputs: every Ready pod's /metrics and the Redis heartbeats.

All pods are scraped concurrently, each with a timeout; a pod that does not answer (or
answers garbage) is reported with an error and counts as unknown. Redis is read once per
role pass (the heartbeats of the whole InferenceService); if it cannot be reached, every pod
is unknown and the planner holds the count.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.redis_auth import RedisCredentials
from pagefleet.operator.signals import MetricsError, PodSnapshot, parse_metrics


@dataclass(frozen=True, slots=True)
class PodTarget:
    name: str
    url: str  # http://<pod ip>:<port>/metrics
    parse: Callable[[str, float], PodSnapshot] = parse_metrics  # a daemon's, or a gateway's


@dataclass(slots=True)
class Scrape:
    snapshot: PodSnapshot | None
    error: str | None = None


# Most bytes of one pod's /metrics the operator reads. A daemon's is ~27 KB; a body past
# this (a label explosion, a port that serves something else) would otherwise be read whole
# and parsed while the pass holds the service's lock (300 MiB: 38 s and 1.8 GiB).
MAX_METRICS_BYTES = 4 * 1024 * 1024


async def _fetch(
    session: aiohttp.ClientSession, target: PodTarget, limit: int
) -> tuple[str | None, float, str | None]:
    """(the body, when it arrived, or None and why not); stops reading past ``limit``."""
    too_big = (
        f"{target.url}: the body is larger than {limit} bytes (a daemon's is ~30 KB): "
        "not read; is this port a pagefleet daemon's /metrics?"
    )
    try:
        async with session.get(target.url) as resp:
            if resp.status != 200:
                return None, 0.0, f"GET {target.url}: HTTP {resp.status}"
            if resp.content_length is not None and resp.content_length > limit:
                return None, 0.0, too_big
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > limit:
                    return None, 0.0, too_big
                chunks.append(chunk)
            charset = resp.charset or "utf-8"  # the exposition format's is UTF-8
        return b"".join(chunks).decode(charset), time.monotonic(), None
    except (UnicodeDecodeError, LookupError) as exc:  # not text in the declared charset
        return None, 0.0, f"{target.url}: the body is not text: {type(exc).__name__}: {exc}"
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return None, 0.0, f"GET {target.url}: {type(exc).__name__}: {exc}".rstrip(": ")


def _parse(target: PodTarget, text: str | None, t: float, error: str | None) -> Scrape:
    if text is None:
        return Scrape(None, error)
    try:
        return Scrape(target.parse(text, t))
    except MetricsError as exc:
        return Scrape(None, f"{target.url}: {exc}")


async def scrape_pods(
    targets: list[PodTarget], timeout_s: float, limit: int = MAX_METRICS_BYTES
) -> dict[str, Scrape]:
    """Every target's snapshot (or the error that made it unknown), fetched concurrently,
    then parsed: a parse holds the event loop, and inside the fetches it would eat the other
    pods' timeouts."""
    if not targets:
        return {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # One connection per pod: the timeout counts the wait for a pooled connection, and
    # with the default pool of 100 the pods past it timed out behind slow ones.
    connector = aiohttp.TCPConnector(limit=max(100, len(targets)))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        bodies = await asyncio.gather(*(_fetch(session, t, limit) for t in targets))
    return {t.name: _parse(t, *body) for t, body in zip(targets, bodies, strict=True)}


async def read_heartbeats(
    redis_url: str,
    kv_namespace: str,
    timeout_s: float,
    credentials: RedisCredentials | None = None,
) -> dict[str, PodLoad]:
    """Live pods' heartbeats of one InferenceService; raises OSError-like redis errors when
    Redis cannot be reached or refuses the credentials (the caller turns that into a
    condition, never into zeros)."""
    import redis.asyncio as aredis

    from pagefleet.kvindex.redis_index import RedisKVIndex

    client = aredis.Redis.from_url(
        redis_url,
        decode_responses=False,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        **(credentials or RedisCredentials()).client_kwargs(redis_url),
    )
    index = RedisKVIndex(client, namespace=kv_namespace, owns_client=True, auto_gc_interval_s=None)
    try:
        async with asyncio.timeout(timeout_s):
            return await index.pods()
    finally:
        await index.close()


async def gather_inputs(
    targets: list[PodTarget],
    redis_url: str | None,
    kv_namespace: str,
    timeout_s: float,
    credentials: RedisCredentials | None = None,
) -> tuple[dict[str, Scrape], dict[str, PodLoad] | None, str | None]:
    """Scrapes and heartbeats at once: (scrapes, heartbeats or None, Redis error or None)."""

    async def heartbeats() -> tuple[dict[str, PodLoad] | None, str | None]:
        if redis_url is None:
            return None, "no Redis URL"
        try:
            loads = await read_heartbeats(redis_url, kv_namespace, timeout_s, credentials)
            return loads, None
        except Exception as exc:  # any failure of Redis means: heartbeats unknown
            return None, f"Redis {_redact(redis_url)}: {type(exc).__name__}: {exc}"

    scrapes, (loads, err) = await asyncio.gather(scrape_pods(targets, timeout_s), heartbeats())
    return scrapes, loads, err


def _redact(url: str) -> str:
    """The URL without its password (status messages and Events are readable by many)."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    host = rest.rsplit("@", 1)[1]
    return f"{scheme}://***@{host}" if scheme else f"***@{host}"
