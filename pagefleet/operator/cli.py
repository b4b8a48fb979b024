"""`pagefleet operator`: run the kopf operator with the pagefleet handlers."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import click

from pagefleet.operator.builders import BuildSettings


@click.command("operator")
@click.option(
    "--namespace",
    "-n",
    "namespaces",
    multiple=True,
    help="Watch only this namespace (repeatable; glob patterns allowed).",
)
@click.option(
    "--all-namespaces",
    "-A",
    is_flag=True,
    help="Watch InferenceServices in every namespace (needs the ClusterRole).",
)
@click.option(
    "--standalone/--peering",
    default=True,
    show_default=True,
    help="Standalone runs without kopf's peering CRDs (one operator replica).",
)
@click.option(
    "--default-redis-url",
    envvar="PAGEFLEET_DEFAULT_REDIS_URL",
    default=None,
    help="Redis for InferenceServices that set no spec.index.redisURL (the chart's bundled one).",
)
@click.option(
    "--default-redis-secret",
    envvar="PAGEFLEET_DEFAULT_REDIS_SECRET",
    default=None,
    help="Secret with the bundled Redis' ACL passwords (keys daemon-password, "
    "gateway-password) for InferenceServices on --default-redis-url.",
)
@click.option(
    "--default-redis-password",
    envvar="PAGEFLEET_DEFAULT_REDIS_PASSWORD",
    default=None,
    hidden=True,  # environment only: a password on the command line is readable by all
    help="Password of the bundled Redis' read-only user pf-gateway (the autoscaler reads "
    "the load heartbeats with it).",
)
@click.option(
    "--resync-seconds",
    type=click.FloatRange(min=1.0),
    default=30.0,
    show_default=True,
    help="Full reconcile period per InferenceService (repairs hand-edited children).",
)
@click.option(
    "--liveness",
    "liveness_endpoint",
    default=None,
    help="Serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz.",
)
@click.option(
    "--allowed-image-prefix",
    "allowed_image_prefixes",
    multiple=True,
    envvar="PAGEFLEET_ALLOWED_IMAGE_PREFIXES",
    help="Run only InferenceServices whose spec.image starts with this (repeatable; "
    "none: any image). Others get Degraded=True, reason ImageNotAllowed.",
)
@click.option(
    "--allow-host-path/--no-allow-host-path",
    default=False,
    show_default=True,
    help="Allow model.source.hostPath (mounts a node directory into the pods).",
)
@click.option(
    "--network-policies/--no-network-policies",
    default=True,
    show_default=True,
    help="Create NetworkPolicies: only the gateway (and --metrics-peer) reach the daemons.",
)
@click.option(
    "--metrics-peer",
    "metrics_peers",
    multiple=True,
    help="A NetworkPolicyPeer (JSON) allowed to the daemons' port for /metrics, e.g. "
    '\'{"namespaceSelector":{},"podSelector":{"matchLabels":{"app":"prometheus"}}}\' '
    "(repeatable).",
)
@click.option(
    "--autoscale-seconds",
    type=click.FloatRange(min=0.5),
    default=5.0,
    show_default=True,
    help="Autoscaler timer per InferenceService; each role decides every "
    "autoscaling.intervalSeconds (rounded up to this).",
)
@click.option(
    "--scrape-timeout-seconds",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Per-pod /metrics and Redis timeout of the autoscaler; a pod slower than this "
    "counts as unknown.",
)
@click.option(
    "--rate-window-seconds",
    type=click.FloatRange(min=1.0),
    default=30.0,
    show_default=True,
    help="History the autoscaler's rates and latency percentiles span (PromQL rate[window]).",
)
@click.option(
    "--prometheus-url",
    envvar="PAGEFLEET_PROMETHEUS_URL",
    default=None,
    help="Read the autoscaler's inputs from this Prometheus (one PromQL query per input; "
    "it must scrape the daemons with a namespace label) instead of scraping every pod.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    default=0,
    show_default=True,
    help="Serve the operator's Prometheus metrics (docs/metrics.md) on this port; 0: off "
    "(the Helm chart turns it on).",
)
@click.option(
    "--metrics-host",
    default="0.0.0.0",
    show_default=True,
    help="Address the metrics port binds.",
)
@click.option("--verbose", "-v", is_flag=True, help="Log every handler run.")
def command(
    namespaces: tuple[str, ...],
    all_namespaces: bool,
    standalone: bool,
    default_redis_url: str | None,
    default_redis_secret: str | None,
    default_redis_password: str | None,
    resync_seconds: float,
    liveness_endpoint: str | None,
    allowed_image_prefixes: tuple[str, ...],
    allow_host_path: bool,
    network_policies: bool,
    metrics_peers: tuple[str, ...],
    autoscale_seconds: float,
    scrape_timeout_seconds: float,
    rate_window_seconds: float,
    prometheus_url: str | None,
    metrics_port: int,
    metrics_host: str,
    verbose: bool,
) -> None:
    """Run the InferenceService operator (kubeconfig or in-cluster credentials)."""
    import kopf

    from pagefleet.operator.autoscaler import Autoscaler, AutoscalerSettings
    from pagefleet.operator.handlers import OperatorContext, register
    from pagefleet.operator.kube import RestKube
    from pagefleet.operator.metrics import OperatorMetrics

    if bool(namespaces) == all_namespaces:
        raise click.UsageError("pass either --namespace NS (repeatable) or --all-namespaces")
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    registry = register(
        kopf.OperatorRegistry(), resync_s=resync_seconds, autoscale_s=autoscale_seconds
    )
    settings = BuildSettings(
        default_redis_url=default_redis_url,
        default_redis_secret=default_redis_secret,
        allowed_image_prefixes=tuple(p for p in allowed_image_prefixes if p),
        allow_host_path=allow_host_path,
        network_policies=network_policies,
        metrics_peers=tuple(_peer(p) for p in metrics_peers),
    )
    kube = RestKube()
    metrics = OperatorMetrics()
    if metrics_port:
        metrics.serve(metrics_port, metrics_host)
    autoscaler = Autoscaler(
        kube,
        settings,
        AutoscalerSettings(
            scrape_timeout_s=scrape_timeout_seconds,
            rate_window_s=rate_window_seconds,
            prometheus_url=prometheus_url,
            default_redis_password=default_redis_password,
        ),
        metrics,
    )
    ctx = OperatorContext(kube=kube, settings=settings, autoscaler=autoscaler, metrics=metrics)
    asyncio.run(
        kopf.operator(
            registry=registry,
            standalone=standalone,
            clusterwide=all_namespaces,
            namespaces=list(namespaces),
            liveness_endpoint=liveness_endpoint,
            memo=kopf.Memo(ctx=ctx),
        )
    )


def _peer(text: str) -> dict[str, Any]:
    try:
        peer = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"--metrics-peer {text!r} is not JSON: {exc}") from exc
    if not isinstance(peer, dict) or not peer.keys() <= {
        "podSelector",
        "namespaceSelector",
        "ipBlock",
    }:
        raise click.BadParameter(
            f"--metrics-peer {text!r}: expected a NetworkPolicyPeer object with "
            "podSelector / namespaceSelector / ipBlock"
        )
    return peer
