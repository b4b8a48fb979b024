"""What a user gets for a broken checkpoint: an error that names the file or field at fault
and says what to do, raised before the model is built or served.

Each case damages a copy of a seeded tiny checkpoint (or a GGUF file written here) the way
downloads and hand edits break in practice; the daemon-level view of the same errors (exit
status, termination log, nothing left running) is tests/daemon/test_startup_errors.py.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.loader import load_model
from pagefleet.engine.model_config import ModelConfig
from pagefleet.engine.tiny import PRESETS, checkpoint_tensor_shapes, write_random_checkpoint
from pagefleet.kernels.torch_ref import TorchAttentionBackend
from pagefleet.testing.gguf_writer import gpt2_vocab, write_llama_gguf
from pagefleet.testing.paged_run import PagedSequenceRunner

# A short context keeps the engine cases cheap (KV pool and RoPE tables of 64 positions).
SMALL = {**PRESETS["tiny"], "num_hidden_layers": 2, "max_position_embeddings": 64}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", SMALL, seed=7)


@pytest.fixture
def ckpt(small_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the small checkpoint to damage."""
    return Path(shutil.copytree(small_dir, tmp_path / "ckpt"))


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), {"format": "pt"})


# --- weights files ------------------------------------------------------------------------


def test_truncated_safetensors_is_named_with_the_fix(ckpt: Path) -> None:
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(ValueError, match="not a valid safetensors file") as err:
        load_model(ckpt)
    assert str(file) in str(err.value) and "download it again" in str(err.value)


def test_damaged_safetensors_header_is_named(ckpt: Path) -> None:
    file = ckpt / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:40] = b"\xff" * 32
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a valid safetensors file") as err:
        load_model(ckpt)
    assert str(file) in str(err.value)


def test_a_damaged_later_shard_fails_before_the_model_is_built(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "m", SMALL, num_shards=3)
    last = path / "model-00003-of-00003.safetensors"
    last.write_bytes(last.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model-00003-of-00003\.safetensors is not a valid"):
        load_model(path)


def test_index_without_weight_map_is_named(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "m", SMALL, num_shards=2)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"index\.json has no weight_map"):
        load_model(path)


@pytest.mark.parametrize(
    ("tensor", "value"),
    [
        ("model.layers.1.mlp.up_proj.weight", float("nan")),
        ("model.embed_tokens.weight", float("-inf")),
    ],
)
def test_nan_or_inf_weights_are_refused(ckpt: Path, tensor: str, value: float) -> None:
    def poison(t: dict[str, torch.Tensor]) -> None:
        t[tensor][3, 5] = value  # 1e40 is inf in float32

    _edit_tensors(ckpt, poison)
    with pytest.raises(ValueError, match="holds NaN or Inf values") as err:
        load_model(ckpt)
    assert repr(tensor) in str(err.value)


def test_weights_that_overflow_the_run_dtype_say_which_dtype_to_use(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "bf16", SMALL, dtype="bfloat16")

    def big(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6  # fine in bf16, inf in fp16

    _edit_tensors(path, big)
    with pytest.raises(ValueError, match=r"overflows torch\.float16.*--dtype bfloat16"):
        load_model(path, dtype="float16")
    _, config, _ = load_model(path, dtype="bfloat16")
    assert config.dtype == torch.bfloat16


# --- config.json --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", "big"),
        ("num_hidden_layers", None),
        ("num_attention_heads", 4.5),  # int() used to truncate it to 4 and serve on
        ("num_key_value_heads", 0),
        ("intermediate_size", -1),
        ("rms_norm_eps", [1e-6]),
        ("rope_theta", "1e4"),
        ("tie_word_embeddings", "false"),  # bool("false") is True
        ("attention_bias", 1),
    ],
)
def test_mistyped_config_field_is_named(ckpt: Path, field: str, value: object) -> None:
    _edit_config(ckpt, **{field: value})
    with pytest.raises(ValueError, match=rf"config\.json: {field} must be") as err:
        load_model(ckpt)
    assert repr(value) in str(err.value)


