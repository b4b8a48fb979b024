"""``pagefleet gateway``: the cache-aware OpenAI front door for a fleet of daemons.

Never imports torch nor the engine: the tokenizer that computes block keys comes from the
checkpoint directory or, for a preset name, from pagefleet.presets (torch-free).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Literal

import click
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagefleet.api.body_budget import DEFAULT_MAX_INFLIGHT_BODY_MB
from pagefleet.api.limits import DEFAULT_MAX_BODY_BYTES
from pagefleet.api.model_context import rope_positions
from pagefleet.api.model_names import default_served_model_name
from pagefleet.fdlimit import raise_open_files_limit
from pagefleet.gateway.connections import (
    ConnectionGate,
    auto_max_connections,
    listen_backlog,
    quiet_accept_errors,
)
from pagefleet.gateway.policies import POLICY_NAMES, RoutingWeights
from pagefleet.listen_errors import listen_error

logger = logging.getLogger(__name__)


class GatewayConfig(BaseModel):
    """Everything ``pagefleet gateway`` is configured with (flags, or the operator's env)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    policy: Literal["cache_aware", "least_load", "round_robin", "session"] = "cache_aware"
    redis_url: str | None = None
    kv_namespace: str = ""
    model: str | None = "tiny"
    served_model_name: str | None = None
    block_size: int = Field(16, ge=1)
    discovery: Literal["static", "k8s"] = "static"
    endpoints: list[str] = Field(default_factory=list)
    namespace: str = "default"
    service: str | None = None
    target_port: str | None = None
    # P/D: the two role pools (static URLs or the role Services' EndpointSlices); with a
    # prefill pool the main pool (--endpoints/--service or the decode ones) is decode.
    prefill_endpoints: list[str] = Field(default_factory=list)
    decode_endpoints: list[str] = Field(default_factory=list)
    prefill_service: str | None = None
    decode_service: str | None = None
    pd_min_uncached_tokens: int = Field(256, ge=0)
    pd_max_prefill_inflight: int = Field(8, ge=1)
    pd_prefill_timeout_s: float = Field(30.0, gt=0)
    weights: RoutingWeights = Field(default_factory=RoutingWeights)
    max_attempts: int = Field(3, ge=1)
    index_timeout_ms: float = Field(100.0, gt=0)
    seed: int | None = None
    log_level: str = "warning"
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    max_concurrency: int = Field(1024, ge=1)
    max_inflight_body_mb: int = Field(DEFAULT_MAX_INFLIGHT_BODY_MB, ge=1)
    max_connections: int = Field(0, ge=0)  # 0: from the open-files limit
    max_response_bytes: int = Field(256 << 20, ge=1024)
    max_model_len: int | None = Field(None, ge=2)
    first_byte_timeout_s: float = Field(60.0, gt=0)
    inter_chunk_timeout_s: float = Field(30.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    client_write_timeout_s: float = Field(30.0, gt=0)
    keepalive_timeout_s: float = Field(75.0, gt=0)
    probe_interval_s: float = Field(1.0, ge=0)
    probe_timeout_s: float = Field(1.0, gt=0)
    probe_failures: int = Field(2, ge=1)
    probe_dead_after_s: float = Field(10.0, ge=0)
    intake_workers: int = Field(2, ge=0)
    # Replicas share recent placements over Redis pub/sub (shared_placements.py).
    shared_placements: bool = True
    # On SIGTERM: how long open requests (streams) may take to finish before they are cut.
    drain_timeout_s: float = Field(20.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> GatewayConfig:
        if self.decode_endpoints and not self.endpoints:
            self.endpoints = list(self.decode_endpoints)
        if self.decode_service and not self.service:
            self.service = self.decode_service
        if self.discovery == "static" and not self.endpoints:
            raise ValueError("--discovery static needs --endpoints (or --decode-url) URL,...")
        if self.discovery == "k8s" and not self.service:
            raise ValueError("--discovery k8s needs --service (the daemons' Service name)")
        if self.discovery == "static" and self.prefill_service:
            raise ValueError("--prefill-service needs --discovery k8s; use --prefill-url")
        if self.discovery == "k8s" and self.prefill_endpoints:
            raise ValueError("--prefill-url needs --discovery static; use --prefill-service")
        return self

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_endpoints or self.prefill_service)

    @property
    def model_name(self) -> str:
        # As the daemons name it (a .gguf file: its stem), or every request gets a 404.
        if self.served_model_name:
            return self.served_model_name
        return default_served_model_name(self.model) if self.model else "model"

    @property
    def namespace_key(self) -> str:
        # Same default as the daemon: the block-key namespace is the served model name.
        return self.kv_namespace or self.model_name

    @property
    def target_port_value(self) -> int | str | None:
        if self.target_port is None:
            return None
        return int(self.target_port) if self.target_port.isdigit() else self.target_port


def _load_tokenizer(spec: str):  # -> pagefleet.tokenizer.Tokenizer
    from pagefleet.presets import load_tokenizer

    try:
        return load_tokenizer(spec)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(
            f"cannot load the tokenizer of --model {spec!r}: {exc}"
        ) from None


def checkpoint_max_len(model_dir: Path) -> int | None:
    """The context length a daemon serves this checkpoint with by default (the positions
    its RoPE serves, api/model_context.py, capped at a sliding window as the engine does),
    or None if unknown."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    n = cfg.get("max_position_embeddings")
    if not isinstance(n, int) or n < 2:
        return None
    params = cfg.get("rope_parameters")
    scaling = params if isinstance(params, dict) else cfg.get("rope_scaling")
    with contextlib.suppress(TypeError, ValueError, KeyError):  # the daemon names the error
        n = rope_positions(n, scaling if isinstance(scaling, dict) else None)
    window = cfg.get("sliding_window")
    arch = (cfg.get("architectures") or [""])[0]
    if (
        isinstance(window, int)
        and window > 1
        and (arch == "MistralForCausalLM" or cfg.get("use_sliding_window"))
    ):
        n = min(n, window)
    return n


def build_gateway(config: GatewayConfig):  # -> Gateway (imports kept local for start-up cost)
    from pagefleet.gateway.discovery import KubernetesDiscovery, StaticDiscovery
    from pagefleet.gateway.policies import make_policy
    from pagefleet.gateway.prompts import PromptTokenizer
    from pagefleet.gateway.router import Router
    from pagefleet.gateway.server import Gateway, ProxySettings
    from pagefleet.httpauth import Credentials, upstream_key_from_env
    from pagefleet.kvindex.memory import MemoryKVIndex

    if config.discovery == "static":
        discovery = StaticDiscovery(
            config.endpoints,
            probe_interval_s=config.probe_interval_s or None,
            probe_timeout_s=config.probe_timeout_s,
            unhealthy_after=config.probe_failures,
            dead_after_s=config.probe_dead_after_s,
        )
    else:
        assert config.service is not None
        discovery = KubernetesDiscovery(config.namespace, config.service, config.target_port_value)
    from pagefleet.kvindex.redis_index import RedisKVIndex

    if config.redis_url:
        from pagefleet.kvindex.redis_auth import warn_if_password_in_url

        warn_if_password_in_url(config.redis_url)
        # Read-only: the gateway only looks up, so it runs no gc (the daemons do) and works
        # with a read-only Redis ACL user (docs/operator.md).
        index = RedisKVIndex.from_url(
            config.redis_url, namespace=config.namespace_key, auto_gc_interval_s=None
        )
    else:
        # Nothing feeds a private in-memory index (daemons publish to Redis only), so
        # cache_aware then routes on this gateway's in-flight counts alone.
        logger.warning("no --redis-url: the prefix index is empty; cache_aware routes on load")
        index = MemoryKVIndex(config.namespace_key)
    tokenizer = (
        PromptTokenizer(_load_tokenizer(config.model), spec=config.model) if config.model else None
    )
    model_dir = Path(config.model).expanduser() if config.model else None
    max_model_len = config.max_model_len or (
        checkpoint_max_len(model_dir) if model_dir is not None else None
    )
    try:
        credentials = Credentials.from_env()
        upstream_key = upstream_key_from_env()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    router = Router(
        discovery=discovery,
        policy=make_policy(config.policy, config.weights),
        index=index,
        block_size=config.block_size,
        kv_namespace=config.namespace_key,
        lookup_timeout_s=config.index_timeout_ms / 1000.0,
        seed=config.seed,
    )
    if isinstance(index, RedisKVIndex) and config.shared_placements and router.policy.uses_index:
        from pagefleet.gateway.shared_placements import SharedPlacements

        router.shared = SharedPlacements(
            index.client, index.prefix + "placements", router.placements
        )
    gateway = Gateway(
        router=router,
        tokenizer=tokenizer,
        served_model_name=config.model_name,
        proxy=ProxySettings(
            max_attempts=config.max_attempts,
            first_byte_timeout_s=config.first_byte_timeout_s,
            inter_chunk_timeout_s=config.inter_chunk_timeout_s,
            request_timeout_s=config.request_timeout_s,
            body_timeout_s=config.body_timeout_s,
            client_write_timeout_s=config.client_write_timeout_s,
            max_body_bytes=config.max_body_bytes,
            max_concurrency=config.max_concurrency,
            max_inflight_body_mb=config.max_inflight_body_mb,
            max_response_bytes=config.max_response_bytes,
            max_model_len=max_model_len,
            intake_workers=config.intake_workers,
        ),
        credentials=credentials,
        upstream_key=upstream_key,
    )
    if config.disaggregated:
        from pagefleet.gateway.pd import PDOrchestrator, PDSettings

        if config.discovery == "static":
            pre_discovery: Any = StaticDiscovery(config.prefill_endpoints)
        else:
            assert config.prefill_service is not None
            pre_discovery = KubernetesDiscovery(
                config.namespace, config.prefill_service, config.target_port_value
            )
        pre_router = Router(
            discovery=pre_discovery,
            policy=make_policy(config.policy, config.weights),
            index=index,
            block_size=config.block_size,
            kv_namespace=config.namespace_key,
            lookup_timeout_s=config.index_timeout_ms / 1000.0,
            seed=config.seed,
        )
        gateway.pd = PDOrchestrator(
            pre_router,
            PDSettings(
                min_uncached_tokens=config.pd_min_uncached_tokens,
                max_prefill_inflight=config.pd_max_prefill_inflight,
                prefill_timeout_s=config.pd_prefill_timeout_s,
            ),
            registry=gateway.metrics.registry,
        )
    return gateway


# After the drain: cancelled handlers unwinding and the app's cleanup (Redis, client
# sessions, the intake workers), bounded so a stuck close cannot hold the exit.
CLEANUP_S = 3.0
# After that, asyncio's teardown and the interpreter's exit (thread joins, atexit): past
# this the watchdog prints every thread's stack to the log and exits the process.
EXIT_S = 2.0


async def serve(config: GatewayConfig, *, exit_watchdog: bool = False) -> None:
    """Serve until SIGTERM/SIGINT, then stop accepting, let open requests finish for up to
    ``config.drain_timeout_s``, cut the rest and clean up. Invariant: the coroutine returns
    within drain + CLEANUP_S of the signal; with ``exit_watchdog`` (the CLI, not in-process
    callers) the process is gone within drain + CLEANUP_S + EXIT_S, stacks logged if late."""
    gateway = build_gateway(config)
    drain_s = config.drain_timeout_s
    # shutdown_timeout is aiohttp's wait for open handlers on cleanup (then they are
    # cancelled, which closes their upstream stream: the daemon aborts the request). Its
    # default, 60 s, kept a gateway with one open stream alive past `pagefleet up`'s 10 s
    # grace (SIGKILLed) and past a pod's termination grace.
    # keepalive_timeout also bounds a connection that never completes its headers
    # (aiohttp's only timer before a request starts); its default, 3630 s, let idle and
    # slowloris connections hold a socket each for an hour.
    runner = web.AppRunner(
        gateway.make_app(),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=drain_s,
        keepalive_timeout=config.keepalive_timeout_s,
    )
    await runner.setup()
    loop = asyncio.get_running_loop()
    # Connections past the cap get a 503 (gateway/connections.py): at the open-files limit
    # the gateway hung every open request and its probes in an accept-error storm.
    quiet_accept_errors(loop)
    assert runner.server is not None
    max_connections = config.max_connections or auto_max_connections()
    gate = ConnectionGate(
        runner.server,
        max_connections,
        on_refused=gateway.metrics.rejected.labels(reason="connections").inc,
        probes=gateway.probe_answers(),
    )
    try:
        listener = await loop.create_server(
            gate, config.host, config.port, backlog=listen_backlog()
        )
    except OSError as exc:
        # Raised as is: a traceback, then "Unclosed client session" from the gateway's
        # upstream session, for the commonest start-up failure (the port in use).
        await runner.cleanup()
        raise click.ClickException(listen_error(config.host, config.port, exc)) from None
    logger.warning(
        "pagefleet gateway listening on http://%s:%d (policy %s, index %s)",
        config.host,
        config.port,
        config.policy,
        "redis" if config.redis_url else "none",
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if exit_watchdog:
        # Covers what no timeout here can: asyncio.run's teardown and the interpreter's
        # exit. Never cancelled: the process is ending either way.
        faulthandler.dump_traceback_later(drain_s + CLEANUP_S + EXIT_S, exit=True)
    listener.close()  # no new connections from here on; the open ones may finish
    server = runner.server
    open_conns = len(server.connections) if server is not None else 0
    logger.warning("stop signal: draining %d open connection(s) (up to %.0fs)", open_conns, drain_s)
    try:
        # aiohttp's Server.shutdown waits up to drain_s for the handlers, then cancels them
        # and waits up to drain_s again: the outer bound keeps the whole at drain + CLEANUP_S.
        async with asyncio.timeout(drain_s + CLEANUP_S):
            await runner.cleanup()
    except TimeoutError:
        logger.error(
            "shutdown did not finish within %.0fs of the stop signal; exiting anyway",
            drain_s + CLEANUP_S,
        )


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--policy", type=click.Choice(POLICY_NAMES), default="cache_aware", show_default=True)
@click.option(
    "--redis-url",
    default=None,
    help="The daemons' prefix index. Without it cache_aware routes on load only. "
    "Credentials from env, never the URL: PAGEFLEET_REDIS_USERNAME, PAGEFLEET_REDIS_PASSWORD "
    "or PAGEFLEET_REDIS_PASSWORD_FILE, PAGEFLEET_REDIS_CA_FILE (rediss://).",
)
@click.option(
    "--kv-namespace",
    default="",
    help="Block-key namespace (default: the served model name, as the daemons).",
)
@click.option(
    "--model",
    default="tiny",
    show_default=True,
    help="Checkpoint directory or tiny preset: its tokenizer computes block keys.",
)
@click.option(
    "--served-model-name",
    default=None,
    help="Model name in the API (default: --model as given; a .gguf file's stem).",
)
@click.option(
    "--block-size",
    default=16,
    show_default=True,
    type=int,
    help="Must equal the daemons' --block-size.",
)
@click.option(
    "--discovery", type=click.Choice(["static", "k8s"]), default="static", show_default=True
)
@click.option("--endpoints", default=None, help="Static discovery: daemon URLs, comma separated.")
@click.option(
    "--namespace",
    default="default",
    show_default=True,
    help="k8s discovery: the Service's namespace.",
)
@click.option("--service", default=None, help="k8s discovery: the daemons' Service.")
@click.option(
    "--target-port", default=None, help="k8s discovery: EndpointSlice port name or number."
)
@click.option(
    "--prefill-url",
    "prefill_endpoints",
    default=None,
    help="P/D, static discovery: prefill daemon URLs, comma separated (the main pool is "
    "then the decode pool: --decode-url or --endpoints).",
)
@click.option(
    "--decode-url",
    "decode_endpoints",
    default=None,
    help="P/D, static discovery: decode daemon URLs, comma separated.",
)
@click.option("--prefill-service", default=None, help="P/D, k8s discovery: prefill Service.")
@click.option("--decode-service", default=None, help="P/D, k8s discovery: decode Service.")
@click.option(
    "--pd-min-uncached-tokens",
    default=256,
    show_default=True,
    type=int,
    help="P/D: prefill remotely only when the decode pod would compute at least this many "
    "prompt tokens (its cached prefix aside); shorter ones prefill on the decode pod.",
)
@click.option(
    "--pd-max-prefill-inflight",
    default=8,
    show_default=True,
    type=int,
    help="P/D: a prefill pod with this many requests in flight (this gateway's, plus what "
    "its Redis heartbeat reports beyond them) takes no more; when every prefill pod is "
    "that busy the decode pod prefills locally.",
)
@click.option(
    "--pd-prefill-timeout",
    "pd_prefill_timeout_s",
    default=30.0,
    show_default=True,
    type=float,
    help="P/D: seconds to wait for a remote prefill before the decode pod prefills locally.",
)
@click.option(
    "--weights",
    default=None,
    help="cache_aware cost weights, e.g. prefill=1,queue=0.25,kv=0.5,imbalance_abs=4.",
)
@click.option(
    "--max-attempts",
    default=3,
    show_default=True,
    type=int,
    help="Pods tried per request when they fail before the first byte.",
)
@click.option("--index-timeout-ms", default=100.0, show_default=True, type=float)
@click.option(
    "--max-body-bytes",
    default=DEFAULT_MAX_BODY_BYTES,
    show_default=True,
    type=int,
    help="Largest request body; keep equal to the daemons' --max-body-bytes.",
)
@click.option(
    "--max-concurrency",
    default=1024,
    show_default=True,
    type=int,
    help="Requests open at once across the gateway; past it, 429 with Retry-After.",
)
@click.option(
    "--max-inflight-body-mb",
    default=DEFAULT_MAX_INFLIGHT_BODY_MB,
    show_default=True,
    type=int,
    help="MiB of request bodies held at once across the gateway (never below one "
    "--max-body-bytes body); a request that would pass it is a 503 with Retry-After, "
    "decided before its body is read. Under a flood of large bodies memory grew by about "
    "1.5 times this.",
)
@click.option(
    "--max-connections",
    default=0,
    show_default=True,
    type=int,
    help="Client connections open at once; past it a new one gets a 503 with Retry-After. "
    "0: what the open-files limit allows (three files per connection, and a reserve).",
)
@click.option(
    "--max-response-bytes",
    default=256 << 20,
    show_default=True,
    type=int,
    help="Largest non-streamed answer the gateway holds to relay; past it, a 502 "
    "(streams are passed through, not held).",
)
@click.option(
    "--max-model-len",
    default=None,
    type=int,
    help="Context length prompts are checked against (default: the checkpoint's).",
)
@click.option(
    "--first-byte-timeout",
    "first_byte_timeout_s",
    default=60.0,
    show_default=True,
    type=float,
    help="Streams: seconds to the first byte before the request moves to the next pod.",
)
@click.option(
    "--inter-chunk-timeout",
    "inter_chunk_timeout_s",
    default=30.0,
    show_default=True,
    type=float,
    help="Streams: longest silence between chunks before the stream ends with an error.",
)
@click.option(
    "--request-timeout",
    "request_timeout_s",
    default=600.0,
    show_default=True,
    type=float,
    help="Non-streamed requests: seconds for the whole answer.",
)
@click.option(
    "--body-timeout",
    "body_timeout_s",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds a request body may take to arrive after its headers (then a 408).",
)
@click.option(
    "--client-write-timeout",
    "client_write_timeout_s",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds a client may leave sent bytes unread before it is cut (a stream's pod "
    "request with it).",
)
@click.option(
    "--keepalive-timeout",
    "keepalive_timeout_s",
    default=75.0,
    show_default=True,
    type=float,
    help="Seconds an idle connection, or one still sending its headers, is kept open; "
    "keep it above the idle timeout of a load balancer in front (GCP's: 600 s).",
)
@click.option(
    "--probe-interval",
    "probe_interval_s",
    default=1.0,
    show_default=True,
    type=float,
    help="Static discovery: seconds between /ready probes of each pod (0: no probing).",
)
@click.option(
    "--probe-timeout",
    "probe_timeout_s",
    default=1.0,
    show_default=True,
    type=float,
    help="Static discovery: a probe not answered in this many seconds is a miss.",
)
@click.option(
    "--probe-failures",
    default=2,
    show_default=True,
    type=int,
    help="Static discovery: misses in a row after which no new request is routed to a pod; "
    "its open requests go on, unless every one of those probes was refused (nothing listens).",
)
@click.option(
    "--probe-dead-after",
    "probe_dead_after_s",
    default=10.0,
    show_default=True,
    type=float,
    help="Static discovery: seconds a pod may answer no probe at all before the requests "
    "waiting on it are released to other pods (a busy pod answers late, a frozen one never).",
)
@click.option(
    "--intake-workers",
    default=2,
    show_default=True,
    type=int,
    help="Processes that parse and tokenize large bodies off the event loop (0: inline).",
)
@click.option(
    "--shared-placements/--no-shared-placements",
    default=True,
    show_default=True,
    help="With --redis-url: share where this replica sent each prompt with the other "
    "gateway replicas (Redis pub/sub), so a burst split over replicas lands together "
    "before the index learns its blocks. Needs publish/subscribe rights on the channel "
    "'pf:{ns=NAMESPACE}:placements'.",
)
@click.option(
    "--drain-timeout",
    "drain_timeout_s",
    default=20.0,
    show_default=True,
    type=float,
    help="On SIGTERM: seconds open requests (streams) get to finish before they are cut; "
    "keep it a few seconds below the pod's termination grace.",
)
@click.option("--seed", default=None, type=int, help="Seed the tie-break RNG (tests, benchmarks).")
@click.option(
    "--log-level",
    default="warning",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
def command(**kw: object) -> None:
    """Run the cache-aware OpenAI-compatible gateway in front of pagefleet daemons.

    API keys come from the environment, never flags: PAGEFLEET_API_KEYS (comma separated)
    and/or PAGEFLEET_API_KEYS_FILE (one per line). Without them every client is served.
    Daemons that require keys get PAGEFLEET_UPSTREAM_API_KEY (or _FILE) on every request,
    prefill and KV release included.
    """
    logging.basicConfig(
        level=str(kw["log_level"]).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        weights = RoutingWeights.parse(kw.pop("weights"))  # type: ignore[arg-type]
        lists = ("endpoints", "prefill_endpoints", "decode_endpoints")
        config = GatewayConfig(
            **{k: v for k, v in kw.items() if k not in lists},  # type: ignore[arg-type]
            **{k: _split(kw[k]) for k in lists},  # type: ignore[arg-type]
            weights=weights,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    raise_open_files_limit("gateway")
    asyncio.run(serve(config, exit_watchdog=True))
