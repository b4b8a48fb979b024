"""Tiny presets: seeded random checkpoints in the Hugging Face format, with a real tokenizer.

``ensure_tiny_checkpoint("tiny")`` writes (once) a directory that looks exactly like a
downloaded model — config.json, generation_config.json, safetensors, tokenizer files — so
tests, benchmarks and the local fleet always run the same loader as production.
``write_random_checkpoint`` makes one of any shape (e.g. Llama-3-8B-shaped on a GPU),
generating each tensor on the fly in the target dtype and writing it shard by shard.

Weights use a larger init scale than usual (std 0.2) so that the next token is decided by
a clear margin: harmless float reordering between implementations must not flip a
near-tie.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from pagefleet.engine.model_config import ModelConfig, parse_dtype
from pagefleet.presets import tiny_tokenizer

logger = logging.getLogger(__name__)

# Bump when preset shapes, init or file layout change: it names the cache directory, so
# old caches are simply ignored.
CHECKPOINT_VERSION = 1
DEFAULT_STD = 0.2
DEFAULT_SEED = 1234

_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "initializer_range": DEFAULT_STD,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "torch_dtype": "float32",
    "attention_dropout": 0.0,
}


def _preset(**kw: Any) -> MappingProxyType:
    return MappingProxyType({**_COMMON, **kw})


PRESETS: MappingProxyType = MappingProxyType(
    {
        # Llama with GQA (4 query heads share 2 KV heads).
        "tiny": _preset(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_theta=10000.0,
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
        ),
        # Qwen2: q/k/v bias, tied embeddings, large rope base.
        "tiny-qwen2": _preset(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            hidden_size=128,
            intermediate_size=320,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=3,
        ),
        # Qwen3: per-head q/k RMSNorm and a head_dim that is not hidden/heads.
        "tiny-qwen3": _preset(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=48,
            max_position_embeddings=4096,
            rope_theta=1000000.0,
            attention_bias=False,
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=3,
        ),
        # Llama 3 with its frequency-dependent rope scaling.
        "tiny-llama3": _preset(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=True,
        ),
        # Mistral: Llama layout under its own architecture name.
        "tiny-mistral": _preset(
            architectures=["MistralForCausalLM"],
            model_type="mistral",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_theta=10000.0,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
    }
)


def default_root() -> Path:
    """``$PAGEFLEET_CACHE/models`` or ``~/.cache/pagefleet/models``."""
    base = os.environ.get("PAGEFLEET_CACHE")
    return Path(base) / "models" if base else Path.home() / ".cache" / "pagefleet" / "models"


def checkpoint_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Llama-family checkpoint for ``config``, in order."""
    c = config
    h, d = c.hidden_size, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    o_bias = c.attention_bias and c.architecture != "Qwen2ForCausalLM"
    mlp_bias = bool(c.raw.get("mlp_bias", False))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, h)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        shapes[p + "self_attn.o_proj.weight"] = (h, c.q_size)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
        if mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (c.intermediate_size,)
            shapes[p + "mlp.up_proj.bias"] = (c.intermediate_size,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def _random_tensor(
    name: str,
    shape: tuple[int, ...],
    seed: int,
    std: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    # Seeded per tensor name, so values do not depend on sharding or write order.
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    is_norm = name.endswith("norm.weight")
    if is_norm:
        # Around 1 but not exactly: a loader that skipped a norm weight would show.
        t = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        return t.mul_(0.1).add_(1.0)
    t = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    return t.mul_(std * 0.5 if name.endswith(".bias") else std)


def _plan_shards(
    shapes: dict[str, tuple[int, ...]],
    itemsize: int,
    max_shard_bytes: int | None,
    num_shards: int | None,
) -> list[list[str]]:
    sizes = {n: itemsize * int(torch.Size(s).numel()) for n, s in shapes.items()}
    if num_shards is not None and num_shards > 1:
        # Even split by bytes: a tensor goes to the shard where its first byte falls.
        total = sum(sizes.values())
        split: list[list[str]] = [[] for _ in range(num_shards)]
        offset = 0
        for name, nbytes in sizes.items():
            split[min(num_shards - 1, offset * num_shards // total)].append(name)
            offset += nbytes
        return [s for s in split if s]
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_random_checkpoint(
    path: str | Path,
    config_dict: dict[str, Any],
    seed: int = DEFAULT_SEED,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    std: float = DEFAULT_STD,
    max_shard_bytes: int | None = 4 << 30,
    num_shards: int | None = None,
    write_tokenizer: bool = True,
    tokenizer_style: str | None = None,
) -> Path:
    """Write a complete HF checkpoint directory with seeded random weights into ``path``.

    ``config_dict`` is a config.json body; missing ``vocab_size``/token ids come from the
    tiny tokenizer (written alongside when ``write_tokenizer``; Qwen-style for qwen model
    types unless ``tokenizer_style`` says otherwise). The same name and seed give
    the same tensor whatever the sharding. Tensors are generated one shard at a time on
    ``device`` in ``dtype`` (default: the config's torch_dtype), so peak memory is one
    shard. ``num_shards`` splits evenly by bytes; otherwise ``max_shard_bytes`` caps each shard
    (None: one file).
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(config_dict)
    if write_tokenizer:
        style = tokenizer_style or (
            "qwen" if str(cfg.get("model_type", "")).startswith("qwen") else "llama"
        )
        ids = tiny_tokenizer.write_tokenizer_files(path, style)
        cfg.setdefault("vocab_size", ids["vocab_size"])
        cfg.setdefault("bos_token_id", ids["bos"])
        cfg.setdefault("eos_token_id", ids["eos"])
        cfg.setdefault("pad_token_id", ids["pad"])
        eos_ids = ids["eos_ids"]
    else:
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    store_dtype = parse_dtype(dtype if dtype is not None else cfg.get("torch_dtype", "float32"))
    cfg["torch_dtype"] = str(store_dtype).removeprefix("torch.")
    config = ModelConfig.from_dict(cfg)
    shapes = checkpoint_tensor_shapes(config)
    itemsize = torch.empty((), dtype=store_dtype).element_size()
    shards = _plan_shards(shapes, itemsize, max_shard_bytes, num_shards)
    dev = torch.device(device)

    weight_map: dict[str, str] = {}
    total_size = 0
    for k, names in enumerate(shards):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {
            n: _random_tensor(n, shapes[n], seed, std, store_dtype, dev).contiguous() for n in names
        }
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
        # safetensors serialises from CPU memory; move shard by shard.
        save_file({n: t.cpu() for n, t in tensors.items()}, str(path / fname), {"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys(names, fname))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    gen_cfg = {
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": eos_ids,
        "do_sample": False,
    }
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return path


def preset_dir_name(preset: str) -> str:
    return f"{preset}-v{CHECKPOINT_VERSION}.{tiny_tokenizer.TOKENIZER_VERSION}"


def ensure_tiny_checkpoint(preset: str = "tiny", root: Path | None = None) -> Path:
    """The directory of ``preset``'s checkpoint, writing it first if it is not there.

    Written into a temporary sibling and renamed into place, so concurrent callers (several
    daemons, pytest workers) never see a half-written directory: whoever renames first
    wins, the others discard their copy.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}: choose one of {', '.join(PRESETS)}")
    root = Path(root) if root is not None else default_root()
    final = root / preset_dir_name(preset)
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        write_random_checkpoint(tmp, dict(PRESETS[preset]), seed=DEFAULT_SEED)
        try:
            os.rename(tmp, final)
            logger.info("wrote tiny checkpoint %s", final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            # Another process won the race; its directory is identical.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
