"""Choosing an attention backend for a device.

``triton`` is the GPU path; ``torch`` runs anywhere and is the CPU default. Triton is
imported only when the triton backend is chosen, so CPU-only processes never load it.
"""

from __future__ import annotations

import logging
import os

import torch

from pagefleet.kernels.metadata import AttentionBackend
from pagefleet.kernels.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "triton")


def default_backend_name(device: torch.device) -> str:
    """``triton`` on CUDA, ``torch`` everywhere else."""
    return "triton" if device.type == "cuda" else "torch"


def get_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """The attention backend called ``name`` (``None`` or ``"auto"``: the device's default).

    Raises ValueError, naming the fix, for an unknown name or for ``triton`` on a
    non-CUDA device without ``TRITON_INTERPRET=1`` (there the kernels cannot run).
    """
    device = torch.device(device)
    chosen = default_backend_name(device) if name in (None, "", "auto") else name
    if chosen == "torch":
        return TorchAttentionBackend()
    if chosen != "triton":
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)} "
            "(or leave it unset: triton on CUDA, torch on CPU)"
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
