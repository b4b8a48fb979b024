"""Runtime entry points load neither torch nor the engine package.

Each import runs in a fresh interpreter, since this test process has loaded torch long ago.
import-linter (``make lint``) checks the static import graph; this checks what really gets
loaded, including imports done at run time by the CLI's lazy subcommands.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# module to import, or the CLI argv to run ("--help" paths load each subcommand's module)
ENTRY_POINTS = [
    ("import", "pagefleet.api"),
    ("import", "pagefleet.kvindex"),
    ("import", "pagefleet.presets"),
    ("import", "pagefleet.cli"),
    ("import", "pagefleet.gateway.cli"),
    ("import", "pagefleet.operator.cli"),
    ("cli", "gateway --help"),
    ("cli", "operator --help"),
    ("cli", "crd"),
]
PROBE = """
import contextlib, io, runpy, sys
kind, what = sys.argv[1], sys.argv[2]
if kind == "import":
    __import__(what)
else:
    sys.argv = ["pagefleet", *what.split()]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        runpy.run_module("pagefleet.cli", run_name="__main__")
print("torch" in sys.modules, any(m.startswith("pagefleet.engine") for m in sys.modules))
"""


@pytest.mark.parametrize(("kind", "what"), ENTRY_POINTS, ids=[w for _, w in ENTRY_POINTS])
def test_entry_point_does_not_load_torch(kind: str, what: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, kind, what], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    torch_loaded, engine_loaded = proc.stdout.split()[-2:]
    assert torch_loaded == "False", f"{what} loaded torch"
    # None of them needs the engine package either (its torch-free modules included).
    assert engine_loaded == "False", f"{what} loaded pagefleet.engine"
