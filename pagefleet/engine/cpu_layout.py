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
