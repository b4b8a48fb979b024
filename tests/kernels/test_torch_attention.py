"""The torch backend (the CPU path and the Triton kernels' oracle) against attention written
out by hand: softmax(q k^T * scale) v over each sequence's context, read position by
position through its block table."""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels.metadata import build_metadata
from pagefleet.kernels.torch_ref import TorchAttentionBackend, _decode_plan


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[Q, Hq, D]`` (the last Q positions of the context), k/v ``[S, Hkv, D]``."""
    qlen, hq, _ = q.shape
    s, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k.double()) * scale
    qpos = torch.arange(s - qlen, s).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(s).unsqueeze(0) > qpos, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize(
    ("hq", "hkv", "cache_dtype"), [(8, 8, torch.float32), (6, 2, torch.bfloat16)]
)
def test_decodes_in_place_or_gathered_and_prefills_match_dense_attention(hq, hkv, cache_dtype):
    dtype = cache_dtype
    bs, d, num_blocks = 4, 16, 64
    gen = torch.Generator().manual_seed(3)
    # Rows 0-3 decode (query 1), rows 4-5 prefill/extend. Row 0's and row 2's blocks are
    # consecutive ids (read in place), rows 1 and 3 are scattered (gathered).
    query_lens = [1, 1, 1, 1, 5, 9]
    seq_lens = [9, 13, 4, 17, 5, 14]
    tables = [[10, 11, 12], [40, 3, 22, 7], [30], [50, 1, 2, 60, 33], [20, 21], [5, 44, 6, 45]]
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    total = sum(query_lens)
    q = torch.randn(total, hq, d, generator=gen).to(dtype)
    k_new = torch.randn(total, hkv, d, generator=gen).to(dtype)
    v_new = torch.randn(total, hkv, d, generator=gen).to(dtype)
    meta = build_metadata(tables, query_lens, seq_lens, bs)
    assert meta.num_decodes == 4
    scale = d**-0.5
    out = TorchAttentionBackend().forward(q, k_new, v_new, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype and out.shape == q.shape

    in_place = [blocks is None for _, blocks, _ in _decode_plan(meta)]
    assert in_place == [True, False, True, False]
    start = 0
    for t, s, ql in zip(tables, seq_lens, query_lens, strict=True):
        ctx = torch.tensor([t[p // bs] * bs + p % bs for p in range(s)])
        kk = k_cache.view(-1, hkv, d)[ctx].float()
        vv = v_cache.view(-1, hkv, d)[ctx].float()
        want = _dense(q[start : start + ql].float(), kk, vv, scale)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(
            out[start : start + ql].double(), want, atol=tol, rtol=tol, check_dtype=False
        )
        start += ql
    # The plan is derived once per step: a second layer reuses the same object.
    assert _decode_plan(meta) is _decode_plan(meta)
