"""The engine with the Triton backend (interpreter on CPU) against transformers and
against itself with the torch backend: greedy tokens must be identical.

Small token budget and block size so that prompts are chunked and mixed with decodes;
two prompts share a prefix so the second one extends cached blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.tiny import ensure_tiny_checkpoint

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint("tiny", tmp_path_factory.mktemp("models"))


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, vocab, (40,), generator=gen).tolist()
    return [
        torch.randint(0, vocab, (3,), generator=gen).tolist(),
        shared + torch.randint(0, vocab, (9,), generator=gen).tolist(),
        torch.randint(0, vocab, (27,), generator=gen).tolist(),
        shared + torch.randint(0, vocab, (21,), generator=gen).tolist(),
    ]


def _engine_tokens(
    path: Path, backend: str, prompts: list[list[int]], device: torch.device
) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device=str(device),
            attention_backend=backend,
            block_size=16,
            num_gpu_blocks=64,
            max_num_batched_tokens=24,
            max_num_seqs=4,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.outputs[0].token_ids for r in engine.generate(prompts, params)]


@torch.no_grad()
def _hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    result = []
    for ids in prompts:
        seq = list(ids)
        for _ in range(MAX_TOKENS):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        result.append(seq[len(ids) :])
    return result


def test_engine_greedy_parity_with_triton_backend(tiny_dir, device):
    """On CPU the Triton kernels run in the interpreter; on a GPU, compiled (fp32)."""
    vocab = transformers.AutoConfig.from_pretrained(tiny_dir).vocab_size
    prompts = _prompts(vocab)
    want = _hf_greedy(tiny_dir, prompts)
    assert _engine_tokens(tiny_dir, "torch", prompts, device) == want
    assert _engine_tokens(tiny_dir, "triton", prompts, device) == want