def test_missing_config_field_names_file_and_field(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["intermediate_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json lacks required fields \['intermediate"):
        load_model(ckpt)


def test_config_that_is_not_json_is_named(ckpt: Path) -> None:
    (ckpt / "config.json").write_text('{"hidden_size": 128,')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON .*line 1") as err:
        load_model(ckpt)
    assert str(ckpt / "config.json") in str(err.value)


def test_hidden_size_must_split_into_heads(ckpt: Path) -> None:
    _edit_config(ckpt, hidden_size=130)
    with pytest.raises(ValueError, match="hidden_size=130 is not a multiple of num_attention"):
        load_model(ckpt)


def test_quantized_torch_dtype_is_explained(ckpt: Path) -> None:
    _edit_config(ckpt, torch_dtype="int8")
    with pytest.raises(ValueError, match="torch_dtype 'int8' is not a floating-point type"):
        load_model(ckpt)


@pytest.mark.parametrize(
    ("scaling", "lacks"),
    [
        ({"rope_type": "linear"}, "factor"),
        ({"type": "yarn", "original_max_position_embeddings": 32}, "factor"),
        ({"rope_type": "llama3", "factor": 8.0}, "original_max_position_embeddings"),
    ],
)
def test_incomplete_rope_scaling_is_named(ckpt: Path, scaling: dict, lacks: str) -> None:
    _edit_config(ckpt, rope_scaling=scaling)
    with pytest.raises(ValueError, match=rf"rope_scaling of type '\w+' lacks {lacks}"):
        load_model(ckpt)


def test_eos_outside_the_vocabulary_is_refused() -> None:
    base = {**SMALL, "vocab_size": 1024}
    with pytest.raises(ValueError, match=r"eos_token_id \[5000\] is outside the vocabulary"):
        ModelConfig.from_dict({**base, "eos_token_id": 2}, {"eos_token_id": [2, 5000]})


# --- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_of_another_model_is_refused(tmp_path: Path) -> None:
    """vocab_size 100 beside a 1024-token tokenizer: the daemon used to start and then
    refuse nearly every prompt (ids past the embedding)."""
    path = write_random_checkpoint(tmp_path / "m", {**SMALL, "vocab_size": 100})
    with pytest.raises(ValueError, match="has 1024 tokens but the model's vocab_size is 100"):
        load_model(path)


def test_special_tokens_past_the_embedding_only_warn(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pad token added after training, without resizing the embedding: only prompts
    that spell it out are refused, so the model still serves."""
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok["added_tokens"].append(
        {"id": 1024, "content": "<pad_extra>", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
    )  # fmt: skip
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    with caplog.at_level(logging.WARNING, logger="pagefleet.engine.loader"):
        _, config, tokenizer = load_model(ckpt)
    assert tokenizer.vocab_size == 1025 and config.vocab_size == 1024
    assert "<pad_extra>" in caplog.text and "beyond the model's vocab_size 1024" in caplog.text


# --- tied embeddings ----------------------------------------------------------------------


def test_tied_config_with_its_own_head_loads_as_transformers_does(ckpt: Path) -> None:
    """tie_word_embeddings true, but the weights carry a separate lm_head.weight:
    transformers (the oracle) then keeps the head; the loader used to drop it and serve
    the embedding as the head, i.e. other logits."""
    _edit_config(ckpt, tie_word_embeddings=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    ids = list(range(5, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    model, config, _ = load_model(ckpt)
    assert not config.tie_word_embeddings and model.lm_head is not None
    ours = PagedSequenceRunner(model, config, TorchAttentionBackend()).step({"s": ids})["s"]
    assert (ours - ref).abs().max().item() < 1e-4


# --- context length and KV pool -----------------------------------------------------------


def test_max_model_len_past_the_models_positions_is_refused(small_dir: Path) -> None:
    """Positions past max_position_embeddings have no RoPE row: a long prompt used to end
    the engine with an IndexError (a device-side assert on a GPU)."""
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 64"):
        LLMEngine(EngineConfig(model=str(small_dir), num_gpu_blocks=64, max_model_len=512))
    engine = LLMEngine(EngineConfig(model=str(small_dir), num_gpu_blocks=64, max_model_len=64))
    assert engine.max_model_len == 64


def test_explicit_max_model_len_that_the_kv_pool_cannot_hold_is_refused(
    small_dir: Path,
) -> None:
    with pytest.raises(ValueError, match=r"max_model_len 64 does not fit the KV pool.*2 blocks"):
        LLMEngine(
            EngineConfig(model=str(small_dir), block_size=16, num_gpu_blocks=2, max_model_len=64)
        )
    # Without an explicit length the model's own maximum is capped to the pool, as before.
    engine = LLMEngine(EngineConfig(model=str(small_dir), block_size=16, num_gpu_blocks=2))
    assert engine.max_model_len == 32


# --- GGUF ---------------------------------------------------------------------------------


def _gguf(path: Path, **kw: object) -> Path:
    tokens, types, merges = gpt2_vocab(["the", "cat"])
    cfg = {**SMALL, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
           "vocab_size": len(tokens)}  # fmt: skip
    rng = np.random.default_rng(0)
    state = {
        n: (0.2 * rng.standard_normal(s)).astype(np.float32)
        for n, s in checkpoint_tensor_shapes(ModelConfig.from_dict(cfg)).items()
    }
    write_llama_gguf(path, cfg, state, "F32", tokens, types, merges, **kw)  # type: ignore[arg-type]
    return path


def test_truncated_gguf_is_named(tmp_path: Path) -> None:
    file = _gguf(tmp_path / "m.gguf")
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"m\.gguf is not a GGUF file pagefleet can read"):
        load_model(file)


def test_garbage_gguf_is_named(tmp_path: Path) -> None:
    file = tmp_path / "junk.gguf"
    file.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(ValueError, match=r"junk\.gguf is not a GGUF file .*download it again"):
        load_model(file)


def test_gguf_rope_scaling_without_factor_is_named(tmp_path: Path) -> None:
    file = _gguf(tmp_path / "m.gguf", extra_fields={"llama.rope.scaling.type": "linear"})
    with pytest.raises(ValueError, match=r"m\.gguf metadata: rope_scaling .* lacks factor"):
        load_model(file)


def test_kv_budget_below_one_block_names_the_flags(tmp_path: Path) -> None:
    """The message was "a KV budget of 1048576 bytes holds no KV block (4194304 bytes
    each); raise it or set num_gpu_blocks": engine field names, not the daemon's flags."""
    wide = {**SMALL, "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8,
            "head_dim": 256, "num_hidden_layers": 16}  # fmt: skip  # 4 MiB per fp32 block
    path = write_random_checkpoint(tmp_path / "wide", wide)
    with pytest.raises(ValueError, match=r"1\.0 MiB holds no KV block .*4\.0 MiB each") as err:
        LLMEngine(EngineConfig(model=str(path), kv_cache_memory_bytes=1 << 20))
    assert "--kv-cache-memory-mb" in str(err.value) and "--num-gpu-blocks" in str(err.value)


@pytest.mark.parametrize(("key", "value"), [("attention.head_count", 0), ("block_count", [1])])
def test_gguf_bad_shape_metadata_is_named(key: str, value: object) -> None:
    from pagefleet.engine.gguf_loader import config_dict

    fields = {
        "general.architecture": "llama",
        "llama.embedding_length": 256,
        "llama.block_count": 1,
        "llama.attention.head_count": 4,
        "llama.feed_forward_length": 512,
        f"llama.{key}": value,
    }
    with pytest.raises(ValueError, match=rf"GGUF metadata llama\.{key} is "):
        config_dict(fields, set())
