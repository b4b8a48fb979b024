"""Our Llama-family model against transformers on the same checkpoints.

Every preset (Llama GQA, Qwen2 bias+tied, Qwen3 qk-norm, Llama 3 rope scaling, Mistral) and
two more rope scalings (linear, yarn) run as one packed prefill of mixed-length prompts and
as prefix + extend + single-token decodes through a paged cache with the torch backend.
Logits must agree within 1e-4 and greedy tokens exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagefleet.engine.loader import load_model
from pagefleet.engine.tiny import PRESETS, ensure_tiny_checkpoint, write_random_checkpoint
from pagefleet.kernels.torch_ref import TorchAttentionBackend
from pagefleet.testing.paged_run import PagedSequenceRunner

ATOL = 1e-4
PROMPT_LENS = [1, 2, 7, 16, 17, 33, 64, 129, 300]
NUM_DECODES = 4

EXTRA_CONFIGS = {
    "tiny-linear-rope": {
        **PRESETS["tiny"],
        "num_hidden_layers": 2,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    },
    "tiny-yarn-rope": {
        **PRESETS["tiny"],
        "num_hidden_layers": 2,
        "max_position_embeddings": 8192,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
        },
    },
}
ALL_MODELS = [*PRESETS, *EXTRA_CONFIGS]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _checkpoint(name: str, root: Path) -> Path:
    if name in PRESETS:
        return ensure_tiny_checkpoint(name, root)
    path = root / name
    if not (path / "config.json").is_file():
        write_random_checkpoint(path, dict(EXTRA_CONFIGS[name]), seed=7)
    return path


class Pair:
    """Our model and transformers' on one checkpoint, plus seeded prompts."""

    def __init__(self, path: Path) -> None:
        self.model, self.config, self.tokenizer = load_model(path)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.hf.eval()
        gen = torch.Generator().manual_seed(0)
        vocab = self.config.vocab_size
        self.prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        text = "Hello, world! Once upon a time a café served 日本語 🙂 to the queue."
        self.prompts.append(self.tokenizer.encode(text))

        self._refs: dict[int, tuple[list[int], torch.Tensor]] = {}

    def reference(self, i: int) -> tuple[list[int], torch.Tensor]:
        """HF's greedy continuation of prompt i and its logits over prompt + continuation."""
        if i not in self._refs:
            cont = self.hf_greedy(self.prompts[i], NUM_DECODES)
            self._refs[i] = (cont, self.hf_logits(self.prompts[i] + cont))
        return self._refs[i]

    @torch.no_grad()
    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([ids])).logits[0].float()

    def hf_greedy(self, ids: list[int], n: int) -> list[int]:
        # Plain argmax, not generate(): no EOS handling or logits processors in the way.
        out = list(ids)
        for _ in range(n):
            out.append(int(self.hf_logits(out)[-1].argmax()))
        return out[len(ids) :]

    def runner(self, block_size: int = 16) -> PagedSequenceRunner:
        return PagedSequenceRunner(
            self.model,
            self.config,
            TorchAttentionBackend(),
            num_blocks=4096 // block_size + 8,
            block_size=block_size,
        )


@pytest.fixture(scope="module")
def pairs(model_root: Path) -> dict[str, Pair]:
    """Loaded model pairs by name: loading both models is the slow part, so tests share."""
    return {}


def _pair(pairs: dict[str, Pair], root: Path, name: str) -> Pair:
    if name not in pairs:
        pairs[name] = Pair(_checkpoint(name, root))
    return pairs[name]


@pytest.fixture(scope="module", params=ALL_MODELS)
def pair(request: pytest.FixtureRequest, pairs: dict[str, Pair], model_root: Path) -> Pair:
    return _pair(pairs, model_root, request.param)


def test_packed_prefill_matches_transformers(pair: Pair) -> None:
    runner = pair.runner()
    out = runner.step({f"s{i}": p for i, p in enumerate(pair.prompts)})
    for i, prompt in enumerate(pair.prompts):
        ours = out[f"s{i}"]
        ref = pair.hf_logits(prompt)
        assert ours.dtype == torch.float32
        assert ours.shape == ref.shape
        diff = (ours - ref).abs().max().item()
        assert diff < ATOL, f"prompt {i} (len {len(prompt)}): max |diff| {diff}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_prefix_extend_and_decode_match_transformers(pair: Pair) -> None:
    _check_extend_and_decode(pair, block_size=16)


