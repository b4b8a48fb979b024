"""pagefleet.kvindex: block hashing, KV events and the global prefix index backends.

The Redis backend is imported lazily (``from pagefleet.kvindex.redis_index import
RedisKVIndex``) so importing this package does not need a Redis client.
"""

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
from pagefleet.kvindex.redis_server import LocalRedis, find_redis_server

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVIndex",
    "LocalRedis",
    "MemoryKVIndex",
    "PodLoad",
    "block_hashes",
    "chain_hash",
    "find_redis_server",
    "root_hash",
]
