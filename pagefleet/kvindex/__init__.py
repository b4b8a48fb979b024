"""pagefleet.kvindex: block hashing, KV events and the global prefix index backends.

``RedisKVIndex`` is resolved lazily, so importing this package (the engine does, for
hashing) never imports the Redis client.
"""

from typing import TYPE_CHECKING, Any

from pagefleet.kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from pagefleet.kvindex.hashing import block_hashes, chain_hash, root_hash
from pagefleet.kvindex.index import KVIndex, PodLoad
from pagefleet.kvindex.memory import MemoryKVIndex

if TYPE_CHECKING:
    from pagefleet.kvindex.redis_index import RedisKVIndex


def __getattr__(name: str) -> Any:
    if name == "RedisKVIndex":
        from pagefleet.kvindex.redis_index import RedisKVIndex

        return RedisKVIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVIndex",
    "MemoryKVIndex",
    "PodLoad",
    "RedisKVIndex",
    "block_hashes",
    "chain_hash",
    "root_hash",
]
