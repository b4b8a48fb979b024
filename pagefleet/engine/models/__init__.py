"""Model implementations by Hugging Face architecture name."""

from __future__ import annotations

from types import MappingProxyType

from pagefleet.engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagefleet.engine.models.llama import LlamaForCausalLM

# The engine codes against this name; every supported family is the Llama decoder.
CausalLM = LlamaForCausalLM

MODEL_REGISTRY = MappingProxyType(dict.fromkeys(SUPPORTED_ARCHITECTURES, LlamaForCausalLM))


def get_model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The implementation serving ``config.architecture``; ValueError if none does."""
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}: pagefleet serves "
            f"{', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


__all__ = ["MODEL_REGISTRY", "CausalLM", "LlamaForCausalLM", "get_model_class"]
