"""Block keys: THE one hash function shared by daemons and gateways (docs/architecture.md).

Invariant: for the same (namespace, token ids, block size, extra) every process on every
machine computes the same keys, forever. So the hash is a fixed, seedless 64-bit content
hash (BLAKE2b with an 8-byte digest over a canonical byte encoding), never Python's
``hash()``. Changing anything here invalidates every index in the fleet.

    h_0 = H(b"pagefleet/ns\\0" + namespace)
    h_i = H(h_{i-1} as 8 little-endian bytes || token ids of block i as uint32 LE || extra)

Only full blocks get keys; a trailing partial block has none.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_NS_TAG = b"pagefleet/ns\x00"
_EXTRA_TAG = b"\x00extra\x00"


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def root_hash(namespace: str) -> int:
    """h_0: the chain's root for one namespace (the model / InferenceService key)."""
    return _h(_NS_TAG + namespace.encode("utf-8"))


def chain_hash(parent: int, block_token_ids: Sequence[int], extra: str | None = None) -> int:
    """h_i from h_{i-1} and the token ids of one full block."""
    payload = parent.to_bytes(8, "little") + struct.pack(
        f"<{len(block_token_ids)}I", *block_token_ids
    )
    if extra:
        payload += _EXTRA_TAG + extra.encode("utf-8")
    return _h(payload)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str = "",
    extra: str | None = None,
    parent: int | None = None,
    start_block: int = 0,
) -> list[int]:
    """Keys of every full block of ``token_ids``, in order.

    ``parent``/``start_block`` let a caller extend an existing chain: pass the key of block
    ``start_block - 1`` and only blocks from ``start_block`` on are hashed.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = root_hash(namespace) if parent is None else parent
    out: list[int] = []
    n_full = len(token_ids) // block_size
    for i in range(start_block, n_full):
        prev = chain_hash(prev, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(prev)
    return out
