"""``pagefleet up``: Redis, N daemons and a gateway on one machine, as child processes.

Invariant: every process this module starts is stopped by ``LocalFleet.stop()`` (gateway
first, then daemons, then Redis), also on Ctrl-C and on a failed start; children run in
their own sessions so a terminal's Ctrl-C reaches only us and we stop them in order.

A child that exits on its own (a daemon crash) is restarted at the same address after a
backoff (1 s, doubling to 30 s, reset once it stayed up a minute) while the others keep
serving; the gateway's probes drop it meanwhile and re-admit it once ready.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import click
from click.core import ParameterSource

from pagefleet.api.model_names import default_served_model_name
from pagefleet.dev import process
from pagefleet.dev.process import free_port
from pagefleet.httpauth import ENV_KV_SECRET, ENV_KV_SECRET_FILE
from pagefleet.kvindex.redis_auth import PASSWORD_ENV, split_password

logger = logging.getLogger(__name__)

# The fleet's gateway: seconds open streams get on stop (its exit follows within ~5 s more,
# pagefleet.gateway.cli's CLEANUP_S + EXIT_S), inside GATEWAY_STOP_S.
GATEWAY_DRAIN_S = 3.0
GATEWAY_STOP_S = 10.0
# The daemons' drain on stop (their own 30 s default is for pods). A daemon's stop can take
# the drain, then 5 s for the aborted requests to end (Daemon.drain), then aiohttp's
# cleanup, which waits for a handler still open (a stream whose client stopped reading)
# twice its 3 s shutdown timeout before cancelling it; plus the engine's stop and the exit.
# DAEMON_STOP_S covers all of it: a clean stop never needs SIGKILL.
DAEMON_DRAIN_S = 6.0
DAEMON_STOP_S = DAEMON_DRAIN_S + 5.0 + 2 * 3.0 + 3.0
# A daemon stuck past all of that (a hung engine) ends itself a little before our SIGKILL,
# its threads' stacks in its log (the daemon's --shutdown-timeout).
DAEMON_SHUTDOWN_S = DAEMON_STOP_S - 2.0


def resolve_checkpoint_dir(spec: str) -> Path:
    """A checkpoint directory or GGUF file for ``spec`` (a path, a GGUF preset, or a tiny
    preset written on first use). Tiny presets resolve in a child process: the engine's
    writer needs torch, and ``up`` itself stays light (it only starts processes)."""
    from pagefleet.presets.gguf_presets import gguf_preset_path

    path = Path(spec).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    try:
        preset = gguf_preset_path(spec)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    if preset is not None:
        return preset
    code = (
        "from pagefleet.engine.loader import resolve_model as r; import sys; print(r(sys.argv[1]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, spec], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise click.ClickException(
            f"cannot resolve model {spec!r}: "
            f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
        )
    return Path(proc.stdout.strip().splitlines()[-1])


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's own
    terminated: bool = False  # SIGTERM sent (terminate) and the child not stopped yet
    # The log's size when this start began: logs are appended to, so what this start of the
    # child wrote begins here (an earlier run's lines come before it).
    log_start: int = 0

    def start(self) -> None:
        env = dict(os.environ)
        # Each daemon gets the machine's cores to itself only in name: cap torch threads so
        # N daemons on a small box do not oversubscribe the CPU.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(self.env)
        try:
            self.log_start = self.log_path.stat().st_size
        except FileNotFoundError:
            self.log_start = 0
        self.proc = process.spawn(self.argv, self.log_path, env=env)
        self.terminated = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """Send SIGTERM without waiting (stop several children in parallel); no-op for a
        child that has exited (``stop`` then says how)."""
        if self.alive:
            assert self.proc is not None
            process.signal_group(self.proc, signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (unless ``terminate`` sent it) and wait up to ``timeout``; then SIGKILL,
        loudly. Never a second SIGTERM: it would kill a daemon in its exit, after its loop
        closed, before multiprocessing cleans up its engine process's semaphores. A child
        that had exited before the stop is reported as such, with its status."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        term, self.terminated = not self.terminated, False
        if term and proc.poll() is not None:
            # It ended on its own (a crash, the OOM killer) between the supervisor's looks:
            # its -9 is not our SIGKILL, and "did not stop" sent people after a hang.
            logger.warning(
                "%s had exited on its own with status %s before the stop (log %s)",
                self.name, proc.returncode, self.log_path,
            )  # fmt: skip
            process.stop(proc, grace_s=0, term=False)
            return
        if process.stop(proc, grace_s=timeout, term=term) == -signal.SIGKILL:
            logger.warning("%s did not stop within %.1fs of SIGTERM: killed", self.name, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crashed pod: no draining, no goodbye to the index (no-op once
        stopped)."""
        if self.proc is not None:
            process.signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def log_tail(self, n: int = 20) -> str:
        return process.tail(self.log_path, n)

    def listening(self) -> bool:
        """Whether this child (its process group) holds the socket listening at its URL's
        port: a /ready answered at the URL alone may come from another process on that port
        (a second `up`'s gateway), while this child failed to bind."""
        port = urlsplit(self.url).port
        if self.proc is None or port is None:
            return False
        return process.group_listens(self.proc.pid, port) is not False

    @property
    def crashed(self) -> bool:
        """It was started, not stopped by us, and has exited."""
        return self.proc is not None and self.proc.poll() is not None

    def exit_note(self) -> str:
        """``name (status N, log PATH)`` of a child that has exited."""
        status = None if self.proc is None else self.proc.returncode
        return f"{self.name} (status {status}, log {self.log_path})"


