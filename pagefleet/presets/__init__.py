"""Named models (presets) seen from the torch-free side: where each one's tokenizer comes from.

The gateway, and anything else that must not load torch, turns a ``--model`` value into a
``Tokenizer`` with ``load_tokenizer``: a directory holding tokenizer.json is read as is; a
preset name is looked up in ``TOKENIZER_PRESETS``, whose entry names a torch-free function
that builds the very tokenizer the engine uses for that preset. A preset's weights are the
engine's business (engine/tiny.py writes the tiny checkpoints) and need torch.

Invariant: for every preset, ``load_tokenizer(name)`` encodes and renders chat templates
exactly as the daemon's tokenizer for ``--model name`` does; otherwise the gateway's block
keys never match the daemons' (tests/gateway/test_presets.py checks every preset).

Adding a preset whose tokenizer has no files on disk (e.g. a GGUF checkpoint, whose
tokenizer is in its metadata): write a function ``() -> pagefleet.tokenizer.Tokenizer`` in a
module under pagefleet/presets/ that imports neither torch nor pagefleet.engine
(import-linter fails ``make lint`` otherwise; reading the GGUF header with plain Python or
the ``gguf`` package is fine), add ``"name": "pagefleet.presets.<module>:<function>"`` to
``TOKENIZER_PRESETS``, and have the engine's loader get its tokenizer from the same
function, so both sides agree by construction.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import MappingProxyType

from pagefleet.tokenizer import Tokenizer

# name -> "module:function" returning the preset's Tokenizer; imported only when used.
TOKENIZER_PRESETS: MappingProxyType[str, str] = MappingProxyType(
    {
        "tiny": "pagefleet.presets.tiny_tokenizer:load_llama",
        "tiny-llama3": "pagefleet.presets.tiny_tokenizer:load_llama",
        "tiny-mistral": "pagefleet.presets.tiny_tokenizer:load_llama",
        "tiny-qwen2": "pagefleet.presets.tiny_tokenizer:load_qwen",
        "tiny-qwen3": "pagefleet.presets.tiny_tokenizer:load_qwen",
        "smollm2-135m": "pagefleet.presets.gguf_presets:load_smollm2_135m",
    }
)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer (with its chat template) of a checkpoint directory, a GGUF file or a
    preset name.

    Never imports torch. Raises FileNotFoundError naming the presets when ``spec`` is
    neither.
    """
    path = Path(spec).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return Tokenizer.from_dir(path)
    target = TOKENIZER_PRESETS.get(spec)
    if target is None:
        raise FileNotFoundError(
            f"model {spec!r} is neither a checkpoint directory nor a preset "
            f"({', '.join(sorted(TOKENIZER_PRESETS))}); pass the model's directory"
        )
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)()
