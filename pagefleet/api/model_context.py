"""How many positions a checkpoint's RoPE serves, from its config.json alone (no torch).

One rule for the engine (its tables and default --max-model-len) and the gateway (which
refuses prompts past the daemons' default length before routing them): if the two
disagreed, the gateway would refuse prompts the daemons serve, or route ones they refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def rope_positions(max_position_embeddings: int, rope_scaling: Mapping[str, Any] | None) -> int:
    """``max_position_embeddings``, except under YaRN: its context is
    ``original_max_position_embeddings x factor``, the length vLLM derives for it, and its
    configs often keep ``max_position_embeddings`` at the original length (Qwen2.5, Qwen3:
    32768 with factor 4 serve 131072)."""
    kind = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_scaling is not None and kind == "yarn":
        original = rope_scaling.get("original_max_position_embeddings")
        return int(float(original or max_position_embeddings) * float(rope_scaling["factor"]))
    return max_position_embeddings