@dataclass(slots=True)
class Backoff:
    """When to restart one crashed child: ``base_s`` doubling to ``max_s``; a child that
    stayed up ``stable_s`` starts over at ``base_s``."""

    base_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0
    restarts: int = 0
    started_at: float = 0.0
    due_at: float | None = None

    def crashed(self, now: float) -> float:
        """Schedule the restart of a child seen dead at ``now``; returns the delay."""
        if now - self.started_at >= self.stable_s:
            self.restarts = 0
        delay = min(self.max_s, self.base_s * (2**self.restarts))
        self.due_at = now + delay
        return delay

    def restarted(self, now: float) -> None:
        self.restarts += 1
        self.started_at = now
        self.due_at = None


@dataclass(slots=True)
class FleetSpec:
    num_daemons: int = 2
    model: str = "tiny"
    served_model_name: str | None = None
    redis_url: str | None = None
    use_redis: bool = True
    policy: str = "cache_aware"
    weights: str | None = None
    host: str = "127.0.0.1"
    gateway_port: int = 0
    block_size: int = 16
    kv_cache_memory_mb: int | None = None
    num_gpu_blocks: int | None = None  # per daemon; overrides kv_cache_memory_mb
    kv_namespace: str = ""
    daemon_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    ready_timeout_s: float = 180.0
    seed: int | None = None
    # P/D: with num_prefill > 0 the fleet is num_prefill prefill + num_decode decode
    # daemons (num_daemons is ignored) and the gateway gets both pools.
    num_prefill: int = 0
    num_decode: int = 0


