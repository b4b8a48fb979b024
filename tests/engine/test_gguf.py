"""The GGUF loader on small files written here with ``gguf.GGUFWriter``.

Every supported tensor type, stored the way llama.cpp's converter stores it (Q/K rows
permuted), must arrive in our model exactly as ``gguf`` dequantizes it and in the Hugging
Face layout; the quantizable types must also stay close to the float originals. A
Llama-architecture file must give transformers' logits (transformers reads the same file
with its own GGUF code), and the rebuilt tokenizers must agree with transformers' on the
same files. Unsupported types and architectures fail with their name in the message.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagefleet.engine.cpu_layout import linear_weight
from pagefleet.engine.gguf_loader import SUPPORTED_TYPES
from pagefleet.engine.loader import load_model, resolve_model
from pagefleet.engine.model_config import ModelConfig
from pagefleet.engine.tiny import checkpoint_tensor_shapes
from pagefleet.testing.gguf_writer import gpt2_vocab, permute_rows, spm_vocab, write_llama_gguf
from pagefleet.tokenizer import Tokenizer

WORDS = ["the", "capital", "of", "france", "is", "paris", "hello", "world", "cat"]
# K-quants need rows of 256 values; two layers keep it small.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# Largest |ours - original| / max|original| each quantizable type may cost.
TOLERANCE = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 1e-2,
    "Q8_0": 1e-2,
    "Q5_0": 0.05,
    "Q5_1": 0.05,
    "Q4_0": 0.1,
    "Q4_1": 0.1,
}


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[int], list[str]]:
    return gpt2_vocab(WORDS)


def _state(vocab_size: int, tie: bool = False, seed: int = 0) -> tuple[dict, dict]:
    cfg = {**CONFIG, "vocab_size": vocab_size, "tie_word_embeddings": tie}
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in checkpoint_tensor_shapes(ModelConfig.from_dict(cfg)).items():
        if name.endswith("norm.weight"):
            state[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            state[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    return cfg, state


def _ours(model: torch.nn.Module, cfg: dict, name: str) -> np.ndarray:
    """The HF-named tensor as our fused model holds it."""
    params = dict(model.named_parameters())
    for mod_name, module in model.named_modules():  # packed ones hold no plain weight
        if isinstance(module, torch.nn.Linear):
            params[f"{mod_name}.weight"] = linear_weight(module)
    q = cfg["num_attention_heads"] * 64
    kv = cfg["num_key_value_heads"] * 64
    ffn = cfg["intermediate_size"]
    slices = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, ffn),
        "mlp.up_proj": ("mlp.gate_up_proj", ffn, 2 * ffn),
    }
    for part, (fused, lo, hi) in slices.items():
        if f".{part}." in name:
            return params[name.replace(part, fused)].detach()[lo:hi].numpy()
    if name == "lm_head.weight" and model.lm_head is None:
        name = "model.embed_tokens.weight"
    return params[name].detach().numpy()


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_every_type_arrives_dequantized_in_hf_layout(tmp_path: Path, vocab, qtype: str) -> None:
    tokens, types, merges = vocab
    cfg, state = _state(len(tokens))
    path = tmp_path / f"m-{qtype}.gguf"
    stored = write_llama_gguf(path, cfg, state, qtype, tokens, types, merges, seed=3)
    model, config, _ = load_model(path)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.head_dim == 64 and not config.tie_word_embeddings
    for name, original in state.items():
        ours = _ours(model, cfg, name)
        as_stored = ours
        if name.endswith("q_proj.weight"):
            as_stored = permute_rows(ours, 4)
        elif name.endswith("k_proj.weight"):
            as_stored = permute_rows(ours, 2)
        # Exactly what gguf's dequantizer gives for the stored blocks, in the file's layout.
        np.testing.assert_array_equal(as_stored, stored[name], err_msg=f"{qtype} {name}")
        if qtype in TOLERANCE:
            err = np.abs(ours - original).max() / np.abs(original).max()
            assert err <= TOLERANCE[qtype], f"{qtype} {name}: relative error {err}"


def test_llama_gguf_logits_match_transformers(tmp_path: Path, vocab) -> None:
    """transformers reads the same Q8_0 file with its own GGUF code: its un-permutation and
    config mapping are an independent oracle for ours."""
    import transformers

    from pagefleet.kernels.torch_ref import TorchAttentionBackend
    from pagefleet.testing.paged_run import PagedSequenceRunner

    tokens, types, merges = vocab
    cfg, state = _state(len(tokens), tie=True, seed=5)
    write_llama_gguf(tmp_path / "m.gguf", cfg, state, "Q8_0", tokens, types, merges)
    model, config, tok = load_model(tmp_path / "m.gguf")
    assert config.tie_word_embeddings
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    runner = PagedSequenceRunner(model, config, TorchAttentionBackend(), num_blocks=16)
    prompts = {
        "a": tok.encode("hello world, the capital of france is paris"),
        "b": [5, 17, 200, 3, 44, 91, 7],
    }
    out = runner.step(prompts)
    for key, ids in prompts.items():
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert (out[key] - ref).abs().max().item() < 1e-4
        assert torch.equal(out[key].argmax(-1), ref.argmax(-1))


def test_gpt2_tokenizer_and_chat_template_match_transformers(tmp_path: Path, vocab) -> None:
    import transformers

    tokens, types, merges = vocab
    cfg, state = _state(len(tokens))
    write_llama_gguf(tmp_path / "m.gguf", cfg, state, "F16", tokens, types, merges)
    ours = Tokenizer.from_dir(tmp_path)  # a directory holding one .gguf
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in ["hello world", " the capital of france is paris!", "a 2024 café\n\tcat"]:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids) == text
    messages = [{"role": "user", "content": "hello"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = ours.encode(rendered, add_special_tokens=False)
    assert ids[0] == tokens.index("<|im_start|>")
    assert ours.eos_token_ids == [tokens.index("<|im_end|>")]


def test_sentencepiece_tokenizer_matches_transformers(tmp_path: Path) -> None:
    import transformers

    tokens, types, scores = spm_vocab(WORDS)
    cfg, state = _state(len(tokens))
    write_llama_gguf(tmp_path / "m.gguf", cfg, state, "F32", tokens, types, [], spm_scores=scores)
    ours = Tokenizer.from_dir(tmp_path / "m.gguf")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in ["hello world", "the capital of france is paris", "cat é 7"]:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ids[0] == tokens.index("<s>")
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_unsupported_type_and_architecture_are_named(tmp_path: Path, vocab) -> None:
    tokens, types, merges = vocab
    cfg, state = _state(len(tokens))
    write_llama_gguf(tmp_path / "iq.gguf", cfg, state, "IQ4_NL", tokens, types, merges)
    with pytest.raises(ValueError, match="IQ4_NL"):
        load_model(tmp_path / "iq.gguf")
    write_llama_gguf(
        tmp_path / "phi.gguf", cfg, state, "F32", tokens, types, merges, architecture="phi3"
    )
    with pytest.raises(ValueError, match="GGUF architecture 'phi3' is not supported"):
        load_model(tmp_path / "phi.gguf")


def test_gguf_preset_missing_package_says_how_to_install(monkeypatch) -> None:
    from pagefleet.presets import gguf_presets

    fake = gguf_presets.GGUFPreset(
        package="pagefleet_no_such_package",
        filename="x.gguf",
        install="pip install x",
        description="",
    )
    monkeypatch.setattr(gguf_presets, "GGUF_PRESETS", {"smollm2-135m": fake})
    with pytest.raises(FileNotFoundError, match="run `pip install x`"):
        resolve_model("smollm2-135m")
    with pytest.raises(FileNotFoundError, match="smollm2-135m"):
        resolve_model("no-such-model")
