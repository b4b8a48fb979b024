"""Weight storage layout for fp32 models on CPU.

``F.linear(x, W)`` with ``W`` stored row-major (``[out, in]``, as checkpoints and nn.Linear
keep it) hands MKL a transposed B; the same values stored column-major (shape still
``[out, in]``, ``W.t()`` contiguous) make it a plain GEMM. Measured on the bench model's
projections, one thread: 35 -> 76 GFLOP/s at 8 rows, 117 -> 146 at 64, equal at 1024 —
decode steps are small-row GEMMs. From 32 rows up the results are bit-identical; below,
MKL picks another kernel and they differ by fp32 rounding (~1e-5 relative).
"""

from __future__ import annotations

import torch
from torch import nn

from pagefleet.kernels import mkl_packed


def column_major_linear_weights(model: nn.Module) -> int:
    """Re-store every fp32 CPU ``nn.Linear`` weight of ``model`` column-major (same shape
    and values; ``weight.t()`` becomes contiguous). Returns how many were changed.

    Call after the weights are loaded: the fused q/k/v and gate/up loaders write row slices,
    which are not contiguous views in this layout. Embeddings (and a head tied to them)
    stay row-major: their row lookups want contiguous rows.
    """
    changed = 0
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, nn.Linear):
                continue
            w = module.weight
            if w.device.type != "cpu" or w.dtype != torch.float32 or w.t().is_contiguous():
                continue
            w.data = w.data.t().contiguous().t()
            changed += 1
    return changed


# Smallest weight (elements) worth packing. Measured (docs/benchmarks.md, engine speed,
# session 10): at 128-256 wide (the test presets' 32K-131K-element weights) the packed call
# is 0.55-0.99x F.linear's speed at 1-64 rows (its fixed cost, ~4 us, is most of such a
# call); from 512 x 512 (262K) up it wins at decode-sized row counts (1.1-1.6x).
PACK_MIN_ELEMENTS = 1 << 18


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameter names and shapes) whose forward multiplies by its
    weight packed once for MKL's packed GEMM (``kernels/mkl_packed.py``): decode-sized
    GEMMs skip MKL's per-call weight re-pack.

    Invariant: the packed copy is the only copy of the weight. ``weight`` is left on the
    meta device (shape and dtype kept, no storage: reading its values fails loudly instead
    of holding the weight twice), so every input goes through the packed GEMM: rows that
    are not contiguous, or inputs with more than 2 dimensions, are made 2-D contiguous
    first. Only fp32 inputs are taken (the packed weight is fp32).
    """

    packed: mkl_packed.PackedWeight
    gemm: mkl_packed.MklPackedGemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if mkl_packed.usable(x, self.in_features):
            return self.gemm.linear(x, self.packed, self.bias)
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise TypeError(
                f"a packed fp32 CPU linear ({self.in_features} -> {self.out_features}) got "
                f"{x.dtype} {tuple(x.shape)} on {x.device}: cast the input to fp32 on CPU"
            )
        rows = x.reshape(-1, self.in_features).contiguous()
        out = self.gemm.linear(rows, self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def pack_linear_weights(
    model: nn.Module,
    gemm: mkl_packed.MklPackedGemm | None,
    min_elements: int = PACK_MIN_ELEMENTS,
) -> int:
    """Turn every fp32 CPU ``nn.Linear`` of ``model`` whose weight has at least
    ``min_elements`` elements into a ``PackedLinear`` in place, and free its unpacked weight
    (the module keeps its parameter names; ``weight`` becomes a meta tensor of the same
    shape). Returns how many were packed; none when ``gemm`` is None (no MKL here).

    Memory: the weights are held once, packed (MKL's size for it is the weight's plus a
    fixed reserve it never writes, so never made resident). Call after the weights are
    loaded, as ``column_major_linear_weights``; nothing may read a packed module's weight
    values afterwards.
    """
    if gemm is None:
        return 0
    packed = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.numel() < min_elements:
            continue
        if module.bias is not None and module.bias.dtype != torch.float32:
            continue
        module.packed = gemm.pack(w)
        module.gemm = gemm
        meta = torch.empty(w.shape, dtype=w.dtype, device="meta")
        module.weight = nn.Parameter(meta, requires_grad=False)
        module.__class__ = PackedLinear
        packed += 1
    return packed


def linear_weight(module: nn.Linear) -> torch.Tensor:
    """The ``[out, in]`` weight values of ``module``, packed or not. A ``PackedLinear``
    holds its weight only packed: its values come back as the product with the identity,
    which is exact in fp32 (each output is one weight times 1 plus zeros). For inspection
    (tests, debugging), not for the step: it computes an ``in x in`` GEMM."""
    if isinstance(module, PackedLinear):
        eye = torch.eye(module.in_features, dtype=torch.float32)
        return module.gemm.linear(eye, module.packed).t()
    return module.weight.detach()
