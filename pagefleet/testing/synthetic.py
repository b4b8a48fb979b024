"""Random paged batches that honour the ``AttentionMetadata`` contract.

Shared by the kernel tests and the kernel benchmark so both exercise the same layouts:
sequences own random, non-contiguous blocks of one pool, decodes come first, and the new
tokens' slots follow each sequence's cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.kernels.metadata import AttentionMetadata, build_metadata


@dataclass(slots=True)
class PagedBatch:
    """One step's inputs: packed q/k/v for the new tokens, the caches, the metadata."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
    block_offset: int = 1,
    pad_slots: int = 0,
    seed: int = 0,
) -> PagedBatch:
    """Sequences with ``seq_lens[i]`` tokens of context of which the last ``query_lens[i]``
    are new (decodes, query_len 1, must come first). The cached prefix is filled with random
    K/V; the new tokens' K/V are in ``k``/``v`` with their slots in ``slot_mapping``.

    Blocks are a random permutation of ``block_offset .. num_blocks`` (so tables are not
    contiguous); block 0 is the zeroed null block that padded table entries point at;
    ``pad_slots`` extra rows with slot -1 are appended to the packed batch.
    Only the blocks a sequence uses are written, so a huge ``num_blocks`` costs address
    space, not memory (``torch.empty`` pages are touched lazily).
    """
    if len(query_lens) != len(seq_lens):
        raise ValueError("query_lens and seq_lens must have one entry per sequence")
    if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens, strict=True)):
        raise ValueError("need 1 <= query_len <= seq_len for every sequence")
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    needed = sum(blocks_per_seq)
    if num_blocks is None:
        num_blocks = block_offset + needed + 3
    if num_blocks - block_offset < needed:
        raise ValueError(f"{needed} blocks needed, only {num_blocks - block_offset} available")
    pool = torch.randperm(num_blocks - block_offset, generator=gen)[:needed] + block_offset
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros((len(seq_lens), max_blocks + 1), dtype=torch.int32)
    cursor = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = pool[cursor : cursor + nb].to(torch.int32)
        cursor += nb

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    # Fill every block a sequence owns (prefix positions get real values; the positions
    # that the new tokens will overwrite get noise, which a skipped store would expose).
    k_cache[0].zero_()
    v_cache[0].zero_()
    used = pool.to(device=device, dtype=torch.long)
    noise = torch.randn((needed, block_size, num_kv_heads, head_dim), generator=gen)
    k_cache[used] = noise.to(device=device, dtype=dtype)
    noise = torch.randn((needed, block_size, num_kv_heads, head_dim), generator=gen)
    v_cache[used] = noise.to(device=device, dtype=dtype)

    num_tokens = sum(query_lens) + pad_slots
    # One padding column past the longest table, as the engine's tables may have.
    rows = [tables[i, : nb + 1].tolist() for i, nb in enumerate(blocks_per_seq)]
    meta = build_metadata(rows, query_lens, seq_lens, block_size, device, pad_slots=pad_slots)

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(s, generator=gen).to(device=device, dtype=dtype)

    q = rand(num_tokens, num_q_heads, head_dim)
    k = rand(num_tokens, num_kv_heads, head_dim)
    v = rand(num_tokens, num_kv_heads, head_dim)
    return PagedBatch(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, meta=meta)
