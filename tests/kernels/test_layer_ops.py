"""The fused decoder-layer ops (``kernels/csrc/layer_ops_cpu.cpp``: RMSNorm with its residual
add, SiLU(gate) x up) against the torch reference (``torch_ref.rms_norm`` / ``silu_mul``,
HF Llama's op order) and against float64, on tiny shapes; the residual add in place; what
the C path does not cover falls back to the reference exactly."""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels.cpu_attention import LAYER_OPS_LIBRARY, LIBRARY, CpuAttentionBackend
from pagefleet.kernels.cpu_build import load_library
from pagefleet.kernels.torch_ref import TorchAttentionBackend, rms_norm, silu_mul

EPS = 1e-6


@pytest.fixture(scope="module")
def backend() -> CpuAttentionBackend:
    return CpuAttentionBackend(load_library(LIBRARY), load_library(LAYER_OPS_LIBRARY))


def _norm64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("rows", [0, 1, 5, 200])  # 200 x 384 takes the OpenMP path
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch_and_float64(
    backend: CpuAttentionBackend, rows: int, with_residual: bool
) -> None:
    g = torch.Generator().manual_seed(rows)
    cols = 384
    x = torch.randn(rows, cols, generator=g) * 3
    w = torch.randn(cols, generator=g)
    res = torch.randn(rows, cols, generator=g) if with_residual else None
    ref_out, ref_res = rms_norm(x, w, EPS, None if res is None else res.clone())
    mine_res_in = None if res is None else res.clone()
    out, new_res = backend.rms_norm(x, w, EPS, mine_res_in)
    assert out.shape == (rows, cols) and out.dtype == torch.float32
    # The residual sum is one fp32 add either way: bit-identical, and written in place.
    assert torch.equal(new_res, ref_res)
    if mine_res_in is not None:
        assert new_res.data_ptr() == mine_res_in.data_ptr()
    else:
        assert new_res is x
    # Only the sum of squares' order differs from torch: within a few fp32 ulps.
    torch.testing.assert_close(out, ref_out, rtol=4e-7, atol=1e-6)
    exact = _norm64(ref_res, w)
    err = (out.double() - exact).abs()
    assert rows == 0 or err.max().item() <= 2e-6 * max(1.0, exact.abs().max().item())


def test_rms_norm_on_a_strided_view_and_fallbacks(backend: CpuAttentionBackend) -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 100, generator=g)
    x = base[:, 10:74]  # rows 100 apart: the C path reads the view in place
    w = torch.randn(64, generator=g)
    torch.testing.assert_close(backend.rms_norm(x, w, EPS)[0], rms_norm(x, w, EPS)[0])
    # bf16 and a transposed view are not the C path's: the reference, bit for bit.
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(backend.rms_norm(xb, wb, EPS)[0], rms_norm(xb, wb, EPS)[0])
    xt = torch.randn(64, 6, generator=g).t()
    assert torch.equal(backend.rms_norm(xt, w, EPS)[0], rms_norm(xt, w, EPS)[0])
    # The torch backend is the reference itself.
    assert torch.equal(TorchAttentionBackend().rms_norm(x, w, EPS)[0], rms_norm(x, w, EPS)[0])


@pytest.mark.parametrize("rows", [0, 3, 64])  # 64 x 1100: the OpenMP path
def test_silu_mul_matches_torch(backend: CpuAttentionBackend, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    inter = 1100
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
    gate_up[:, 0] = torch.tensor([-100.0, 100.0, 0.0] * 22)[:rows]  # saturated and zero
    out = backend.silu_mul(gate_up)
    assert out.shape == (rows, inter)
    torch.testing.assert_close(out, silu_mul(gate_up), rtol=1e-6, atol=1e-7)
    gd, ud = gate_up.double().chunk(2, dim=-1)
    exact = gd * torch.sigmoid(gd) * ud
    err = (out.double() - exact).abs()
    assert rows == 0 or err.max().item() <= 1e-6 * max(1.0, exact.abs().max().item())


def test_silu_mul_fallback_is_the_reference(backend: CpuAttentionBackend) -> None:
    gate_up = torch.randn(4, 10).bfloat16()
    assert torch.equal(backend.silu_mul(gate_up), silu_mul(gate_up))
    strided = torch.randn(10, 4).t()  # columns not contiguous: the reference path
    assert torch.equal(backend.silu_mul(strided), silu_mul(strided))
