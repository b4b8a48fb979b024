"""Engine factories for tests of the engine process (module-level: pickled by reference)."""

from __future__ import annotations

import sys
import types
from typing import Any


def unreadable_engine_factory(config: Any, event_sink: Any) -> Any:
    """The daemon's engine, whose tokenizer is of a class only the engine process has: the
    HTTP process cannot unpickle its "ready" message (as after a partial upgrade)."""
    from pagefleet.daemon.app import default_engine_factory

    engine = default_engine_factory(config, event_sink)
    module = types.ModuleType("pagefleet_ghost_module")

    class Ghost:
        pass

    Ghost.__module__ = module.__name__
    Ghost.__qualname__ = "Ghost"
    module.Ghost = Ghost  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    engine.tokenizer = Ghost()
    return engine