class LocalFleet:
    """Start with ``start()`` (blocks until every process is ready), stop with ``stop()``."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.log_dir = spec.log_dir or Path(tempfile.mkdtemp(prefix="pagefleet-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.daemons: list[Child] = []
        self.gateway: Child | None = None
        self.redis_url: str | None = spec.redis_url
        self._redis = None  # a LocalRedis we own
        self.model_dir: str = spec.model
        self.backoff: dict[str, Backoff] = {}
        self.restart_log: list[tuple[float, str]] = []  # (monotonic time, child name)
        # Every exit a child made on its own, as first seen: "name (status N, log PATH)".
        self.crashes: list[str] = []
        self._supervisor: threading.Thread | None = None
        self._stop_supervising = threading.Event()
        # The fleet's P/D secret (httpauth.ENV_KV_SECRET): one per fleet, in the children's
        # environment (never a command line), unless the caller's environment names one.
        self.kv_env: dict[str, str] = {}
        if not (os.environ.get(ENV_KV_SECRET) or os.environ.get(ENV_KV_SECRET_FILE)):
            self.kv_env[ENV_KV_SECRET] = secrets.token_hex(32)
        # A socket listening on the gateway's port from `up`'s check until the gateway is
        # spawned: a second `up` on the same port is refused at once, not after its start.
        self.port_hold: socket.socket | None = None

    # -- urls -----------------------------------------------------------------------------

    @property
    def gateway_url(self) -> str:
        assert self.gateway is not None, "fleet not started"
        return self.gateway.url

    @property
    def daemon_urls(self) -> list[str]:
        return [d.url for d in self.daemons]

    @property
    def disaggregated(self) -> bool:
        return self.spec.num_prefill > 0

    def daemons_by_role(self) -> str:
        """The daemons' URLs for a person: "daemons URL, URL", or in a P/D fleet
        "prefill URL; decode URL, URL", so the reader knows which log and metrics are whose."""
        if not self.disaggregated:
            return f"daemons {', '.join(self.daemon_urls)}"
        pools = (f"{role} {', '.join(self.role_urls(role))}" for role in ("prefill", "decode"))
        return "; ".join(pools)

    def role_urls(self, role: str) -> list[str]:
        """URLs of the daemons of one role (prefill, decode; unified fleets: all)."""
        return [d.url for d in self.daemons if d.name.startswith(role)] or (
            self.daemon_urls if role != "prefill" else []
        )

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, on_spawned: Callable[[], None] | None = None) -> LocalFleet:
        """Start Redis, the daemons and the gateway; block until all are ready.

        ``on_spawned`` runs once every daemon process is started (``daemon_urls`` known)
        and before waiting for them to load: a benchmark starts its own front doors there,
        beside the daemons' start-up instead of after it."""
        try:
            self._start_redis()
            if self.disaggregated:
                self.daemons = [
                    *(self._daemon(i, "prefill") for i in range(self.spec.num_prefill)),
                    *(self._daemon(i, "decode") for i in range(max(1, self.spec.num_decode))),
                ]
            else:
                self.daemons = [self._daemon(i) for i in range(self.spec.num_daemons)]
            for d in self.daemons:
                d.start()
            if on_spawned is not None:
                on_spawned()
            # The gateway needs the checkpoint directory for its tokenizer; resolving a tiny
            # preset imports torch in a child, so do it while the daemons load.
            self._resolve_model()
            self.wait_ready(self.daemons)
            self.start_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_redis(self) -> None:
        if self.redis_url or not self.spec.use_redis:
            return
        from pagefleet.dev.redis_server import LocalRedis

        self._redis = LocalRedis()
        self.redis_url = self._redis.start()

    def _resolve_model(self) -> None:
        # Concurrent writers of a tiny preset are safe (atomic rename in the writer).
        self.model_dir = str(resolve_checkpoint_dir(self.spec.model))

    def _daemon(self, i: int, role: str = "unified") -> Child:
        port = free_port()
        host = self.spec.host
        argv = [
            sys.executable,
            "-m",
            "pagefleet.cli",
            "daemon",
            "--model",
            self.spec.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            host,
            "--port",
            str(port),
            "--pod-name",
            f"{host}:{port}",
            "--block-size",
            str(self.spec.block_size),
            "--kv-namespace",
            self.namespace,
        ]
        if self.redis_url:
            argv += ["--redis-url", self.redis_url]
        if self.spec.kv_cache_memory_mb is not None:
            argv += ["--kv-cache-memory-mb", str(self.spec.kv_cache_memory_mb)]
        if self.spec.num_gpu_blocks is not None:
            argv += ["--num-gpu-blocks", str(self.spec.num_gpu_blocks)]
        name = f"daemon-{i}"
        if role != "unified":
            argv += ["--role", role]
            name = f"{role}-{i}"
        # Before the spec's own arguments, so a caller's --drain-timeout wins.
        argv += ["--drain-timeout", str(DAEMON_DRAIN_S)]
        argv += ["--shutdown-timeout", str(DAEMON_SHUTDOWN_S)]
        argv += self.spec.daemon_args
        return Child(
            name, argv, f"http://{host}:{port}", self.log_dir / f"{name}.log", env=self.kv_env
        )

    @property
    def served_model_name(self) -> str:
        # The daemons' and the gateway's own default, passed to both explicitly.
        return self.spec.served_model_name or default_served_model_name(self.spec.model)

    @property
    def namespace(self) -> str:
        return self.spec.kv_namespace or self.served_model_name

    def start_gateway(self, policy: str | None = None, weights: str | None = None) -> str:
        """(Re)start the fleet's gateway, e.g. with another policy; returns its URL."""
        if self.gateway is not None:
            self.gateway.stop()
        self.gateway = self.spawn_gateway(policy, weights, name="gateway")
        self.wait_ready([self.gateway])
        return self.gateway.url

    def spawn_gateway(
        self,
        policy: str | None = None,
        weights: str | None = None,
        name: str = "gateway",
        port: int | None = None,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
    ) -> Child:
        """Start one more gateway over the same daemons and index, without waiting for it
        (several replicas, or one per policy in a benchmark; ``env`` on top of ours, e.g.
        another PYTHONPATH to run another version of the code; ``args``: more flags for this
        one). The caller stops it."""
        port = port or (self.spec.gateway_port if name == "gateway" else 0) or free_port()
        host = self.spec.host
        argv = [
            sys.executable, "-m", "pagefleet.cli", "gateway",
            "--host", host, "--port", str(port),
            "--policy", policy or self.spec.policy,
            "--model", self.model_dir,
            "--served-model-name", self.served_model_name,
            "--kv-namespace", self.namespace,
            "--block-size", str(self.spec.block_size),
            "--endpoints", ",".join(self.role_urls("decode")),
        ]  # fmt: skip
        if self.disaggregated:
            argv += ["--prefill-url", ",".join(self.role_urls("prefill"))]
        if self.redis_url:
            argv += ["--redis-url", self.redis_url]
        if weights or self.spec.weights:
            argv += ["--weights", weights or self.spec.weights or ""]
        if self.spec.seed is not None:
            argv += ["--seed", str(self.spec.seed)]
        # Its drain (plus its bounded cleanup and exit) fits inside GATEWAY_STOP_S, so
        # a stop with streams still open cuts them instead of waiting to be SIGKILLed.
        argv += ["--drain-timeout", str(GATEWAY_DRAIN_S)]
        argv += self.spec.gateway_args + (args or [])
        child = Child(
            name, argv, f"http://{host}:{port}", self.log_dir / f"{name}.log",
            env={**self.kv_env, **(env or {})},
        )  # fmt: skip
        if name == "gateway":
            self.release_port()
        child.start()
        return child

    def release_port(self) -> None:
        """Close ``port_hold`` (the gateway binds the port next; or the fleet stops)."""
        if self.port_hold is not None:
            self.port_hold.close()
            self.port_hold = None

    def wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        pending = list(children)
        while pending:
            for c in list(pending):
                if not c.alive:
                    raise RuntimeError(
                        f"{c.name} exited during start-up; its log ({c.log_path}) ends:\n"
                        f"{c.log_tail()}"
                    )
                if http_ok(c.url + "/ready") and c.listening():
                    pending.remove(c)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise TimeoutError(
                    f"{names} not ready after {self.spec.ready_timeout_s:.0f}s; logs in "
                    f"{self.log_dir}"
                )
            if pending:
                time.sleep(0.1)

    # -- supervision ----------------------------------------------------------------------

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart crashed children whose backoff is over; returns the names restarted."""
        now = time.monotonic() if now is None else now
        done: list[str] = []
        for child in [*self.daemons, *([self.gateway] if self.gateway else [])]:
            b = self.backoff.setdefault(child.name, Backoff(started_at=now))
            if not child.crashed:
                continue
            if b.due_at is None:
                assert child.proc is not None
                delay = b.crashed(now)
                self.crashes.append(child.exit_note())
                logger.warning(
                    "%s exited with status %s; restarting it in %.0fs (log %s):\n%s",
                    child.name,
                    child.proc.returncode,
                    delay,
                    child.log_path,
                    child.log_tail(5),
                )
            elif now >= b.due_at:
                child.start()
                b.restarted(now)
                self.restart_log.append((now, child.name))
                done.append(child.name)
        return done

    def supervise_in_background(self, interval_s: float = 0.5) -> None:
        """Run ``supervise`` every ``interval_s`` on a thread until ``stop()``."""
        if self._supervisor is not None:
            return
        self._stop_supervising.clear()

        def loop() -> None:
            while not self._stop_supervising.wait(interval_s):
                try:
                    self.supervise()
                except Exception:  # keep supervising the others
                    logger.exception("supervising the local fleet failed")

        self._supervisor = threading.Thread(target=loop, name="fleet-supervisor", daemon=True)
        self._supervisor.start()

    def stop(self, grace_s: float | None = None) -> None:
        """Stop everything started here, bounded: the gateway and the daemons get SIGTERM
        at once (they drain in parallel); a gateway still running ``GATEWAY_STOP_S`` later,
        a daemon ``DAEMON_STOP_S`` later (both ``grace_s`` when given) gets SIGKILL; then
        Redis stops (SIGKILL after 5 s). At most ~``DAEMON_STOP_S`` + 10 s."""
        self.release_port()
        self._stop_supervising.set()
        if self._supervisor is not None:
            self._supervisor.join(5)
            self._supervisor = None
        children = [c for c in (self.gateway, *self.daemons) if c is not None]
        for c in children:
            b = self.backoff.get(c.name)
            if c.crashed and (b is None or b.due_at is None):  # since supervise's last look
                self.crashes.append(c.exit_note())
        for c in children:
            c.terminate()
        t0 = time.monotonic()
        try:
            for c in children:
                grace = grace_s
                if grace is None:
                    grace = GATEWAY_STOP_S if c is self.gateway else DAEMON_STOP_S
                c.stop(timeout=max(0.0, t0 + grace - time.monotonic()))
        finally:
            # Interrupted (a second Ctrl-C while stopping): what still runs gets SIGKILL,
            # and Redis and its files go all the same.
            for c in children:
                c.kill()
            if self._redis is not None:
                self._redis.stop()
                self._redis = None

    def stop_redis(self) -> None:
        """Stop the fleet's own Redis (tests: the index going away mid-run)."""
        if self._redis is None:
            raise RuntimeError("this fleet does not own its Redis (--redis-url was given)")
        self._redis.stop()
        self._redis = None

    def restart_redis(self) -> None:
        """Start the fleet's Redis again at its old address, empty (after ``stop_redis``)."""
        if self.redis_url is None or self._redis is not None:
            raise RuntimeError("restart_redis() follows stop_redis() on a fleet owning Redis")
        from pagefleet.dev.redis_server import LocalRedis

        self._redis = LocalRedis(port=urlsplit(self.redis_url).port)
        self._redis.start()

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _refuse_bench_options_without_bench(run_bench: bool) -> None:
    """--plot and --bench-requests only shape the --bench run: without it they would be
    ignored while the fleet serves, and the plots a user waits for never come."""
    if run_bench:
        return
    ctx = click.get_current_context()
    for name, flag in (("plot", "--plot"), ("bench_requests", "--bench-requests")):
        if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
            raise click.UsageError(
                f"{flag} goes with --bench (e.g. `pagefleet up --bench {flag} ...`)"
            )


