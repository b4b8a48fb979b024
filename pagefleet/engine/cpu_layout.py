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
import torch.nn.functional as F
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


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same names) whose forward multiplies by a copy of
    its weight packed once for MKL's packed GEMM (``kernels/mkl_packed.py``): decode-sized
    GEMMs skip MKL's per-call weight re-pack. Inputs the packed path does not take (not
    2-D fp32 rows) go to ``F.linear``.

    Invariant: the packed copy equals ``weight`` as it was when packed; the weights are not
    written after loading (``pack_linear_weights`` runs after the load).
    """

    packed: mkl_packed.PackedWeight
    gemm: mkl_packed.MklPackedGemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if mkl_packed.usable(x, self.in_features):
            return self.gemm.linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linear_weights(model: nn.Module, gemm: mkl_packed.MklPackedGemm | None) -> int:
    """Turn every fp32 CPU ``nn.Linear`` of ``model`` into a ``PackedLinear`` in place (the
    module object keeps its parameters; only its class and a packed copy are added).
    Returns how many were packed; none when ``gemm`` is None (no MKL here).

    Memory: the packed copy is about the weight's size again (the originals stay, for the
    ``F.linear`` path and anything that reads ``weight``). Call after the weights are
    loaded, as ``column_major_linear_weights``.
    """
    if gemm is None:
        return 0
    packed = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            continue
        if module.bias is not None and module.bias.dtype != torch.float32:
            continue
        module.packed = gemm.pack(w)
        module.gemm = gemm
        module.__class__ = PackedLinear
        packed += 1
    return packed
