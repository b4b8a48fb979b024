"""The routers people already run, as front doors over a LocalFleet's daemons (benchmarks).

``sglang-router`` and ``vllm-router`` come from PyPI (``pip install 'pagefleet[bench]'``);
both are Rust binaries behind a Python launcher. Each is started with the daemons' static
URLs and its own cache-aware policy at its defaults, so a comparison measures their
designs, not our tuning of them.

Invariant: every router this module starts runs as a ``Child`` the caller stops, listens on
loopback only, and its Prometheus exporter gets its own free port (both default to the same
one, and a second router would crash on it). A free port is only free when it is picked:
another process can bind it before the router does, so a router that exits on "Address
already in use" is started again on fresh ports (:func:`wait_peer_ready`).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

from pagefleet.dev.local_fleet import Child, free_port

PEERS: dict[str, str] = {"sglang": "sglang-router", "vllm_router": "vllm-router"}


def peer_version(kind: str) -> str | None:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return metadata.version(PEERS[kind])
    except metadata.PackageNotFoundError:
        return None


def _executable(dist: str) -> str:
    # The venv's scripts sit beside its python; PATH may not include them.
    local = Path(sys.executable).parent / dist
    found = str(local) if local.exists() else shutil.which(dist)
    if not found:
        raise FileNotFoundError(
            f"{dist} is not installed; `pip install 'pagefleet[bench]'` installs the peer routers"
        )
    return found


def peer_argv(
    kind: str, worker_urls: list[str], port: int, policy: str = "cache_aware"
) -> list[str]:
    """Command line of one peer router over ``worker_urls`` with ``policy``."""
    exe = _executable(PEERS[kind])
    common = [
        "--host", "127.0.0.1", "--port", str(port),
        "--policy", policy,
        "--worker-urls", *worker_urls,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    if kind == "sglang":
        return [exe, "launch", *common, "--log-level", "warn"]
    if kind == "vllm_router":
        return [exe, *common, "--log-level", "warning"]
    raise ValueError(f"unknown peer router {kind!r}; choose one of {', '.join(PEERS)}")


def spawn_peer(
    kind: str,
    worker_urls: list[str],
    log_dir: Path,
    policy: str = "cache_aware",
    tag: str = "",
) -> Child:
    """Start a peer router (not waiting for it; see :func:`wait_peer_ready`). ``tag`` tells
    several routers of one kind apart (their names and logs)."""
    port = free_port()
    name = f"{kind}-{policy}" + (f"-{tag}" if tag else "")
    child = Child(
        name,
        peer_argv(kind, worker_urls, port, policy),
        f"http://127.0.0.1:{port}",
        log_dir / f"{name}.log",
    )
    child.start()
    return child


# What both routers log when a port they were given is taken (Rust's io::Error text).
_PORT_TAKEN = "Address already in use"


def _with_fresh_ports(child: Child) -> None:
    """Point ``child``'s listening and Prometheus ports at newly picked free ones."""
    argv = list(child.argv)
    for flag in ("--port", "--prometheus-port"):
        argv[argv.index(flag) + 1] = str(free_port())
    child.argv = argv
    child.url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def _log_since(child: Child, offset: int) -> str:
    try:
        with child.log_path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def wait_peer_ready(
    child: Child, model: str, timeout_s: float = 120.0, port_retries: int = 3
) -> None:
    """Block until the router lists ``model`` (its workers registered), or raise. A router
    that lost one of its ports to another process between ``free_port()`` and its bind is
    restarted on fresh ports, up to ``port_retries`` times; ``child.url`` follows."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not child.alive:
            # Only what this start of the router wrote: an earlier run's port clash, further
            # up the same appended log, must not turn another exit into a retry.
            if port_retries > 0 and _PORT_TAKEN in _log_since(child, child.log_start):
                port_retries -= 1
                child.stop()
                _with_fresh_ports(child)
                child.start()
                continue
            raise RuntimeError(f"{child.name} exited; its log ends:\n{child.log_tail()}")
        try:
            with urllib.request.urlopen(child.url + "/v1/models", timeout=2) as r:
                ids = [m.get("id") for m in json.loads(r.read()).get("data", [])]
            if model in ids:
                return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{child.name} did not list model {model!r} within {timeout_s:.0f}s; log "
                f"{child.log_path}:\n{child.log_tail()}"
            )
        time.sleep(0.2)