def _gateway_port(port: int, run_bench: bool) -> tuple[int, socket.socket | None]:
    """The gateway's port for ``up``: ``port`` as given, refused up front when taken, and a
    socket that holds it (listening) until the gateway starts (None for any free port).

    Only --bench without an explicit --port takes any free port: a benchmark needs no fixed
    address, and the default 8080 being busy must not stop `make run`. A port the user
    typed is kept, --bench or not (a dashboard or a second client points at it).

    Held, not only probed: a second `up` on the same port started while the first loads its
    model found the port free, started its whole fleet, and its gateway then failed to bind
    while its readiness probe got the first fleet's answer ("fleet ready")."""
    ctx = click.get_current_context()
    explicit = ctx.get_parameter_source("gateway_port") is not ParameterSource.DEFAULT
    if (run_bench and not explicit) or not port:
        return 0, None
    hold = socket.socket()
    # As the gateway binds (asyncio's reuse_address): a port in TIME_WAIT is not "in use".
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        hold.bind(("127.0.0.1", port))
        hold.listen(1)
    except OSError as exc:
        hold.close()
        raise click.UsageError(
            f"port {port} is in use ({os.strerror(exc.errno or 0)}); pass --port 0 or another"
        ) from None
    return port, hold


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-n",
    "--num-daemons",
    default=2,
    show_default=True,
    type=click.IntRange(min=1),
    help="Unified daemons (each prefills and decodes); --prefill/--decode replace it.",
)
@click.option(
    "--prefill",
    "num_prefill",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="P/D: this many prefill daemons (with --decode; replaces -n).",
)
@click.option(
    "--decode",
    "num_decode",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="P/D: this many decode daemons (with --prefill).",
)
@click.option(
    "--model",
    # The real model by default, so the first run shows real answers; tiny for speed.
    default="smollm2-135m",
    show_default=True,
    help="Checkpoint directory, .gguf file, or preset (smollm2-135m, tiny, ...).",
)
@click.option(
    "--served-model-name",
    default=None,
    help="Model name clients send (default: --model as given; a .gguf file's stem).",
)
@click.option("--redis-url", default=None, help="Use this Redis instead of starting one.")
@click.option(
    "--policy",
    default="cache_aware",
    show_default=True,
    type=click.Choice(["cache_aware", "least_load", "round_robin", "session"]),
    help="How the gateway picks a daemon for each request (see pagefleet gateway).",
)
@click.option(
    "--weights", default=None, help="Gateway cache_aware weights (see pagefleet gateway)."
)
@click.option(
    "--port",
    "gateway_port",
    default=8080,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Gateway port (0: any free port; with --bench and no --port, any free port).",
)
@click.option(
    "--kv-cache-memory-mb",
    default=None,
    type=click.IntRange(min=1),
    help="Per-daemon KV cache budget in MiB (default: the daemon's, 256).",
)
@click.option(
    "--log-dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the children's logs go (default: a temp dir).",
)
@click.option(
    "--bench",
    "run_bench",
    is_flag=True,
    help="Run a short `pagefleet bench` through the gateway, print its report and one "
    "sample answer, then stop the fleet.",
)
@click.option(
    "--bench-requests",
    default=48,
    show_default=True,
    type=click.IntRange(min=1),
    help="With --bench: chat requests (conversation turns) to send.",
)
@click.option(
    "--plot",
    default=None,
    type=click.Path(path_type=Path),
    help="With --bench: write PNG plots here.",
)
def command(
    num_daemons: int,
    num_prefill: int,
    num_decode: int,
    model: str,
    served_model_name: str | None,
    redis_url: str | None,
    policy: str,
    weights: str | None,
    gateway_port: int,
    kv_cache_memory_mb: int | None,
    log_dir: Path | None,
    run_bench: bool,
    bench_requests: int,
    plot: Path | None,
) -> None:
    """Start Redis, N daemons and a gateway on this machine; Ctrl-C (or SIGTERM) stops
    them all."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _refuse_bench_options_without_bench(run_bench)
    if redis_url:
        # Children inherit the environment; their command lines (visible to every local
        # user) get the URL without the password.
        redis_url, password = split_password(redis_url)
        if password is not None:
            os.environ[PASSWORD_ENV] = password
    if (num_prefill > 0) != (num_decode > 0):
        raise click.UsageError("--prefill and --decode go together (e.g. --prefill 1 --decode 1)")
    # Last of the checks: from here the port is held (listening) for the fleet's gateway.
    gateway_port, port_hold = _gateway_port(gateway_port, run_bench)
    spec = FleetSpec(
        num_daemons=num_daemons,
        num_prefill=num_prefill,
        num_decode=num_decode,
        model=model,
        served_model_name=served_model_name,
        redis_url=redis_url,
        policy=policy,
        weights=weights,
        gateway_port=gateway_port,
        kv_cache_memory_mb=kv_cache_memory_mb,
        log_dir=log_dir,
    )
    # Ctrl-C and SIGTERM both stop the fleet in order (KeyboardInterrupt below). Set here,
    # once the arguments are checked (an in-process usage error leaves the caller's alone),
    # not left to Python: a process started with SIGINT ignored (any background job of a
    # script, `cmd &`, inherits SIG_IGN) keeps ignoring it, and Ctrl-C then did nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # A closed terminal (SIGHUP) too; Python's default ended us at once, so the children
    # were SIGKILLed by their watchers and Redis's files stayed. Unless the caller chose to
    # outlive the terminal (nohup: SIGHUP ignored).
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.default_int_handler)
    # `kill -USR1` prints where every thread is to stderr: a stop that seems stuck can say
    # where (tests/gateway/test_up_cli.py asks before it gives up on one). A stderr with no
    # file descriptor (click's CliRunner in tests) cannot take the dump: nothing to register.
    with contextlib.suppress(io.UnsupportedOperation, ValueError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        fleet = LocalFleet(spec)  # may refuse --log-dir
    except BaseException:
        if port_hold is not None:
            port_hold.close()
        raise
    fleet.port_hold = port_hold
    what = (
        f"{num_prefill} prefill + {num_decode} decode daemon(s)"
        if num_prefill
        else f"{num_daemons} daemon(s)"
    )
    # An external Redis is used, not started: say which, so a user can tell where the
    # fleet indexes (the URL is shown without its password, split off above).
    redis_what = f"using Redis at {redis_url}" if redis_url else "starting Redis"
    click.echo(f"{redis_what}, {what} and a gateway (logs: {fleet.log_dir})", err=True)
    t0 = time.monotonic()
    try:
        fleet.start()
    except (RuntimeError, TimeoutError) as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        click.echo("interrupted during start-up; stopped everything", err=True)
        # Not a success: no fleet served, no bench ran (a script must not read 0).
        click.get_current_context().exit(128 + signal.SIGINT)
    interrupted = False
    try:
        try:
            click.echo(
                f"fleet ready in {time.monotonic() - t0:.1f}s: redis {fleet.redis_url}; "
                f"{fleet.daemons_by_role()}",
                err=True,
            )
            click.echo(
                f"gateway: {fleet.gateway_url}  (OpenAI base_url {fleet.gateway_url}/v1, "
                f"model {fleet.served_model_name!r})"
            )
            if run_bench:
                # A daemon that crashes mid-bench is said at once and restarted, as when
                # serving: unwatched, it went unmentioned (the bench only counted errors).
                fleet.supervise_in_background()
                _bench(fleet, bench_requests, plot)
            else:
                _serve(fleet)
        except KeyboardInterrupt:
            # Serving, a stop signal is how `up` ends (status 0). A bench cut short is not
            # a bench that ran: say so, and no status 0 (click said only "Aborted!", 1).
            if run_bench:
                click.echo("interrupted during the bench; stopping the fleet", err=True)
                interrupted = True
    finally:
        fleet.stop()
        click.echo("fleet stopped", err=True)
    if interrupted:
        click.get_current_context().exit(128 + signal.SIGINT)
    if run_bench and fleet.crashes:
        # The report above counts their failed requests; a script (make run) must not read
        # status 0 as a clean run.
        raise click.ClickException(
            f"during the bench {len(fleet.crashes)} crash(es): {'; '.join(fleet.crashes)}"
        )


def _serve(fleet: LocalFleet) -> None:
    """Until a stop signal (KeyboardInterrupt): a crashed daemon is restarted with backoff;
    the others keep serving meanwhile."""
    # From the moment this is printed a stop signal is the normal way out.
    click.echo("Ctrl-C to stop", err=True)
    while True:
        for name in fleet.supervise():
            click.echo(f"restarted {name} (logs: {fleet.log_dir})", err=True)
        time.sleep(0.5)


def _bench(fleet: LocalFleet, num_requests: int, plot: Path | None) -> None:
    """`up --bench`: the bench's report through the gateway, then one sample answer."""
    from pagefleet.dev.loadgen import BenchOptions, run_bench_sync
    from pagefleet.dev.sample_chat import QUESTION, ask

    run_bench_sync(
        BenchOptions(
            url=fleet.gateway_url,
            model=fleet.served_model_name,
            num_requests=num_requests,
            plot_dir=plot,
            tokenizer_dir=fleet.model_dir,
        )
    )
    click.echo(f"\nQ: {QUESTION}\nA: {ask(fleet.gateway_url, fleet.served_model_name)}")
