"""Bookkeeping of prefill/decode KV hand-over inside one engine.

A *prefill* engine finishes a request marked for export and, instead of freeing its
prompt's blocks, keeps them pinned under a transfer handle (the request id). A decode pod
pulls them over the network (pagefleet/daemon/kv_transfer.py) while the engine keeps
stepping; then, or at the handle's deadline, the engine unpins them.

A *decode* engine reserves blocks for a pull before it starts (its own prefix-cache hits
plus fresh blocks, pinned), receives the bytes, and commits: the KV is written, the full
blocks get their keys, and the request starts with the whole prompt but its last token
computed (``LLMEngine.commit_import``).

Threads: pins and the pool belong to the engine thread. The network side reads exported
blocks from another thread, so ``ExportRegistry`` is locked, and a handle being read is
never freed (``readers > 0`` blocks ``collect``) -- its blocks cannot be reused under the
reader.

Invariant: every handle ends exactly once, by ``release(consumed=True)`` + ``collect`` or
by expiry, and its pin goes with it; an engine's pins are exactly its live handles plus
its open import reservations.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pagefleet.kvindex.hashing import chain_hash, root_hash


@dataclass(slots=True)
class ExportedKV:
    """A finished prefill's prompt KV, pinned under ``handle`` until pulled or expired."""

    handle: str
    block_ids: list[int]  # covering positions 0 .. num_tokens - 1
    token_ids: list[int]  # the prompt
    block_hashes: list[int]  # keys of the prompt's full blocks
    lora_id: str | None
    deadline: float  # time.monotonic()
    readers: int = 0
    consumed: bool = False
    # The chain key over the prompt's partial last block (``tail_hash``), None when the
    # prompt ends on a block boundary.
    tail_hash: int | None = None


@dataclass(slots=True)
class ImportPlan:
    """Blocks a decode engine reserved for one pull (pinned under ``key``).

    Blocks ``0 .. first_block - 1`` are this engine's own cache hits; ``block_ids`` (the
    fresh ones) receive blocks ``first_block .. num_blocks - 1`` of the prompt, which cover
    positions ``0 .. num_prompt_tokens - 2`` (the last prompt token is recomputed here, so
    sampling -- greedy, seeded, n > 1 -- is exactly what a unified engine does).
    """

    key: str
    request_id: str
    token_ids: list[int]
    block_hashes: list[int]  # keys of every full prompt block (this engine's namespace)
    first_block: int
    num_blocks: int
    block_ids: list[int]
    lora_id: str | None
    deadline: float
    # Layers 0 .. layers_written - 1 of the pulled KV are in the blocks already
    # (``LLMEngine.write_import``: copied ahead of the commit, off the engine's steps).
    layers_written: int = 0
    # The chain key over the prompt's partial last block (``tail_hash``), None when the
    # prompt ends on a block boundary.
    tail_hash: int | None = None

    @property
    def num_pull_blocks(self) -> int:
        return self.num_blocks - self.first_block


def tail_hash(
    prompt: list[int], hashes: list[int], block_size: int, namespace: str, extra: str | None
) -> int | None:
    """The key the chain would give the prompt's partial last block, were it full (None
    when there is none): a pull whose range holds only that block has no full block whose
    key ties it to this namespace (the model) and adapter, so both sides compare this one
    too. It is never published or cached: a partial block has no key in the index."""
    n_full = len(hashes)
    if n_full * block_size == len(prompt):
        return None
    parent = hashes[-1] if hashes else root_hash(namespace)
    return chain_hash(parent, prompt[n_full * block_size :], extra)


@dataclass(slots=True)
class ExportRegistry:
    """Transfer handles of one engine: added by the engine thread, read from any thread."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _entries: dict[str, ExportedKV] = field(default_factory=dict)
    expired_total: int = 0
    released_total: int = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def add(self, entry: ExportedKV) -> None:
        with self._lock:
            if entry.handle in self._entries:
                raise ValueError(f"transfer handle {entry.handle!r} already exists")
            self._entries[entry.handle] = entry

    def acquire(self, handle: str, now: float) -> ExportedKV | None:
        """Start reading ``handle``; None when it does not exist, was pulled, or expired.
        Every successful acquire must be paired with one ``release``."""
        with self._lock:
            e = self._entries.get(handle)
            if e is None or e.consumed or now >= e.deadline:
                return None
            e.readers += 1
            return e

    def release(self, handle: str, consumed: bool) -> None:
        """End a read; ``consumed`` (the decode side has the bytes) frees the handle at the
        engine's next ``collect``."""
        with self._lock:
            e = self._entries.get(handle)
            if e is None:
                return
            e.readers -= 1
            assert e.readers >= 0, f"transfer handle {handle!r} released more than acquired"
            if consumed:
                e.consumed = True

    def collect(self, now: float, force: bool = False) -> list[ExportedKV]:
        """Remove (and return) handles that are consumed or past their deadline and not
        being read; ``force`` removes every unread handle (shutdown, reset)."""
        out: list[ExportedKV] = []
        with self._lock:
            for h, e in list(self._entries.items()):
                if e.readers:
                    continue
                if e.consumed:
                    self.released_total += 1
                elif now >= e.deadline or force:
                    self.expired_total += 1
                else:
                    continue
                del self._entries[h]
                out.append(e)
        return out

    def handles(self) -> list[str]:
        with self._lock:
            return list(self._entries)
