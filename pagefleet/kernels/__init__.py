"""pagefleet.kernels: paged-attention backends (torch reference, Triton kernels).

``get_backend`` picks one per device; the Triton module is imported only on demand.
"""

from pagefleet.kernels.backend import BACKEND_NAMES, default_backend_name, get_backend
from pagefleet.kernels.metadata import AttentionBackend, AttentionMetadata
from pagefleet.kernels.torch_ref import TorchAttentionBackend

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "default_backend_name",
    "get_backend",
]
