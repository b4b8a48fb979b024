"""Triton kernels for paged attention, behind the ``AttentionBackend`` contract.

Four kernels, each checked against ``torch_ref``:

- ``store_kv``: scatter this step's K/V rows into the paged cache by slot (-1 = skip).
- ``copy_blocks``: whole-block copies for copy-on-write.
- ``paged_decode``: one query token per sequence. One program owns *all* query heads of a
  KV head (GQA: K/V are read once per group, not once per query head) and one split of the
  context; a second kernel merges the splits by log-sum-exp (flash-decoding).
- ``paged_prefill``: a packed variable-length batch whose new tokens attend causally to
  their cached prefix plus themselves (chunked prefill and prefix-cache hits). Rows of a
  tile are (query token, query head of the group) pairs, so GQA heads share K/V tiles.

Rules that keep one source valid both on the GPU and under ``TRITON_INTERPRET=1``:
loads are cast to the compute dtype at once (fp32 in the interpreter, whose bf16 ``tl.dot``
is wrong), softmax statistics and accumulators are fp32, every ``BLOCK_*`` is >= 16, no
pointer is ever loaded from memory (block tables hold integers that are turned into
offsets), and cache offsets are int64 (a large KV pool overflows int32 element offsets).
On CUDA with 16-bit inputs the dot operands stay 16-bit (tensor cores, as flash attention
does); everything else is identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagefleet.kernels import torch_ref
from pagefleet.kernels.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
_MIN_BLOCK = 16
_TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(slots=True, frozen=True)
class DecodeConfig:
    """Launch knobs of the decode kernel; ``num_kv_splits=None`` picks from the device."""

    block_n: int = 64
    num_kv_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2


@dataclass(slots=True, frozen=True)
class PrefillConfig:
    """Launch knobs of the prefill/extend kernel (``block_m`` rows = tokens x group heads).

    The defaults are the usual flash-attention tile for head_dim 128 on Hopper-class GPUs;
    bench/kernel_bench.py sweeps alternatives on the device at hand."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def kernels_interpreted() -> bool:
    """Whether this module's kernels were decorated in interpreter mode (CPU tensors OK)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_split_kernel, InterpretedFunction)


def _pow2_block(n: int) -> int:
    return max(_MIN_BLOCK, triton.next_power_of_2(n))


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> tl.dtype:
    """fp32 in the interpreter and for fp32 inputs; the 16-bit input dtype on the GPU."""
    if device.type == "cuda" and not _interpreting() and dtype in (torch.float16, torch.bfloat16):
        return _TORCH_TO_TL[dtype]
    return tl.float32


def _check_cache(cache: torch.Tensor, what: str) -> None:
    if cache.dim() != 4:
        raise ValueError(
            f"{what} must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(cache.shape)}"
        )
    if cache.stride(-1) != 1:
        raise ValueError(f"{what} must be contiguous in head_dim (stride {cache.stride(-1)})")


def _check_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, int, int]:
    """Validate q ``[T, Hq, D]`` against the paged caches; returns (Hq, block_size, Hkv)."""
    _check_cache(k_cache, "k_cache")
    _check_cache(v_cache, "v_cache")
    num_q_heads = q.shape[1]
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} KV heads")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim")
    return num_q_heads, page_size, num_kv_heads


# --------------------------------------------------------------------------- store / copy


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KCache,
    VCache,
    SlotMapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # slot -1 marks a row that must not be stored (padding).
    if slot < 0:
        return
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    page = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE
    row = t.to(tl.int64)
    k = tl.load(K + row * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + row * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = KCache + page * stride_kcb + in_page * stride_kcs
    v_dst = VCache + page * stride_vcb + in_page * stride_vcs
    tl.store(
        k_dst + offs_h[:, None] * stride_kch + offs_d[None, :],
        k.to(KCache.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + offs_h[:, None] * stride_vch + offs_d[None, :],
        v.to(VCache.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write row t of k/v (``[T, Hkv, D]``) to flat slot ``slot_mapping[t]``; -1 is skipped."""
    _check_cache(k_cache, "k_cache")
    _check_cache(v_cache, "v_cache")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be contiguous in head_dim; pass .contiguous() rows")
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=_pow2_block(num_kv_heads),
        BLOCK_D=_pow2_block(head_dim),
    )


