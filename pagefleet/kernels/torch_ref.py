"""Torch attention over the paged KV cache: the CPU production path and the oracle that
every Triton kernel is tested against (same contract as ``metadata.AttentionMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(slots=True)
class _DecodeBucket:
    """Decode rows ``[start, end)`` of the length-sorted order, padded to ``span`` keys."""

    start: int
    end: int
    flat_blocks: torch.Tensor  # [rows * n_blocks] int64: the blocks to gather, row-major
    valid: torch.Tensor  # [rows, 1, 1, span] bool: key position < the row's seq_len
    span: int


@dataclass(slots=True)
class StepPlan:
    """What every layer of one step's attention shares, derived once from the metadata:
    the decode rows sorted by context length and cut into buckets (gather indices and
    masks ready), and the valid KV slots. Saves each layer re-deriving the same small
    index tensors — on a shared 2-core CPU each tiny op costs far more than its work."""

    order: torch.Tensor  # [num_decodes] int64: decode rows, shortest context first
    buckets: list[_DecodeBucket]
    store_rows: torch.Tensor | None  # rows of k/v to store, None: all of them
    store_slots: torch.Tensor  # their slots


def plan_step(meta: AttentionMetadata, block_size: int) -> StepPlan:
    """The ``StepPlan`` of ``meta`` for a cache of ``block_size`` tokens per block."""
    slots = meta.slot_mapping
    valid_slot = slots >= 0
    if bool(valid_slot.all()):
        store_rows, store_slots = None, slots
    else:
        store_rows = valid_slot.nonzero().squeeze(1)
        store_slots = slots[store_rows]
    nd = meta.num_decodes
    rows_in_order: list[int] = []
    buckets: list[_DecodeBucket] = []
    device = meta.seq_lens.device
    for rows in _length_buckets(meta.seq_lens_cpu[:nd]) if nd else []:
        max_len = max(meta.seq_lens_cpu[r] for r in rows)
        n_blocks = (max_len + block_size - 1) // block_size
        span = n_blocks * block_size
        idx = torch.tensor(rows, device=device)
        flat = meta.block_tables[idx, :n_blocks].long().flatten()
        valid = torch.arange(span, device=device).unsqueeze(0) < meta.seq_lens[idx].unsqueeze(1)
        start = len(rows_in_order)
        rows_in_order.extend(rows)
        buckets.append(
            _DecodeBucket(start, len(rows_in_order), flat, valid[:, None, None, :], span)
        )
    order = torch.tensor(rows_in_order, dtype=torch.int64, device=device)
    return StepPlan(order, buckets, store_rows, store_slots)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    plan: StepPlan | None = None,
) -> torch.Tensor:
    """Causal attention of each packed query row over its sequence's cached context.

    Accumulates in fp32 whatever the cache dtype; returns q's dtype. ``plan`` (from
    ``plan_step(meta, ...)``) may be shared by every layer of the step; None derives it.
    """
    if plan is None:
        plan = plan_step(meta, k_cache.shape[1])
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    qsl = meta.query_start_loc.tolist() if meta.num_seqs else [0]
    nd = meta.num_decodes
    if nd > 0:
        # One gather of q into length order, contiguous slices per bucket, one scatter back.
        q_sorted = q.index_select(0, plan.order)
        out_sorted = torch.empty_like(q_sorted)
        for b in plan.buckets:
            out_sorted[b.start : b.end] = _decode_batched(
                q_sorted[b.start : b.end], k_cache, v_cache, b, scale, group
            )
        out.index_copy_(0, plan.order, out_sorted)
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
    bucket: _DecodeBucket,
    scale: float,
    group: int,
) -> torch.Tensor:
    """Single-token sequences at once, their contexts padded to the bucket's longest.

    GQA without copies: the ``group`` query heads that share a KV head become the query
    rows of one SDPA call over that head's keys, so K/V are never repeated per query head.
    """
    nd = q.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    span = bucket.span
    # [nd, S, Hkv, D] -> [nd, Hkv, S, D]; .float() is free for an fp32 cache.
    kc = k_cache.index_select(0, bucket.flat_blocks).view(nd, span, hkv, d).transpose(1, 2).float()
    vc = v_cache.index_select(0, bucket.flat_blocks).view(nd, span, hkv, d).transpose(1, 2).float()
    qf = q.float().view(nd, hkv, group, d)
    o = F.scaled_dot_product_attention(qf, kc, vc, attn_mask=bucket.valid, scale=scale)
    return o.reshape(nd, hkv * group, d).to(q.dtype)


class TorchAttentionBackend:
    """The reference backend: runs anywhere torch runs."""

    name = "torch"

    def __init__(self) -> None:
        # The plan of the step being run: every layer gets the same metadata object, so
        # the first layer derives the plan and the others reuse it (held by reference, so
        # an identity match is never a stale object's recycled id).
        self._plan: tuple[AttentionMetadata, StepPlan] | None = None

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
        if self._plan is None or self._plan[0] is not meta:
            self._plan = (meta, plan_step(meta, k_cache.shape[1]))
        plan = self._plan[1]
        kf = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
        vf = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
        if plan.store_rows is not None:
            k, v = k.index_select(0, plan.store_rows), v.index_select(0, plan.store_rows)
        kf.index_copy_(0, plan.store_slots, k.to(k_cache.dtype))
        vf.index_copy_(0, plan.store_slots, v.to(v_cache.dtype))
        return paged_attention(q, k_cache, v_cache, meta, scale, plan)

    def copy_blocks(
        self,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> None:
        copy_blocks(k_caches, v_caches, src, dst)
