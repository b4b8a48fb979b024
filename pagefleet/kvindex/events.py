"""KV events, vLLM-shaped: what a pod stored and dropped (docs/architecture.md).

Invariant: a pod emits its events in the order its engine applied them, batched per
engine step; replaying them in order into an empty index reproduces exactly the set of
blocks the pod holds as cached (hashed) blocks.

The prefix-closure contract between engines and indexes (stated here only; the modules on
either side refer to this):

- *What holds.* After every engine step, each pod's cached set is prefix-closed: if a
  block is cached, so is its parent (the block before it in its chain, named by
  ``BlockStored.parent_block_hash``). So along any prompt's chain of block keys, the
  blocks a pod holds are exactly a leading run.
- *Who keeps it* (pagefleet/engine): ``BlockPool`` is the only source of events and the
  only place the cache map changes; ``KVCacheManager`` frees a sequence's blocks tail
  first (the LRU evicts a chain's tail before its head), caches a block only while its
  parent is cached, and after each step folds a duplicate block (two sequences filled
  the same block in one step; only one copy can hold the key) into the cached original,
  so no cached block hangs under an uncached copy of its parent.
- *Who relies on it* (pagefleet/kvindex): ``KVIndex.lookup`` counts a pod's leading
  blocks; the Redis backend bisects the chain (redis_lua.LOOKUP) instead of walking it,
  which is exact only on prefix-closed sets. On a set with a hole (a lost event, before
  the daemon's resync repairs it) a match may run past the hole, never short of the held
  prefix nor beyond the last held block.
- *The test*: tests/contract/test_prefix_closure.py runs the real engine and the Redis
  index together and checks, after every step, that each chain's cached blocks are a
  leading run and that lookups equal what the engine holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass(slots=True, frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: str | None = None
    type: Literal["BlockStored"] = "BlockStored"


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    type: Literal["BlockRemoved"] = "BlockRemoved"


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    type: Literal["AllBlocksCleared"] = "AllBlocksCleared"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """All events of one engine step, in order. ``seq`` increases by one per batch per pod."""

    ts: float
    seq: int
    events: list[KVEvent] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"ts": self.ts, "seq": self.seq, "events": [asdict(e) for e in self.events]}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KVEventBatch:
        kinds = {
            "BlockStored": BlockStored,
            "BlockRemoved": BlockRemoved,
            "AllBlocksCleared": AllBlocksCleared,
        }
        events: list[KVEvent] = []
        for e in d["events"]:
            e = dict(e)
            kind = kinds[e.pop("type")]
            events.append(kind(**e))
        return KVEventBatch(ts=d["ts"], seq=d["seq"], events=events)
