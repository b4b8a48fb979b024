"""Torch attention over the paged KV cache: the CPU production path and the oracle that
every Triton kernel is tested against (same contract as ``metadata.AttentionMetadata``)."""

from __future__ import annotations

from collections.abc import Iterable

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


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half (NeoX) layout: ``x * cos + rotate_half(x) * sin`` for heads
    ``x [T, H, D]`` with per-token tables ``cos``/``sin`` ``[T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Llama's RMSNorm (fp32 statistics, cast back before the weight) of ``residual + x``
    when a residual is given, else of ``x``. Returns ``(normed, the normalised input)``: the
    second is the next residual (the sum, in the op order HF uses)."""
    if residual is not None:
        x = residual + x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up [T, 2I]`` holds gate then up in each row."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd > 0:
        _decode(q, k_cache, v_cache, _decode_plan(meta), scale, out)
    if nd == meta.num_seqs:
        return out
    prefill_rows(q, k_cache, v_cache, meta, scale, out, range(nd, meta.num_seqs))
    return out


def prefill_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    seqs: Iterable[int],
) -> None:
    """Write ``out``'s rows of each sequence in ``seqs``: one causal SDPA call per sequence
    over its gathered context (any query length; a matmul-backed SDPA suits long chunks)."""
    group = q.shape[1] // k_cache.shape[2]
    qsl = meta.query_start_loc.tolist()
    for i in seqs:
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


# One decode row's context: (its first slot, None) when its blocks are consecutive ids,
# else (None, its block ids); and its length in tokens.
DecodeRow = tuple[int | None, torch.Tensor | None, int]


def _decode_plan(meta: AttentionMetadata) -> list[DecodeRow]:
    """Where each decode row's context lives, derived once per step for all layers.

    A context whose blocks are consecutive ids (a prompt allocated in one go usually is)
    is a plain slice of the pool and is read in place; any other is gathered block by
    block, its own blocks only (no padding to the batch's longest context).
    """
    plan = meta.scratch.get("torch_decode_plan")
    if plan is not None:
        return plan  # type: ignore[return-value]
    bs = meta.block_size
    tables = meta.block_tables[: meta.num_decodes].tolist()
    rows: list[DecodeRow] = []
    for table, seq_len in zip(tables, meta.seq_lens_cpu, strict=False):
        n = (seq_len + bs - 1) // bs
        blocks = table[:n]
        first = blocks[0]
        if blocks[-1] - first == n - 1 and blocks == list(range(first, first + n)):
            rows.append((first * bs, None, seq_len))
        else:
            rows.append((None, torch.tensor(blocks, dtype=torch.int64), seq_len))
    meta.scratch["torch_decode_plan"] = rows
    return rows


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: list[DecodeRow],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Single-token rows ``0 .. len(plan) - 1``, one SDPA call per row over its own context.

    Per row rather than padded into one batch: the padded batch copied every row's
    context up to the longest one (and again per layer), which cost more than the
    attention itself on CPU; a row's own context stays in cache between its gather and
    its SDPA. GQA without copies: the ``group`` query heads sharing a KV head are the
    query rows of one SDPA call over that head's keys.
    """
    _, _, hkv, d = k_cache.shape
    nd, hq = len(plan), q.shape[1]
    upcast = k_cache.dtype != torch.float32  # accumulate in fp32 whatever the cache holds
    kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    qf = q[:nd].float().view(nd, hkv, hq // hkv, d)
    outs = []
    for i, (slot, blocks, seq_len) in enumerate(plan):
        if blocks is None:
            kc, vc = kf[slot : slot + seq_len], vf[slot : slot + seq_len]
        else:
            kc = k_cache.index_select(0, blocks).view(-1, hkv, d)[:seq_len]
            vc = v_cache.index_select(0, blocks).view(-1, hkv, d)[:seq_len]
        kc, vc = kc.transpose(0, 1), vc.transpose(0, 1)  # [Hkv, seq_len, D], views
        if upcast:
            kc, vc = kc.float(), vc.float()
        outs.append(F.scaled_dot_product_attention(qf[i], kc, vc, scale=scale))
    if out.dtype == torch.float32:
        torch.stack(outs, out=out[:nd].view(nd, hkv, hq // hkv, d))
    else:
        out[:nd] = torch.stack(outs).view(nd, hq, d)


class TorchAttentionBackend:
    """The reference backend: runs anywhere torch runs. The other backends subclass it and
    override ``store`` / ``attend`` (and ``rotate_half``, ``copy_blocks`` where they have
    faster ones), so ``forward``, the contract every backend shares, is written once."""

    name = "torch"

    def rotate_half(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_half(x, cos, sin)

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, weight, eps, residual)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write this step's K/V rows into their slots (``store_kv``)."""
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of every packed row of q over its cached context (K/V stored)."""
        return paged_attention(q, k_cache, v_cache, meta, scale)

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
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale)

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
    ) -> torch.Tensor:
        """RoPE, K/V store and attention of the packed ``qkv [T, (hq + 2 hkv) d]`` rows,
        ``heads = (hq, hkv, d)``; returns ``[T, hq, d]``. ``qkv``'s q and k parts may be
        rotated in place."""
        t = qkv.shape[0]
        hq, hkv, d = heads
        qk = self.rotate_half(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
        q, k = qk.split([hq, hkv], dim=1)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        return self.forward(q, k, v, k_cache, v_cache, meta, scale)

    def copy_blocks(
        self,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> None:
        copy_blocks(k_caches, v_caches, src, dst)
