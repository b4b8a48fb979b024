"""Load a checkpoint into our model, plus its tokenizer.

Two formats. A Hugging Face directory holds config.json, model.safetensors or shards named
by model.safetensors.index.json, and tokenizer.json/tokenizer_config.json; tensors stream
from the memory-mapped safetensors files. A GGUF file (or a directory holding exactly one)
carries config, tokenizer and chat template in its metadata; its tensors are dequantized
(see ``gguf_loader``). Either way tensors go straight into the (already allocated) fused
parameters, converted to the run dtype one tensor at a time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from pagefleet.engine.cpu_layout import column_major_linear_weights, pack_linear_weights
from pagefleet.engine.model_config import ModelConfig, read_json_file, resolve_dtype
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
        weight_map = read_json_file(index, "the model's " + SAFETENSORS_INDEX).get("weight_map")
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(v, str) for v in weight_map.values())
        ):
            raise ValueError(
                f"{index} has no weight_map naming the shard of each tensor: the file is "
                "damaged; download it again"
            )
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


def unreadable(path: Path, what: str) -> PermissionError:
    """The error for a model file or directory this process may not read: names the uid,
    since in a pod the files were usually written by another user (root, a download job)."""
    return PermissionError(
        f"cannot read {what} {path}: permission denied for this process (uid {os.getuid()}); "
        "make the model files readable by the daemon's user (e.g. chmod -R a+rX on the model "
        "directory, or fsGroup in the pod's securityContext)"
    )


def check_model_dir(path: Path) -> None:
    """Raise the permission error of a directory that cannot be listed: the checks that
    follow would otherwise fail on its first file with an errno and no advice."""
    try:
        next(os.scandir(path), None)
    except PermissionError:
        raise unreadable(path, "model directory") from None


def check_checkpoint_files(files: list[Path]) -> set[str]:
    """Open every safetensors file and parse its header before anything is allocated: a
    truncated or damaged shard then fails at once, named, instead of as safetensors' bare
    "incomplete metadata, file not fully covered" (or, for a file this process may not
    read, "No such file or directory") after the model was built. Returns the names of
    all tensors."""
    from safetensors import SafetensorError, safe_open

    names: set[str] = set()
    for file in files:
        try:
            with open(file, "rb") as fh:
                fh.read(8)
        except PermissionError:
            raise unreadable(file, "weights file") from None
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names.update(f.keys())
        except (SafetensorError, OSError) as exc:
            raise ValueError(
                f"{file} is not a valid safetensors file ({exc}): it is truncated or damaged "
                "(an interrupted download?); download it again"
            ) from None
    return names


def iter_checkpoint_tensors(
    path: Path, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, read lazily file by file onto ``device``."""
    from safetensors import SafetensorError, safe_open

    # On CUDA, safetensors copies each tensor straight to the device (no host staging).
    load_device = str(device) if torch.device(device).type == "cuda" else "cpu"
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device=load_device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError) as exc:
                    raise ValueError(
                        f"reading tensor {name!r} from {file} failed ({exc}): the file is "
                        "damaged or its storage failed; download it again"
                    ) from None
                yield name, tensor


def check_finite(name: str, original: torch.Tensor, loaded: torch.Tensor, source: Path) -> None:
    """Raise for a tensor with NaN or Inf values: a model with one serves NaN logits,
    i.e. garbage or a crash in sampling, for every request that touches it. ``original``
    is the tensor as stored, ``loaded`` the same in the run dtype: the second can overflow
    where the first did not (a bfloat16 checkpoint run in float16)."""
    if not loaded.is_floating_point():
        return
    # A NaN or an Inf makes the fp32 sum NaN or Inf, so a finite sum proves the tensor
    # finite, 7-10x cheaper on a CPU than isfinite().all() (a bool written per element).
    # Only a non-finite sum (or one that overflowed) pays for the exact check.
    if bool(torch.isfinite(loaded.sum(dtype=torch.float32))):
        return
    if bool(torch.isfinite(loaded).all()):
        return
    if original.is_floating_point() and bool(torch.isfinite(original).all()):
        raise ValueError(
            f"tensor {name!r} of {source} overflows {loaded.dtype} (values beyond its range, "
            f"up to {original.abs().max().item():.3g}); run with --dtype bfloat16 or float32"
        )
    raise ValueError(
        f"tensor {name!r} of {source} holds NaN or Inf values: the checkpoint is damaged "
        "(or was saved from a diverged training run); download it again or use another one"
    )


