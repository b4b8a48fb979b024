"""The compiled CPU attention kernel (``kernels/csrc/paged_attention_cpu.cpp``) against the
torch backend and against attention written out in float64, on tiny shapes: random
(scattered) block tables, GQA, odd context lengths and lengths on block boundaries,
decodes, short chunks (the kernel) and long chunks (torch's SDPA) in one step."""

from __future__ import annotations

import random

import pytest
import torch

from pagefleet.kernels import mkl_packed
from pagefleet.kernels.cpu_attention import (
    LIBRARY,
    MAX_KERNEL_QUERY_LEN,
    CpuAttentionBackend,
)
from pagefleet.kernels.cpu_build import load_library
from pagefleet.kernels.metadata import AttentionMetadata, build_metadata
from pagefleet.kernels.torch_ref import (
    TorchAttentionBackend,
    paged_attention,
    rotate_half,
    store_kv,
)


@pytest.fixture(scope="module")
def backend() -> CpuAttentionBackend:
    return CpuAttentionBackend(load_library(LIBRARY))


def _step(
    query_lens: list[int], seq_lens: list[int], bs: int, num_blocks: int, seed: int
) -> AttentionMetadata:
    """Metadata of one step whose sequences own random, non-consecutive blocks."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for s in seq_lens:
        n = (s + bs - 1) // bs
        tables.append([free.pop() for _ in range(n)])
    return build_metadata(tables, query_lens, seq_lens, bs)


def _dense(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v, position by position through the block table."""
    hq, hkv, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    bs = meta.block_size
    kf = k_cache.reshape(-1, hkv, d).double().repeat_interleave(hq // hkv, dim=1)
    vf = v_cache.reshape(-1, hkv, d).double().repeat_interleave(hq // hkv, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    tables = meta.block_tables.tolist()
    starts = meta.query_start_loc.tolist()
    for i, (ql, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        ctx = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(s)])
        for r in range(ql):
            pos = s - ql + r
            row = starts[i] + r
            scores = torch.einsum("hd,shd->hs", q[row].double(), kf[ctx[: pos + 1]]) * scale
            out[row] = torch.einsum("hs,shd->hd", scores.softmax(-1), vf[ctx[: pos + 1]])
    return out


# (hq, hkv, head_dim, block_size): MHA, GQA groups 3 and 7, MQA with 32 heads (over the
# 8-row tile: fewer rows per work item), a head_dim without a compiled specialisation.
SHAPES = [(8, 8, 64, 16), (6, 2, 16, 4), (14, 2, 32, 8), (32, 1, 16, 16), (4, 4, 40, 5)]


@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES)
def test_kernel_matches_dense_attention_on_scattered_blocks(backend, hq, hkv, d, bs):
    rng = random.Random(hq * 100 + d)
    # Decodes with odd lengths and lengths on/next to block boundaries; short chunks that
    # the row-tile path takes (2, 7); chunks for the chunk path (kChunkMinRows + 1, several
    # row tiles of 64 query vectors, one past a prefix ending mid-block); the threshold
    # itself (or 200 rows) and one chunk past it (left to SDPA while the threshold is 200
    # or less).
    seq_lens = [1, bs, bs + 1, 2 * bs - 1, 3 * bs, rng.randint(1, 9 * bs), rng.randint(1, 9 * bs)]
    query_lens = [1] * len(seq_lens)
    chunks = ((2, 3), (7, 0), (9, bs - 1), (70, 5), (33, 2 * bs + 1))
    top = min(MAX_KERNEL_QUERY_LEN, 200)
    chunks += ((top, 3), (top + 1, 1))
    for ql, extra in chunks:
        query_lens.append(ql)
        seq_lens.append(ql + extra)
    meta = _step(query_lens, seq_lens, bs, num_blocks=512, seed=hq + d)
    gen = torch.Generator().manual_seed(d)
    k_cache = torch.randn(512, bs, hkv, d, generator=gen)
    v_cache = torch.randn(512, bs, hkv, d, generator=gen)
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    assert backend.covers(q, k_cache)
    scale = d**-0.5
    out = backend.attend(q, k_cache, v_cache, meta, scale)
    want = _dense(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-5)
    # The torch backend agrees to fp32 rounding too: same contract, other summation order.
    ref = paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES[:4])
