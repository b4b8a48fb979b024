"""``pagefleet daemon``: serve one model over the OpenAI API until SIGTERM.

Shutdown (SIGTERM or SIGINT): /ready turns 503, new requests get 503, in-flight ones finish
within --drain-timeout (aborted after: streams end with finish_reason "abort"), the pod
leaves the prefix index, exit status 0.

Invariants: from the first stop signal the process is gone within --shutdown-timeout,
whatever is stuck (a stream, the engine, a cleanup): past it the daemon logs every thread's
stack, kills its engine process and exits 1. A second stop signal exits at once (status
128 + the signal). Kubernetes bounds a pod by its terminationGracePeriodSeconds; a daemon
run by hand or under systemd has only these bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, cast

import click
from aiohttp import web
from pydantic import ValidationError

from pagefleet.api.body_budget import DEFAULT_MAX_INFLIGHT_BODY_MB
from pagefleet.api.limits import DEFAULT_MAX_BODY_BYTES
from pagefleet.api.openai import TOOL_CALL_PARSERS
from pagefleet.daemon.config import DEFAULT_LONG_PREFILL_TOKENS, DaemonConfig
from pagefleet.daemon.termination import write_termination_message
from pagefleet.fdlimit import raise_open_files_limit
from pagefleet.listen_errors import listen_error

if TYPE_CHECKING:
    from pagefleet.daemon.app import Daemon

logger = logging.getLogger(__name__)

HANDLER_SHUTDOWN_S = 3.0
# The default bound on a whole shutdown, a little under the terminationGracePeriodSeconds
# (60) of the pods the operator builds: a pod ends on its own terms (stacks logged) before
# the kubelet's SIGKILL. Its parts: --drain-timeout (30 s), 5 s for aborted requests to end,
# aiohttp's cleanup (twice HANDLER_SHUTDOWN_S), the engine's stop (up to 10 s).
DEFAULT_SHUTDOWN_TIMEOUT_S = 55.0
# What a shutdown needs after the drain when nothing is stuck: the aborted requests' last
# chunks, the index goodbye, the engine's stop. A drain is cut short to leave this much.
AFTER_DRAIN_S = 10.0
# Past the deadline the Python-level exit (a thread) gets this long; then faulthandler ends
# the process from C, which works even while some thread holds the GIL.
EXIT_BACKSTOP_S = 2.0


def drain_within_deadline(drain_s: float, deadline_s: float | None) -> float:
    """The drain that leaves AFTER_DRAIN_S of the shutdown deadline: requests still open
    then are aborted in time for their clients to read finish_reason "abort", instead of
    being cut by the deadline's exit."""
    if deadline_s is None:
        return drain_s
    return max(0.0, min(drain_s, deadline_s - AFTER_DRAIN_S))


