"""Checkpoint loading: tiny presets on disk, sharded round trip, dtype, and clear errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagefleet.engine.loader import load_model, resolve_model
from pagefleet.engine.tiny import (
    PRESETS,
    ensure_tiny_checkpoint,
    preset_dir_name,
    write_random_checkpoint,
)
from pagefleet.kernels.torch_ref import TorchAttentionBackend
from pagefleet.testing.paged_run import PagedSequenceRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint("tiny", tmp_path_factory.mktemp("models"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _tree_digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def _prefill_logits(path: Path, ids: list[int]) -> torch.Tensor:
    model, config, _ = load_model(path)
    return PagedSequenceRunner(model, config, TorchAttentionBackend()).step({"s": ids})["s"]


# --- presets ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_is_a_complete_hf_checkpoint(tmp_path: Path, preset: str) -> None:
    path = ensure_tiny_checkpoint(preset, tmp_path)
    assert path.name == preset_dir_name(preset)
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (path / name).is_file(), name
    model, config, tokenizer = load_model(path)
    assert config.vocab_size == tokenizer.vocab_size
    assert config.max_position_embeddings >= 2048
    assert config.dtype == torch.float32
    assert config.eos_token_ids == tokenizer.eos_token_ids
    assert tokenizer.token_to_id("<|im_end|>") in config.eos_token_ids
    if tokenizer.bos_token_id is not None:
        assert tokenizer.token_to_id("</s>") in config.eos_token_ids
    # Keep tests fast: tiny means tiny.
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    # No leftover temporary directories beside it.
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_preset_flags() -> None:
    from pagefleet.engine.model_config import ModelConfig

    def parse(preset: str) -> ModelConfig:
        return ModelConfig.from_dict({**PRESETS[preset], "vocab_size": 1024})

    llama = parse("tiny")
    assert llama.num_attention_heads > llama.num_key_value_heads  # GQA
    qwen2 = parse("tiny-qwen2")
    assert qwen2.attention_bias and qwen2.tie_word_embeddings
    qwen3 = parse("tiny-qwen3")
    assert qwen3.qk_norm and qwen3.head_dim != qwen3.hidden_size // qwen3.num_attention_heads
    llama3 = parse("tiny-llama3")
    assert llama3.rope_scaling is not None and llama3.rope_scaling["rope_type"] == "llama3"


def test_preset_is_written_once_and_identically(tmp_path: Path) -> None:
    a = ensure_tiny_checkpoint("tiny", tmp_path / "a")
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_checkpoint("tiny", tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    b = ensure_tiny_checkpoint("tiny", tmp_path / "b")
    assert _tree_digest(a) == _tree_digest(b)


def test_preset_is_deterministic_across_processes(tmp_path: Path) -> None:
    """Fresh interpreters (different tokenizer thread counts) write byte-identical files:
    the tokenizer training and the seeded weights depend on nothing else."""
    local = ensure_tiny_checkpoint("tiny-qwen2", tmp_path / "local")
    for threads in ("3",):
        root = tmp_path / f"proc{threads}"
        code = (
            "import sys; from pathlib import Path; "
            "from pagefleet.engine.tiny import ensure_tiny_checkpoint; "
            "print(ensure_tiny_checkpoint('tiny-qwen2', Path(sys.argv[1])))"
        )
        env = {**os.environ, "RAYON_NUM_THREADS": threads}
        out = subprocess.run(
            [sys.executable, "-c", code, str(root)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=120,
        )
        assert _tree_digest(Path(out.stdout.strip())) == _tree_digest(local)


def test_concurrent_writers_race_safely(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; "
        "from pagefleet.engine.tiny import ensure_tiny_checkpoint; "
        "print(ensure_tiny_checkpoint('tiny-mistral', Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1
    final = Path(outs[0])
    assert [p.name for p in tmp_path.iterdir()] == [final.name]
    load_model(final)


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown tiny preset"):
        ensure_tiny_checkpoint("tiny-gpt5")


def test_resolve_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEFLEET_CACHE", str(tmp_path / "cache"))
    path = resolve_model("tiny")
    assert path.is_relative_to(tmp_path / "cache")
    assert (path / "config.json").is_file()
    assert resolve_model(str(path)) == path
    with pytest.raises(FileNotFoundError, match=r"neither a checkpoint directory, a \.gguf"):
        resolve_model(str(tmp_path / "nope"))


# --- sharded checkpoints and dtypes ----------------------------------------------------


def test_sharded_round_trip(tmp_path: Path) -> None:
    cfg = dict(PRESETS["tiny"])
    single = write_random_checkpoint(tmp_path / "single", cfg, seed=3)
    sharded = write_random_checkpoint(tmp_path / "sharded", cfg, seed=3, num_shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (sharded / "model.safetensors").exists()
    # Same seed, same tensors, whatever the sharding.
    merged = {}
    for f in files:
        merged.update(load_file(str(sharded / f)))
    ref = load_file(str(single / "model.safetensors"))
    assert merged.keys() == ref.keys()
    assert all(torch.equal(merged[k], ref[k]) for k in ref)

    ids = list(range(3, 90))
    ours_sharded = _prefill_logits(sharded, ids)
    assert torch.equal(ours_sharded, _prefill_logits(single, ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32)
    with torch.no_grad():
        ref_logits = hf(torch.tensor([ids])).logits[0]
    assert (ours_sharded - ref_logits).abs().max().item() < 1e-4


def test_max_shard_bytes_caps_shards(tmp_path: Path) -> None:
    path = write_random_checkpoint(
        tmp_path / "m", dict(PRESETS["tiny-mistral"]), max_shard_bytes=200_000
    )
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for f in shards for t in load_file(str(path / f)).values()
    )
    load_model(path)


def test_bf16_checkpoint_loads_as_float32_on_cpu_by_default(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "bf16", dict(PRESETS["tiny"]), dtype="bfloat16")
    stored = load_file(str(path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, config, _ = load_model(path)  # auto
    assert config.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model, config, _ = load_model(path, dtype="bfloat16")
    assert config.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])


def test_fused_weights_hold_the_checkpoint_tensors(tiny_dir: Path) -> None:
    model, config, _ = load_model(tiny_dir)
    stored = load_file(str(tiny_dir / "model.safetensors"))
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([config.q_size, config.kv_size, config.kv_size])
    assert torch.equal(q, stored["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, stored["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, stored["model.layers.1.self_attn.v_proj.weight"])
    gate, up = model.model.layers[1].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, stored["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(up, stored["model.layers.1.mlp.up_proj.weight"])


def test_unknown_dtype(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_model(tiny_dir, dtype="float8")


# --- errors ----------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "absent")


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("config.json", "config.json not found"),
        ("model.safetensors", "no weights in"),
        ("tokenizer.json", "tokenizer.json not found"),
    ],
)
def test_missing_file(tiny_dir: Path, tmp_path: Path, remove: str, message: str) -> None:
    path = _copy(tiny_dir, tmp_path / "ckpt")
    (path / remove).unlink()
    with pytest.raises(FileNotFoundError, match=message):
        load_model(path)


def test_missing_shard(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "m", dict(PRESETS["tiny"]), num_shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002.*incomplete"):
        load_model(path)


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "ckpt")
    _edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_model(path)


def test_unsupported_rope_scaling(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "ckpt")
    _edit_config(path, rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'longrope'"):
        load_model(path)


def test_shape_mismatch(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "ckpt")
    _edit_config(path, intermediate_size=384)
    with pytest.raises(ValueError, match=r"shape mismatch for 'model\.layers\.0\.mlp\..*384"):
        load_model(path)


def test_missing_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\).*model\.norm\.weight") as err:
        load_model(path)
    assert "layers.2.self_attn.qkv_proj.weight#1" in str(err.value)


def test_unexpected_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "ckpt")
    _edit_config(path, num_hidden_layers=2)  # the checkpoint has 4 layers
    with pytest.raises(ValueError, match=r"'model\.layers\.2\..*has no place"):
        load_model(path)


def test_heads_must_divide(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "ckpt")
    _edit_config(path, num_key_value_heads=3)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads=3"):
        load_model(path)


def test_loads_what_transformers_saves(tmp_path: Path) -> None:
    """A checkpoint written by transformers' own save_pretrained (its config layout, e.g.
    rope_parameters and dtype, and its safetensors naming) loads to the same logits."""
    src = write_random_checkpoint(tmp_path / "src", dict(PRESETS["tiny-qwen3"]), seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    out = tmp_path / "saved"
    hf.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(out)
    ids = list(range(5, 60))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (_prefill_logits(out, ids) - ref).abs().max().item() < 1e-4


def test_sliding_window_caps_the_context_it_cannot_apply(tmp_path) -> None:
    from pagefleet.engine.config import EngineConfig
    from pagefleet.engine.engine import LLMEngine
    from pagefleet.engine.sampling_params import SamplingParams

    cfg = {**PRESETS["tiny-mistral"], "sliding_window": 64}
    path = write_random_checkpoint(tmp_path / "mistral-sw", cfg, seed=4)
    engine = LLMEngine(EngineConfig(model=str(path), num_gpu_blocks=64))
    # Within the window full attention is exact; past it the output would be wrong.
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("long", list(range(1, 80)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="sliding_window 64"):
        LLMEngine(EngineConfig(model=str(path), num_gpu_blocks=64, max_model_len=128))