@triton.jit
def _copy_blocks_kernel(
    KCache,
    VCache,
    Src,
    Dst,
    stride_kb,
    stride_vb,
    BLOCK_NUMEL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(Src + pair).to(tl.int64)
    dst = tl.load(Dst + pair).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < BLOCK_NUMEL
    k = tl.load(KCache + src * stride_kb + offs, mask=mask)
    tl.store(KCache + dst * stride_kb + offs, k, mask=mask)
    v = tl.load(VCache + src * stride_vb + offs, mask=mask)
    tl.store(VCache + dst * stride_vb + offs, v, mask=mask)


def copy_blocks(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Copy whole blocks ``src[j] -> dst[j]`` in every layer.

    The pairs run in no fixed order (one program each): no block may be both a source and
    a destination in one call (the model runner splits a step's copies into such waves).
    Each block's [block_size, Hkv, D] payload must be contiguous (the standard layout, or a
    view that only strides over the block axis). One launch per layer: the kernel never
    loads a pointer, so it cannot walk a table of per-layer caches.
    """
    if src.numel() == 0:
        return
    if src.shape != dst.shape:
        raise ValueError(f"src and dst must pair up, got {src.shape} vs {dst.shape}")
    for kc, vc in zip(k_caches, v_caches, strict=True):
        for cache, what in ((kc, "k_cache"), (vc, "v_cache")):
            _check_cache(cache, what)
            if not cache[0].is_contiguous():
                raise ValueError(f"{what} blocks must be contiguous inside a block")
        block_numel = kc[0].numel()
        block = min(4096, triton.next_power_of_2(block_numel))
        grid = (src.numel(), triton.cdiv(block_numel, block))
        _copy_blocks_kernel[grid](
            kc, vc, src, dst, kc.stride(0), vc.stride(0), BLOCK_NUMEL=block_numel, BLOCK=block
        )


# --------------------------------------------------------------------------- decode


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    KCache,
    VCache,
    table,
    n0,
    n_end,
    q_pos,
    kv_head,
    sm_scale_log2,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """One online-softmax step over keys ``n0 .. n0 + BLOCK_N`` (those < ``n_end``),
    gathered through the block table. Returns the updated (m_i, l_i, acc), all fp32."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < n_end
    page = tl.load(table + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    k_off = page * stride_kb + in_page * stride_ks + kv_head * stride_kh
    k = tl.load(KCache + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    # "ieee": fp32 inputs must not silently drop to tf32 on the GPU (no-op for 16-bit).
    s = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision="ieee") * sm_scale_log2
    s = tl.where(n_mask[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    # Callers guarantee every row sees a key in its first tile, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = page * stride_vb + in_page * stride_vs + kv_head * stride_vh
    v = tl.load(VCache + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v.to(COMPUTE), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    Q,
    KCache,
    VCache,
    BlockTables,
    SeqLens,
    MidO,
    MidLse,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    # Splits are whole BLOCK_N tiles so no tile straddles two splits.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q_ptrs = Q + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(COMPUTE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, KCache, VCache, table, n0, end, m_i, kv_head, sm_scale_log2,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            HEAD_DIM, PAGE_SIZE, BLOCK_D, BLOCK_N, False, COMPUTE,
        )  # fmt: skip

    # An empty split (short sequence, many splits) reports weight 0 through lse = -inf.
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptrs = (
        MidO
        + seq.to(tl.int64) * stride_mob
        + heads[:, None] * stride_moh
        + split * stride_mos
        + offs_d[None, :]
    )
    tl.store(o_ptrs, out.to(MidO.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    lse_ptrs = MidLse + seq.to(tl.int64) * stride_mlb + heads * stride_mlh + split
    tl.store(lse_ptrs, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    MidO,
    MidLse,
    Out,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(
        MidLse + seq.to(tl.int64) * stride_mlb + head * stride_mlh + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )
    # Split 0 always covers the first token, so the max is finite.
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(
        MidO
        + seq.to(tl.int64) * stride_mob
        + head * stride_moh
        + offs_s[:, None] * stride_mos
        + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(
        Out + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def _device_sm_count(device: torch.device) -> int:
    if device.type == "cuda" and not _interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int
) -> int:
    """Enough (sequence, KV head, split) programs to fill the device a few times over,
    each split at least 4 tiles long; a power of two so few kernel variants exist."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(4 * num_sms, programs)
    max_useful = max(1, triton.cdiv(max_seq_len, 4 * block_n))
    splits = max(1, min(wanted, max_useful, 64))
    return 1 << (splits - 1).bit_length() if splits & (splits - 1) else splits


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its first ``seq_lens[b]`` cached
    positions. q ``[B, Hq, D]``; returns ``[B, Hq, D]`` in q's dtype (written into ``out``
    when given). ``max_seq_len`` is a host-side bound used only to size the split grid."""
    cfg = config or DecodeConfig()
    num_q_heads, page_size, num_kv_heads = _check_attention_inputs(q, k_cache, v_cache)
    num_seqs, _, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    splits = cfg.num_kv_splits or choose_num_kv_splits(
        num_seqs, num_kv_heads, max_seq_len, cfg.block_n, _device_sm_count(q.device)
    )
    compute = _compute_dtype(q.dtype, q.device)
    block_d = _pow2_block(head_dim)
    if splits == 1:
        # A single split is already normalised: write straight into the output.
        mid_o, mid_lse = out, torch.empty((num_seqs, num_q_heads, 1), device=q.device)
        mo_strides = (out.stride(0), out.stride(1), 0)
    else:
        mid_o = torch.empty(
            (num_seqs, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        mid_lse = torch.empty((num_seqs, num_q_heads, splits), device=q.device)
        mo_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2))
    extra = {} if _interpreting() else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        mid_o,
        mid_lse,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        *mo_strides,
        mid_lse.stride(0),
        mid_lse.stride(1),
        splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=_pow2_block(group),
        BLOCK_D=block_d,
        BLOCK_N=cfg.block_n,
        COMPUTE=compute,
        **extra,
    )
    if splits > 1:
        _decode_merge_kernel[(num_seqs, num_q_heads)](
            mid_o,
            mid_lse,
            out,
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            out.stride(0),
            out.stride(1),
            splits,
            HEAD_DIM=head_dim,
            BLOCK_S=_pow2_block(splits),
            BLOCK_D=block_d,
        )
    return out


# --------------------------------------------------------------------------- prefill / extend


@triton.jit
def _prefill_kernel(
    Q,
    KCache,
    VCache,
    Out,
    BlockTables,
    SeqLens,
    QueryStartLoc,
    sm_scale_log2,
    seq_offset,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    seq = tl.program_id(0) + seq_offset
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_start = tl.load(QueryStartLoc + seq)
    q_len = tl.load(QueryStartLoc + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(SeqLens + seq)
    prefix_len = seq_len - q_len

    # Row r of the tile is query token q_block*BLOCK_Q + r // GROUP, head r % GROUP of
    # this KV head's group.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_tok = q_block * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    m_mask = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix_len + q_tok
    rows = (q_start + q_tok).to(tl.int64)
    q_ptrs = Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(COMPUTE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    # Keys before the tile's first query position are visible to every row: no mask there.
    # Then the diagonal tiles, masked causally (their first key is visible to every row, so
    # no row's running max stays -inf).
    first_pos = prefix_len + q_block * BLOCK_Q
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    causal_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, KCache, VCache, table, n0, full_end, q_pos, kv_head,
            sm_scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            HEAD_DIM, PAGE_SIZE, BLOCK_D, BLOCK_N, False, COMPUTE,
        )  # fmt: skip
    for n0 in range(full_end, causal_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, KCache, VCache, table, n0, causal_end, q_pos, kv_head,
            sm_scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            HEAD_DIM, PAGE_SIZE, BLOCK_D, BLOCK_N, True, COMPUTE,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = Out + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    seq_offset: int = 0,
    num_seqs: int | None = None,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of sequences ``[seq_offset, seq_offset + num_seqs)`` of a packed
    batch: their query rows (``query_start_loc``) attend to cached positions
    ``0 .. seq_len - q_len + r``. The new tokens' K/V must already be in the cache. Rows of
    other sequences in ``out`` are left untouched."""
    cfg = config or PrefillConfig()
    num_q_heads, page_size, num_kv_heads = _check_attention_inputs(q, k_cache, v_cache)
    head_dim = q.shape[2]
    if num_seqs is None:
        num_seqs = seq_lens.shape[0] - seq_offset
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_m = max(cfg.block_m, _pow2_block(group))
    block_q = block_m // group
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    extra = {} if _interpreting() else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        seq_offset,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_D=_pow2_block(head_dim),
        BLOCK_N=cfg.block_n,
        COMPUTE=_compute_dtype(q.dtype, q.device),
        **extra,
    )
    return out


# --------------------------------------------------------------------------- backend


class TritonAttentionBackend(torch_ref.TorchAttentionBackend):
    """Store, then one decode launch for the leading single-token sequences and one
    prefill/extend launch for the rest (the ``num_decodes`` ordering invariant); RoPE is
    the torch backend's."""

    name = "triton"

    def __init__(
        self, decode: DecodeConfig | None = None, prefill: PrefillConfig | None = None
    ) -> None:
        self.decode_config = decode or DecodeConfig()
        self.prefill_config = prefill or PrefillConfig()

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd > 0:
            paged_decode(
                q[:nd],
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                max(meta.seq_lens_cpu[:nd]),
                scale,
                out=out[:nd],
                config=self.decode_config,
            )
        if meta.num_seqs > nd:
            paged_prefill(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                max(meta.query_lens_cpu[nd:]),
                scale,
                seq_offset=nd,
                num_seqs=meta.num_seqs - nd,
                out=out,
                config=self.prefill_config,
            )
        return out

    def copy_blocks(
        self,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> None:
        copy_blocks(k_caches, v_caches, src, dst)


def attention_flops(query_lens: list[int], seq_lens: list[int], num_q_heads: int, d: int) -> int:
    """Multiply-add FLOPs of causal paged attention (QK^T and PV), for TFLOP/s figures."""
    pairs = 0
    for q_len, s_len in zip(query_lens, seq_lens, strict=True):
        prefix = s_len - q_len
        # Row r sees prefix + r + 1 keys.
        pairs += q_len * prefix + q_len * (q_len + 1) // 2
    return 4 * pairs * num_q_heads * d


__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "TritonAttentionBackend",
    "attention_flops",
    "choose_num_kv_splits",
    "copy_blocks",
    "kernels_interpreted",
    "paged_decode",
    "paged_prefill",
    "store_kv",
]
