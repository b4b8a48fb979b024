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

import array
from collections.abc import Iterable, Sequence
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


# array.array type codes of the index dtypes (C int and long long: 4 and 8 bytes here).
_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def index_tensor(
    values: Iterable[int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A 1-D int32 or int64 tensor of ``values``, through an ``array.array`` the tensor
    then shares: ``torch.tensor`` converts a list element by element (~90 us for the
    1000-entry block table of a 27-decode step, ~4x this way), and every step builds
    several of these (tables, slots, ids, positions)."""
    buf = array.array(_ARRAY_CODES[dtype], values)
    if not buf:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(buf, dtype=dtype).to(device)


def build_metadata(
    block_tables: Sequence[Sequence[int]],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
    *,
    pad_slots: int = 0,
) -> AttentionMetadata:
    """The metadata of one packed step: sequence ``i`` owns blocks ``block_tables[i]``, has
    ``query_lens[i]`` new tokens and ``seq_lens[i]`` tokens of context after the step.

    The one place that derives slots, start offsets and the padded table (the model runner,
    the test runners and the kernel tests all build steps here). Sequences keep their order,
    so the caller puts decodes first (the ordering invariant); ``num_decodes`` counts the
    leading one-token sequences. ``pad_slots`` extra rows get slot -1 (stored nowhere).
    Raises ValueError when a sequence's table does not cover its context.
    """
    bs = block_size
    slots: list[int] = []
    qsl = [0]
    width = 1
    for table, q_len, s_len in zip(block_tables, query_lens, seq_lens, strict=True):
        if q_len < 1 or q_len > s_len or len(table) * bs < s_len:
            raise ValueError(
                f"a sequence with {q_len} new of {s_len} tokens and {len(table)} blocks of "
                f"{bs}: need 1 <= new <= tokens <= blocks x block_size"
            )
        if q_len == 1:  # a decode: one slot (most rows of most steps)
            p = s_len - 1
            slots.append(table[p // bs] * bs + p % bs)
        else:
            slots.extend(table[p // bs] * bs + p % bs for p in range(s_len - q_len, s_len))
        qsl.append(qsl[-1] + q_len)
        width = max(width, len(table))
    slots.extend([-1] * pad_slots)
    flat: list[int] = []
    for table in block_tables:
        flat.extend(table)
        flat.extend([0] * (width - len(table)))
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    return AttentionMetadata(
        slot_mapping=index_tensor(slots, torch.int64, device),
        query_start_loc=index_tensor(qsl, torch.int32, device),
        seq_lens=index_tensor(seq_lens, torch.int32, device),
        block_tables=index_tensor(flat, torch.int32, device).view(-1, width),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=bs,
    )


class AttentionBackend(Protocol):
    """Stores this step's K/V into the paged cache, then attends.

    ``forward`` shapes: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (Hq % Hkv == 0), caches as in
    the module docstring; returns ``[T, Hq, D]`` in q's dtype.
    ``copy_blocks`` copies whole blocks ``src[j] -> dst[j]`` in every layer (copy-on-write).
    ``rotate_half`` applies RoPE (rotate-half layout) to heads ``x [T, H, D]`` with tables
    ``[T, 1, D]``, bit-identical to ``torch_ref.rotate_half``; it may rotate ``x`` in place
    and return it (the caller no longer needs the unrotated values).
    ``rms_norm`` and ``silu_mul`` are the decoder layer's elementwise ops, within fp32
    rounding of ``torch_ref.rms_norm`` / ``torch_ref.silu_mul``; ``rms_norm`` may write the
    sum ``residual + x`` into ``residual`` and return it as the new residual (the caller
    owns the residual and no longer needs its old values).
    ``qkv_attention`` is ``rotate_half`` of the q and k heads of a fused q/k/v projection's
    rows ``[T, (Hq + 2 Hkv) D]``, then ``forward``: one call where a backend fuses them.
    """

    name: str

    def rotate_half(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor: ...

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

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

    def qkv_attention(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int, int],
        cos: torch.Tensor,
        sin: torch.Tensor,
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
