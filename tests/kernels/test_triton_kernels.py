"""Every Triton kernel against the torch reference (pagefleet.kernels.torch_ref).

On CPU these run under TRITON_INTERPRET=1 (set by conftest), so shapes stay tiny:
B <= 5, L <= 256. The cases are a covering subset of block size {16, 32} x head dim
{64, 128} x GQA ratio {1, 4, 8} x lengths {1, odd, block-crossing} x split counts.
"""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels import torch_ref
from pagefleet.kernels.triton_attention import (
    DecodeConfig,
    PrefillConfig,
    TritonAttentionBackend,
    choose_num_kv_splits,
    copy_blocks,
    paged_decode,
    paged_prefill,
    store_kv,
)
from pagefleet.testing.synthetic import PagedBatch, make_paged_batch


def _batch(query_lens, seq_lens, hq, hkv, d, bs, dtype, device, **kw) -> PagedBatch:
    return make_paged_batch(
        query_lens,
        seq_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=dtype,
        device=device,
        **kw,
    )


def _rows(b: PagedBatch) -> int:
    return sum(b.meta.query_lens_cpu)


# (seq_lens, block_size, head_dim, Hq, Hkv, num_kv_splits)
DECODE_CASES = [
    pytest.param([1, 17, 33, 100], 16, 64, 4, 4, 1, id="gqa1-bs16-d64-1split"),
    pytest.param([5, 31, 64, 129], 32, 128, 8, 2, 4, id="gqa4-bs32-d128-4splits"),
    pytest.param([1, 255, 77], 16, 64, 8, 1, 2, id="gqa8-bs16-d64-2splits"),
    pytest.param([256, 3], 32, 64, 16, 2, 8, id="gqa8-bs32-8splits-some-empty"),
]


@pytest.mark.parametrize(("seq_lens", "bs", "d", "hq", "hkv", "splits"), DECODE_CASES)
def test_paged_decode_matches_reference(seq_lens, bs, d, hq, hkv, splits, dtype, device, tol):
    b = _batch([1] * len(seq_lens), seq_lens, hq, hkv, d, bs, dtype, device)
    scale = d**-0.5
    # The new token's K/V go in first, exactly as the backend does it.
    torch_ref.store_kv(b.k, b.v, b.k_cache, b.v_cache, b.meta.slot_mapping)
    ref = torch_ref.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, scale)
    out = paged_decode(
        b.q,
        b.k_cache,
        b.v_cache,
        b.meta.block_tables,
        b.meta.seq_lens,
        b.meta.max_seq_len,
        scale,
        config=DecodeConfig(block_n=16 if bs == 16 else 32, num_kv_splits=splits),
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol(dtype))


def test_decode_split_count_does_not_change_result(device):
    """Split-K with a log-sum-exp merge is the same softmax as one pass (fp32)."""
    b = _batch([1, 1], [200, 45], 8, 2, 64, 16, torch.float32, device)
    torch_ref.store_kv(b.k, b.v, b.k_cache, b.v_cache, b.meta.slot_mapping)
    args = (b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.seq_lens, 200, 0.125)
    one = paged_decode(*args, config=DecodeConfig(block_n=16, num_kv_splits=1))
    many = paged_decode(*args, config=DecodeConfig(block_n=16, num_kv_splits=4))
    torch.testing.assert_close(many, one, atol=1e-6, rtol=1e-5)


# (query_lens, seq_lens, block_size, head_dim, Hq, Hkv, pad_slots)
FORWARD_CASES = [
    pytest.param([7, 40], [7, 40], 16, 64, 4, 4, 0, id="prefill-gqa1-bs16-d64"),
    pytest.param([16, 33], [48, 200], 32, 128, 8, 2, 0, id="extend-prefix-gqa4-bs32-d128"),
    pytest.param(
        [1, 1, 1, 13, 64], [1, 50, 129, 30, 64], 16, 64, 8, 1, 3, id="mixed-gqa8-bs16-pad"
    ),
    pytest.param([1, 3, 1], [33, 19, 16], 32, 64, 8, 2, 0, id="decode-then-1tok-extend"),
]


@pytest.mark.parametrize(("qlens", "slens", "bs", "d", "hq", "hkv", "pad"), FORWARD_CASES)
def test_backend_forward_matches_reference(qlens, slens, bs, d, hq, hkv, pad, dtype, device, tol):
    """The full backend step (store, decode launch, prefill/extend launch) vs torch."""
    b = _batch(qlens, slens, hq, hkv, d, bs, dtype, device, pad_slots=pad)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    scale = d**-0.5
    ref = torch_ref.TorchAttentionBackend().forward(b.q, b.k, b.v, kc, vc, b.meta, scale)
    backend = TritonAttentionBackend(
        decode=DecodeConfig(block_n=16, num_kv_splits=2),
        prefill=PrefillConfig(block_m=32, block_n=16),
    )
    out = backend.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, scale)
    rows = _rows(b)
    torch.testing.assert_close(out[:rows], ref[:rows], **tol(dtype))
    used = b.meta.block_tables[b.meta.block_tables.ne(0)].long().unique()
    torch.testing.assert_close(b.k_cache[used], kc[used], atol=0, rtol=0)
    torch.testing.assert_close(b.v_cache[used], vc[used], atol=0, rtol=0)


