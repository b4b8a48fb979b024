"""Building and loading pagefleet's compiled CPU kernels (``kernels/csrc/*.cpp``).

The sources are plain C++ with a C ABI (no torch headers), so g++ builds one in seconds and
Python calls it through ctypes. A build is cached on disk under a key of the source, the
compiler's version, the flags and the CPU's instruction-set flags (``-march=native`` code
must never run on a CPU that lacks them), so each machine compiles each source once
(``cache_dir``; the operator points ``$PAGEFLEET_CACHE`` at a writable volume). Concurrent
builds are safe: each compiles to its own temporary file and renames it into place
atomically.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
    "-std=c++17",
) + (
    # 512-bit vectors where the CPU has them (gcc defaults to 256 on AVX-512 parts): ~5%.
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
)
BUILD_TIMEOUT_S = 300


class KernelBuildError(RuntimeError):
    """The compiled kernel is unavailable (no compiler, a failed build, or a bad library)."""


def cache_dir() -> Path:
    """Where built kernels live: ``$PAGEFLEET_KERNEL_CACHE``, else ``$PAGEFLEET_CACHE/kernels``,
    else ``~/.cache/pagefleet/kernels``."""
    env = os.environ.get("PAGEFLEET_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("PAGEFLEET_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "pagefleet") / "kernels"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KernelBuildError(
            "no C++ compiler found (g++ or c++ on PATH, or $CXX); install g++ "
            "(apt-get install g++) to use the compiled CPU attention"
        )
    return cxx


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_key(source: bytes, cxx: str) -> str:
    try:
        version = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"C++ compiler {cxx!r} does not run: {exc}") from exc
    h = hashlib.sha256()
    for part in (source, version.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def load_library(name: str) -> ctypes.CDLL:
    """The built ``csrc/<name>.cpp`` loaded with ctypes, compiling it first if this machine's
    cache has no build of this exact source (with the csrc headers), compiler, flags and CPU.

    Raises KernelBuildError saying what is missing or what the compiler printed.
    """
    src = CSRC / f"{name}.cpp"
    try:
        # The shared headers are part of the build: a change to one rebuilds every kernel.
        source = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    except OSError as exc:
        raise KernelBuildError(f"kernel source {src} is missing: {exc}") from exc
    cxx = _compiler()
    target = cache_dir() / f"{name}-{_build_key(source, cxx)}.so"
    if not target.exists():
        _compile(cxx, src, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelBuildError(
            f"built kernel {target} does not load ({exc}); delete it to rebuild"
        ) from exc


def _compile(cxx: str, src: Path, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        raise KernelBuildError(f"cannot write the kernel cache {target.parent}: {exc}") from exc
    logger.info("building CPU kernel %s -> %s", src.name, target)
    try:
        proc = subprocess.run(
            [cxx, *FLAGS, "-o", tmp, str(src)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise KernelBuildError(
                f"{cxx} failed to build {src.name} (exit {proc.returncode}): "
                f"{proc.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, target)  # atomic: a concurrent loader sees all of it or nothing
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"building {src.name} with {cxx} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