class StopSignals:
    """The daemon's SIGTERM/SIGINT. The first sets ``stop`` (the graceful drain begins) and
    arms the shutdown deadline; a second exits the process at once.

    Invariant: once ``stop`` is set, the process ends within ``deadline_s`` (plus
    EXIT_BACKSTOP_S), its engine process killed with it; ``deadline_s`` None arms nothing."""

    def __init__(self, daemon: Daemon, deadline_s: float | None) -> None:
        self.daemon = daemon
        self.deadline_s = deadline_s
        self.stop = asyncio.Event()

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.received, sig)

    def received(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            # Someone chose not to wait for the drain (a second Ctrl-C, `kill` again).
            self.exit_now(f"second {sig.name} during the shutdown: exiting now", 128 + sig)
        self.stop.set()
        if self.deadline_s is not None:
            timer = threading.Timer(self.deadline_s, self._overdue)
            timer.daemon = True
            timer.start()
            # Never cancelled: the process is ending either way.
            faulthandler.dump_traceback_later(self.deadline_s + EXIT_BACKSTOP_S, exit=True)

    def _overdue(self) -> None:
        logger.error(
            "shutdown not done %.0fs after the stop signal (--shutdown-timeout): exiting "
            "with %d request(s) still open; where every thread was:",
            self.deadline_s,
            self.daemon.admission.inflight,
        )
        with contextlib.suppress(OSError, ValueError):
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        self.exit_now("shutdown deadline passed", 1)

    def exit_now(self, why: str, status: int) -> None:
        """End the process now: open connections close (their clients see the stream cut),
        the engine process is SIGKILLed (a stopped or hung one would outlive us), the pod's
        index entries expire with its heartbeat."""
        logger.error(
            "%s (%d request(s) open, exit status %d)", why, self.daemon.admission.inflight, status
        )
        handle = self.daemon.engine_loop
        pid = handle.pid if handle is not None else None
        if pid is not None and pid != os.getpid():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(status)


async def serve(config: DaemonConfig, shutdown_timeout_s: float | None = None) -> None:
    """Run the daemon until a stop signal, then drain and clean up; with
    ``shutdown_timeout_s`` (the CLI), the process exits within that long of the signal."""
    from pagefleet.daemon.app import Daemon

    daemon = Daemon(config)
    signals = StopSignals(daemon, shutdown_timeout_s)
    stop = signals.stop
    signals.install(asyncio.get_running_loop())
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its
    # engine requests (their blocks go back to the pool at once).
    # shutdown_timeout: by runner.cleanup every admitted request has ended (drain waits,
    # then aborts); what is still open (a KV pull, a scrape) gets this long, not aiohttp's
    # default 60 s, which could outlive the pod's termination grace.
    # keepalive_timeout also bounds a connection that never completes its headers
    # (aiohttp's only timer before a request starts); its default, 3630 s, let idle and
    # slowloris connections hold a socket each for an hour.
    runner = web.AppRunner(
        daemon.app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=HANDLER_SHUTDOWN_S,
        keepalive_timeout=config.keepalive_timeout_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()  # /health answers while the model loads; /ready waits for it
    except OSError as exc:
        # Raised as is, this was a traceback ending in "[Errno 98] error while attempting
        # to bind on address": the most common start-up failure after a bad model path.
        await runner.cleanup()
        raise click.ClickException(listen_error(config.host, config.port, exc)) from None
    logger.warning("pagefleet daemon listening on http://%s:%d", config.host, config.port)
    start = asyncio.create_task(daemon.start())
    stop_wait = asyncio.create_task(stop.wait())
    died = asyncio.create_task(daemon.engine_died.wait())
    done, _ = await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if start in done and start.exception() is not None:
        await runner.cleanup()
        raise click.ClickException(f"the engine failed to start: {start.exception()}")
    await asyncio.wait({stop_wait, died}, return_when=asyncio.FIRST_COMPLETED)
    if died.done() and not stop.is_set():
        # A daemon without its engine only fails requests: exit non-zero and let
        # Kubernetes restart the pod (its liveness probe would take much longer).
        handle = daemon.engine_loop
        why = handle.end_reason() if handle is not None else "the engine ended"
        await daemon.stop()
        await runner.cleanup()
        raise click.ClickException(f"{why}; exiting")
    died.cancel()
    drain_s = drain_within_deadline(config.drain_timeout_s, shutdown_timeout_s)
    if drain_s < config.drain_timeout_s:
        logger.warning(
            "--drain-timeout %.0fs does not fit --shutdown-timeout %.0fs: open requests get "
            "%.1fs, then are aborted",
            config.drain_timeout_s,
            shutdown_timeout_s,
            drain_s,
        )
    logger.warning("stop signal: draining (up to %.0fs)", drain_s)
    if not start.done():
        start.cancel()
    await daemon.drain(drain_s)
    await daemon.stop()
    await runner.cleanup()
    if daemon.engine_died.is_set():
        # It ended unasked during the drain (a stop never sets this): a crash, which the
        # pod's exit status and termination message must say, not a clean exit 0.
        handle = daemon.engine_loop
        why = handle.end_reason() if handle is not None else "the engine ended"
        raise click.ClickException(f"{why} during the drain; exiting")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--model",
    default="tiny",
    show_default=True,
    help="Checkpoint directory, .gguf file, or a preset (tiny, tiny-qwen2, tiny-qwen3, "
    "smollm2-135m).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--role",
    type=click.Choice(["unified", "prefill", "decode"]),
    default="unified",
    show_default=True,
    help="prefill: runs prompts and keeps their KV for decode pods to pull; decode: pulls "
    "KV named by kv_transfer_params, else prefills locally; unified: both in one pod.",
)
@click.option(
    "--kv-transfer-timeout",
    "kv_transfer_timeout_s",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds a prefill pod keeps a finished prompt's KV for a decode pod to pull.",
)
@click.option(
    "--kv-pull-timeout",
    "kv_pull_timeout_s",
    default=10.0,
    show_default=True,
    type=float,
    help="Seconds a decode pod waits for one KV pull before prefilling locally.",
)
@click.option(
    "--kv-stage-dir",
    default="/dev/shm",
    show_default=True,
    help="tmpfs directory where P/D KV bytes are staged between the HTTP process and the "
    "engine process (shared memory, no copies through the engine pipe); '' to use the pipe. "
    "In Kubernetes give it an emptyDir with medium Memory when /dev/shm is small.",
)
@click.option(
    "--kv-advertise-host",
    default=None,
    help="Address decode pods pull this pod's KV from (default: $POD_IP, else --host).",
)
@click.option(
    "--served-model-name",
    default=None,
    help="Model name in the API (default: --model as given; a .gguf file's stem).",
)
@click.option(
    "--redis-url",
    default=None,
    help="Publish KV events and heartbeats to this Redis (no publishing without it). "
    "Credentials from env, never the URL: PAGEFLEET_REDIS_USERNAME, PAGEFLEET_REDIS_PASSWORD "
    "or PAGEFLEET_REDIS_PASSWORD_FILE, PAGEFLEET_REDIS_CA_FILE (rediss://).",
)
@click.option(
    "--kv-events-zmq",
    default=None,
    metavar="ENDPOINT",
    help="Also publish KV events in vLLM's ZeroMQ format (PUB, msgpack) on this endpoint, "
    "e.g. tcp://*:5557, for routers that read vLLM's KV events (needs pyzmq, msgpack).",
)
@click.option(
    "--kv-events-zmq-replay",
    default=None,
    metavar="ENDPOINT",
    help="With --kv-events-zmq: a ROUTER endpoint (e.g. tcp://*:5558) that sends recent "
    "events again to a subscriber that missed some, as vLLM's replay socket does.",
)
@click.option(
    "--kv-namespace", default="", help="Block-key namespace (default: the served model name)."
)
@click.option(
    "--pod-name",
    default=None,
    help="This pod's name in the index (default: $POD_NAME, else host:port).",
)
@click.option("--block-size", default=16, show_default=True, type=int)
@click.option("--max-num-seqs", default=64, show_default=True, type=int)
@click.option(
    "--max-num-batched-tokens",
    default=None,
    type=click.IntRange(1),
    help="Token budget of one engine step (default: 2048; on --role decode, 2 x "
    "--max-num-seqs, so a turnover's new prompts join a few at a time).",
)
@click.option(
    "--long-prefill-token-threshold",
    default=DEFAULT_LONG_PREFILL_TOKENS,
    show_default=True,
    type=int,
    help="Most prompt tokens one request prefills per step (chunked prefill; 0: no cap, a "
    "prompt up to the step budget in one step); lowers TTFT of requests that arrive "
    "while a long prompt prefills.",
)
@click.option("--max-model-len", default=None, type=int, help="Default: the model's maximum.")
@click.option("--kv-cache-memory-mb", default=256, show_default=True, type=int)
@click.option(
    "--num-gpu-blocks",
    default=None,
    type=int,
    help="KV pool size in blocks; overrides --kv-cache-memory-mb (as vLLM's flag).",
)
@click.option(
    "--gpu-memory-utilization",
    default=None,
    type=click.FloatRange(0, 1, min_open=True),
    help="On --device cuda: size the KV pool so the daemon fills at most this share of the "
    "GPU's memory (replaces --kv-cache-memory-mb; --num-gpu-blocks still wins).",
)
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=False,
    show_default=True,
    help="Replay decode steps from CUDA graphs captured at batch sizes 1, 2, 4, 8, 16, ... "
    "up to --max-num-seqs (--device cuda with the triton backend; elsewhere ignored with a "
    "warning).",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--max-queue",
    default=256,
    show_default=True,
    type=int,
    help="Requests that may wait beyond the running batch; past it, 429.",
)
@click.option(
    "--max-body-bytes",
    default=DEFAULT_MAX_BODY_BYTES,
    show_default=True,
    type=click.IntRange(min=1024),
    help="Largest request body; past it, 413. Keep equal to the gateway's --max-body-bytes.",
)
@click.option(
    "--max-inflight-body-mb",
    default=DEFAULT_MAX_INFLIGHT_BODY_MB,
    show_default=True,
    type=click.IntRange(min=1),
    help="MiB of request bodies held at once (never below one --max-body-bytes body); a "
    "request that would pass it is a 503 with Retry-After, decided before its body is read.",
)
@click.option(
    "--attention-backend",
    default=None,
    help="cpu (compiled, the CPU default) | torch | triton (the CUDA default); default: by device.",
)
@click.option(
    "--drain-timeout",
    "drain_timeout_s",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds to finish in-flight requests on SIGTERM; then they are aborted (streams "
    "end with finish_reason abort).",
)
@click.option(
    "--client-write-timeout",
    "client_write_timeout_s",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a client may leave sent bytes unread before it is cut and its request "
    "aborted (its blocks freed), as the gateway's flag of the same name.",
)
@click.option(
    "--max-stream-backlog-mb",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="A stream whose client is this many MiB of output behind is cut and its request "
    "aborted: the engine cannot pause one sequence, so a slow reader's output would "
    "otherwise pile up in the daemon.",
)
@click.option(
    "--body-timeout",
    "body_timeout_s",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a request body may take to arrive after its headers (then a 408).",
)
@click.option(
    "--keepalive-timeout",
    "keepalive_timeout_s",
    default=75.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds an idle connection, or one still sending its headers, is kept open; "
    "keep it above the idle timeout of a router or load balancer in front.",
)
@click.option(
    "--shutdown-timeout",
    "shutdown_timeout_s",
    default=DEFAULT_SHUTDOWN_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds from SIGTERM until the process has exited, whatever is stuck (a stream, "
    "the engine): past it, stacks are logged and it exits 1. Open requests are aborted 10 s "
    "before it at the latest (--drain-timeout is cut short to fit). Keep it below the pod's "
    "terminationGracePeriodSeconds (the operator passes grace - 5). A second SIGTERM or Ctrl-C "
    "exits at once.",
)
@click.option(
    "--cost-per-hour",
    default=0.0,
    show_default=True,
    type=float,
    help="Dollars per hour this replica costs; /metrics then reports cost per 1M tokens.",
)
@click.option(
    "--engine-process/--no-engine-process",
    default=True,
    show_default=True,
    help="Run the engine in its own process (the HTTP layer never takes the GIL from the "
    "model); if that process dies, the daemon exits non-zero.",
)
@click.option(
    "--engine-hang-timeout",
    "engine_hang_timeout_s",
    default=60.0,
    show_default=True,
    type=float,
    help="Seconds the engine (process or thread) may go silent while it has work before it "
    "counts as hung: /health fails and the daemon exits non-zero (0: never).",
)
@click.option(
    "--request-log",
    default=None,
    help="Append one JSON line per finished prompt to this file: its fingerprint, "
    "prompt and cached tokens, and when it reached the HTTP handler, the engine, the "
    "batch and its first token (monotonic clock); for benchmarks joining their requests "
    "to the daemon's view.",
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(list(TOOL_CALL_PARSERS)),
    default="none",
    show_default=True,
    help="With tool_choice auto (the default when a request has tools), read the calls "
    "the model writes out of its text into message.tool_calls: hermes (<tool_call>{...}"
    "</tool_call>: Qwen 2.5/3, Hermes), llama3_json (the output is one JSON call: Llama "
    "3.1+), pythonic ([f(a=1), g()]: Llama 3.2/4) or mistral ([TOOL_CALLS] then the calls). "
    "none: the text is returned as content. vLLM's flag of the same name.",
)
@click.option(
    "--log-level",
    default="warning",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
@click.option(
    "--termination-log",
    envvar="PAGEFLEET_TERMINATION_LOG",
    default=None,
    help="On a fatal start-up error, write its one-line cause here "
    "[default: /dev/termination-log, when that file exists (Kubernetes creates it)].",
)
def command(**kwargs: object) -> None:
    """Run one inference daemon: the engine plus the OpenAI-compatible API.

    API keys come from the environment, never flags: PAGEFLEET_API_KEYS (and/or _FILE);
    a decode daemon presents PAGEFLEET_UPSTREAM_API_KEY (or _FILE) to prefill daemons that
    require one, as the gateway does.
    """
    logging.basicConfig(
        level=str(kwargs["log_level"]).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    termination_log = cast("str | None", kwargs.pop("termination_log"))
    shutdown_timeout_s = cast("float", kwargs.pop("shutdown_timeout_s"))
    try:
        _run(kwargs, shutdown_timeout_s)
    except click.ClickException as exc:
        # Kubernetes shows this line as the container's last termination message.
        write_termination_message(exc.format_message(), termination_log)
        raise
    except Exception as exc:
        write_termination_message(f"{type(exc).__name__}: {exc}", termination_log)
        raise


def config_error_line(exc: ValidationError) -> str:
    """A DaemonConfig validation error as one line in the flags' own names, e.g.
    ``--max-model-len 1: must be >= 2``. pydantic's text spans several lines, names
    fields rather than flags and ends in a link and a dump of every setting: that was the
    termination message a pod showed."""
    flags = {p.name: p.opts[0] for p in command.params if p.opts}
    parts = []
    for err in exc.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        msg = msg.replace("Input should be ", "must be ")
        for words, sign in (("greater than or equal to", ">="), ("less than or equal to", "<="),
                            ("greater than", ">"), ("less than", "<")):  # fmt: skip
            msg = msg.replace(words, sign)
        field = str(err["loc"][0]) if err["loc"] else None
        if field is None:
            parts.append(msg)
            continue
        flag = flags.get(field, "--" + field.replace("_", "-"))
        parts.append(f"{flag} {err.get('input')!s}: {msg}")
    return "; ".join(parts)


def _run(kwargs: dict[str, object], shutdown_timeout_s: float) -> None:
    try:
        config = DaemonConfig(**kwargs)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise click.UsageError(config_error_line(exc)) from None
    raise_open_files_limit("daemon")
    asyncio.run(serve(config, shutdown_timeout_s))
