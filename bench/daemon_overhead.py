"""What the daemon costs on top of the engine, and whether its event loop stays responsive.

Baseline (same process, same engine config): ``LLMEngine.generate`` on all requests at once,
offline, on a thread of its own. Then the same requests through a live daemon on 127.0.0.1
(the real aiohttp app; the engine in its own process, or with ``--engine thread`` on a thread
of the HTTP process), all sent at once over HTTP, as plain JSON and then streamed (SSE).
Greedy with ``ignore_eos``, so both make exactly the same tokens. The HTTP client shares the
daemon's HTTP process and event loop. While the daemon works, a probe (a process of its own,
as the kubelet) hits ``/health`` every 20 ms: its latency shows whether the event loop ever
waits on the model.

Each run lasts seconds, not fractions of one (a 0.2 s run moved its ratio by 10 points from
one scheduling hiccup), and the three measurements (engine, JSON, SSE) are interleaved in
rounds; the ratios reported are medians over the rounds of each round's ratio, so a load
swing on this shared machine hits both sides of a ratio alike.

Two readings of the same rounds are added beside those (the keys above keep their meaning):
- bracketed (``*_vs_engine_bracketed``): one more bare-engine run closes the series, so every
  daemon measurement sits between two bare ones, and is compared with their mean. The
  engine's own speed drifts by 10-20 % over tens of seconds on this VM; the round's ratio
  compares with the bare run before it only.
- clean (``*_vs_engine_clean``): the same per-round ratios, over the rounds in which no
  measurement had more than ``CLEAN_OTHERS_CPU_S`` CPU-seconds of other processes beside it
  (``/proc/stat``; the bench hold keeps benchmarks out, not simulations and scripts).

    python bench/daemon_overhead.py            # 64 requests, 5 rounds, tokens per model
    python bench/daemon_overhead.py --quick    # 64 requests, 3 rounds, < 60 s
    python bench/daemon_overhead.py --model bench --engine thread   # 4x512 Llama, old way
"""

from __future__ import annotations

import os

# One intra-op thread, as `pagefleet up` runs its daemons: on a shared 2-core VM, OpenMP
# spin-waiting makes multi-threaded steps swing 10-40x from run to run.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import aiohttp
from aiohttp import web

from pagefleet.daemon.app import Daemon
from pagefleet.daemon.config import DaemonConfig
from pagefleet.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16

# A round is "clean" when others used at most this many CPU-seconds beside each of its
# measurements (~5 % of one core over a 4 s measurement).
CLEAN_OTHERS_CPU_S = 0.2


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids from 16 up: clear of the tiny vocabulary's special tokens.
    return [[rng.randrange(16, vocab) for _ in range(rng.randint(32, 96))] for _ in range(n)]