def check_vocabulary(tokenizer: Tokenizer, config: ModelConfig, source: Path) -> None:
    """The tokenizer must fit the model's embedding. Ordinary tokens past ``vocab_size``
    mean the tokenizer belongs to another model: nearly every prompt would be refused
    (its ids index past the embedding). Special tokens past it (a pad token added after
    training, without resizing the embedding) only refuse prompts that spell them out,
    so they are a warning."""
    if tokenizer.vocab_size <= config.vocab_size:
        return
    beyond = range(config.vocab_size, tokenizer.vocab_size)
    ordinary = [i for i in beyond if i not in tokenizer.all_special_ids]
    if not ordinary:
        logger.warning(
            "tokenizer of %s has special token(s) %s beyond the model's vocab_size %d; "
            "prompts containing them will be refused",
            source,
            tokenizer.convert_ids_to_tokens(list(beyond))[:8],
            config.vocab_size,
        )
        return
    shown = tokenizer.convert_ids_to_tokens(ordinary[:3])
    raise ValueError(
        f"the tokenizer of {source} has {tokenizer.vocab_size} tokens but the model's "
        f"vocab_size is {config.vocab_size} (tokens such as {shown} have no embedding): the "
        "tokenizer files and config.json belong to different models; use the tokenizer "
        "that came with these weights"
    )


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
    if path.is_dir():
        check_model_dir(path)
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
        config = ModelConfig.from_dict(cfg, source=f"{gguf_file} metadata")
        tokenizer = build_tokenizer(fields)
        run_dtype = resolve_dtype(dtype, config.dtype, device)

        def tensors(target: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in gguf_loader.iter_gguf_tensors(reader, cfg, run_dtype):
                loaded = t.to(device=target)
                check_finite(name, loaded, loaded, gguf_file)
                yield name, loaded

        source = gguf_file
    else:
        config = ModelConfig.from_dir(path)
        tokenizer = Tokenizer.from_dir(path)
        stored = check_checkpoint_files(checkpoint_files(path))
        if config.tie_word_embeddings and "lm_head.weight" in stored:
            # The config says tied, the weights carry their own head. transformers then
            # loads the head untied (when it differs from the embedding), and it is the
            # oracle: skipping the stored head served other logits than it does.
            logger.warning(
                "%s ties word embeddings but the checkpoint holds its own lm_head.weight: "
                "loading it untied, as transformers does (set tie_word_embeddings to false "
                "in config.json to silence this)",
                path / "config.json",
            )
            config.tie_word_embeddings = False
        run_dtype = resolve_dtype(dtype, config.dtype, device)

        def tensors(target: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in iter_checkpoint_tensors(path, target):
                loaded = t.to(device=target, dtype=run_dtype)
                check_finite(name, t, loaded, path)
                yield name, loaded

        source = path
    check_vocabulary(tokenizer, config, source)
    config.dtype = run_dtype
    if not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)

    model_cls = get_model_class(config)
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        # Else torch's "Found no NVIDIA driver on your system ..." from the first
        # allocation, which says nothing about the flag or the pod.
        raise RuntimeError(
            f"device {device!r} was asked for but this process sees no CUDA GPU "
            "(torch.cuda.is_available() is false): give the pod a GPU (nvidia.com/gpu "
            "limit, NVIDIA driver and runtime) or run with --device cpu"
        )
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
