"""Choosing an attention backend for a device.

``triton`` is the GPU path; ``cpu`` (the compiled C++ kernel, ``cpu_attention.py``) is the
CPU default; ``torch`` runs anywhere and is what ``cpu`` falls back to, with one warning,
when the kernel cannot be built here (no g++, a failed compile). Triton is imported only
when the triton backend is chosen, so CPU-only processes never load it.
"""

from __future__ import annotations

import logging
import os

import torch

from pagefleet.kernels.metadata import AttentionBackend
from pagefleet.kernels.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("cpu", "torch", "triton")


def default_backend_name(device: torch.device) -> str:
    """``triton`` on CUDA, ``cpu`` (compiled, torch if it cannot be built) everywhere else."""
    return "triton" if device.type == "cuda" else "cpu"


def cpu_backend() -> AttentionBackend:
    """The compiled CPU kernel's backend, or the torch backend (after one warning that says
    why and how to fix it) when the kernel cannot be built or loaded on this machine."""
    from pagefleet.kernels.cpu_attention import LAYER_OPS_LIBRARY, LIBRARY, CpuAttentionBackend
    from pagefleet.kernels.cpu_build import KernelBuildError, load_library

    try:
        return CpuAttentionBackend(load_library(LIBRARY), load_library(LAYER_OPS_LIBRARY))
    except KernelBuildError as exc:
        logger.warning(
            "compiled CPU attention unavailable, using the slower torch attention instead "
            "(pass --attention-backend torch to choose it and silence this): %s",
            exc,
        )
        return TorchAttentionBackend()


def get_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """The attention backend called ``name`` (``None`` or ``"auto"``: the device's default).

    Raises ValueError, naming the fix, for an unknown name or for ``triton`` on a
    non-CUDA device without ``TRITON_INTERPRET=1`` (there the kernels cannot run).
    """
    device = torch.device(device)
    chosen = default_backend_name(device) if name in (None, "", "auto") else name
    if chosen == "torch":
        return TorchAttentionBackend()
    if chosen == "cpu":
        if device.type != "cpu":
            raise ValueError(
                f"attention backend 'cpu' runs on the CPU, but the engine runs on "
                f"{device.type!r}; use --attention-backend triton (or torch) there"
            )
        return cpu_backend()
    if chosen != "triton":
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)} "
            "(or leave it unset: triton on CUDA, cpu on CPU)"
        )
    interpret = os.environ.get("TRITON_INTERPRET", "") == "1"
    if device.type != "cuda" and not interpret:
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device, but the engine runs on "
            f"{device.type!r}; use --attention-backend torch there, or set TRITON_INTERPRET=1 "
            "in the environment before start-up to run the Triton kernels in the (slow) "
            "CPU interpreter"
        )
    try:
        from pagefleet.kernels import triton_attention
    except ImportError as exc:
        raise ValueError(
            "attention backend 'triton' needs the triton package: "
            "pip install 'pagefleet[engine]' (Linux), or use --attention-backend torch"
        ) from exc
    if device.type != "cuda" and not triton_attention.kernels_interpreted():
        raise ValueError(
            "TRITON_INTERPRET=1 was set after pagefleet's Triton kernels were imported, so "
            "they were compiled for the GPU; set it in the environment before the process "
            "starts"
        )
    logger.debug("attention backend: triton on %s (interpreter=%s)", device, interpret)
    return triton_attention.TritonAttentionBackend()
