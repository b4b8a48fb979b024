"""Load a checkpoint into our model, plus its tokenizer.

Two formats. A Hugging Face directory holds config.json, model.safetensors or shards named
by model.safetensors.index.json, and tokenizer.json/tokenizer_config.json; tensors stream
from the memory-mapped safetensors files. A GGUF file (or a directory holding exactly one)
carries config, tokenizer and chat template in its metadata; its tensors are dequantized
(see ``gguf_loader``). Either way tensors go straight into the (already allocated) fused
parameters, converted to the run dtype one tensor at a time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from pagefleet.engine.cpu_layout import column_major_linear_weights, pack_linear_weights
from pagefleet.engine.model_config import ModelConfig, resolve_dtype
from pagefleet.engine.models import CausalLM, get_model_class
from pagefleet.gguf_tokenizer import find_gguf_file
from pagefleet.kernels import mkl_packed
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
    """Build the model for the checkpoint at ``path``, fill every weight, return it in eval
    mode. ``path`` is a Hugging Face directory, a ``.gguf`` file, or a directory holding one.

    Raises FileNotFoundError for a missing file and ValueError for an unsupported
    architecture or quantization type, a tensor whose shape disagrees with the config, or
    missing tensors. ``config.dtype`` is set to the dtype the model runs in.
    """
    path = Path(path)
    gguf_file = find_gguf_file(path)
    if gguf_file is None and not path.is_dir():
        raise FileNotFoundError(
            f"model {path} does not exist: pass a Hugging Face checkpoint directory, a .gguf "
            "file, or a preset name (tiny, tiny-qwen2, tiny-qwen3, tiny-llama3, smollm2-135m)"
        )
    if gguf_file is not None:
        from pagefleet.engine import gguf_loader
        from pagefleet.gguf_tokenizer import build_tokenizer, read_fields

        reader = gguf_loader.open_gguf(gguf_file)
        fields = read_fields(reader)
        names = {t.name for t in reader.tensors}
        cfg = gguf_loader.config_dict(fields, names)
        gguf_loader.check_tensor_types(reader)
        config = ModelConfig.from_dict(cfg)
        tokenizer = build_tokenizer(fields)
        run_dtype = resolve_dtype(dtype, config.dtype, device)

        def tensors(target: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in gguf_loader.iter_gguf_tensors(reader, cfg, run_dtype):
                yield name, t.to(device=target)

        source = gguf_file
    else:
        config = ModelConfig.from_dir(path)
        tokenizer = Tokenizer.from_dir(path)
        run_dtype = resolve_dtype(dtype, config.dtype, device)

        def tensors(target: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in iter_checkpoint_tensors(path, target):
                yield name, t.to(device=target, dtype=run_dtype)

        source = path
    config.dtype = run_dtype
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

    loaded = model.load_weights(tensors(target))
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(
            f"checkpoint {source} lacks {len(missing)} tensor(s) the config requires: {shown}. "
            "Is the download complete and does the config belong to these weights?"
        )
    model.eval()
    if target.type == "cpu":
        # Decode-sized GEMMs without MKL's per-call weight re-pack (kernels/mkl_packed.py);
        # packed first, straight from the loaded weights, which are then freed.
        pack_linear_weights(model, mkl_packed.load())
        column_major_linear_weights(model)  # the rest: faster small-row GEMMs (cpu_layout.py)
    logger.info(
        "loaded %s (%d layers, hidden %d) from %s as %s on %s",
        config.architecture,
        config.num_hidden_layers,
        config.hidden_size,
        source,
        run_dtype,
        target,
    )
    return model, config, tokenizer


def resolve_model(spec: str) -> Path:
    """``"tiny*"`` -> the preset's cached checkpoint (written on first use); a GGUF preset
    (``smollm2-135m``) -> its file in the installed package; else a directory or a .gguf."""
    from pagefleet.engine.tiny import PRESETS, ensure_tiny_checkpoint
    from pagefleet.presets.gguf_presets import GGUF_PRESETS, gguf_preset_path

    if spec in PRESETS:
        return ensure_tiny_checkpoint(spec)
    preset = gguf_preset_path(spec)
    if preset is not None:
        return preset
    path = Path(spec).expanduser()
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        hint = ", ".join([*sorted(PRESETS), *GGUF_PRESETS])
        raise FileNotFoundError(
            f"model {spec!r} is neither a checkpoint directory, a .gguf file nor a preset "
            f"({hint}); download the model (e.g. huggingface-cli download) and pass its path"
        )
    return path
