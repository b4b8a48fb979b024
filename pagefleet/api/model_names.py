"""The name a model is served under when no ``--served-model-name`` is given.

Invariant: the daemon, the gateway and ``pagefleet up`` all default through
``default_served_model_name``, so a fleet started from the same ``--model`` value agrees on
the one name its clients send (the gateway refuses any other with a 404) and on the
block-key namespace that defaults to it. Torch-free and filesystem-free: a gateway pod
computes the same name as a daemon pod without seeing the daemon's files.
"""

from __future__ import annotations

from pathlib import PurePath

GGUF_SUFFIX = ".gguf"


def default_served_model_name(model: str) -> str:
    """``model`` as given, except a ``.gguf`` file path, served under the file's stem.

    A preset name (``smollm2-135m``) and a checkpoint directory (served under its path, as
    vLLM does) stay as they are. A GGUF path such as ``/models/Qwen2.5-0.5B.Q4_K_M.gguf``
    becomes ``Qwen2.5-0.5B.Q4_K_M``: clients should not have to send a file path of the
    server's disk as their model name."""
    path = PurePath(model)
    # Case as the loaders match it: a file they would not read as GGUF keeps its name.
    if path.suffix == GGUF_SUFFIX and path.stem:
        return path.stem
    return model
