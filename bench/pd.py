"""Prefill/decode disaggregation vs unified serving: inter-token latency under long prompts.

Two cores. Three fleets, each two daemons pinned one per core (``taskset``,
``OMP_NUM_THREADS=1``) behind a real gateway, on the 4x512 bench Llama:

- ``unified``: two unified daemons (no chunking: a long prompt is one step);
- ``unified_chunked``: the same with ``--long-prefill-token-threshold`` (chunked prefill);
- ``pd``: one prefill daemon + one decode daemon, the gateway doing remote prefills.

Workload (seeded, the same for each fleet): ``--chats`` chat sessions decoding all the time
(short prompts, ``--chat-tokens`` output tokens each, back to back), while ``--long-prompts``
long prompts (1.5k-2k tokens, 4 output tokens) arrive at random (exponential gaps,
``--long-gap-s`` mean); the chats run until the last long prompt is answered. Figures, from
the client's clock on streamed tokens:

- ``itl_p99_ms_*``: p99 gap between consecutive tokens of the chat streams;
- ``ttft_p50_ms_*``: median time to first token of the long prompts under that chat load;
- ``ttft_idle_p50_ms_unified`` / ``_pd`` and ``ttft_cost_ms_pd``: the TTFT cost of P/D by
  itself -- ``--idle-prompts`` long prompts one at a time on otherwise idle fleets (unified
  vs P/D), the difference of the medians (a remote prefill round trip, the KV pull, and the
  decode pod's own step for the last prompt token);
- ``transfer_mb_per_s``, ``transfer_ms_p50``: the decode daemon's KV pulls (its metrics);
- ``pd_token_exact``: the same seeded, sampled long-prompt requests give identical text
  through the unified and the P/D fleet;
- ``busy``: each daemon's CPU seconds per wall second over its fleet's run (its core's
  utilisation; on a shared machine, what it got, not what it wanted).

Every fleet starts each run with empty prefix caches (``POST /reset_prefix_cache``): the
runs repeat the same seeded prompts.

    python bench/pd.py --quick      # 3 long prompts per fleet
    python bench/pd.py              # 24 long prompts per fleet, 6 idle ones
    python bench/pd.py --sweep --long-prompts 8   # unified vs P/D, 4-32 chats x 2 rates

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pd_trace
from bench_models import bench_model

MODEL = "bench-pd"
# Every chat of the largest sweep cell fits in one decode batch (a P/D decode pod serves
# them all; vLLM's default is 256).
MAX_NUM_SEQS = 64
# The unified baseline and the prefill pod prefill a prompt in one step, as the bench
# defines them (the chunked baseline passes --chunk). Said explicitly since the daemon's
# own default became chunked prefill (256, b4736dd, after session 6's runs): without it the
# "unified" fleet silently became a second chunked one.
ONE_STEP = ("--long-prefill-token-threshold", "0")
# pagefleet/daemon/step_trace.py's switch (named here: the bench imports no daemon code).
STEP_TRACE_ENV = "PAGEFLEET_STEP_TRACE"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen
    log: Path


def _spawn(
    name: str, args: list[str], cpu: int | None, logdir: Path, env_extra: dict | None = None
) -> Proc:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(env_extra or {}))
    argv = [sys.executable, "-m", "pagefleet.cli", *args, "--host", "127.0.0.1",
            "--port", str(port)]  # fmt: skip
    if cpu is not None and shutil.which("taskset") and (os.cpu_count() or 1) > cpu:
        argv = ["taskset", "-c", str(cpu), *argv]
    log = logdir / f"{name}.log"
    popen = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    return Proc(name, f"http://127.0.0.1:{port}", popen, log)


def _daemon(
    name: str, model: str, cpu: int, role: str, logdir: Path, extra=(), env_extra=None
) -> Proc:
    args = ["daemon", "--model", model, "--served-model-name", MODEL, "--role", role,
            "--pod-name", name, "--block-size", "16", "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-model-len", "4096", "--kv-cache-memory-mb", "256", *extra]  # fmt: skip
    return _spawn(name, args, cpu, logdir, env_extra)


def _pd_pair(model: str, logdir: Path, args: argparse.Namespace) -> list[Proc]:
    """The P/D fleet's prefill (core 0) and decode (core 1) daemons. The decode pod's
    per-step token budget is its role's default (2 x --max-num-seqs = 128 here), or
    ``--decode-max-batched-tokens``: new requests it prefills itself (the short chats) join
    its running streams a few at a time instead of all in one long step that stalls every
    stream (docs/benchmarks.md, session 6)."""
    budget = args.decode_max_batched_tokens
    extra = ["--max-num-batched-tokens", str(budget)] if budget else []
    # --trace: the decode pod writes a line per engine step and per import (step_trace.py).
    # The prefill pod too: its steps time each long prompt's queue and compute there.
    env = {STEP_TRACE_ENV: str(Path(args.trace) / "decode")} if args.trace else None
    penv = {STEP_TRACE_ENV: str(Path(args.trace) / "prefill")} if args.trace else None
    return [_daemon("p0", model, 0, "prefill", logdir, ONE_STEP, penv),
            _daemon("d0", model, 1, "decode", logdir, extra, env)]  # fmt: skip


def _unified_pair(model: str, logdir: Path, args: argparse.Namespace) -> list[Proc]:
    """The unified fleet's two daemons (core 0 and 1), traced with ``--trace`` (their
    steps time each long prompt's queue and compute, for the P/D comparison)."""
    return [
        _daemon(f"u{i}", model, i, "unified", logdir, ONE_STEP,
                {STEP_TRACE_ENV: str(Path(args.trace) / f"u{i}")} if args.trace else None)
        for i in range(2)
    ]  # fmt: skip


