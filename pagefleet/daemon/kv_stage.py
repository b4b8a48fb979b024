"""Shared-memory staging of P/D KV bytes between a daemon's HTTP process and its engine process.

A prompt's KV is tens of MB (the 4x512 bench model: 16 KB a token). Sent through the engine
pipe it was copied to bytes, pickled, written, read, unpickled and copied again on each
side, per layer, in small round trips. Instead the HTTP process creates a file on tmpfs
(``/dev/shm``) and maps it, the engine process maps the same file, and only the file's path
and sizes cross the pipe: the engine gathers the exported blocks straight into it (prefill
side) or copies the pulled bytes out of it into its pool (decode side), and the HTTP process
writes it to, or reads it from, the TCP stream.

Layout of a stage: for each layer, K then V of the blocks, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` in C order -- the same bytes, in the
same order, as the ``/v1/kv/pull`` payload (kv_transfer.py), so a stage is sent or filled
in one piece.

Invariants: the HTTP process owns every stage file: it unlinks it as soon as both sides are
done with it (``close``, always in a ``finally``), names carry its pid
(``pagefleet-kv-<pid>-<random>``) so a leftover of a killed daemon is recognisable, and the
space is reserved up front (``posix_fallocate``): a full tmpfs fails ``create`` (the caller
then uses the pipe) instead of killing a process with SIGBUS on a later write.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

STAGE_DIR = "/dev/shm"


class KVStage:
    """One mapped tmpfs file of ``capacity`` bytes (HTTP-process side), of which the first
    ``nbytes`` are in use (a reused stage holds a smaller payload than it can)."""

    __slots__ = ("_mm", "capacity", "nbytes", "path")

    def __init__(self, path: str, nbytes: int, mm: mmap.mmap) -> None:
        self.path = path
        self.nbytes = nbytes
        self.capacity = nbytes
        self._mm: mmap.mmap | None = mm

    @classmethod
    def create(cls, nbytes: int, directory: str = STAGE_DIR) -> KVStage | None:
        """A new stage, or None when shared memory is unavailable here (no tmpfs, no room):
        the caller moves the bytes through the pipe instead."""
        if nbytes <= 0 or not os.path.isdir(directory):
            return None
        path = os.path.join(directory, f"pagefleet-kv-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        finally:
            os.close(fd)
        return cls(path, nbytes, mm)

    def view(self) -> memoryview:
        """A writable view of the ``nbytes`` in use."""
        if self._mm is None:
            raise ValueError("the KV stage is closed")
        return memoryview(self._mm)[: self.nbytes]

    def close(self) -> None:
        """Unlink the file and drop the mapping (idempotent). A view still alive keeps the
        memory mapped until it is collected; the file name is gone at once either way."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()

    def __enter__(self) -> KVStage:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class StagePool:
    """Stages kept for reuse by one daemon's decode side (HTTP process).

    Creating a stage for every pull cost the decode core ~17 ms of CPU a 29 MB pull on the
    2-core VM (``posix_fallocate`` zero-fills the tmpfs pages, the first write through a
    new mapping faults on each page, unlink and unmap free them): CPU taken from the
    decode steps. A reused stage pays none of it. Capacity is rounded up to ``grain``
    bytes so prompts of similar lengths share stages; at most ``keep`` idle stages are
    kept (``keep * capacity`` of tmpfs held while idle), the rest are closed.

    Invariant: a stage is given back (``give_back``) only when nobody else will read or
    write it -- in particular not when an engine call that reads it may still run (a
    cancelled commit): such a stage is closed instead, and its file name goes at once.
    """

    __slots__ = ("_free", "grain", "keep")

    def __init__(self, keep: int = 2, grain: int = 8 << 20) -> None:
        self.keep = keep
        self.grain = grain
        self._free: list[KVStage] = []

    def take(self, nbytes: int, create: Callable[[int], KVStage | None]) -> KVStage | None:
        """A stage with ``nbytes`` in use: the smallest idle one that fits, else
        ``create(capacity)`` (None: no shared memory; the caller uses the pipe)."""
        fits = [s for s in self._free if s.capacity >= nbytes]
        if fits:
            stage = min(fits, key=lambda s: s.capacity)
            self._free.remove(stage)
        else:
            stage = create(-(-nbytes // self.grain) * self.grain)
            if stage is None:
                return None
        stage.nbytes = nbytes
        return stage

    def give_back(self, stage: KVStage) -> None:
        """Keep ``stage`` for the next pull (or close it when ``keep`` are idle already:
        the smallest goes)."""
        if stage._mm is None:
            return
        self._free.append(stage)
        if len(self._free) > self.keep:
            self._free.sort(key=lambda s: s.capacity)
            self._free.pop(0).close()

    def close(self) -> None:
        """Close every idle stage (daemon shutdown)."""
        while self._free:
            self._free.pop().close()

    def idle_paths(self) -> list[str]:
        """The files of the idle stages kept for reuse."""
        return [s.path for s in self._free]


class ByteBudget:
    """Bytes of pulled or exported KV a daemon's HTTP process stages at once (stages, or
    buffers where there is no shared memory), one event loop's.

    Each pull staged its whole payload before its first byte arrived, however many ran:
    N pulls from slow peers held N stages at once, bounded by nothing but the KV pool, on
    tmpfs that is the pod's memory. ``take`` waits for room (back-pressure) and says False
    when none came in time; the caller then moves the bytes another way or falls back.

    Invariant: ``used`` is the sum of the grants not yet given back (``give``), at most
    ``limit`` unless one grant alone exceeds it: a payload larger than the whole budget
    still goes, alone (else a long enough prompt could never be pulled)."""

    __slots__ = ("_waiters", "limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []  # woken on every ``give``

    def try_take(self, nbytes: int) -> bool:
        """Grant ``nbytes`` now if they fit (or nothing else is held); never waits."""
        if self.used and self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    async def take(self, nbytes: int, wait_s: float) -> bool:
        """Grant ``nbytes``, waiting up to ``wait_s`` for room; False when none came.
        Cancel-safe: a cancelled wait holds nothing."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not self.try_take(nbytes):
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            try:
                async with asyncio.timeout_at(deadline):
                    await fut
            except TimeoutError:
                return False
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
        return True

    def give(self, nbytes: int) -> None:
        """Return a grant (in a ``finally``); every waiter tries again."""
        self.used -= nbytes
        assert self.used >= 0, "a KV staging budget given back more than it granted"
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


def stage_bytes(layout: Any, num_blocks: int) -> int:
    """Size of a stage holding K and V of ``num_blocks`` blocks in every layer."""
    return 2 * layout.num_layers * num_blocks * layout.block_bytes_per_layer


def stage_tensors(
    path: str, layout: Any, num_blocks: int, maps: StageMaps | None = None
) -> list[tuple[Any, Any]]:
    """Engine-process side: per layer (K, V) tensor views of the stage file at ``path``
    (mapped shared: writes reach the HTTP process). The mapping lives as long as a view;
    with ``maps`` it is the one kept for that file (no page faults on a reused stage)."""
    import torch

    per = num_blocks * layout.block_bytes_per_layer
    size = 2 * layout.num_layers * per
    if maps is not None:
        flat = maps.get(path, size)
    else:
        flat = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    dtype = getattr(torch, layout.dtype)
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)

    def part(i: int) -> Any:
        return flat[i * per : (i + 1) * per].view(dtype).view(shape)

    return [(part(2 * layer), part(2 * layer + 1)) for layer in range(layout.num_layers)]


class StageMaps:
    """Engine-process side: the mappings of stage files, kept while their file lives.

    The HTTP process reuses its stages (``StagePool``), but a new mapping of the same file
    in the engine process faults in every page again on first touch: a 29 MB gather or
    write through a new mapping took 15-20 ms, through a kept one 5-6 ms (one core,
    docs/benchmarks.md, P/D session 9). A mapping is dropped when its file is gone (the HTTP
    side closed the stage: only the mapping still held the memory) or changed (another
    inode or size), and beyond ``keep`` mappings, the least recently used first. Thread
    safe (the engine thread gathers, side threads write)."""

    def __init__(self, keep: int = 6) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, tuple[tuple[int, int], Any]] = OrderedDict()

    def get(self, path: str, size: int) -> Any:
        """A flat uint8 tensor mapping at least the first ``size`` bytes of ``path``
        (FileNotFoundError when it is gone)."""
        import torch

        st = os.stat(path)
        ident = (st.st_ino, st.st_size)
        with self._lock:
            self._prune_locked()
            hit = self._maps.get(path)
            if hit is not None and hit[0] == ident and hit[1].numel() >= size:
                self._maps.move_to_end(path)
                return hit[1]
            flat = torch.from_file(path, shared=True, size=st.st_size, dtype=torch.uint8)
            self._maps[path] = (ident, flat)
            while len(self._maps) > self._keep:
                self._maps.popitem(last=False)
            return flat

    def prune(self) -> None:
        """Drop the mappings of stage files that are gone (their memory goes with them)."""
        with self._lock:
            self._prune_locked()

    def _prune_locked(self) -> None:
        for path in [p for p in self._maps if not os.path.exists(p)]:
            del self._maps[path]

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)
