"""Torch attention over the paged KV cache: the CPU production path and the oracle that
every Triton kernel is tested against (same contract as ``metadata.AttentionMetadata``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefleet.kernels.metadata import AttentionMetadata


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write row t of k/v to flat slot ``slot_mapping[t]``; rows with slot -1 are skipped."""
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid] if not bool(valid.all()) else slot_mapping
    kf = k_cache.view(-1, num_kv_heads, head_dim)
    vf = v_cache.view(-1, num_kv_heads, head_dim)
    if slots.numel() == slot_mapping.numel():
        kf[slots] = k.to(k_cache.dtype)
        vf[slots] = v.to(v_cache.dtype)
    else:
        kf[slots] = k[valid].to(k_cache.dtype)
        vf[slots] = v[valid].to(v_cache.dtype)


def copy_blocks(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Copy whole blocks ``src[j] -> dst[j]`` in every layer."""
    if src.numel() == 0:
        return
    for kc, vc in zip(k_caches, v_caches, strict=True):
        kc[dst] = kc[src]
        vc[dst] = vc[src]


def gather_context(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` positions of one sequence's K or V: ``[seq_len, Hkv, D]``."""
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table_row[:n_blocks].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each packed query row over its sequence's cached context.

    Accumulates in fp32 whatever the cache dtype; returns q's dtype.
    """
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    qsl = meta.query_start_loc.tolist() if meta.num_seqs else [0]
    nd = meta.num_decodes
    if nd > 0:
        for rows in _length_buckets(meta.seq_lens_cpu[:nd]):
            idx = torch.tensor(rows, device=q.device)
            out[idx] = _decode_batched(
                q[idx],
                k_cache,
                v_cache,
                meta.block_tables[idx],
                meta.seq_lens[idx],
                max(meta.seq_lens_cpu[r] for r in rows),
                scale,
                group,
            )
    for i in range(nd, meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        qlen = end - start
        kc = gather_context(k_cache, meta.block_tables[i], seq_len).float()
        vc = gather_context(v_cache, meta.block_tables[i], seq_len).float()
        qi = q[start:end].float().transpose(0, 1)  # [Hq, qlen, D]
        kc = kc.transpose(0, 1)  # [Hkv, S, D]: SDPA shares each KV head with its group
        vc = vc.transpose(0, 1)
        # Query row r sits at position seq_len - qlen + r and sees keys 0..that position.
        qpos = torch.arange(seq_len - qlen, seq_len, device=q.device).unsqueeze(1)
        kpos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        mask = kpos <= qpos
        o = F.scaled_dot_product_attention(
            qi, kc, vc, attn_mask=mask, scale=scale, enable_gqa=group > 1
        )
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


def _length_buckets(seq_lens: list[int], max_buckets: int = 4) -> list[list[int]]:
    """Decode rows grouped by context length, so each group pads only to its own longest.

    The padded gather copies every row's context up to the group's maximum: with lengths
    spread 1..L, one group copies ~2x the live K/V, four sorted groups ~1.15x. A group per
    quarter of the rows keeps the SDPA calls few.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    n = len(order)
    if n < 8:
        return [order]
    size = -(-n // max_buckets)
    return [order[i : i + size] for i in range(0, n, size)]


def _decode_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
    group: int,
) -> torch.Tensor:
    """Single-token sequences at once, their contexts padded to the longest one.

    GQA without copies: the ``group`` query heads that share a KV head become the query
    rows of one SDPA call over that head's keys, so K/V are never repeated per query head.
    """
    nd = q.shape[0]
    block_size = k_cache.shape[1]
    n_blocks = (max_len + block_size - 1) // block_size
    flat = block_tables[:, :n_blocks].long().flatten()
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    span = n_blocks * block_size
    # [nd, S, Hkv, D] -> [nd, Hkv, S, D]; .float() is free for an fp32 cache.
    kc = k_cache.index_select(0, flat).view(nd, span, hkv, d).transpose(1, 2).float()
    vc = v_cache.index_select(0, flat).view(nd, span, hkv, d).transpose(1, 2).float()
    qf = q.float().view(nd, hkv, group, d)
    valid = torch.arange(span, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)
    o = F.scaled_dot_product_attention(qf, kc, vc, attn_mask=valid[:, None, None, :], scale=scale)
    return o.reshape(nd, hkv * group, d).to(q.dtype)


class TorchAttentionBackend:
    """The reference backend: runs anywhere torch runs."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale)

    def copy_blocks(
        self,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> None:
        copy_blocks(k_caches, v_caches, src, dst)