def _gateway(name: str, model: str, decode: list[str], prefill: list[str], logdir: Path) -> Proc:
    args = ["gateway", "--model", model, "--served-model-name", MODEL, "--block-size", "16",
            "--policy", "least_load", "--endpoints", ",".join(decode), "--seed", "1"]  # fmt: skip
    if prefill:
        args += ["--prefill-url", ",".join(prefill), "--pd-min-uncached-tokens", "256"]
    return _spawn(name, args, None, logdir)


def stop(procs: list[Proc]) -> None:
    """Terminate every process, then wait for each (killed after 10 s)."""
    for p in procs:
        p.popen.terminate()
    for p in procs:
        try:
            p.popen.wait(10)
        except subprocess.TimeoutExpired:
            p.popen.kill()


async def _wait_ready(procs: list[Proc], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        for p in procs:
            while True:
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited: {p.log.read_text()[-2000:]}")
                try:
                    async with s.get(p.url + "/ready") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{p.name} not ready")
                await asyncio.sleep(0.2)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and all its descendants (a daemon, its fork
    server, its engine process), from /proc; 0 where /proc is missing."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


async def _reset_caches(procs: list[Proc]) -> None:
    """Empty every daemon's prefix cache: a fleet never starts with another run's prompts
    cached (the idle prompts repeat the seeded ones)."""
    async with aiohttp.ClientSession() as s:
        for p in procs:
            async with s.post(p.url + "/reset_prefix_cache") as r:
                if r.status != 200:
                    raise RuntimeError(f"{p.name}: reset_prefix_cache answered {r.status}")


@dataclass
class Result:
    itl: list[float] = field(default_factory=list)
    # Time to first token of the chat requests: what a decode pod's per-step token budget
    # (``--decode-max-batched-tokens``) trades for smoother ITL.
    chat_ttft: list[float] = field(default_factory=list)
    long_ttft: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0
    busy: list[float] = field(default_factory=list)  # each daemon's CPU s / wall s
    # For --trace: each chat request's token arrival times, each long prompt's (send time,
    # TTFT, prompt tokens), and the run's start and end (perf_counter).
    streams: list[list[float]] = field(default_factory=list)
    long_sent: list[tuple[float, float, int]] = field(default_factory=list)
    span: tuple[float, float] = (0.0, 0.0)

    def cell(self) -> dict:
        return {
            "chat_tokens": len(self.itl),
            "itl_p50_ms": round(_pct(self.itl, 0.5) * 1e3, 1),
            "itl_p99_ms": round(_pct(self.itl, 0.99) * 1e3, 1),
            "itl_p999_ms": round(_pct(self.itl, 0.999) * 1e3, 1),
            "ttft_p50_ms": round(_pct(self.long_ttft, 0.5) * 1e3, 1),
            "chat_ttft_p50_ms": round(_pct(self.chat_ttft, 0.5) * 1e3, 1),
            "chat_ttft_p99_ms": round(_pct(self.chat_ttft, 0.99) * 1e3, 1),
            "busy": [round(b, 2) for b in self.busy],
            "errors": self.errors,
        }


async def _stream(
    s: aiohttp.ClientSession, url: str, body: dict, times: list[float] | None = None
) -> tuple[float, list[float]]:
    """POST a streaming completion; (ttft, token arrival times). Arrival times are
    appended to ``times`` as they come (kept when the caller cancels mid-stream)."""
    t0 = time.perf_counter()
    times = [] if times is None else times
    async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                lp = ch.get("logprobs") or {}
                k = len(lp.get("tokens") or []) or (1 if ch.get("text") else 0)
                now = time.perf_counter()
                times.extend([now] * k)
    return (times[0] - t0 if times else float("nan")), times


async def _run_fleet(
    url: str, args: argparse.Namespace, vocab: int, daemons: list[Proc] | None = None
) -> Result:
    """The chat + long-prompt workload through the gateway at ``url``; ``daemons``' CPU
    use over the run (busy fraction of their one core each) goes into the result."""
    daemons = daemons or []
    cpu0 = [_cpu_seconds(p.popen.pid) for p in daemons]
    t0 = time.perf_counter()
    res = Result()
    rng = random.Random(args.seed)
    done = asyncio.Event()  # the last long prompt was answered: no new chat requests
    timeout = aiohttp.ClientTimeout(total=600)

    async def chat(i: int) -> None:
        crng = random.Random(args.seed * 100 + i)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            while not done.is_set():
                prompt = [crng.randrange(5, vocab) for _ in range(32)]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": args.chat_tokens,
                        "temperature": 0.0, "ignore_eos": True, "logprobs": 0}  # fmt: skip
                times: list[float] = []
                t0 = time.perf_counter()
                try:
                    await _stream(s, url, body, times)
                except Exception:
                    res.errors += 1
                    continue
                finally:  # cancelled mid-stream at the end: its gaps so far count too
                    res.itl.extend(b - a for a, b in itertools.pairwise(times))
                    res.streams.append(times)
                    if times:
                        res.chat_ttft.append(times[0] - t0)

    async def long_prompts() -> None:
        async with aiohttp.ClientSession(timeout=timeout) as s:
            tasks = []
            for _ in range(args.long_prompts):
                await asyncio.sleep(rng.expovariate(1.0 / args.long_gap_s))
                n = rng.randrange(1536, 2048)
                prompt = [rng.randrange(5, vocab) for _ in range(n)]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                        "ignore_eos": True}  # fmt: skip

                async def one(body=body) -> None:
                    try:
                        sent = time.perf_counter()
                        ttft, _ = await _stream(s, url, body)
                        res.long_ttft.append(ttft)
                        res.long_sent.append((sent, ttft, len(body["prompt"])))
                    except Exception:
                        res.errors += 1

                tasks.append(asyncio.create_task(one()))
            await asyncio.gather(*tasks)
        done.set()

    # The chats stop when the last long prompt is answered, mid-stream: a chat request
    # still running then would add seconds of gaps that no long prompt overlaps.
    chats = [asyncio.create_task(chat(i)) for i in range(args.chats)]
    try:
        await long_prompts()
    finally:
        for t in chats:
            t.cancel()
        await asyncio.gather(*chats, return_exceptions=True)
    res.wall_s = time.perf_counter() - t0
    res.span = (t0, t0 + res.wall_s)
    res.busy = [
        (_cpu_seconds(p.popen.pid) - c) / res.wall_s for p, c in zip(daemons, cpu0, strict=True)
    ]
    return res


