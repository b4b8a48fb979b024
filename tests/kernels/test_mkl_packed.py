"""MKL's packed GEMM (kernels/mkl_packed.py) and the PackedLinear swap (engine/cpu_layout.py):
the same values as F.linear (to fp32 rounding) at every row count, from one packed buffer."""

from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.cpu_layout import PackedLinear, linear_weight, pack_linear_weights
from pagefleet.kernels import mkl_packed


@pytest.fixture(scope="module")
def gemm() -> mkl_packed.MklPackedGemm:
    g = mkl_packed.load()
    if g is None:
        # The x86-64 Linux torch wheel ships MKL with its CBLAS symbols: losing them there
        # would silently lose the decode speed-up, so that is a failure, not a skip.
        assert not (sys.platform == "linux" and platform.machine() == "x86_64"), (
            "torch on x86-64 Linux no longer exposes MKL's cblas_sgemm_pack"
        )
        pytest.skip("no MKL in this torch build: PackedLinear is never used here")
    return g


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_packed_buffer_serves_every_row_count(
    gemm: mkl_packed.MklPackedGemm, threads: int
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(96, 80, generator=g)
        bias = torch.randn(96, generator=g)
        bias0 = bias.clone()
        packed = gemm.pack(w)
        for m in (0, 1, 2, 7, 16, 33, 64, 200):
            x = torch.randn(m, 80, generator=g)
            out = gemm.linear(x, packed)
            assert out.shape == (m, 96) and out.dtype == torch.float32
            _close(out, F.linear(x, w))
            _close(gemm.linear(x, packed, bias), F.linear(x, w, bias))
        assert torch.equal(bias, bias0), "the bias must never be written"
    finally:
        torch.set_num_threads(before)


def test_strided_rows_and_a_column_major_weight(gemm: mkl_packed.MklPackedGemm) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 32, generator=g).t().contiguous().t()  # as cpu_layout stores it
    x = torch.randn(5, 64, generator=g)[:, 16:48]  # rows of a wider tensor
    assert mkl_packed.usable(x, 32)
    _close(gemm.linear(x, gemm.pack(w)), F.linear(x, w))
    # Packed straight from the row-major weight (as the loader does): the same buffer.
    row_major = w.contiguous()
    assert row_major.is_contiguous() and not w.is_contiguous()
    assert torch.equal(gemm.linear(x, gemm.pack(row_major)), gemm.linear(x, gemm.pack(w)))
    assert not mkl_packed.usable(x.t(), 5)  # columns not contiguous
    assert not mkl_packed.usable(x.to(torch.bfloat16), 32)
    assert not mkl_packed.usable(x.unsqueeze(0), 32)


def test_pack_rejects_what_it_cannot_pack(gemm: mkl_packed.MklPackedGemm) -> None:
    with pytest.raises(ValueError, match="fp32 CPU weight"):
        gemm.pack(torch.zeros(4, 4, dtype=torch.bfloat16))


def test_pack_linear_weights_keeps_names_frees_weights_and_values(
    gemm: mkl_packed.MklPackedGemm,
) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8, bias=False))
    model.append(nn.Linear(8, 4).to(torch.bfloat16))  # not fp32: left alone
    model.append(nn.Linear(4, 4))  # below min_elements: left alone
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    w0 = model[0].weight.detach().clone()
    x = torch.randn(6, 16)
    with torch.inference_mode():
        ref = model[:3](x)
    assert pack_linear_weights(model, gemm, min_elements=17) == 2
    assert pack_linear_weights(model, gemm, min_elements=17) == 0  # already packed
    assert pack_linear_weights(model, None, min_elements=0) == 0
    assert [n for n, _ in model.named_parameters()] == names
    assert [p.shape for p in model.parameters()] == shapes
    assert isinstance(model[0], PackedLinear) and isinstance(model[0], nn.Linear)
    assert type(model[3]) is nn.Linear and type(model[4]) is nn.Linear
    # The packed copy is the only one: the unpacked weight's storage is gone.
    assert model[0].weight.is_meta and model[2].weight.is_meta
    assert not model[4].weight.is_meta
    # ... and its values still come back exactly, for inspection.
    assert torch.equal(linear_weight(model[0]), w0)
    assert torch.equal(linear_weight(model[4]), model[4].weight)
    with torch.inference_mode():
        _close(model[:3](x), ref)
        # Inputs that are not 2-D contiguous rows still go through the packed weight.
        x3 = x.view(2, 3, 16)
        _close(model[0](x3), F.linear(x3, w0, model[0].bias))
        xt = torch.randn(16, 5).t()  # rows 1 element apart: not the packed path's layout
        _close(model[0](xt), F.linear(xt, w0, model[0].bias))
        with pytest.raises(TypeError, match="cast the input to fp32"):
            model[0](x.to(torch.bfloat16))


def test_default_threshold_skips_small_weights_packs_large_ones(
    gemm: mkl_packed.MklPackedGemm,
) -> None:
    # The test presets' projections (<= 131K elements) lose to F.linear when packed; the
    # bench model's (>= 512 x 512) win (docs/benchmarks.md, engine speed, session 10).
    small, large = nn.Linear(128, 1024, bias=False), nn.Linear(512, 512, bias=False)
    model = nn.Sequential(small, large)
    assert pack_linear_weights(model, gemm) == 1
    assert type(small) is nn.Linear and isinstance(large, PackedLinear)
