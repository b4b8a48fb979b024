"""``pagefleet bench``: drive a seeded chat workload through a gateway; print a report.

Uses the official ``openai`` client (async, streaming) the way an application would.
Turn k+1 of a conversation is sent only after turn k finished, so a chat's prompt grows
exactly as in real use. Conversations start closed-loop by default (``--concurrency``
workers each take the next one), or open-loop with ``--request-rate R``: conversations
arrive as a seeded Poisson process of R per second whatever the fleet's speed, so policies
compared at one rate face the same offered load (closed loop hands the faster policy more
load, which hides part of its lead).

Figures: TTFT = first streamed token; ITL = gaps between streamed tokens; TPOT =
(end-to-end - TTFT) / (output tokens - 1); goodput = requests meeting both SLOs per second;
cluster prefix hit rate = sum(cached_tokens) / sum(prompt_tokens) from the usage the
daemons report; per-pod share from the gateway's ``x-pagefleet-pod`` header (a daemon
does not send it: bench pointed at one reports the share as unknown, not a pod "").
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagefleet.api.cost import cost_per_million_tokens
from pagefleet.dev.workload import Conversation, WorkloadSpec, build_conversations

logger = logging.getLogger(__name__)

POD_HEADER = "x-pagefleet-pod"
HIT_HEADER = "x-pagefleet-predicted-hit-tokens"
ROUTE_HEADER = "x-pagefleet-route"


class BenchOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    url: str
    model: str = "tiny"
    num_requests: int = Field(48, ge=1, description="conversations are added until this many turns")
    concurrency: int = Field(8, ge=1)
    request_rate: float | None = Field(
        None, gt=0, description="conversations per second, Poisson (open loop); None: closed"
    )
    seed: int = 0
    num_tenants: int = Field(16, ge=1)
    system_prompt_words: int = Field(120, ge=1)
    max_turns: int = Field(3, ge=1)
    max_tokens: int = Field(16, ge=1)
    zipf_s: float = 1.1
    salt: str = ""
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 100.0
    plot_dir: Path | None = None
    prometheus_url: str | None = None
    tokenizer_dir: str | None = None
    progress: bool = True
    timeout_s: float = 120.0
    cost_per_hour: float = Field(0.0, ge=0, description="dollars per hour per replica")
    replicas: int = Field(1, ge=1, description="replicas behind --url (for the cost)")

    def load_description(self) -> str:
        """The load the figures were measured under, in the report's words: throughput and
        latency mean little without it."""
        if self.request_rate is None:
            arrival = f"closed loop, {self.concurrency} conversations in flight"
        else:
            arrival = f"open loop, {self.request_rate:g} new conversations/s (Poisson)"
        return (
            f"load: {arrival}; {self.num_tenants} tenants, up to {self.max_turns} turns each, "
            f"{self.max_tokens} output tokens per request (ignore_eos)"
        )

    def workload(self) -> WorkloadSpec:
        return WorkloadSpec(
            num_conversations=self.num_requests,  # trimmed to num_requests turns below
            num_tenants=self.num_tenants,
            system_prompt_words=self.system_prompt_words,
            max_turns=self.max_turns,
            zipf_s=self.zipf_s,
            max_tokens=self.max_tokens,
            seed=self.seed,
            salt=self.salt,
        )


@dataclass(slots=True)
class RequestResult:
    conversation: int
    turn: int
    tenant: int
    ok: bool
    error: str = ""
    pod: str = ""
    start: float = 0.0
    ttft: float = math.nan
    e2e: float = math.nan
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    predicted_hit: int = -1  # the gateway's x-pagefleet-predicted-hit-tokens; -1: not sent
    route: str = ""  # the gateway's x-pagefleet-route ("placement/reason"); "": not sent

    @property
    def tpot(self) -> float:
        if self.completion_tokens <= 1 or math.isnan(self.e2e):
            return math.nan
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def trim(convs: list[Conversation], num_requests: int) -> list[Conversation]:
    """The first conversations whose turns add up to ``num_requests`` (last one cut short)."""
    out: list[Conversation] = []
    left = num_requests
    for c in convs:
        if left <= 0:
            break
        turns = c.turns[:left]
        left -= len(turns)
        out.append(Conversation(c.id, c.tenant, turns))
    return out


async def _one_turn(client: Any, model: str, turn: Any, timeout_s: float) -> RequestResult:
    res = RequestResult(turn.conversation, turn.index, turn.tenant, ok=False)
    t0 = time.perf_counter()
    res.start = t0
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=turn.as_openai(),
            max_tokens=turn.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            timeout=timeout_s,
        )
        res.pod = raw.headers.get(POD_HEADER, "")
        res.predicted_hit = int(raw.headers.get(HIT_HEADER, -1))
        res.route = raw.headers.get(ROUTE_HEADER, "")
        last = None
        async for chunk in raw.parse():
            now = time.perf_counter()
            if chunk.choices:
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
            if chunk.usage is not None:
                res.prompt_tokens = chunk.usage.prompt_tokens
                res.completion_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                res.cached_tokens = (details.cached_tokens or 0) if details else 0
        res.e2e = time.perf_counter() - t0
        res.ok = not math.isnan(res.ttft)
        if not res.ok:
            res.error = "stream ended without a token"
    except Exception as exc:  # a failed request is a data point, not a crash of the bench
        res.error = f"{type(exc).__name__}: {exc}"
        res.e2e = time.perf_counter() - t0
    return res


async def run_workload(
    url: str,
    model: str,
    convs: list[Conversation],
    concurrency: int,
    progress: bool = True,
    timeout_s: float = 120.0,
    request_rate: float | None = None,
    seed: int = 0,
    think_s: float = 0.0,
) -> tuple[list[RequestResult], float]:
    """Run conversations; returns per-turn results and the wall time.

    ``think_s``: pause between a turn's last byte and the next turn (an agent's tool call
    takes a few ms; a person takes seconds).

    ``request_rate`` None: closed loop, ``concurrency`` conversations in flight. Otherwise
    open loop: conversation i starts at the i-th arrival of a Poisson process of
    ``request_rate`` per second (seeded), however many are still in flight.
    """
    import openai

    client = openai.AsyncOpenAI(
        base_url=url.rstrip("/") + "/v1", api_key="pagefleet", max_retries=0, timeout=timeout_s
    )
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for c in convs:
        queue.put_nowait(c)
    total = sum(len(c.turns) for c in convs)
    results: list[RequestResult] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="requests", unit="req", leave=False)

    async def converse(conv: Conversation) -> None:
        for k, turn in enumerate(conv.turns):  # turn k+1 only after turn k finished
            if k and think_s > 0:
                await asyncio.sleep(think_s)
            results.append(await _one_turn(client, model, turn, timeout_s))
            if bar is not None:
                bar.update(1)

    async def worker() -> None:
        while True:
            try:
                conv = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await converse(conv)

    async def scheduled(conv: Conversation, at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        await converse(conv)

    t0 = time.perf_counter()
    try:
        if request_rate is None:
            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(convs)))))
        else:
            arrivals = poisson_arrivals(len(convs), request_rate, seed)
            await asyncio.gather(*(scheduled(c, at) for c, at in zip(convs, arrivals, strict=True)))
    finally:
        wall = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        await client.close()
    return results, wall


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Start times (s) of ``n`` arrivals of a Poisson process of ``rate`` per second; the
    first at 0. The same seed gives the same times, so every policy sees one schedule."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 per second, got {rate}")
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _pct(values: list[float], q: float) -> float:
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    k = (len(vals) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def summarize(
    results: list[RequestResult],
    wall_s: float,
    slo_ttft_ms: float = 500.0,
    slo_tpot_ms: float = 100.0,
) -> dict[str, Any]:
    """Report figures (times in ms) from per-request results."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [r.tpot * 1000 for r in ok]
    itl = [x * 1000 for r in ok for x in r.itls]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    good = [
        r
        for r in ok
        if r.ttft * 1000 <= slo_ttft_ms and (math.isnan(r.tpot) or r.tpot * 1000 <= slo_tpot_ms)
    ]
    # Only a gateway names the pod it routed to; a request without the header is counted
    # apart, never as a pod named "".
    pods = Counter(r.pod for r in ok if r.pod)
    routed = sum(pods.values())
    report: dict[str, Any] = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "wall_s": round(wall_s, 3),
        "throughput_req_s": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        "throughput_out_tok_s": round(out_tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "goodput_req_s": round(len(good) / wall_s, 3) if wall_s > 0 else 0.0,
        "slo_attainment": round(len(good) / len(results), 4) if results else 0.0,
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": out_tokens,
        "pod_share": {p: round(n / routed, 4) for p, n in sorted(pods.items())},
        # None: no response named its pod (bench pointed at a daemon, not a gateway).
        "max_pod_share": round(max(pods.values()) / routed, 4) if routed else None,
        "requests_without_pod": len(ok) - routed,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    report["ttft_ms_mean"] = round(sum(ttft) / len(ttft), 2) if ttft else None
    for name, vals in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        for q in (0.5, 0.9, 0.99):
            v = _pct(vals, q)
            report[f"{name}_p{int(q * 100)}"] = None if math.isnan(v) else round(v, 2)
    return report


def print_report(report: dict[str, Any], title: str = "pagefleet bench") -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=title, show_header=True)
    t.add_column("metric")
    t.add_column("p50", justify="right")
    t.add_column("p90", justify="right")
    t.add_column("p99", justify="right")
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        t.add_row(name, *(_cell(report.get(f"{name}_p{q}")) for q in (50, 90, 99)))
    console.print(t)
    # The table's names are terse; say once what each measures (the table is narrower
    # than this line, which a caption would wrap into four).
    console.print(
        "TTFT: time to first token; TPOT: time per output token after the first; "
        "ITL: gap between streamed tokens; in ms"
    )
    console.print(
        f"requests {report['requests']} (failed {report['failed']}) in {report['wall_s']} s | "
        f"throughput {report['throughput_req_s']} req/s, "
        f"{report['throughput_out_tok_s']} output tok/s | goodput {report['goodput_req_s']} "
        f"req/s ({report['slo_attainment']:.0%} within SLO: TTFT <= {report['slo_ttft_ms']:g} "
        f"ms, TPOT <= {report['slo_tpot_ms']:g} ms)"
    )
    console.print(
        f"cluster prefix hit rate {report['prefix_hit_rate']:.1%} ({report['cached_tokens']} "
        f"of {report['prompt_tokens']} prompt tokens served from the prefix cache) | "
        + _pod_share_text(report)
    )
    if "cost_per_1m_output_tokens" in report:
        console.print(
            f"cost per 1M tokens: input ${report['cost_per_1m_input_tokens']}, "
            f"output ${report['cost_per_1m_output_tokens']}"
        )
    if report["errors"]:
        console.print(f"[red]errors: {report['errors']}[/red]")


