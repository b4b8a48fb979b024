"""The dashboard's main SLO panels as PNGs (matplotlib), for `pagefleet bench --plot` and docs.

Two sources, same pictures:
- ``plot_from_prometheus``: the dashboard's own queries (pagefleet/dev/dashboards.py), run
  as ``query_range`` over the bench's time span, variables substituted as Grafana would;
- ``plot_from_samples``: the bench's per-request samples, bucketed in time, when there is no
  Prometheus.

Files: ``slo_latency.png`` (TTFT, TPOT, ITL p50/p90/p99) and ``slo_goodput_cache.png``
(goodput, prefix-cache hit rate, tokens/s, requests per pod).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagefleet.dev.dashboards import ROWS, PanelSpec, substitute

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from pagefleet.dev.loadgen import RequestResult
    from pagefleet.dev.prometheus import PrometheusAPI

# (file, panel titles) in the order drawn; titles are the dashboard's.
FIGURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("slo_latency.png", ("Time to first token", "Time per output token", "Inter-token latency")),
    (
        "slo_goodput_cache.png",
        (
            "Goodput: share of requests within the SLO",
            "Prefix-cache hit rate",
            "Tokens per second",
            "Requests per pod",
        ),
    ),
)
# series label -> list of (unix time, value)
Series = dict[str, list[tuple[float, float]]]


def _panel(title: str) -> PanelSpec:
    for _, panels in ROWS:
        for p in panels:
            if p.title == title:
                return p
    raise KeyError(f"no dashboard panel titled {title!r}")


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def _draw(figure_name: str, panels: Sequence[tuple[PanelSpec, Series]], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3 if len(panels) == 3 else 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    t0 = min((pts[0][0] for _, s in panels for pts in s.values() if pts), default=0.0)
    for ax, (spec, series) in zip(axes.flat, panels, strict=False):
        _plot_panel(ax, spec, series, t0)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / figure_name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_panel(ax: Axes, spec: PanelSpec, series: Series, t0: float) -> None:
    scale, unit = (1000.0, "ms") if spec.unit == "s" else (1.0, "")
    for label, pts in sorted(series.items()):
        pts = [(t, v) for t, v in pts if math.isfinite(v)]
        if pts:
            ax.plot([t - t0 for t, _ in pts], [v * scale for _, v in pts], label=label, lw=1.4)
    ax.set_title(spec.title, fontsize=10)
    ax.set_xlabel("seconds")
    if spec.unit == "percentunit":
        ax.set_ylim(0, 1.05)
    elif unit:
        ax.set_ylabel(unit)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7, loc="best")


def plot_from_prometheus(
    api: PrometheusAPI,
    out_dir: Path,
    start: float,
    end: float,
    variables: dict[str, str] | None = None,
    rate: str = "30s",
    step_s: float = 2.0,
) -> list[Path]:
    """Run each panel's queries as query_range over [start, end]; one PNG per figure."""
    paths = []
    for name, titles in FIGURES:
        panels = []
        for title in titles:
            spec = _panel(title)
            series: Series = {}
            for q in spec.queries:
                expr = substitute(q.expr, variables, rate)
                for r in api.query_range(expr, start, end, step_s):
                    label = _legend(q.legend, r["metric"]) or q.legend
                    label = substitute(label, variables, rate) if "$" in label else label
                    series[label] = [(float(t), float(v)) for t, v in r["values"]]
            panels.append((spec, series))
        paths.append(_draw(name, panels, out_dir))
    return paths


def _pcts(values: list[float]) -> dict[str, float]:
    vals = sorted(values)
    return {f"p{q}": vals[min(len(vals) - 1, int(q / 100 * len(vals)))] for q in (50, 90, 99)}