async def _idle_ttft(url: str, vocab: int, n: int, sent: list | None = None) -> list[float]:
    """TTFT of ``n`` long prompts sent one at a time to an otherwise idle fleet; each
    prompt's (send time, TTFT, length) appended to ``sent`` when given (--trace)."""
    rng = random.Random(4242)  # the same prompts for every fleet, none seen before
    out: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for _ in range(n):
            prompt = [rng.randrange(5, vocab) for _ in range(rng.randrange(1536, 2048))]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            t0 = time.perf_counter()
            ttft, _ = await _stream(s, url, body)
            out.append(ttft)
            if sent is not None:
                sent.append((t0, ttft, len(prompt)))
    return out


async def _exact(urls: list[str], vocab: int, n: int) -> bool:
    """Same seeded sampled long-prompt requests through each fleet: identical text?"""
    rng = random.Random(99)
    bodies = [
        {"model": MODEL,
         "prompt": [rng.randrange(5, vocab) for _ in range(rng.randrange(600, 900))],
         "max_tokens": 16, "temperature": 0.8, "seed": 1000 + i, "ignore_eos": True}
        for i in range(n)
    ]  # fmt: skip
    texts: list[list[str]] = []
    async with aiohttp.ClientSession() as s:
        for url in urls:
            got = []
            for b in bodies:
                async with s.post(url + "/v1/completions", json=b) as r:
                    got.append((await r.json())["choices"][0]["text"])
            texts.append(got)
    return all(t == texts[0] for t in texts[1:])


