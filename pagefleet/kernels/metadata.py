"""The attention contract between the ModelRunner and every attention backend.

A step's batch is *packed*: the new tokens of all scheduled sequences, one after another,
``num_tokens`` rows in all. Sequence ``i`` owns rows ``query_start_loc[i] :
query_start_loc[i+1]`` (its ``query_lens[i]`` new tokens), and after this step holds
``seq_lens[i]`` tokens of context (cached prefix + new). Its new tokens sit at positions
``seq_lens[i] - query_lens[i] ... seq_lens[i] - 1``; token at position p attends to
positions 0..p (causal), whose K/V live in the paged cache at
``block_tables[i, p // block_size] * block_size + p % block_size``.

Ordering invariant: the ModelRunner puts the ``num_decodes`` sequences with exactly one new
token first, so a backend may run one decode kernel on sequences ``[0, num_decodes)`` and
one prefill/extend kernel on the rest.

KV cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V.
``slot_mapping[t]`` is the flat slot (block * block_size + offset) where row t's K/V go;
-1 means "do not store" (e.g. padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int  # leading sequences whose query_len == 1
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Values a backend derives from this metadata once per step and reuses in every layer
    # (the metadata is built once per step and is the same object for all layers).
    scratch: dict[str, object] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


class AttentionBackend(Protocol):
    """Stores this step's K/V into the paged cache, then attends.

    ``forward`` shapes: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (Hq % Hkv == 0), caches as in
    the module docstring; returns ``[T, Hq, D]`` in q's dtype.
    ``copy_blocks`` copies whole blocks ``src[j] -> dst[j]`` in every layer (copy-on-write).
    ``rotate_half`` applies RoPE (rotate-half layout) to heads ``x [T, H, D]`` with tables
    ``[T, 1, D]``, bit-identical to ``torch_ref.rotate_half``; it may rotate ``x`` in place
    and return it (the caller no longer needs the unrotated values).
    """

    name: str

    def rotate_half(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...

    def copy_blocks(
        self,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> None: ...