def plot_from_samples(
    results: Sequence[RequestResult],
    out_dir: Path,
    slo_ttft_s: float,
    slo_tpot_s: float,
    bin_s: float = 5.0,
) -> list[Path]:
    """The same figures from the bench's own per-request samples, in `bin_s` time bins
    (by request start; ITL by token)."""
    ok = [r for r in results if r.ok]
    if not ok:
        return []
    t0 = min(r.start for r in ok)
    bins: dict[float, list[RequestResult]] = defaultdict(list)
    for r in ok:
        bins[t0 + (r.start - t0) // bin_s * bin_s + bin_s / 2].append(r)
    latency: dict[str, Series] = {"ttft": {}, "tpot": {}, "itl": {}}
    goodput: Series = {}
    tokens: Series = {}
    pods: Series = {}
    hit: Series = {}
    for t, rs in sorted(bins.items()):
        metrics = {
            "ttft": [r.ttft for r in rs],
            "tpot": [r.tpot for r in rs if not math.isnan(r.tpot)],
            "itl": [x for r in rs for x in r.itls],
        }
        for key, vals in metrics.items():
            if vals:
                for label, v in _pcts(vals).items():
                    latency[key].setdefault(label, []).append((t, v))
        goodput.setdefault(f"TTFT <= {slo_ttft_s:g}s", []).append(
            (t, sum(r.ttft <= slo_ttft_s for r in rs) / len(rs))
        )
        with_tpot = [r for r in rs if not math.isnan(r.tpot)]
        if with_tpot:
            goodput.setdefault(f"TPOT <= {slo_tpot_s:g}s", []).append(
                (t, sum(r.tpot <= slo_tpot_s for r in with_tpot) / len(with_tpot))
            )
        tokens.setdefault("prompt", []).append((t, sum(r.prompt_tokens for r in rs) / bin_s))
        tokens.setdefault("generated", []).append((t, sum(r.completion_tokens for r in rs) / bin_s))
        prompt = sum(r.prompt_tokens for r in rs)
        hit.setdefault("cluster", []).append(
            (t, sum(r.cached_tokens for r in rs) / prompt if prompt else math.nan)
        )
        for pod in {r.pod for r in ok}:
            pods.setdefault(pod or "?", []).append((t, sum(r.pod == pod for r in rs) / bin_s))
    figures: dict[str, Series] = {
        "Time to first token": latency["ttft"],
        "Time per output token": latency["tpot"],
        "Inter-token latency": latency["itl"],
        "Goodput: share of requests within the SLO": goodput,
        "Prefix-cache hit rate": hit,
        "Tokens per second": tokens,
        "Requests per pod": pods,
    }
    return [
        _draw(name, [(_panel(t), figures[t]) for t in titles], out_dir) for name, titles in FIGURES
    ]


def plot_bench(
    results: Sequence[RequestResult],
    report: dict[str, Any],
    out_dir: Path,
    prometheus_url: str | None,
    slo_ttft_s: float,
    slo_tpot_s: float,
    start: float,
    end: float,
) -> list[Path]:
    """`pagefleet bench --plot`: from Prometheus when given, else from the samples."""
    if prometheus_url:
        from pagefleet.dev.prometheus import PrometheusAPI

        # `le` label strings as prometheus-client writes them ("2.0", "0.1").
        variables = {"ttft_slo": str(float(slo_ttft_s)), "tpot_slo": str(float(slo_tpot_s))}
        return plot_from_prometheus(PrometheusAPI(prometheus_url), out_dir, start, end, variables)
    return plot_from_samples(results, out_dir, slo_ttft_s, slo_tpot_s)


def render_docs_figures(out_dir: Path, num_requests: int = 200) -> list[Path]:
    """Docs helper (`python -m pagefleet.dev.slo_plots docs/img`): a local fleet (Redis,
    2 daemons, gateway) scraped by a local Prometheus under ~a minute of open-loop load;
    the figures are drawn from Prometheus with the dashboard's queries. The SLO targets are
    tight (TTFT 0.2 s, TPOT 20 ms) so goodput shows something on a tiny CPU model."""
    import asyncio
    import time

    from pagefleet.dev.loadgen import BenchOptions, run_bench
    from pagefleet.dev.local_fleet import FleetSpec, LocalFleet
    from pagefleet.dev.prometheus import LocalPrometheus, ScrapeTarget

    with LocalFleet(FleetSpec(num_daemons=2, seed=0, num_gpu_blocks=256)) as fleet:
        labels = {"namespace": "default", "inferenceservice": "tiny"}
        urls = [*fleet.daemon_urls, fleet.gateway_url]
        targets = [ScrapeTarget(u.removeprefix("http://"), labels) for u in urls]
        with LocalPrometheus(targets, interval_s=1.0) as prom:
            while prom.api.targets_up() < len(targets):
                time.sleep(0.5)
            start = time.time()
            opts = BenchOptions(
                url=fleet.gateway_url,
                model=fleet.served_model_name,
                num_requests=num_requests,
                request_rate=1.5,
                num_tenants=6,
                max_tokens=16,
                progress=False,
            )
            asyncio.run(run_bench(opts))
            time.sleep(3)
            variables = {"ttft_slo": "0.2", "tpot_slo": "0.02"}
            return plot_from_prometheus(
                prom.api, out_dir, start + 15, time.time(), variables, rate="15s"
            )


if __name__ == "__main__":
    import sys

    for path in render_docs_figures(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img")):
        print(f"wrote {path}")
