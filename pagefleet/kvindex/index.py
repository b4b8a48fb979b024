"""The global prefix index contract: what every backend (memory, Redis) implements.

Invariant shared by all backends: a pod counts in ``lookup`` and ``pods`` only while its
last heartbeat is younger than that heartbeat's TTL. Entries of a pod without a live
heartbeat are kept (the pod may come back) until ``gc`` removes them, but they never
count.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from pagefleet.kvindex.events import KVEventBatch

ROLES = frozenset({"unified", "prefill", "decode"})
# Larger than any real queue or KV cache in blocks, small enough for any arithmetic.
MAX_COUNT = 1 << 40
# How far a heartbeat's timestamp may be ahead of the reader's clock, in seconds.
MAX_CLOCK_SKEW_S = 30.0


def _checked(values: dict[str, Any], now: float | None) -> dict[str, Any]:
    """``values`` (PodLoad fields) range-checked; see ``PodLoad.checked``."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name == "role":
            if not isinstance(value, str) or value not in ROLES:
                raise ValueError(f"heartbeat role {value!r} is not one of {sorted(ROLES)}")
            out[name] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"heartbeat field {name}={value!r} is not a number")
        if not math.isfinite(value):
            raise ValueError(f"heartbeat field {name}={value!r} is not finite")
        if value < 0:
            raise ValueError(f"heartbeat field {name}={value!r} is negative")
        if name == "kv_usage":
            out[name] = min(1.0, float(value))
        elif name == "ts":
            ahead = value - (time.time() if now is None else now)
            if ahead > MAX_CLOCK_SKEW_S:
                raise ValueError(
                    f"heartbeat ts is {ahead:.0f} s ahead of this clock "
                    f"(more than the {MAX_CLOCK_SKEW_S:.0f} s of skew tolerated)"
                )
            out[name] = float(value)
        else:
            out[name] = int(min(MAX_COUNT, value))
    return out


@dataclass(slots=True)
class PodLoad:
    """A pod's load as it reported it in its last heartbeat.

    ``ts`` is the pod's wall-clock time when it measured the load, so a reader can tell
    how old the figures are.
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks referenced by live requests, 0..1
    num_blocks: int = 0  # KV capacity in blocks (0 when unknown)
    num_cached_blocks: int = 0  # blocks the pod advertises in the index
    role: str = "unified"  # unified | prefill | decode
    ts: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def checked(self, now: float | None = None) -> PodLoad:
        """This load range-checked: the one check every reader of heartbeats applies (the
        Redis backend when it parses one, the gateway on whatever a backend returns).

        Whoever can write a heartbeat must not be able to make a pod look more idle than an
        idle pod or break the reader: a field of the wrong type, not finite, negative (a
        negative queue would rank the pod best forever), a role outside ``ROLES`` or a
        ``ts`` more than ``MAX_CLOCK_SKEW_S`` ahead of ``now`` (default: the wall clock)
        raises ValueError, and callers drop that pod. Counts above ``MAX_COUNT`` are
        clamped to it, ``kv_usage`` above 1 to 1.
        """
        return PodLoad(**_checked({f.name: getattr(self, f.name) for f in fields(self)}, now))

    @classmethod
    def from_dict(cls, d: dict[str, Any], now: float | None = None) -> PodLoad:
        """A load as read from the index, range-checked as ``checked`` says (ValueError
        when it is not usable)."""
        # Unknown keys are dropped so an older reader accepts a newer writer's heartbeat.
        known = {f.name for f in fields(cls)}
        return cls(**_checked({k: v for k, v in d.items() if k in known}, now))

    @classmethod
    def from_json(cls, s: str | bytes) -> PodLoad:
        d = json.loads(s)
        if not isinstance(d, dict):
            raise ValueError(f"heartbeat is not a JSON object: {str(d)[:80]!r}")
        return cls.from_dict(d)


@runtime_checkable
class KVIndex(Protocol):
    """Which pod holds which KV block, and how loaded each pod is.

    One index instance serves one namespace (the InferenceService's block-key namespace);
    instances of different namespaces never see each other's entries.
    """

    async def apply(self, pod: str, batch: KVEventBatch) -> bool | None:
        """Apply one pod's event batch, events in order (batches must arrive in order).

        True when a stored block registered ``pod`` anew: the index did not know the pod
        (see ``heartbeat``), so blocks it stored earlier are not here. None: cannot tell."""
        ...

    async def lookup(self, block_hashes: list[int]) -> dict[str, int]:
        """Live pod -> number of leading blocks of ``block_hashes`` it holds.

        Pods lacking the first block are absent. On prefix-closed sets (the contract in
        events.py, which engines keep) the match is exact: it stops at the pod's first
        missing block. Where an event was lost and left a hole, a backend may count past
        the hole (Redis bisects), but never below the held prefix nor beyond the last
        held block.
        """
        ...

    async def heartbeat(self, pod: str, load: PodLoad, ttl_s: float) -> bool | None:
        """Mark ``pod`` live for ``ttl_s`` seconds and record its load.

        True when this registered ``pod`` anew: its first heartbeat, or the index lost it
        since (a flush, a restart, an eviction, or gc after its heartbeat expired), and
        with it every block it held. None: the backend cannot tell. A publisher that knew
        the pod registered resyncs on True: no call failed to tell it otherwise."""
        ...

    async def pods(self) -> dict[str, PodLoad]:
        """Every pod with a live heartbeat and its last load."""
        ...

    async def clear_pod(self, pod: str) -> None:
        """Drop every block entry of ``pod`` (its heartbeat stays)."""
        ...

    async def resync(self, pod: str, block_hashes: set[int]) -> None:
        """Replace ``pod``'s whole block set with ``block_hashes``."""
        ...

    async def gc(self, grace_s: float = 30.0) -> int:
        """Remove the entries of pods whose heartbeat expired more than ``grace_s`` ago.

        Returns how many pods were removed. Safe to call often from any replica.
        """
        ...

    async def close(self) -> None: ...
