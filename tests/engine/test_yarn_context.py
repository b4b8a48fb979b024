"""YaRN-scaled models serve their extended context, numerically as transformers does.

A YaRN config (Qwen2.5 and Qwen3 ship this shape) keeps ``max_position_embeddings`` at the
pretraining length and extends it by ``rope_scaling.factor``; transformers computes RoPE at
any position and vLLM serves ``original_max_position_embeddings x factor`` tokens. The
checkpoint here: 64 original positions, factor 4, so 256 served, and every test reaches
past position 64.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.loader import load_model
from pagefleet.engine.model_config import ModelConfig
from pagefleet.engine.models.llama import _rope_tables
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.tiny import PRESETS, write_random_checkpoint
from pagefleet.kernels.torch_ref import TorchAttentionBackend
from pagefleet.testing.paged_run import PagedSequenceRunner

ORIGINAL = 64
FACTOR = 4.0
YARN_CONFIG = {
    **PRESETS["tiny"],
    "num_hidden_layers": 2,
    "max_position_embeddings": ORIGINAL,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": FACTOR,
        "original_max_position_embeddings": ORIGINAL,
    },
}
ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-yarn-short"
    write_random_checkpoint(path, dict(YARN_CONFIG), seed=7)
    return path


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return model.eval()


def _prompt(n: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(16, vocab, (n,), generator=gen).tolist()


@torch.no_grad()
def _hf_logits(hf: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def test_default_max_model_len_is_original_times_factor(checkpoint: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), num_gpu_blocks=64, block_size=16))
    assert engine.max_model_len == int(ORIGINAL * FACTOR)
    _, config, _ = load_model(checkpoint)
    config.check_max_model_len(int(ORIGINAL * FACTOR))
    with pytest.raises(ValueError, match=r"YaRN context 256 .* set --max-model-len <= 256"):
        config.check_max_model_len(int(ORIGINAL * FACTOR) + 1)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"beta_fast": 16, "beta_slow": 2, "truncate": False},
        {"mscale": 0.707, "mscale_all_dim": 1.0},
        {"attention_factor": 1.25},
        # Not a power of two: 1 / (factor * f) and (1 / f) / factor then round apart.
        {"factor": 3.0},
    ],
)
def test_rope_tables_equal_transformers(extra: dict) -> None:
    scaling = {**YARN_CONFIG["rope_scaling"], **extra}
    cfg = {**YARN_CONFIG, "vocab_size": 512, "rope_scaling": scaling}
    ours = ModelConfig.from_dict(cfg)
    hf_config = transformers.LlamaConfig(**cfg)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"))
    cos, sin = _rope_tables(ours)
    # transformers' LlamaRotaryEmbedding: outer product, duplicated halves, cos/sin scaled.
    emb = torch.outer(torch.arange(cos.shape[0], dtype=torch.float32), inv_freq).repeat(1, 2)
    assert torch.equal(cos, emb.cos() * attention_factor)
    assert torch.equal(sin, emb.sin() * attention_factor)
    assert cos.shape == (int(ORIGINAL * scaling["factor"]), ours.head_dim)


def test_logits_past_the_original_context_match_transformers(
    checkpoint: Path, hf: transformers.PreTrainedModel
) -> None:
    model, config, _ = load_model(checkpoint)
    runner = PagedSequenceRunner(
        model, config, TorchAttentionBackend(), num_blocks=24, block_size=16
    )
    prompt = _prompt(int(ORIGINAL * FACTOR) - 16, config.vocab_size)
    ours = runner.step({"s": prompt})["s"]
    ref = _hf_logits(hf, prompt)
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"max |diff| {diff}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_engine_greedy_past_the_original_context_matches_transformers(
    checkpoint: Path, hf: transformers.PreTrainedModel
) -> None:
    """The served engine (default max_model_len, compiled CPU backend where it builds)
    decodes at positions 180-199, three times the original context."""
    engine = LLMEngine(EngineConfig(model=str(checkpoint), num_gpu_blocks=64, block_size=16))
    prompt = _prompt(180, engine.runner.model.config.vocab_size)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    expected = list(prompt)
    for _ in range(20):
        expected.append(int(_hf_logits(hf, expected)[-1].argmax()))
    assert out[0].outputs[0].token_ids == expected[len(prompt) :]
