"""``pagefleet generate``: run the engine alone on synthetic prompts and print a report."""

from __future__ import annotations

import random
import time

import click

_SYSTEMS = [
    "You are a concise assistant for a logistics company. Answer in one short paragraph.",
    "You are a careful code reviewer. Point out bugs first, style second, and be specific.",
    "You are a friendly tutor who explains physics with everyday examples and no jargon.",
]
_TOPICS = [
    "pallets",
    "a race condition",
    "buoyancy",
    "shipping delays",
    "recursion",
    "friction",
    "a memory leak",
    "tides",
    "invoices",
    "caching",
    "orbits",
    "retries",
]


def synthetic_prompts(n: int, seed: int) -> list[str]:
    """``n`` chat-like prompts: a few shared system prompts, varied user questions."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        system = _SYSTEMS[i % len(_SYSTEMS)]
        topic = rng.choice(_TOPICS)
        ask = rng.choice(["Explain", "Summarise", "Give an example of", "What goes wrong with"])
        out.append(f"{system}\nUser: {ask} {topic}, case {rng.randint(1, 999)}.\nAssistant:")
    return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


@click.command("generate", help="Run the engine alone on synthetic prompts; print a report.")
@click.option(
    "--model",
    default="tiny",
    show_default=True,
    help="Checkpoint directory or tiny preset (tiny, tiny-qwen2, ...).",
)
@click.option("--num-prompts", default=32, show_default=True, type=click.IntRange(1))
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0))
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(1))
@click.option("--max-num-seqs", default=64, show_default=True, type=click.IntRange(1))
@click.option("--max-num-batched-tokens", default=2048, show_default=True, type=click.IntRange(1))
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--ignore-eos", is_flag=True, help="Always generate --max-tokens tokens.")
def command(
    model: str,
    num_prompts: int,
    max_tokens: int,
    temperature: float,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    prefix_caching: bool,
    device: str,
    dtype: str,
    seed: int,
    ignore_eos: bool,
) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    from rich.table import Table

    from pagefleet.engine.config import EngineConfig
    from pagefleet.engine.engine import LLMEngine
    from pagefleet.engine.sampling_params import SamplingParams

    console = Console()
    config = EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=prefix_caching,
        seed=seed,
    )
    with console.status(f"loading {model} ..."):
        engine = LLMEngine(config)
    params = SamplingParams(
        temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos
    )
    prompts = synthetic_prompts(num_prompts, seed)
    t0 = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"gen-{i}", prompt, params, arrival_time=t0)
    metrics = {}
    n_tokens = {}
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("generating", total=num_prompts)
        while engine.has_unfinished():
            for out in engine.step():
                n_tokens[out.request_id] = out.num_generated_tokens
                if out.finished:
                    metrics[out.request_id] = out.metrics
                    progress.advance(task)
    wall = time.monotonic() - t0
    stats = engine.stats()
    ttft = [
        m.first_token_time - m.arrival_time
        for m in metrics.values()
        if m.first_token_time is not None
    ]
    tpot = [
        (m.last_token_time - m.first_token_time) / (n_tokens[rid] - 1)
        for rid, m in metrics.items()
        if m.first_token_time is not None and m.last_token_time is not None and n_tokens[rid] > 1
    ]
    hit = stats.prefix_hits_tokens / max(stats.prefix_queries_tokens, 1)
    table = Table(title=f"pagefleet generate: {model} on {device}", show_header=False)
    for k, v in [
        ("requests", f"{len(metrics)}"),
        ("prompt tokens", f"{stats.prompt_tokens_total}"),
        ("generated tokens", f"{stats.generation_tokens_total}"),
        ("wall time", f"{wall:.2f} s over {stats.steps_total} steps"),
        (
            "throughput",
            f"{stats.generation_tokens_total / wall:.1f} generated tok/s, "
            f"{(stats.prompt_tokens_total + stats.generation_tokens_total) / wall:.1f}"
            " total tok/s",
        ),
        ("TTFT p50 / p90", f"{_pct(ttft, 0.5) * 1e3:.1f} / {_pct(ttft, 0.9) * 1e3:.1f} ms"),
        ("TPOT p50 / p90", f"{_pct(tpot, 0.5) * 1e3:.1f} / {_pct(tpot, 0.9) * 1e3:.1f} ms"),
        ("prefix-cache hit rate", f"{hit:.1%} of prompt tokens"),
        ("preemptions", f"{stats.num_preempted_total}"),
        ("KV pool", f"{stats.num_blocks} blocks x {block_size} tokens"),
    ]:
        table.add_row(k, v)
    console.print(table)