def config(port: int, model: str = "tiny", engine_process: bool = True) -> DaemonConfig:
    return DaemonConfig(
        model=model, port=port, block_size=BLOCK_SIZE, num_gpu_blocks=1024,
        max_num_seqs=64, max_queue=256, max_model_len=512, enable_prefix_caching=False,
        engine_process=engine_process,
    )  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class BareEngine:
    """The baseline: ``LLMEngine.generate`` on every prompt at once, on a thread of its own
    (as in the daemon). Built once; each ``run`` is one timed round."""

    def __init__(self, prompts: list[list[int]], max_tokens: int, model: str) -> None:
        from pagefleet.engine.engine import LLMEngine

        self.engine = LLMEngine(config(0, model).engine_config())
        self.prompts = prompts
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.generate(prompts[:2], self.params)  # warm-up: first-call allocations

    def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        steps0 = self.engine.stats().steps_total
        cpu0, machine0 = cpu_s(os.getpid()), machine_cpu_s()

        def timed() -> None:
            t0 = time.perf_counter()
            results = self.engine.generate(self.prompts, self.params)
            out["wall_s"] = time.perf_counter() - t0
            out["tokens"] = sum(len(o.token_ids) for r in results for o in r.outputs)

        t = threading.Thread(target=timed)
        t.start()
        t.join()
        out["tok_s"] = out["tokens"] / out["wall_s"]
        out["steps"] = self.engine.stats().steps_total - steps0
        out["engine_cpu_s"] = cpu_s(os.getpid()) - cpu0
        busy, steal = (b - a for a, b in zip(machine0, machine_cpu_s(), strict=True))
        out["other_cpu_s"], out["steal_s"] = busy - out["engine_cpu_s"], steal
        return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runq_wait_s(pid: int) -> float:
    """Seconds the main thread of ``pid`` has spent runnable but waiting for a CPU (Linux
    /proc/PID/schedstat; NaN elsewhere). For the engine process (one thread steps the
    model) this splits a slow round into "others had the cores" and "the engine idled"."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def machine_cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, all cores (Linux /proc/stat).

    Busy minus this run's own processes is what others ran beside a round: the hold keeps
    other benchmarks and tests out, not everything (editors, linters, a stray daemon), and
    steal is time the hypervisor gave to other VMs."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return float("nan"), float("nan")
    hz = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / hz, v[7] / hz


# The /health prober runs in a process of its own, as the kubelet does: a probe coroutine on
# the daemon's own event loop would also wait behind the load generator's work there.
_PROBER = """
import http.client, json, sys, threading, time
host, port = sys.argv[1], int(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
conn, out = http.client.HTTPConnection(host, port), []
while True:
    t = time.perf_counter()
    conn.request("GET", "/health")
    conn.getresponse().read()
    out.append(time.perf_counter() - t)
    if len(out) == 1:
        print("ready", flush=True)
    if stop.wait(0.02):
        break
print(json.dumps(out), flush=True)
"""


class Prober:
    """GET /health every 20 ms from a child process until ``stop``; latencies in seconds."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _PROBER, "127.0.0.1", str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> list[float]:
        out, _ = self.proc.communicate("stop\n", timeout=30)
        return json.loads(out.strip().splitlines()[-1])


async def run_rounds(
    prompts: list[list[int]],
    max_tokens: int,
    model: str,
    engine_process: bool,
    rounds: int,
    bare: BareEngine,
) -> list[dict[str, Any]]:
    """``rounds`` x (bare engine, daemon JSON, daemon SSE), one daemon for all of them."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    daemon = Daemon(config(port, model, engine_process))
    runner = web.AppRunner(daemon.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await daemon.start()
    base = f"http://127.0.0.1:{port}"
    conn = aiohttp.TCPConnector(limit=0)
    out: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession(connector=conn) as s:

            async def plain(p: list[int]) -> int:
                body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True}  # fmt: skip
                async with s.post(f"{base}/v1/completions", json=body) as r:
                    return (await r.json())["usage"]["completion_tokens"]

            async def streamed(p: list[int]) -> tuple[int, float]:
                body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}  # fmt: skip
                t0 = time.perf_counter()
                ttft, tokens = float("nan"), 0
                async with s.post(f"{base}/v1/completions", json=body) as r:
                    async for line in r.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and ttft != ttft:
                            ttft = time.perf_counter() - t0
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                return tokens, ttft

            await plain(prompts[0])  # warm-up
            handle = daemon.live_loop()
            for _ in range(rounds):
                rnd: dict[str, Any] = {"engine": bare.run()}
                for mode, fn in (("json", plain), ("sse", streamed)):
                    steps0 = (await handle.stats()).steps_total
                    cpu0 = cpu_s(os.getpid()), cpu_s(handle.pid)
                    wait0 = runq_wait_s(handle.pid)
                    prober = await asyncio.to_thread(Prober, port)
                    probe_cpu0, machine0 = cpu_s(prober.proc.pid), machine_cpu_s()
                    t0 = time.perf_counter()
                    res = await asyncio.gather(*(fn(p) for p in prompts))
                    wall = time.perf_counter() - t0
                    busy, steal = (b - a for a, b in zip(machine0, machine_cpu_s(), strict=True))
                    probe_cpu = cpu_s(prober.proc.pid) - probe_cpu0
                    health = await asyncio.to_thread(prober.stop)
                    tokens = sum(r if isinstance(r, int) else r[0] for r in res)
                    rnd[mode] = {
                        "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                        "steps": (await handle.stats()).steps_total - steps0,
                        "health": health,
                        # CPU seconds of this (HTTP + client) process and of the engine
                        # process (the same process in thread mode)
                        "http_cpu_s": cpu_s(os.getpid()) - cpu0[0],
                        "engine_cpu_s": cpu_s(handle.pid) - cpu0[1],
                        # the engine process's main thread: runnable but off a CPU
                        "engine_runq_s": runq_wait_s(handle.pid) - wait0,
                    }  # fmt: skip
                    m = rnd[mode]
                    # Busy CPU of the machine beyond the engine, HTTP and probe processes
                    # (approximate: read a moment apart from theirs, at tick resolution).
                    m["other_cpu_s"] = busy - m["http_cpu_s"] - m["engine_cpu_s"] - probe_cpu
                    m["steal_s"] = steal
                    if mode == "sse":
                        rnd[mode]["ttft_p50_s"] = statistics.median([r[1] for r in res])
                out.append(rnd)
            out.append({"engine": bare.run()})  # closes the series: every daemon run bracketed
    finally:
        await daemon.drain(1.0)
        await daemon.stop()
        await runner.cleanup()
    return out


# Output tokens per request (--quick, full): enough for runs of seconds on each model (tiny
# ~6-8k tok/s with the compiled CPU attention, the 4x512 bench model ~0.6k tok/s on this
# VM), few enough for --quick under 60 s; prompts (<= 96) + outputs stay within 512.
TOKENS = {"tiny": (192, 384), "bench": (32, 96)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds, fewer tokens (< 60 s)")
    ap.add_argument(
        "--model", default="tiny", help="tiny (default), bench (the 4x512 Llama), or a preset"
    )
    ap.add_argument(
        "--engine", choices=["process", "thread"], default="process",
        help="where the daemon runs its engine: its own process, or a thread (the old way)",
    )  # fmt: skip
    ap.add_argument("--requests", type=int, default=64, help="requests sent at once")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=None, help="engine/JSON/SSE rounds")
    args = ap.parse_args()
    quick_tokens, full_tokens = TOKENS.get(args.model, TOKENS["bench"])
    max_tokens = args.max_tokens or (quick_tokens if args.quick else full_tokens)
    rounds = args.rounds or (3 if args.quick else 5)
    n = args.requests
    from pagefleet.tokenizer import Tokenizer

    model = args.model
    if model == "bench":
        from bench_models import ensure_bench_model  # bench/ is on sys.path as the script's

        model = str(ensure_bench_model())
    from pagefleet.engine.loader import resolve_model

    vocab = Tokenizer.from_dir(resolve_model(model)).vocab_size
    prompts = workload(n, vocab)
    bare = BareEngine(prompts, max_tokens, model)
    load0 = os.getloadavg()[0]
    rnds = asyncio.run(
        run_rounds(prompts, max_tokens, model, args.engine == "process", rounds, bare)
    )
    rnds, closing = rnds[:-1], rnds[-1]["engine"]
    for i, r in enumerate(rnds):
        e = r["engine"]
        line = (f"round {i}: engine {e['tok_s']:.0f} tok/s ({e['wall_s']:.2f}s, {e['steps']} "
                f"steps, CPU s {e['engine_cpu_s']:.2f}, others {e['other_cpu_s']:.2f} "
                f"steal {e['steal_s']:.2f})")  # fmt: skip
        for mode in ("json", "sse"):
            m = r[mode]
            assert m["tokens"] == e["tokens"], (mode, m["tokens"], e["tokens"])
            line += (f"; {mode} {m['tok_s']:.0f} tok/s = {m['tok_s'] / e['tok_s']:.3f}x "
                     f"({m['wall_s']:.2f}s, {m['steps']} steps, CPU s engine "
                     f"{m['engine_cpu_s']:.2f} http {m['http_cpu_s']:.2f}, others "
                     f"{m['other_cpu_s']:.2f} steal {m['steal_s']:.2f}, engine waited for a "
                     f"CPU {m['engine_runq_s']:.2f})")  # fmt: skip
        print(line)
    print(
        f"closing: engine {closing['tok_s']:.0f} tok/s ({closing['wall_s']:.2f}s, others "
        f"{closing['other_cpu_s']:.2f})"
    )
    med = statistics.median
    ratio = {m: med([r[m]["tok_s"] / r["engine"]["tok_s"] for r in rnds]) for m in ("json", "sse")}
    # Each round's bare engine speed before and after its daemon runs (the next round's, or
    # the closing run), and whether nobody else ran beside any of its measurements.
    after = [r["engine"] for r in rnds[1:]] + [closing]
    bracketed = {
        m: [r[m]["tok_s"] / ((r["engine"]["tok_s"] + a["tok_s"]) / 2)
            for r, a in zip(rnds, after, strict=True)]
        for m in ("json", "sse")
    }  # fmt: skip
    clean = [
        i
        for i, r in enumerate(rnds)
        if max(r[m]["other_cpu_s"] for m in ("engine", "json", "sse")) <= CLEAN_OTHERS_CPU_S
    ]
    per_round = {m: [r[m]["tok_s"] / r["engine"]["tok_s"] for r in rnds] for m in ("json", "sse")}
    health = [h for r in rnds for m in ("json", "sse") for h in r[m]["health"]]
    summary = {
        "model": args.model,
        "engine": args.engine,
        "load_avg_1m_before": round(load0, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "requests": n,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "engine_wall_s_median": round(med([r["engine"]["wall_s"] for r in rnds]), 3),
        "engine_tok_s": round(med([r["engine"]["tok_s"] for r in rnds]), 1),
        "daemon_json_tok_s": round(med([r["json"]["tok_s"] for r in rnds]), 1),
        "daemon_sse_tok_s": round(med([r["sse"]["tok_s"] for r in rnds]), 1),
        "json_vs_engine": round(ratio["json"], 3),
        "sse_vs_engine": round(ratio["sse"], 3),
        "json_vs_engine_rounds": [round(r["json"]["tok_s"] / r["engine"]["tok_s"], 3)
                                  for r in rnds],
        "sse_vs_engine_rounds": [round(r["sse"]["tok_s"] / r["engine"]["tok_s"], 3)
                                 for r in rnds],
        "steps_engine_json_sse": [med([r[m]["steps"] for r in rnds])
                                  for m in ("engine", "json", "sse")],
        # CPU seconds per round (medians): the bare engine; the daemon's engine process and
        # its HTTP process (which here also runs the HTTP client) in JSON and SSE
        "cpu_s_engine": round(med([r["engine"]["engine_cpu_s"] for r in rnds]), 3),
        "cpu_s_json_engine_http": [round(med([r["json"][k] for r in rnds]), 3)
                                   for k in ("engine_cpu_s", "http_cpu_s")],
        "cpu_s_sse_engine_http": [round(med([r["sse"][k] for r in rnds]), 3)
                                  for k in ("engine_cpu_s", "http_cpu_s")],
        # CPU seconds others used beside each run (machine busy minus this run's processes)
        # and hypervisor steal, per round: engine, JSON, SSE
        "other_cpu_s_rounds": [[round(r[m]["other_cpu_s"], 2) for m in ("engine", "json", "sse")]
                               for r in rnds],
        "steal_s_total": round(sum(r[m]["steal_s"] for r in rnds
                                   for m in ("engine", "json", "sse")), 2),
        # the engine process's main thread runnable but off a CPU, per round: JSON, SSE
        "engine_runq_s_rounds": [[round(r[m]["engine_runq_s"], 2) for m in ("json", "sse")]
                                 for r in rnds],
        "health_probes": len(health),
        "health_p50_ms_under_load": round(1e3 * med(health), 2),
        "health_p99_ms_under_load": round(1e3 * pct(health, 0.99), 2),
        "health_max_ms_under_load": round(1e3 * max(health), 2),
        "sse_ttft_p50_s": round(med([r["sse"]["ttft_p50_s"] for r in rnds]), 3),
        # Added in session 9 (see the module doc); the keys above mean what they meant.
        "engine_tok_s_closing": round(closing["tok_s"], 1),
        "json_vs_engine_bracketed": round(med(bracketed["json"]), 3),
        "sse_vs_engine_bracketed": round(med(bracketed["sse"]), 3),
        "json_vs_engine_bracketed_rounds": [round(x, 3) for x in bracketed["json"]],
        "sse_vs_engine_bracketed_rounds": [round(x, 3) for x in bracketed["sse"]],
        "clean_rounds": clean,
        "json_vs_engine_clean": round(med([per_round["json"][i] for i in clean]), 3)
                                if clean else None,
        "sse_vs_engine_clean": round(med([per_round["sse"][i] for i in clean]), 3)
                               if clean else None,
    }  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
