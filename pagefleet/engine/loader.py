"""Load a Hugging Face checkpoint directory into our model, plus its tokenizer.

A directory holds config.json, model.safetensors or shards named by
model.safetensors.index.json, and tokenizer.json/tokenizer_config.json. Tensors stream
from the memory-mapped safetensors files straight into the (already allocated) fused
parameters, converted to the run dtype one tensor at a time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from pagefleet.engine.model_config import ModelConfig, resolve_dtype
from pagefleet.engine.models import CausalLM, get_model_class
from pagefleet.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in a stable order."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} names shard(s) {missing} that are not in {path}: the download is "
                "incomplete; fetch the missing files again"
            )
        return files
    single = path / SAFETENSORS_SINGLE
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(
        f"no weights in {path}: expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} with its "
        "shards (pagefleet reads safetensors only; convert *.bin checkpoints first)"
    )


def iter_checkpoint_tensors(
    path: Path, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, read lazily file by file onto ``device``."""
    from safetensors import safe_open

    # On CUDA, safetensors copies each tensor straight to the device (no host staging).
    load_device = str(device) if torch.device(device).type == "cuda" else "cpu"
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device=load_device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)


def load_model(
    path: str | Path, dtype: str = "auto", device: str = "cpu"
) -> tuple[CausalLM, ModelConfig, Tokenizer]:
    """Build the model for ``path``'s config.json, fill every weight, return it in eval mode.

    Raises FileNotFoundError for a missing file and ValueError for an unsupported
    architecture, a tensor whose shape disagrees with config.json, or missing tensors.
    ``config.dtype`` is set to the dtype the model runs in.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {path} does not exist: pass a Hugging Face checkpoint directory "
            "or a tiny preset name (tiny, tiny-qwen2, tiny-qwen3, tiny-llama3)"
        )
    config = ModelConfig.from_dir(path)
    run_dtype = resolve_dtype(dtype, config.dtype, device)
    config.dtype = run_dtype
    tokenizer = Tokenizer.from_dir(path)
    if not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)

    model_cls = get_model_class(config)
    target = torch.device(device)
    with torch.device("meta"):
        model = model_cls(config)
    # Cast on meta (free), then allocate real storage once, directly in the run dtype: an
    # 8B model never exists in fp32. RoPE tables are rebuilt after to_empty wiped them.
    model = model.to(dtype=run_dtype).to_empty(device=target)
    model.model.rotary_emb.reset_cache(target)

    loaded = model.load_weights(
        (name, t.to(device=target, dtype=run_dtype))
        for name, t in iter_checkpoint_tensors(path, target)
    )
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(
            f"checkpoint {path} lacks {len(missing)} tensor(s) the config requires: {shown}. "
            "Is the download complete and does config.json belong to these weights?"
        )
    model.eval()
    logger.info(
        "loaded %s (%d layers, hidden %d) from %s as %s on %s",
        config.architecture,
        config.num_hidden_layers,
        config.hidden_size,
        path,
        run_dtype,
        target,
    )
    return model, config, tokenizer


def resolve_model(spec: str) -> Path:
    """``"tiny*"`` -> the preset's cached checkpoint (written on first use); else a directory."""
    from pagefleet.engine.tiny import PRESETS, ensure_tiny_checkpoint

    if spec in PRESETS:
        return ensure_tiny_checkpoint(spec)
    path = Path(spec).expanduser()
    if not path.is_dir():
        hint = ", ".join(sorted(PRESETS))
        raise FileNotFoundError(
            f"model {spec!r} is neither a checkpoint directory nor a tiny preset ({hint}); "
            "download the model (e.g. huggingface-cli download) and pass its directory"
        )
    return path
