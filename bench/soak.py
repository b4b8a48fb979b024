"""Soak: mixed traffic with faults against a local fleet; resources sampled for leaks.

    python bench/soak.py --minutes 10        # the soak (not in CI)
    python bench/soak.py --quick             # < 60 s: a 10 s baseline, 20 s with faults

A fleet as `pagefleet up` starts it (Redis, 2 tiny daemons, a gateway with short hang
timeouts), supervised (a killed daemon is restarted). Clients loop over a mix: non-streamed
and streamed completions, chat, streams the client abandons half way, over-long prompts and
broken JSON (both must get an OpenAI-shaped 400). Faults, with faults on, every few seconds
in turn: SIGKILL daemon-0 (restarted by the supervisor), SIGSTOP/SIGCONT daemon-0, a Redis
restart. daemon-1 and the gateway are never faulted: their RSS and open fds are sampled
after warm-up and at the end. Once traffic stops, each live daemon's referenced KV blocks
must drop to zero.

Outcomes: ``ok``; ``retryable`` (429/503/502/504 or a stream ending with an error event,
no [DONE]); ``failed_non_retryable`` (any other error, or a 400 for a valid request);
``wrong_200`` (a 200 that looks complete but is not). The last line is one JSON object:
requests, wrong_200, failed_non_retryable, rss_growth_mb, fd_growth, leaked_blocks, and the
ratio of the faulty phase's throughput to the baseline phase's (same process, same fleet).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagefleet.dev import process
from pagefleet.dev.local_fleet import FleetSpec, LocalFleet, http_ok

MAX_LEN = 256
GATEWAY_ARGS = [
    "--first-byte-timeout", "3", "--inter-chunk-timeout", "2", "--request-timeout", "30",
    "--probe-interval", "0.5", "--probe-timeout", "0.5", "--probe-failures", "2",
    "--max-model-len", str(MAX_LEN),
]  # fmt: skip
DAEMON_ARGS = ["--max-model-len", str(MAX_LEN)]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _tree_usage(pid: int) -> tuple[float, int]:
    """RSS (MiB) and open fds of ``pid`` and its direct children (intake workers)."""
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    rss, fds = 0.0, 0
    for p in pids:
        try:
            rss += _rss_mb(p)
            fds += _fds(p)
        except OSError:
            pass
    return rss, fds


async def _referenced_blocks(s: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None

    def val(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return int(val("pagefleet:kv_cache_num_blocks") - val("pagefleet:kv_cache_free_blocks"))


async def _request(s: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    """One request of the mix; returns its outcome."""
    kind = rng.choices(
        ["plain", "stream", "chat", "abandon", "too_long", "bad_json"], [4, 4, 2, 2, 1, 1]
    )[0]
    n = rng.randint(4, 40)
    prompt = f"soak {rng.randint(0, 50)}: " + "the quick brown fox " * rng.randint(1, 8)
    body: dict = {"model": "tiny", "prompt": prompt, "max_tokens": n, "ignore_eos": True}
    path = "/v1/completions"
    if kind == "chat":
        path = "/v1/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": n, "ignore_eos": True}  # fmt: skip
    if kind in ("stream", "abandon"):
        body["stream"] = True
    if kind == "too_long":
        body["prompt"] = "word " * (MAX_LEN * 4)
    data = b"{not json" if kind == "bad_json" else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    try:
        async with asyncio.timeout(60):
            async with s.post(url + path, data=data, headers=headers) as r:
                if r.status != 200:
                    err = await r.json(content_type=None)
                    shaped = isinstance(err.get("error", {}).get("message"), str)
                    if kind in ("too_long", "bad_json"):
                        return "ok" if r.status == 400 and shaped else "failed_non_retryable"
                    if r.status in (429, 502, 503, 504) and shaped:
                        return "retryable"
                    return "failed_non_retryable"
                if kind in ("too_long", "bad_json"):
                    return "wrong_200"
                if not body.get("stream"):
                    out = await r.json()
                    good = out["choices"][0]["finish_reason"] == "length" and (
                        out["usage"]["completion_tokens"] == n
                    )
                    return "ok" if good else "wrong_200"
                raw = b""
                async for line in r.content:
                    raw += line
                    if kind == "abandon" and raw.count(b"data: {") >= 2:
                        return "ok"  # leaving closes the connection mid-stream
                events = [e for e in raw.decode().split("\n\n") if e.strip()]
                if events and events[-1] == "data: [DONE]":
                    chunks = [json.loads(e[6:]) for e in events[:-1]]
                    finished = any(
                        c["choices"][0].get("finish_reason") for c in chunks if c["choices"]
                    )
                    return "ok" if finished else "wrong_200"
                last = json.loads(events[-1][6:]) if events else {}
                return "retryable" if "error" in last else "wrong_200"
    except TimeoutError:
        return "hung"
    except aiohttp.ClientError:
        return "failed_non_retryable"


async def _clients(url: str, until: float, concurrency: int, seed: int) -> Counter[str]:
    counts: Counter[str] = Counter()

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < until:
                counts[await _request(s, url, rng)] += 1

    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    return counts


def _fault_loop(fleet: LocalFleet, until: float, every_s: float, log: list[str]) -> None:
    """Run in a thread: SIGKILL, SIGSTOP/SIGCONT daemon-0 and restart Redis, in turn."""
    step = 0
    while time.monotonic() + every_s < until:
        time.sleep(every_s)
        victim = fleet.daemons[0]
        fault = ("kill", "stop", "redis")[step % 3]
        step += 1
        if fault == "kill" and victim.alive:
            victim.kill()
        elif fault == "stop" and victim.alive and victim.proc is not None:
            process.signal_group(victim.proc, signal.SIGSTOP)
            time.sleep(2.0)
            process.signal_group(victim.proc, signal.SIGCONT)
        elif fault == "redis":
            fleet.stop_redis()
            time.sleep(0.5)
            fleet.restart_redis()
        else:
            continue
        log.append(f"{time.monotonic():.1f} {fault}")


async def _run(args: argparse.Namespace) -> dict:
    fleet = LocalFleet(
        FleetSpec(num_daemons=2, daemon_args=DAEMON_ARGS, gateway_args=GATEWAY_ARGS, seed=0)
    )
    fleet.start()
    fleet.supervise_in_background(0.2)
    try:
        assert fleet.gateway is not None and fleet.gateway.proc is not None
        steady = fleet.daemons[1]
        assert steady.proc is not None
        url = fleet.gateway_url
        # Warm-up, then the resource baseline.
        await _clients(url, time.monotonic() + 3, args.concurrency, seed=1)
        gw0, d0 = _tree_usage(fleet.gateway.proc.pid), _tree_usage(steady.proc.pid)
        t0 = time.monotonic()
        base = await _clients(url, t0 + args.baseline_s, args.concurrency, seed=2)
        base_rate = sum(base.values()) / (time.monotonic() - t0)
        faults: list[str] = []
        t1 = time.monotonic()
        until = t1 + args.fault_s
        fault_thread = asyncio.to_thread(_fault_loop, fleet, until, args.fault_every_s, faults)
        faulty, _ = await asyncio.gather(
            _clients(url, until, args.concurrency, seed=3), fault_thread
        )
        fault_rate = sum(faulty.values()) / (time.monotonic() - t1)
        # Quiesce: every daemon back, no request in flight, then count referenced blocks.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all(
            d.alive and http_ok(d.url + "/ready", 0.5) for d in fleet.daemons
        ):
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        async with aiohttp.ClientSession() as s:
            leaked = [await _referenced_blocks(s, d.url) for d in fleet.daemons]
        gw1, d1 = _tree_usage(fleet.gateway.proc.pid), _tree_usage(steady.proc.pid)
    finally:
        fleet.stop()
    total = base + faulty
    return {
        "bench": "soak",
        "requests": sum(total.values()),
        "outcomes": dict(total),
        "wrong_200": total["wrong_200"],
        "failed_non_retryable": total["failed_non_retryable"],
        "hung": total["hung"],
        "faults": len(faults),
        "rss_growth_mb": round(max(gw1[0] - gw0[0], d1[0] - d0[0]), 1),
        "fd_growth": max(gw1[1] - gw0[1], d1[1] - d0[1]),
        "leaked_blocks": sum(b or 0 for b in leaked),
        "leak_probe_failed": sum(b is None for b in leaked),
        "baseline_rps": round(base_rate, 1),
        "faulty_rps": round(fault_rate, 1),
        "faulty_vs_baseline": round(fault_rate / base_rate, 3) if base_rate else None,
        "load_avg_1m": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="Faulty phase length.")
    ap.add_argument("--quick", action="store_true", help="10 s baseline + 20 s faults.")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--fault-every-s", type=float, default=5.0)
    args = ap.parse_args()
    args.baseline_s = 10.0 if args.quick else 60.0
    args.fault_s = 20.0 if args.quick else args.minutes * 60
    if args.quick:
        args.fault_every_s = min(args.fault_every_s, 4.0)
    result = asyncio.run(_run(args))
    print(
        f"soak: {result['requests']} requests, wrong_200={result['wrong_200']}, "
        f"failed_non_retryable={result['failed_non_retryable']}, "
        f"leaked_blocks={result['leaked_blocks']}, faulty/baseline throughput "
        f"{result['faulty_vs_baseline']}",
        file=sys.stderr,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