def test_prefill_default_config_and_partial_seq_range(device, tol):
    """Default (GPU-sized) tiles; a launch over a sub-range leaves other rows untouched."""
    dtype = torch.float16
    b = _batch([1, 20, 70], [9, 20, 100], 8, 2, 64, 16, dtype, device)
    torch_ref.store_kv(b.k, b.v, b.k_cache, b.v_cache, b.meta.slot_mapping)
    ref = torch_ref.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.125)
    out = torch.zeros_like(b.q)
    paged_prefill(
        b.q,
        b.k_cache,
        b.v_cache,
        b.meta.block_tables,
        b.meta.seq_lens,
        b.meta.query_start_loc,
        70,
        0.125,
        seq_offset=1,
        out=out,
    )
    assert torch.count_nonzero(out[0]) == 0
    torch.testing.assert_close(out[1:], ref[1:], **tol(dtype))


def test_store_kv_skips_minus_one_and_reads_strided_rows(dtype, device):
    """k/v as strided views of a fused qkv buffer; pad rows (slot -1) must not land."""
    b = _batch([3, 5], [10, 21], 4, 2, 64, 16, dtype, device, pad_slots=2)
    rows = b.k.shape[0]
    fused = torch.randn(rows, 8, 64, dtype=torch.float32).to(device=device, dtype=dtype)
    k, v = fused[:, 4:6], fused[:, 6:8]
    assert not k.is_contiguous()
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    torch_ref.store_kv(k, v, kc, vc, b.meta.slot_mapping)
    store_kv(k, v, b.k_cache, b.v_cache, b.meta.slot_mapping)
    used = b.meta.block_tables[:, :2].reshape(-1).long().unique()
    assert torch.equal(b.k_cache[used], kc[used])
    assert torch.equal(b.v_cache[used], vc[used])
    # The reference wrote the same slots: the caches agree, and the pads went nowhere.
    assert torch.equal(b.k_cache.view(-1, 2, 64)[b.meta.slot_mapping[:-2]], k[:-2])


def test_copy_blocks_every_layer(device):
    layers, nb = 2, 12
    shape = (nb, 16, 2, 64)
    gen = torch.Generator().manual_seed(3)
    kcs = [torch.randn(shape, generator=gen).to(device) for _ in range(layers)]
    vcs = [torch.randn(shape, generator=gen).to(device) for _ in range(layers)]
    ref_k = [c.clone() for c in kcs]
    ref_v = [c.clone() for c in vcs]
    src = torch.tensor([3, 7, 0], device=device)
    dst = torch.tensor([9, 1, 11], device=device)
    torch_ref.copy_blocks(ref_k, ref_v, src, dst)
    copy_blocks(kcs, vcs, src, dst)
    for got, want in zip(kcs + vcs, ref_k + ref_v, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(kcs[1][11], kcs[1][0])


def test_large_num_blocks_offsets_are_int64(device, tol):
    """Blocks past 2**31 elements into the pool: int32 offsets would wrap and read (or
    write) the wrong memory. ``torch.empty`` maps the pool lazily, so only the touched
    blocks cost memory on CPU."""
    dtype = torch.float16
    bs, hkv, d = 16, 1, 64
    num_blocks = 2**31 // (bs * hkv * d) + 64
    b = _batch(
        [1, 1, 9],
        [17, 40, 30],
        8,
        hkv,
        d,
        bs,
        dtype,
        device,
        num_blocks=num_blocks,
        block_offset=num_blocks - 48,
    )
    assert b.k_cache.numel() > 2**31
    # The reference reads the same pool after the Triton store: compare the stored rows
    # directly, then attention against the reference over that pool.
    out = TritonAttentionBackend(
        decode=DecodeConfig(block_n=16, num_kv_splits=2),
        prefill=PrefillConfig(block_m=32, block_n=16),
    ).forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, 0.125)
    slots = b.meta.slot_mapping
    assert torch.equal(b.k_cache.view(-1, hkv, d)[slots], b.k)
    assert torch.equal(b.v_cache.view(-1, hkv, d)[slots], b.v)
    ref = torch_ref.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.125)
    torch.testing.assert_close(out, ref, **tol(dtype))


def test_gpu_16bit_dot_path_matches_reference(monkeypatch, device, tol):
    """On CUDA, 16-bit inputs keep 16-bit dot operands (tensor cores). Force that path here
    too (fp16: the interpreter's fp16 dot is sound, unlike bf16) so CPU runs cover it."""
    import triton.language as tl

    from pagefleet.kernels import triton_attention as ta

    monkeypatch.setattr(
        ta,
        "_compute_dtype",
        lambda dtype, dev: tl.float16 if dtype == torch.float16 else tl.float32,
    )
    dtype = torch.float16
    b = _batch([1, 1, 24], [40, 7, 90], 8, 2, 128, 16, dtype, device)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    ref = torch_ref.TorchAttentionBackend().forward(b.q, b.k, b.v, kc, vc, b.meta, 0.09)
    out = TritonAttentionBackend(
        decode=DecodeConfig(block_n=16, num_kv_splits=2),
        prefill=PrefillConfig(block_m=32, block_n=32),
    ).forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, 0.09)
    torch.testing.assert_close(out, ref, **tol(dtype))


def test_split_heuristic_fills_the_device_without_overdoing_it():
    # A large batch already fills 132 SMs: one pass, no merge kernel.
    assert choose_num_kv_splits(128, 8, 4096, 64, 132) == 1
    # One long sequence: split it, a power of two, each split >= 4 tiles of 64.
    one = choose_num_kv_splits(1, 8, 4096, 64, 132)
    assert one == 16
    assert choose_num_kv_splits(1, 8, 100_000, 64, 132) == 64  # capped
    # A short context is never split into sub-tile pieces.
    assert choose_num_kv_splits(1, 8, 200, 64, 132) == 1
    for args in [(3, 8, 5000, 64, 132), (7, 2, 1000, 32, 80), (64, 8, 4096, 64, 132)]:
        s = choose_num_kv_splits(*args)
        assert s >= 1 and s & (s - 1) == 0 and s <= 64
