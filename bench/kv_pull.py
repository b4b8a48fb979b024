"""The P/D KV pull path alone: shared-memory staging vs the engine pipe, same process.

Two prefill/decode pairs of daemons on the 4x512 bench Llama (each daemon pinned to one
core, ``OMP_NUM_THREADS=1``, engine in its own process, the default): one pair with the
default ``--kv-stage-dir /dev/shm`` (the pulled and exported KV cross between the HTTP and
the engine process in shared memory), one with ``--kv-stage-dir ''`` (pickled bytes through
the engine pipe, per layer on the prefill side: the path before shared memory). For each
of ``--prompts`` long prompts (1.5k-2k tokens, never seen before), alternating the pairs:

1. the prefill daemon runs it with ``max_tokens=1`` and ``do_remote_decode`` (not timed);
2. the decode daemon gets it with those ``kv_transfer_params`` and ``max_tokens=1``: timed
   from the request to the answer (reserve, pull, verify, commit, one step for the last
   prompt token -- what P/D adds to a request's TTFT beyond the prefill itself).

It prints, per path, the median decode-request time and the pulls' mean time and MB/s
(the decode daemons' ``pagefleet:kv_transfer_seconds`` sum / count), and
``pull_ms_ratio_pipe_over_stage``. The last line is one JSON object.

    python bench/kv_pull.py --quick     # 6 prompts per path
    python bench/kv_pull.py             # 20 prompts per path
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from bench_models import bench_model
from pd import MODEL, _daemon, _wait_ready, stop


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with s.post(url + "/v1/completions", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status} from {url}: {data}")
        return data


async def _pull_stats(s: aiohttp.ClientSession, url: str) -> tuple[float, float, float]:
    """(seconds sum, count, bytes received) of a decode daemon's KV pulls."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    secs = count = nbytes = 0.0
    for line in text.splitlines():
        if line.startswith("pagefleet:kv_transfer_seconds_sum"):
            secs = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pagefleet:kv_transfer_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pagefleet:kv_transfer_bytes_total") and "received" in line:
            nbytes = float(line.rsplit(" ", 1)[1])
    return secs, count, nbytes


async def main(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    model = str(bench_model(None))
    vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 1000)
    logdir = Path(tempfile.mkdtemp(prefix="pagefleet-bench-kvpull-"))
    pairs = {
        "stage": [_daemon("p-stage", model, 0, "prefill", logdir),
                  _daemon("d-stage", model, 1, "decode", logdir)],
        "pipe": [_daemon("p-pipe", model, 0, "prefill", logdir, ["--kv-stage-dir", ""]),
                 _daemon("d-pipe", model, 1, "decode", logdir, ["--kv-stage-dir", ""])],
    }  # fmt: skip
    procs = [p for pair in pairs.values() for p in pair]
    walls: dict[str, list[float]] = {k: [] for k in pairs}
    try:
        await _wait_ready(procs)
        print(f"[{time.perf_counter() - t0:5.1f} s] daemons ready", file=sys.stderr)
        rng = random.Random(args.seed)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            for i in range(2 * args.prompts):
                name = ("stage", "pipe")[i % 2]
                prefill, decode = pairs[name]
                ids = [rng.randrange(5, vocab) for _ in range(rng.randrange(1536, 2048))]
                body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
                pre = await _post(s, prefill.url, {**body,
                                  "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
                t = time.perf_counter()
                tp = pre["kv_transfer_params"]
                await _post(s, decode.url, {**body, "kv_transfer_params": tp})
                walls[name].append(time.perf_counter() - t)
            stats = {k: await _pull_stats(s, pair[1].url) for k, pair in pairs.items()}
    finally:
        stop(procs)
    out: dict = {"bench": "kv_pull", "quick": args.quick, "prompts_per_path": args.prompts}
    for k in pairs:
        secs, count, nbytes = stats[k]
        out[f"pull_ms_mean_{k}"] = round(secs / count * 1e3, 1) if count else None
        out[f"pull_mb_per_s_{k}"] = round(nbytes / secs / 1e6, 1) if secs else None
        out[f"pulls_{k}"] = int(count)
        out[f"decode_request_ms_p50_{k}"] = round(statistics.median(walls[k]) * 1e3, 1)
        print(
            f"{k:5s}: pulls {int(count):3d}  pull mean {out[f'pull_ms_mean_{k}']} ms "
            f"({out[f'pull_mb_per_s_{k}']} MB/s)  decode request p50 "
            f"{out[f'decode_request_ms_p50_{k}']} ms",
            file=sys.stderr,
        )
    if out["pull_ms_mean_stage"] and out["pull_ms_mean_pipe"]:
        out["pull_ms_ratio_pipe_over_stage"] = round(
            out["pull_ms_mean_pipe"] / out["pull_ms_mean_stage"], 2
        )
    out["decode_request_ms_ratio_pipe_over_stage"] = round(
        out["decode_request_ms_p50_pipe"] / out["decode_request_ms_p50_stage"], 2
    )
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", type=int, default=None, help="per path (20; quick 6)")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    if args.prompts is None:
        args.prompts = 6 if args.quick else 20
    return args


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args()))))