def test_long_chunks_through_blas_agree_with_the_kernel_loops(backend, hq, hkv, d, bs):
    """Chunks of more than 8 rows go through MKL's GEMM (pf_set_blas, set by the backend
    where torch has MKL); without it the kernel's own loops run. Both are attention to fp32
    rounding; bf16 caches are widened to fp32 before the GEMMs."""
    blas = mkl_packed.blas_addresses()
    if blas is None:
        pytest.skip("this torch has no MKL SGEMM: the kernel's loops are the only path")
    query_lens, seq_lens = [1, 1, 9, 64, 65, 150], [40, 7, 9, 64 + bs + 3, 65, 150 + 2 * bs]
    meta = _step(query_lens, seq_lens, bs, num_blocks=256, seed=hq * d)
    gen = torch.Generator().manual_seed(hq + hkv)
    k_cache = torch.randn(256, bs, hkv, d, generator=gen)
    v_cache = torch.randn(256, bs, hkv, d, generator=gen)
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    scale = d**-0.5
    want = _dense(q, k_cache, v_cache, meta, scale)
    try:
        backend._lib.pf_set_blas(None, None)
        loops = backend.attend(q, k_cache, v_cache, meta, scale)
        loops_bf16 = backend.attend(q, k_cache.bfloat16(), v_cache.bfloat16(), meta, scale)
    finally:
        backend._lib.pf_set_blas(*blas)
    gemm = backend.attend(q, k_cache, v_cache, meta, scale)
    gemm_bf16 = backend.attend(q, k_cache.bfloat16(), v_cache.bfloat16(), meta, scale)
    torch.testing.assert_close(gemm.double(), want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(loops.double(), want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(gemm, loops, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(gemm_bf16, loops_bf16, atol=2e-6, rtol=2e-5)
    # Decode rows never take the GEMM path: bit-identical either way.
    assert torch.equal(gemm[:2], loops[:2])


def test_long_context_scratch_is_given_back_after_the_call(backend):
    """The GEMM path gathers a chunk's whole context per thread; past 4 MB a buffer (8K
    tokens at head_dim 128) it must not stay resident on every thread after the call."""
    blas = mkl_packed.blas_addresses()
    if blas is None:
        pytest.skip("this torch has no MKL SGEMM: the GEMM path and its scratch never run")
    d, bs = 128, 16
    gen = torch.Generator().manual_seed(3)
    # Warm: a short context's scratch is kept between calls.
    meta = _step([16], [200], bs, num_blocks=16, seed=1)
    k_cache, v_cache = torch.randn(2, 16, bs, 1, d, generator=gen)
    backend.attend(torch.randn(16, 1, d, generator=gen), k_cache, v_cache, meta, d**-0.5)
    kept = backend._lib.pf_scratch_bytes()
    assert kept > 0
    # 9000 tokens: 1.15M floats each for K and V, above the 1M floats a thread keeps.
    meta = _step([16], [9000], bs, num_blocks=600, seed=2)
    k_cache, v_cache = torch.randn(2, 600, bs, 1, d, generator=gen)
    q = torch.randn(16, 1, d, generator=gen)
    out = backend.attend(q, k_cache, v_cache, meta, d**-0.5)
    torch.testing.assert_close(
        out.double(), _dense(q, k_cache, v_cache, meta, d**-0.5), atol=2e-6, rtol=2e-5
    )
    # The K and V buffers (4.6 MB each) went back; the 64 x 9000 score tile (2.3 MB) is
    # under the cap and stays, as a short context's buffers do.
    assert backend._lib.pf_scratch_bytes() - kept < 9000 * d * 4


def test_forward_stores_kv_reads_strided_q_and_handles_bf16(backend):
    """The model hands q as a view into the fused qk tensor (row stride > heads x D) and
    new K/V to store first; a bf16 pool is read as bf16 and accumulated in fp32."""
    hq, hkv, d, bs = 6, 2, 16, 4
    query_lens, seq_lens = [1, 1, 1, 3, 40], [5, 8, 13, 10, 40]
    meta = _step(query_lens, seq_lens, bs, num_blocks=64, seed=7)
    gen = torch.Generator().manual_seed(11)
    t = sum(query_lens)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
        qk = torch.randn(t, hq + hkv, d, generator=gen).to(dtype)
        q = qk[:, :hq]
        assert not q.is_contiguous()
        k_new, v_new = (torch.randn(t, hkv, d, generator=gen).to(dtype) for _ in range(2))
        k_pool, v_pool = (torch.randn(64, bs, hkv, d, generator=gen).to(dtype) for _ in range(2))
        caches = [k_pool, v_pool, k_pool.clone(), v_pool.clone()]
        out = backend.forward(q, k_new, v_new, caches[0], caches[1], meta, d**-0.5)
        ref = TorchAttentionBackend().forward(q, k_new, v_new, caches[2], caches[3], meta, d**-0.5)
        assert out.dtype == dtype and out.shape == (t, hq, d)
        torch.testing.assert_close(caches[0], caches[2], atol=0, rtol=0)  # same K/V stored
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("padded", [False, True])
def test_qkv_attention_in_one_pass_equals_rotate_store_attend(backend, padded):
    """``pf_rope_store`` (RoPE of q and k, then K/V into their slots, one pass a row) gives
    bit for bit what ``rotate_half``, ``store`` and ``attend`` give one after the other:
    rotated q/k in place, the same pools, the same output; a -1 slot (padding) is skipped."""
    hq, hkv, d, bs = 6, 2, 16, 4
    query_lens, seq_lens = [1, 1, 1, 3, 40], [5, 8, 13, 10, 40]
    meta = _step(query_lens, seq_lens, bs, num_blocks=64, seed=7)
    skipped = int(meta.slot_mapping[2])
    if padded:
        meta.slot_mapping[2] = -1
    gen = torch.Generator().manual_seed(5)
    t = sum(query_lens)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    angles = torch.randn(t, 1, d // 2, generator=gen) * 3
    cos, sin = (f(torch.cat([angles, angles], -1)).contiguous() for f in (torch.cos, torch.sin))
    k_pool, v_pool = (torch.randn(64, bs, hkv, d, generator=gen) for _ in range(2))
    ref_pools = (k_pool.clone(), v_pool.clone())
    before = k_pool.view(-1, hkv, d)[skipped].clone()
    ref_qkv = qkv.clone()
    heads = (hq, hkv, d)
    out = backend.qkv_attention(qkv, heads, cos, sin, k_pool, v_pool, meta, d**-0.5)
    ref = TorchAttentionBackend.qkv_attention(
        backend, ref_qkv, heads, cos, sin, *ref_pools, meta, d**-0.5
    )
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(k_pool, ref_pools[0]) and torch.equal(v_pool, ref_pools[1])
    assert torch.equal(out, ref)
    # Row 2's own slot: written unless its slot is -1.
    assert torch.equal(k_pool.view(-1, hkv, d)[skipped], before) == padded


def test_threads_split_work_without_changing_results(backend):
    """With several threads heads are split across work items; each query vector's
    arithmetic is the same, so the output is bit-identical to one thread's."""
    meta = _step([1, 1, 1, 5, 20], [33, 7, 64, 20, 30], bs=8, num_blocks=64, seed=3)
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(2, 64, 8, 4, 16, generator=gen)
    q = torch.randn(28, 8, 16, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend.attend(q, k_cache, v_cache, meta, 0.25)
        torch.set_num_threads(4)
        many = backend.attend(q, k_cache, v_cache, meta, 0.25)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 1), (8, 8)])
def test_a_long_chunk_split_over_threads_is_bit_identical(backend, hq, hkv):
    """One long prompt has only hkv GEMM items; with several threads they are split at tile
    boundaries so no thread idles. The tiles are those of the unsplit item, so the output is
    bit-identical to one thread's (and is attention)."""
    if mkl_packed.blas_addresses() is None:
        pytest.skip("this torch has no MKL SGEMM: long chunks take the kernel's loops")
    d, bs = 32, 16
    meta = _step([1, 250], [40, 250 + 37], bs, num_blocks=64, seed=hq)
    gen = torch.Generator().manual_seed(hkv)
    k_cache, v_cache = torch.randn(2, 64, bs, hkv, d, generator=gen)
    q = torch.randn(251, hq, d, generator=gen)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            outs.append(backend.attend(q, k_cache, v_cache, meta, d**-0.5))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    want = _dense(q, k_cache, v_cache, meta, d**-0.5)
    torch.testing.assert_close(outs[0].double(), want, atol=2e-6, rtol=2e-5)


def test_uncovered_dtype_goes_to_the_torch_path(backend):
    meta = _step([1, 2], [9, 6], bs=4, num_blocks=16, seed=1)
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = (torch.randn(16, 4, 2, 16, generator=gen).half() for _ in range(2))
    q = torch.randn(3, 2, 16, generator=gen).half()
    assert not backend.covers(q, k_cache)
    out = backend.attend(q, k_cache, v_cache, meta, 0.25)
    assert torch.equal(out, paged_attention(q, k_cache, v_cache, meta, 0.25))


def test_rope_in_place_is_bit_identical_to_torch(backend):
    """RoPE is computed without fused multiply-adds, so the C path equals torch's ops
    exactly, on the model's strided q/k view into the fused qkv projection."""
    gen = torch.Generator().manual_seed(9)
    t, hq, hkv, d = 37, 6, 2, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 3
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    cos, sin = (torch.randn(t, d, generator=gen).unsqueeze(1) for _ in range(2))
    want = rotate_half(qk.clone(), cos, sin)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    got = backend.rotate_half(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()  # in place
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v untouched
    # bf16 heads take the torch ops (and give their result).
    xb = torch.randn(5, 2, 8, generator=gen).bfloat16()
    cb, sb = (torch.randn(5, 1, 8, generator=gen).bfloat16() for _ in range(2))
    assert torch.equal(backend.rotate_half(xb, cb, sb), rotate_half(xb, cb, sb))


def test_store_writes_the_slots_torch_writes(backend):
    gen = torch.Generator().manual_seed(4)
    t, hkv, d, bs = 9, 2, 8, 4
    kv = torch.randn(t, 3 * hkv * d, generator=gen)
    k, v = kv[:, : hkv * d].view(t, hkv, d), kv[:, 2 * hkv * d :].view(t, hkv, d)
    slots = torch.tensor([3, 17, -1, 0, 63, 8, -1, 40, 41])
    pools = [torch.randn(16, bs, hkv, d, generator=gen) for _ in range(2)]
    ref = [p.clone() for p in pools]
    backend.store(k, v, pools[0], pools[1], slots)
    store_kv(k, v, ref[0], ref[1], slots)
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])


def test_a_non_contiguous_v_pool_is_read_while_it_lives(backend):
    """A V pool that is a view (here the first half of a wider tensor) is copied for the
    kernel; the copy was a temporary freed before the call read it (a segfault once the
    32 MiB copy came from mmap, stale data below that)."""
    torch.manual_seed(0)
    nb, bs, hkv, d, hq = 4096, 16, 2, 64, 8
    k = torch.randn(nb, bs, hkv, d)
    v = torch.randn(nb, bs, hkv, 2 * d)[..., :d]
    assert not v.is_contiguous()
    meta = build_metadata([list(range(188)), list(range(300, 332))], [1, 1], [3000, 500], bs)
    q = torch.randn(2, hq, d)
    assert backend.covers(q, k)
    out = backend.attend(q, k, v, meta, d**-0.5)
    torch.testing.assert_close(out, paged_attention(q, k, v, meta, d**-0.5), atol=2e-6, rtol=2e-5)
