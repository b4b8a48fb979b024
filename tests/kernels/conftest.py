"""Kernel tests run on CUDA when a GPU is present (bf16/fp16/fp32, compiled kernels) and
otherwise on CPU under the Triton interpreter (fp32/fp16).

TRITON_INTERPRET must be in the environment before any ``@triton.jit`` runs, i.e. before
``pagefleet.kernels.triton_attention`` is imported; conftest is imported before the test
modules of this directory, and nothing else in pagefleet imports triton at module level.
PAGEFLEET_KERNEL_DEVICE=cpu forces the interpreter even on a GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch

_FORCE_CPU = os.environ.get("PAGEFLEET_KERNEL_DEVICE", "") == "cpu"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and not _FORCE_CPU else "cpu"
if KERNEL_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The interpreter cannot do bf16 arithmetic faithfully, so bf16 is a GPU-only case.
KERNEL_DTYPES = (
    [torch.bfloat16, torch.float16, torch.float32]
    if KERNEL_DEVICE == "cuda"
    else [torch.float32, torch.float16]
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dtype" in metafunc.fixturenames:
        ids = [str(d).removeprefix("torch.") for d in KERNEL_DTYPES]
        metafunc.parametrize("dtype", KERNEL_DTYPES, ids=ids)


@pytest.fixture
def device() -> torch.device:
    return torch.device(KERNEL_DEVICE)


@pytest.fixture
def tol():
    """(atol, rtol) per dtype: tight for fp32, vLLM's kernel-test tolerances for 16-bit."""

    def _tol(dtype: torch.dtype) -> dict[str, float]:
        if dtype == torch.float32:
            return {"atol": 1e-5, "rtol": 1e-5}
        return {"atol": 1.5e-2, "rtol": 1e-2}

    return _tol