@pytest.mark.parametrize("block_size", [1, 32])
def test_block_sizes(pairs: dict[str, Pair], model_root: Path, block_size: int) -> None:
    _check_extend_and_decode(_pair(pairs, model_root, "tiny"), block_size)


def _check_extend_and_decode(pair: Pair, block_size: int) -> None:
    """Each prompt: its prefix, then the rest, then greedy decodes; sequences at different
    phases share every packed step, so decodes and extends mix in one batch."""
    idx = [i for i, p in enumerate(pair.prompts) if len(p) >= 2]
    prompts = [pair.prompts[i] for i in idx]
    refs = [pair.reference(i) for i in idx]
    continuations = [r[0] for r in refs]
    plans: list[list[list[int]]] = []
    for i, (p, cont) in enumerate(zip(prompts, continuations, strict=True)):
        cut = 1 + (len(p) * (i + 1)) // (len(prompts) + 2)
        # Later prompts first wait `i % 3` steps with nothing, so phases interleave.
        plans.append([[]] * (i % 3) + [p[:cut], p[cut:]] + [[t] for t in cont])
    fed: list[list[int]] = [[] for _ in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    runner = pair.runner(block_size)
    for step in range(max(len(pl) for pl in plans)):
        batch = {f"s{i}": pl[step] for i, pl in enumerate(plans) if step < len(pl) and pl[step]}
        out = runner.step(batch)
        for name, logits in out.items():
            i = int(name[1:])
            fed[i].extend(batch[name])
            got[i].append(logits)
    for i, (p, cont) in enumerate(zip(prompts, continuations, strict=True)):
        full = p + cont
        assert fed[i] == full
        ours = torch.cat(got[i])
        ref = refs[i][1]
        diff = (ours - ref).abs().max().item()
        assert diff < ATOL, f"prompt {i} (len {len(p)}): max |diff| {diff}"
        # Greedy: our argmax after the prompt and after each decoded token is HF's choice.
        ours_greedy = ours[len(p) - 1 : len(full) - 1].argmax(-1).tolist()
        assert ours_greedy == cont


def test_logits_are_decisive(pair: Pair) -> None:
    """The random init gives clear winners, so float reordering cannot flip greedy picks."""
    logits = pair.hf_logits(pair.prompts[-3])
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).median().item()
    assert margin > 100 * ATOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_fp32(model_root: Path, dtype: torch.dtype) -> None:
    path = ensure_tiny_checkpoint("tiny", model_root)
    model, config, _ = load_model(path, dtype=str(dtype).removeprefix("torch."))
    assert config.dtype == dtype
    assert all(p.dtype == dtype for p in model.parameters())
    ref_model, ref_config, _ = load_model(path)
    prompt = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    half = PagedSequenceRunner(model, config, TorchAttentionBackend()).step({"a": prompt.tolist()})
    full = PagedSequenceRunner(ref_model, ref_config, TorchAttentionBackend()).step(
        {"a": prompt.tolist()}
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        hf_half = hf(prompt[None]).logits[0].float()
    assert half["a"].dtype == torch.float32

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    # Our attention accumulates in fp32, so we are at least as close to the fp32 result
    # as transformers' own half-precision run, and within the precision's error.
    ours_err, hf_err = rel(half["a"], full["a"]), rel(hf_half, full["a"])
    assert ours_err <= 1.25 * hf_err, (ours_err, hf_err)
    assert ours_err < (0.12 if dtype == torch.bfloat16 else 0.02)
    agree = (half["a"].argmax(-1) == full["a"].argmax(-1)).float().mean().item()
    assert agree > 0.85


def test_reused_blocks_hold_no_stale_state(pairs: dict[str, Pair], model_root: Path) -> None:
    """Blocks freed by one sequence and reused by another (stale K/V still in them, cache
    allocated uninitialised) give the same logits as a fresh cache."""
    pair = _pair(pairs, model_root, "tiny")
    runner = PagedSequenceRunner(
        pair.model, pair.config, TorchAttentionBackend(), num_blocks=10, block_size=16
    )
    long, short = pair.prompts[7], pair.prompts[4]  # 129 and 17 tokens
    runner.step({"a": long})
    runner.free("a")
    reused = runner.step({"b": short})["b"]
    fresh = pair.runner().step({"b": short})["b"]
    assert torch.equal(reused, fresh)
    with pytest.raises(ValueError, match="at least one new token"):
        runner.step({"b": []})
    with pytest.raises(RuntimeError, match="ran out of KV blocks"):
        runner.step({"c": long})
