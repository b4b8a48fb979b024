"""fp32 linear layers through MKL's packed GEMM (``cblas_sgemm_pack`` / ``_compute``).

Why: ``F.linear`` hands MKL an unpacked weight, and MKL re-packs (copies into its panel
layout) the whole weight on every call. A decode step's GEMMs have few rows (1-64), so that
copy costs as much as the multiply: measured on the bench model's four projections (2-core
VM, 2 threads), packing once at load made them 1.3-1.7x faster at 20-64 rows, ~1.2x at 200
and ~1.1x at 1024 (docs/benchmarks.md, engine speed, session 9).

The symbols come from the MKL that the x86-64 Linux torch wheel links into
``libtorch_cpu.so`` (and exports). Where they are absent (another platform, a torch built
without MKL), ``load()`` returns None and callers keep ``F.linear``: results then differ
only by fp32 rounding (the summation order of another GEMM kernel), never in meaning.

One packed buffer serves every row count: its layout depends on the weight's shape only
(checked by ``tests/kernels/test_mkl_packed.py``). Its size as MKL reports it includes a
fixed ~8 MB reserve that the packing never writes (so those pages are never committed).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151
_c_int, _c_ptr = ctypes.c_int, ctypes.c_void_p
# The row count the weight is packed for: the buffer's content does not depend on it.
_PACK_ROWS = 64


@dataclass(slots=True, frozen=True)
class PackedWeight:
    """A ``[out, in]`` fp32 weight in MKL's packed B layout (``buffer`` keeps it alive)."""

    buffer: torch.Tensor
    out_features: int
    in_features: int


class MklPackedGemm:
    """Bound ``cblas_sgemm_pack`` / ``cblas_sgemm_compute`` of the loaded MKL."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._size = lib.cblas_sgemm_pack_get_size
        self._size.restype = ctypes.c_size_t
        self._size.argtypes = [_c_int] * 4
        self._pack = lib.cblas_sgemm_pack
        self._pack.restype = None
        self._pack.argtypes = [_c_int] * 6 + [ctypes.c_float, _c_ptr, _c_int, _c_ptr]
        self._compute = lib.cblas_sgemm_compute
        self._compute.restype = None
        self._compute.argtypes = [_c_int] * 6 + [
            _c_ptr, _c_int, _c_ptr, _c_int, ctypes.c_float, _c_ptr, _c_int,
        ]  # fmt: skip

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """``weight`` (``[out, in]``, fp32, CPU, any strides) packed for ``linear``."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(
                f"MKL's packed GEMM takes a 2-D fp32 CPU weight, not {weight.dtype} "
                f"{tuple(weight.shape)} on {weight.device}; keep F.linear for it"
            )
        n, k = weight.shape
        w = weight.detach()
        # B = W^T. Packed from either layout in place (no temporary copy of the weight):
        # row-major W is B transposed, column-major W (cpu_layout.py) is B row-major.
        if w.is_contiguous():
            trans, src, ld = _TRANS, w, k
        else:
            trans, src = _NO_TRANS, w.t().contiguous()
            ld = n
        size = self._size(_B_MATRIX, _PACK_ROWS, n, k)
        buffer = torch.empty(-(-size // 4), dtype=torch.float32)
        self._pack(_ROW_MAJOR, _B_MATRIX, trans, _PACK_ROWS, n, k, 1.0,
                   src.data_ptr(), ld, buffer.data_ptr())  # fmt: skip
        return PackedWeight(buffer, n, k)

    def linear(
        self, x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W^T (+ bias)`` for 2-D fp32 CPU ``x`` whose rows are contiguous
        (``usable`` says so); within fp32 rounding of ``F.linear`` with the same weight."""
        m = x.shape[0]
        n, k = packed.out_features, packed.in_features
        out = torch.empty((m, n), dtype=torch.float32)
        beta = 0.0
        if bias is not None:  # C = A @ B + C, C starting as the bias rows (addmm's order);
            out.copy_(bias)  # a fresh tensor: MKL writes C, never the bias itself
            beta = 1.0
        if m:
            self._compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, x.data_ptr(), x.stride(0),
                          packed.buffer.data_ptr(), n, beta, out.data_ptr(), n)  # fmt: skip
        return out


def usable(x: torch.Tensor, in_features: int) -> bool:
    """Whether ``x`` is an input ``MklPackedGemm.linear`` takes (else use ``F.linear``)."""
    return (
        x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.shape[1] == in_features
        and x.stride(1) == 1
        and x.stride(0) >= in_features
    )


def load() -> MklPackedGemm | None:
    """The packed GEMM of the MKL inside this process's torch, or None where torch has no
    MKL or does not export its CBLAS symbols (then nothing is packed)."""
    if not torch.backends.mkl.is_available():
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        return MklPackedGemm(lib)
    except (OSError, AttributeError):
        return None


def blas_addresses() -> tuple[int, int | None] | None:
    """Addresses of Fortran ``SGEMM`` and C ``MKL_Set_Num_Threads_Local`` in this process's
    torch MKL (for the compiled attention kernel's chunk GEMMs), or None where torch has
    no MKL or does not export ``SGEMM``; the second is None when only it is missing."""
    if not torch.backends.mkl.is_available():
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        sgemm = ctypes.cast(lib.SGEMM, _c_ptr).value
    except (OSError, AttributeError):
        return None
    try:
        # The C entry point (an int by value); lowercase mkl_set_num_threads_local is the
        # Fortran one, which takes a pointer.
        local = ctypes.cast(lib.MKL_Set_Num_Threads_Local, _c_ptr).value
    except AttributeError:
        local = None
    return (sgemm, local) if sgemm else None
