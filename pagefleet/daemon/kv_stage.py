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

import contextlib
import mmap
import os
import uuid
from typing import Any

STAGE_DIR = "/dev/shm"


class KVStage:
    """One mapped tmpfs file of ``nbytes`` (HTTP-process side)."""

    __slots__ = ("_mm", "nbytes", "path")

    def __init__(self, path: str, nbytes: int, mm: mmap.mmap) -> None:
        self.path = path
        self.nbytes = nbytes
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
        """A writable view of the whole stage."""
        if self._mm is None:
            raise ValueError("the KV stage is closed")
        return memoryview(self._mm)

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


def stage_bytes(layout: Any, num_blocks: int) -> int:
    """Size of a stage holding K and V of ``num_blocks`` blocks in every layer."""
    return 2 * layout.num_layers * num_blocks * layout.block_bytes_per_layer


def stage_tensors(path: str, layout: Any, num_blocks: int) -> list[tuple[Any, Any]]:
    """Engine-process side: per layer (K, V) tensor views of the stage file at ``path``
    (mapped shared: writes reach the HTTP process). The mapping lives as long as a view."""
    import torch

    per = num_blocks * layout.block_bytes_per_layer
    flat = torch.from_file(path, shared=True, size=2 * layout.num_layers * per, dtype=torch.uint8)
    dtype = getattr(torch, layout.dtype)
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)

    def part(i: int) -> Any:
        return flat[i * per : (i + 1) * per].view(dtype).view(shape)

    return [(part(2 * layer), part(2 * layer + 1)) for layer in range(layout.num_layers)]
