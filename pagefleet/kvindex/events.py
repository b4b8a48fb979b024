"""KV events, vLLM-shaped (ARCHITECTURE §3): what a pod stored and dropped.

Invariant: a pod emits its events in the order its engine applied them, batched per
engine step; replaying them in order into an empty index reproduces exactly the set of
blocks the pod holds as cached (hashed) blocks.
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
