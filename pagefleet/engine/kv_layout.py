"""The shape of one engine's KV pool, as data only (no torch).

It crosses the engine-process pipe (EngineInfo) and P/D peers compare it; keeping it free of
torch lets the daemon's HTTP process unpickle it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per element of the dtypes a KV pool may have (torch names, no "torch." prefix).
_ELEMENT_BYTES = {
    "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}  # fmt: skip


@dataclass(slots=True, frozen=True)
class KVLayout:
    """Shape of one engine's KV pool: what a transfer peer must match block for block."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of K (or of V) of one block in one layer."""
        try:
            elem = _ELEMENT_BYTES[self.dtype]
        except KeyError:
            raise ValueError(f"KV dtype {self.dtype!r} has no known element size") from None
        return self.block_size * self.num_kv_heads * self.head_dim * elem
