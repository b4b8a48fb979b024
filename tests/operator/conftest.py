from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_kube import REDIS, FakeKube

from pagefleet.dev.redis_server import LocalRedis


@pytest.fixture
def unified_spec() -> dict[str, Any]:
    return {
        "model": {"source": {"path": "tiny"}, "servedModelName": "tiny-llama"},
        "image": "pagefleet:test",
        "roles": {"unified": {"replicas": 2}},
        "index": {"redisURL": REDIS},
    }


@pytest.fixture
def pd_spec() -> dict[str, Any]:
    return {
        "model": {"source": {"path": "tiny"}},
        "roles": {
            "prefill": {"replicas": 1},
            "decode": {"autoscaling": {"minReplicas": 2, "maxReplicas": 4}},
        },
        "index": {"redisURL": REDIS},
    }


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


@pytest.fixture(scope="module")
def redis() -> Iterator[str]:
    """A real Redis for the autoscaler's heartbeat reads, one per test module."""
    with LocalRedis() as server:
        yield server.url