def _cell(value: float | None) -> str:
    """A percentile for the table: "-" when no request produced one (e.g. no ITL when
    every answer is one token), not Python's "None"."""
    return "-" if value is None else str(value)


def _pod_share_text(report: dict[str, Any]) -> str:
    """Where requests went, as the gateway's x-pagefleet-pod header said; "unknown" when
    no response carried it (a daemon sends none), never a pod named "?"."""
    if not report["pod_share"]:
        return (
            "per-pod share unknown: no response carried the x-pagefleet-pod header (only a "
            "pagefleet gateway sets it; --url names a daemon or another server)"
        )
    text = "per-pod share " + ", ".join(f"{p} {s:.0%}" for p, s in report["pod_share"].items())
    if report["requests_without_pod"]:
        text += f" (of the requests that named their pod; {report['requests_without_pod']} did not)"
    return text


def write_plots(results: list[RequestResult], report: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.ok]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (label, vals) in zip(
        axes,
        (
            ("TTFT (ms)", [r.ttft * 1000 for r in ok]),
            ("TPOT (ms)", [r.tpot * 1000 for r in ok if not math.isnan(r.tpot)]),
            ("ITL (ms)", [x * 1000 for r in ok for x in r.itls]),
        ),
        strict=True,
    ):
        vals = sorted(vals)
        if vals:
            ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))])
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    share = report["pod_share"]
    ax.bar(range(len(share)), list(share.values()))
    ax.set_xticks(range(len(share)), list(share), rotation=20, fontsize=8)
    if not share:  # an empty chart would read as "no requests"
        ax.text(0.5, 0.5, "unknown: no x-pagefleet-pod header", ha="center", transform=ax.transAxes)
    ax.set_ylabel("share of requests")
    ax.set_title(f"per-pod share (prefix hit rate {report['prefix_hit_rate']:.0%})")
    fig.tight_layout()
    paths.append(out_dir / "pod_share.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


async def run_bench(opts: BenchOptions) -> tuple[dict[str, Any], list[RequestResult]]:
    convs = trim(build_conversations(opts.workload()), opts.num_requests)
    results, wall = await run_workload(
        opts.url,
        opts.model,
        convs,
        opts.concurrency,
        opts.progress,
        opts.timeout_s,
        request_rate=opts.request_rate,
        seed=opts.seed,
    )
    report = summarize(results, wall, opts.slo_ttft_ms, opts.slo_tpot_ms)
    add_cost(report, opts.cost_per_hour * opts.replicas)
    return report, results


def add_cost(report: dict[str, Any], dollars_per_hour: float) -> None:
    """Cost per 1M input and output tokens of the run (api/cost.py), when priced."""
    if dollars_per_hour <= 0:
        return
    tokens_by_kind = (("input", report["prompt_tokens"]), ("output", report["completion_tokens"]))
    for kind, tokens in tokens_by_kind:
        price = cost_per_million_tokens(dollars_per_hour, report["wall_s"], tokens)
        report[f"cost_per_1m_{kind}_tokens"] = None if price is None else round(price, 4)


def run_bench_sync(opts: BenchOptions) -> dict[str, Any]:
    started = time.time()
    report, results = asyncio.run(run_bench(opts))
    ended = time.time()
    print_report(report, f"pagefleet bench: {report['requests']} chat requests via {opts.url}")
    click.echo(opts.load_description())
    if opts.plot_dir is not None:
        from pagefleet.dev.slo_plots import plot_bench

        paths = write_plots(results, report, opts.plot_dir)
        paths += plot_bench(
            results,
            report,
            opts.plot_dir,
            opts.prometheus_url,
            opts.slo_ttft_ms / 1000,
            opts.slo_tpot_ms / 1000,
            started,
            ended,
        )
        for p in paths:
            click.echo(f"wrote {p}", err=True)
    return report


def served_model(url: str, timeout_s: float = 10.0) -> str:
    """The one model ``url`` serves, from its ``GET /v1/models``: a fixed default name made
    `pagefleet up --model tiny` then `pagefleet bench --url ...` fail every request (404)."""
    import openai

    client = openai.OpenAI(
        base_url=url.rstrip("/") + "/v1", api_key="pagefleet", max_retries=0, timeout=timeout_s
    )
    try:
        names = [m.id for m in client.models.list()]
    except openai.OpenAIError as exc:
        raise click.ClickException(
            f"cannot list the models at {url}/v1/models ({type(exc).__name__}: {exc}); "
            "check --url, or name the model with --model"
        ) from None
    finally:
        client.close()
    if len(names) != 1:
        raise click.ClickException(
            f"{url}/v1/models lists {names or 'no models'}: name the one to drive with --model"
        )
    return names[0]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url", required=True, help="Gateway (or daemon) base URL, e.g. http://127.0.0.1:8080"
)
@click.option(
    "--model",
    default=None,
    help="Served model name, as GET /v1/models lists it (`pagefleet up` prints it). "
    "Default: the one model --url serves.",
)
@click.option("-n", "--num-requests", default=48, show_default=True, type=int)
@click.option(
    "-c",
    "--concurrency",
    default=8,
    show_default=True,
    type=int,
    help="Conversations in flight (closed loop; ignored with --request-rate).",
)
@click.option(
    "--request-rate",
    default=None,
    type=float,
    help="Open loop: new conversations per second (Poisson, seeded) instead of --concurrency.",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--num-tenants", default=16, show_default=True, type=int, help="Distinct shared system prompts."
)
@click.option("--system-prompt-words", default=120, show_default=True, type=int)
@click.option("--max-turns", default=3, show_default=True, type=int)
@click.option("--max-tokens", default=16, show_default=True, type=int)
@click.option(
    "--zipf-s", default=1.1, show_default=True, type=float, help="Tenant popularity skew."
)
@click.option(
    "--cost-per-hour",
    default=0.0,
    show_default=True,
    type=float,
    help="Dollars per hour per replica: the report adds cost per 1M input and output tokens.",
)
@click.option(
    "--replicas", default=1, show_default=True, type=int, help="Replicas behind --url (cost)."
)
@click.option("--slo-ttft-ms", default=500.0, show_default=True, type=float)
@click.option("--slo-tpot-ms", default=100.0, show_default=True, type=float)
@click.option(
    "--plot",
    "plot_dir",
    default=None,
    type=click.Path(path_type=Path),
    help="Write PNG plots into this directory: latency CDFs, per-pod share and the "
    "dashboard's SLO panels (from --prometheus, else from the bench's own samples).",
)
@click.option(
    "--prometheus",
    "prometheus_url",
    default=None,
    help="Prometheus scraping the fleet (e.g. http://127.0.0.1:9090): --plot then draws the "
    "dashboard's SLO panels from its query_range data.",
)
@click.option("--json", "as_json", is_flag=True, help="Also print the report as one JSON line.")
@click.option("--no-progress", is_flag=True)
def command(as_json: bool, no_progress: bool, model: str | None, **kw: Any) -> None:
    """Drive a seeded multi-tenant chat workload through a gateway and print a report."""
    try:
        opts = BenchOptions(progress=not no_progress, **kw)
    except ValidationError as exc:
        # Name the flag, not the field: `--num-requests: ...`, never a traceback.
        params = click.get_current_context().command.params
        flags = {p.name: max(p.opts, key=len) for p in params}
        raise click.UsageError(
            "; ".join(
                f"{flags.get(str(e['loc'][0]), e['loc'][0]) if e['loc'] else 'options'}: {e['msg']}"
                for e in exc.errors()
            )
        ) from None
    # Flags are checked first (above), so a bad one never waits on the network.
    opts.model = model if model is not None else served_model(opts.url)
    report = run_bench_sync(opts)
    if as_json:
        click.echo(json.dumps(report))
    if report["failed"] == report["requests"]:
        raise click.ClickException(f"every request failed: {report['errors']}")


__all__ = ["BenchOptions", "RequestResult", "run_bench", "summarize"]