async def _transfer_stats(decode_url: str) -> tuple[float, float, float, float]:
    """(MB/s, p50 ms, pulls, mean ms) of the decode daemon's KV pulls, from its /metrics."""
    async with aiohttp.ClientSession() as s, s.get(decode_url + "/metrics") as r:
        text = await r.text()
    nbytes = secs = count = 0.0
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("pagefleet:kv_transfer_bytes_total") and "received" in name:
            nbytes += float(value)
        elif name.startswith("pagefleet:kv_transfer_seconds_sum"):
            secs = float(value)
        elif name.startswith("pagefleet:kv_transfer_seconds_count"):
            count = float(value)
        elif name.startswith("pagefleet:kv_transfer_seconds_bucket"):
            le = name.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(value)))
    p50 = float("nan")
    prev_le, prev_c = 0.0, 0.0
    for le, c in sorted(buckets):
        if count and c >= count / 2:
            frac = (count / 2 - prev_c) / max(c - prev_c, 1e-9)
            p50 = (prev_le + frac * ((le if le != float("inf") else prev_le) - prev_le)) * 1000
            break
        prev_le, prev_c = le, c
    mean = secs / count * 1000 if count else float("nan")
    return (nbytes / secs / 1e6 if secs else 0.0), p50, count, mean


def procs_of(daemons: dict[str, list[Proc]]) -> list[Proc]:
    return list({id(p): p for ps in daemons.values() for p in ps}.values())


def _report(name: str, r: Result) -> None:
    print(
        f"{name:16s} chat tokens {len(r.itl):5d}  itl p50 {_pct(r.itl, 0.5) * 1e3:7.1f} ms"
        f"  p99 {_pct(r.itl, 0.99) * 1e3:7.1f} ms  p99.9 {_pct(r.itl, 0.999) * 1e3:7.1f} ms"
        f"  long prompts {len(r.long_ttft):3d}  ttft p50 {_pct(r.long_ttft, 0.5) * 1e3:7.1f} ms"
        f"  busy {[round(b, 2) for b in r.busy]}  errors {r.errors}",
        file=sys.stderr,
    )


async def sweep(args: argparse.Namespace) -> dict:
    """ITL p99 of unified vs P/D over chat sessions x long-prompt gaps, one pair of fleets
    (no chunked fleet: its start-up and runs would double the time). Each cell runs both
    fleets with empty prefix caches; ``busy`` is each daemon's core utilisation."""
    t_start = time.perf_counter()
    model = str(bench_model(args.model))
    vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 1000)
    logdir = Path(tempfile.mkdtemp(prefix="pagefleet-bench-pd-sweep-"))
    fleets = args.sweep_fleets
    daemons = {}
    if "unified" in fleets:
        daemons["unified"] = _unified_pair(model, logdir, args)
    if "pd" in fleets:
        daemons["pd"] = _pd_pair(model, logdir, args)
    procs = procs_of(daemons)
    cells = []
    try:
        gws = {}
        if "unified" in fleets:
            gws["unified"] = _gateway("g-unified", model, [p.url for p in daemons["unified"]],
                                      [], logdir)  # fmt: skip
        if "pd" in fleets:
            gws["pd"] = _gateway("g-pd", model, [daemons["pd"][1].url], [daemons["pd"][0].url],
                                 logdir)  # fmt: skip
        procs += list(gws.values())
        await _wait_ready(procs)
        for gap in args.sweep_gaps:
            for chats in args.sweep_chats:
                cell_args = argparse.Namespace(**{**vars(args), "chats": chats,
                                                  "long_gap_s": gap})  # fmt: skip
                cell: dict = {"chats": chats, "long_gap_s": gap}
                for name in fleets:
                    await _reset_caches(daemons[name])
                    r = await _run_fleet(gws[name].url, cell_args, vocab, daemons[name])
                    _report(f"{name} c={chats} gap={gap}", r)
                    cell[name] = r.cell()
                    if name == "pd" and args.trace:
                        cell["decode_trace"] = _trace(args, r)
                    if args.trace:  # each long prompt's phases on this fleet
                        cell[f"long_phases_{name}"] = _phases(args, r, name)
                if len(fleets) == 2:
                    cell["itl_p99_ratio_unified_over_pd"] = round(
                        cell["unified"]["itl_p99_ms"] / cell["pd"]["itl_p99_ms"], 2
                    )
                    cell["itl_p999_ratio_unified_over_pd"] = round(
                        cell["unified"]["itl_p999_ms"] / cell["pd"]["itl_p999_ms"], 2
                    )
                if "pd" in fleets:
                    # The prefill pod's core utilisation: near 1 its queue, not P/D, sets
                    # the long prompts' TTFT (and past it the gateway prefills on the
                    # decode pod, --pd-max-prefill-inflight).
                    cell["prefill_busy"] = cell["pd"]["busy"][0]
                print(json.dumps(cell), file=sys.stderr)
                cells.append(cell)
    finally:
        stop(procs)
    return {
        "bench": "pd_sweep",
        "fleets": fleets,
        "long_prompts_per_cell": args.long_prompts,
        "decode_max_batched_tokens": args.decode_max_batched_tokens or 2 * MAX_NUM_SEQS,
        "cells": cells,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


def _trace(args: argparse.Namespace, r: Result) -> dict:
    """The decode pod's step/import breakdown of run ``r`` (--trace), also on stderr."""
    rep = pd_trace.analyse(args.trace, r)
    print(pd_trace.render(rep), file=sys.stderr)
    return rep


def _phases(args: argparse.Namespace, r: Result, fleet: str) -> dict:
    """Where each long prompt's TTFT went on ``fleet`` (--trace), also on stderr. The
    daemons write their buffered step lines when their engine goes idle: wait for that."""
    time.sleep(1.0)
    rep = pd_trace.long_phases(args.trace, r, fleet)
    print(f"long-prompt phases ({fleet}): {json.dumps(rep)}", file=sys.stderr)
    return rep


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()

    def phase(what: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {what}", file=sys.stderr)

    model = str(bench_model(args.model))
    vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 1000)
    logdir = Path(tempfile.mkdtemp(prefix="pagefleet-bench-pd-"))
    chunk = ["--long-prefill-token-threshold", str(args.chunk)]
    daemons = {
        "unified": _unified_pair(model, logdir, args),
        "unified_chunked": [_daemon(f"c{i}", model, i, "unified", logdir, chunk) for i in range(2)],
    }
    # Quick mode too: a decode pod's step budget is its role's default, which a unified
    # daemon standing in for it would not have.
    daemons["pd"] = _pd_pair(model, logdir, args)
    procs = procs_of(daemons)
    try:
        # The gateways start beside the daemons (they probe until the daemons are ready).
        gws = {
            "unified": _gateway("g-unified", model, [p.url for p in daemons["unified"]], [],
                                logdir),
            "unified_chunked": _gateway("g-chunked", model,
                                        [p.url for p in daemons["unified_chunked"]], [], logdir),
            "pd": _gateway("g-pd", model, [daemons["pd"][1].url], [daemons["pd"][0].url],
                           logdir),
        }  # fmt: skip
        procs += list(gws.values())
        await _wait_ready(procs)
        phase("all daemons and gateways ready")
        results: dict[str, Result] = {}
        for name in ("unified", "unified_chunked", "pd"):
            await _reset_caches(daemons[name])
            results[name] = await _run_fleet(gws[name].url, args, vocab, daemons[name])
            _report(name, results[name])
        trace = _trace(args, results["pd"]) if args.trace else None
        if trace is not None:
            trace["long_phases"] = {k: _phases(args, results[k], k) for k in ("unified", "pd")}
        phase("fleets measured")
        mbps, p50_ms, pulls, mean_ms = await _transfer_stats(daemons["pd"][1].url)
        idle = {}
        for k in ("unified", "pd"):
            await _reset_caches(daemons[k])
            idle_run = Result()
            idle[k] = await _idle_ttft(gws[k].url, vocab, args.idle_prompts, idle_run.long_sent)
            if trace is not None:  # where the idle TTFT goes, both ways
                trace[f"long_phases_idle_{k}"] = _phases(args, idle_run, k)
        if trace is not None:
            # The idle cost of P/D from the phases (robust to the two fleets' prefill steps
            # differing by 100+ ms on a shared machine, which the medians' difference is
            # not): what P/D adds after the prefill step, less unified's first-token delivery.
            pd_ph, u_ph = trace["long_phases_idle_pd"], trace["long_phases_idle_unified"]
            if "phases_ms" in pd_ph and "phases_ms" in u_ph:
                trace["ttft_cost_ms_pd_phases"] = round(
                    pd_ph["after_compute_ms_mean"] - u_ph["phases_ms"]["to_first_token"]["mean"],
                    1,
                )
        # The pulls of the idle prompts alone (the P/D fleet ran them one at a time).
        _, _, pulls2, mean2 = await _transfer_stats(daemons["pd"][1].url)
        n_idle = pulls2 - pulls
        secs_before = mean_ms * pulls if pulls else 0.0  # mean is NaN with no pulls yet
        idle_pull_ms = (mean2 * pulls2 - secs_before) / n_idle if n_idle else float("nan")
        await _reset_caches(procs_of(daemons))
        print(
            f"idle long-prompt TTFT p50: unified {_pct(idle['unified'], 0.5) * 1e3:.1f} ms, "
            f"P/D {_pct(idle['pd'], 0.5) * 1e3:.1f} ms (n={args.idle_prompts} each)",
            file=sys.stderr,
        )
        exact = await _exact([gws["unified"].url, gws["pd"].url], vocab, args.exact_requests)
    finally:
        stop(procs)
    u, c, d = results["unified"], results["unified_chunked"], results["pd"]
    load = os.getloadavg()[0]
    return {
        "bench": "pd",
        "quick": args.quick,
        "chats": args.chats,
        "long_gap_s": args.long_gap_s,
        "decode_max_batched_tokens": args.decode_max_batched_tokens or 2 * MAX_NUM_SEQS,
        # Each daemon's CPU seconds per wall second over its fleet's run (one core each):
        # [unified u0, u1], [chunked c0, c1], [P/D prefill, decode].
        "busy": [[round(b, 2) for b in r.busy] for r in (u, c, d)],
        "itl_p99_ms_unified": round(_pct(u.itl, 0.99) * 1e3, 1),
        "itl_p99_ms_unified_chunked": round(_pct(c.itl, 0.99) * 1e3, 1),
        "itl_p99_ms_pd": round(_pct(d.itl, 0.99) * 1e3, 1),
        "itl_p99_ratio_unified_over_pd": round(_pct(u.itl, 0.99) / _pct(d.itl, 0.99), 2),
        "itl_p99_ratio_chunked_over_pd": round(_pct(c.itl, 0.99) / _pct(d.itl, 0.99), 2),
        # p99.9 too: a long prefill stalls a unified daemon's chats once per long prompt,
        # so when chat tokens outnumber those stalls 100:1 the p99 no longer sees them.
        "itl_p999_ms_unified": round(_pct(u.itl, 0.999) * 1e3, 1),
        "itl_p999_ms_unified_chunked": round(_pct(c.itl, 0.999) * 1e3, 1),
        "itl_p999_ms_pd": round(_pct(d.itl, 0.999) * 1e3, 1),
        "chat_tokens": [len(u.itl), len(c.itl), len(d.itl)],
        "chat_ttft_p50_ms": [round(_pct(r.chat_ttft, 0.5) * 1e3, 1) for r in (u, c, d)],
        "chat_ttft_p99_ms": [round(_pct(r.chat_ttft, 0.99) * 1e3, 1) for r in (u, c, d)],
        "ttft_p50_ms_unified": round(_pct(u.long_ttft, 0.5) * 1e3, 1),
        "ttft_p50_ms_unified_chunked": round(_pct(c.long_ttft, 0.5) * 1e3, 1),
        "ttft_p50_ms_pd": round(_pct(d.long_ttft, 0.5) * 1e3, 1),
        "ttft_p90_ms_unified": round(_pct(u.long_ttft, 0.9) * 1e3, 1),
        "ttft_p90_ms_pd": round(_pct(d.long_ttft, 0.9) * 1e3, 1),
        "ttft_idle_p50_ms_unified": round(_pct(idle["unified"], 0.5) * 1e3, 1),
        "ttft_idle_p50_ms_pd": round(_pct(idle["pd"], 0.5) * 1e3, 1),
        # The TTFT price of P/D alone: idle fleets, the same prompts, medians subtracted.
        "ttft_cost_ms_pd": round((_pct(idle["pd"], 0.5) - _pct(idle["unified"], 0.5)) * 1e3, 1),
        "transfer_mb_per_s": round(mbps, 1),
        "transfer_ms_p50": round(p50_ms, 2),
        "transfer_ms_mean": round(mean_ms, 1),
        "transfer_ms_mean_idle": round(idle_pull_ms, 1),
        "kv_pulls": int(pulls),
        "long_prompts": [len(u.long_ttft), len(c.long_ttft), len(d.long_ttft)],
        "errors": u.errors + c.errors + d.errors,
        "pd_token_exact": exact,
        **({"decode_trace": trace} if trace is not None else {}),
        "loadavg_1m": round(load, 2),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None, help="default: the 4x512 bench Llama")
    ap.add_argument("--long-prompts", type=int, default=None, help="per fleet (24; quick 3)")
    ap.add_argument("--idle-prompts", type=int, default=None, help="idle TTFT (6; quick 2)")
    # 32 concurrent chat streams per fleet: 16 in each unified daemon's batch, all 32 in
    # the P/D decode pod's -- decode batches of tens of streams are what continuous
    # batching serves (a decode pool exists to run them). With 3 chats (the default until
    # session 5) the long prompts' stalls were under 1% of the gaps and p99 never saw them;
    # `--sweep` measures 4-32 chats at two long-prompt rates (docs/benchmarks.md).
    ap.add_argument("--chats", type=int, default=32)
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--long-gap-s", type=float, default=None, help="mean; 4.0 (quick 1.5)")
    ap.add_argument("--chunk", type=int, default=256, help="long_prefill_token_threshold")
    ap.add_argument(
        "--decode-max-batched-tokens",
        type=int,
        default=0,
        help="the P/D decode pod's per-step token budget (0: the decode role's default, "
        f"2 x max_num_seqs = {2 * MAX_NUM_SEQS}, the flag's value in session 6)",
    )
    ap.add_argument("--exact-requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="unified vs P/D over --sweep-chats x --sweep-gaps (no chunked fleet)",
    )
    ap.add_argument(
        "--sweep-chats", type=lambda v: [int(x) for x in v.split(",")], default=[4, 8, 16, 32]
    )
    ap.add_argument(
        "--sweep-gaps", type=lambda v: [float(x) for x in v.split(",")], default=[4.0, 2.0]
    )
    ap.add_argument(
        "--sweep-fleets",
        type=lambda v: [x for x in ("unified", "pd") if x in v.split(",")],
        default=["unified", "pd"],
        help="unified,pd (default) or one of them: e.g. the P/D decode pod's ITL alone",
    )
    ap.add_argument(
        "--trace",
        default="",
        help="a folder: the P/D decode pod traces its steps and imports there, and the "
        "output gains a decode_trace breakdown of its slow gaps (bench/pd_trace.py)",
    )
    args = ap.parse_args()
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    if args.long_prompts is None:
        args.long_prompts = 3 if args.quick else 24
    if args.long_gap_s is None:
        # One long prompt per 4 s: the prefill pod's core ~25% busy when idle-fast (about
        # 1 s a prompt), the lower of the sweep's two rates.
        args.long_gap_s = 1.5 if args.quick else 4.0
    if args.idle_prompts is None:
        args.idle_prompts = 2 if args.quick else 6
    if args.exact_requests is None:
        args.exact_requests = 2 if args.quick else 6
    return args


if __name__ == "__main__":
    a = parse_args()
    out = asyncio.run(sweep(a) if a.sweep else main(a))
    print(json.dumps(out))
