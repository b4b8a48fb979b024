"""The front door's hop alone: what pagefleet's gateway adds to a request's way in and out.

    .venv/bin/python bench/gateway_hop.py --quick

bench/routing.py's per-request breakdown puts our gateway's hits 6-11 ms behind
sglang-router's on the way in (``door_in``) on a loaded machine, and the gateway's own
handler accounts for only part of it. This bench isolates the hop: fake upstreams (one
process, 4 ports) answer the bench's chat and agentic prompts with an SSE stream whose
first chunk carries two CLOCK_MONOTONIC stamps (the upstream handler's start, its first
write), after a fixed ``--prefill-ms``. The same client (aiohttp, the trace's prompts,
1 or 8 in flight) sends them straight to one upstream (``direct``: the floor), through
pagefleet's gateway (cache_aware, real Redis, real tokenizer) and through sglang-router
(when installed). Per door: ``door_in`` (client send -> upstream handler) and
``door_out`` (upstream first write -> client has the chunk), p50/p90/p99 in ms, and the
gateway's CPU per request (its process's CPU time over the run, start-up excluded).
``--busy N`` runs N spinning processes beside it (a fleet's busy daemons on the same cores).

Each door first gets a cold burst: the agentic trace's opening 8 turns at once, as the
door's very first requests (``{door}_cold_burst_door_in_ms_p50/max``): what a fresh
gateway costs a trace's opening burst. ``--base-pythonpath DIR`` runs a second gateway
from another checkout beside ours (door ``gateway_base``; ``gateway_over_base_*`` keys):
a paired A/B of two gateways in one run. ``--profile PATH`` runs our gateway under
cProfile (its CPU figures then include the profiler's cost).

Last line: one JSON object; ``gateway_door_in_ms_p50_c8`` etc., and
``gateway_over_sglang_door_in_p50_c8`` (ours / sglang-router's, same process and run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from pagefleet.dev.local_fleet import Child, free_port, http_ok, resolve_checkpoint_dir
from pagefleet.dev.peer_routers import peer_version, spawn_peer, wait_peer_ready
from pagefleet.dev.redis_server import LocalRedis
from pagefleet.dev.workload import (
    AgenticSpec,
    WorkloadSpec,
    build_agentic,
    build_conversations,
    flatten,
)

MODEL = "m"


# -- the fake upstream (run as its own process: `gateway_hop.py --serve-fake PORTS MS`) ----


async def _fake(ports: list[int], prefill_s: float) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        t_http = time.monotonic()
        await request.read()
        await asyncio.sleep(prefill_s)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        t_write = time.monotonic()
        chunk: dict[str, Any] = {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": f"{t_http:.6f} {t_write:.6f}"},
                    "finish_reason": None,
                }
            ],
        }
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        for _ in range(3):  # a few tokens, as max_tokens=4 makes
            await asyncio.sleep(0.005)
            chunk["choices"][0]["delta"] = {"content": " tok"}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        chunk["choices"][0].update(delta={}, finish_reason="length")
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def info(request: web.Request) -> web.Response:
        # /health, /ready, /v1/models, the peers' model-info probes: one answer for all.
        return web.json_response(
            {"status": "ok", "model_path": MODEL, "data": [{"id": MODEL, "object": "model"}]}
        )

    app = web.Application(client_max_size=1 << 24)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/{tail:.*}", info)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for p in ports:
        await web.TCPSite(runner, "127.0.0.1", p).start()
    await asyncio.Event().wait()


# -- the client ----------------------------------------------------------------------------


def _bodies(shape: str, n: int, system_prompt_words: int) -> list[bytes]:
    if shape == "chat":
        convs = build_conversations(
            WorkloadSpec(
                num_conversations=n, num_tenants=32, system_prompt_words=system_prompt_words,
                user_turn_words=8, assistant_turn_words=12, max_turns=4, max_tokens=4,
            )
        )  # fmt: skip
    else:
        convs = build_agentic(
            AgenticSpec(
                num_conversations=n, num_tenants=12, initial_tenants=4,
                system_prompt_words=system_prompt_words,
            )
        )  # fmt: skip
    turns = list(flatten(convs))[:n]
    return [
        json.dumps(
            {"model": MODEL, "messages": t.as_openai(), "max_tokens": 4, "stream": True}
        ).encode()
        for t in turns
    ]


async def _one(s: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float]:
    t0 = time.monotonic()
    async with s.post(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    ) as r:
        r.raise_for_status()
        got: tuple[float, float] | None = None
        async for line in r.content:
            if got is None and line.startswith(b"data: {"):
                first = time.monotonic()
                stamps = json.loads(line[6:])["choices"][0]["delta"]["content"].split()
                t_http, t_write = float(stamps[0]), float(stamps[1])
                got = ((t_http - t0) * 1e3, (first - t_write) * 1e3)
    assert got is not None, f"no stamped chunk from {url}"
    return got


async def _burst(url: str, bodies: list[bytes]) -> list[tuple[float, float]]:
    """``bodies`` all at once, as a door's very first requests (a trace's opening burst)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        return list(await asyncio.gather(*(_one(s, url, b) for b in bodies)))


async def _drive(url: str, bodies: list[bytes], concurrency: int) -> list[tuple[float, float]]:
    rows: list[tuple[float, float]] = []
    queue = list(bodies)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for b in bodies[:4]:  # warm the connections, the tokenizer, the template
            await _one(s, url, b)

        async def worker() -> None:
            while queue:
                rows.append(await _one(s, url, queue.pop(0)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rows


def _q(values: list[float], q: float) -> float:
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 2)


def _cpu_ms(pid: int) -> float:
    """CPU time (user + system) of ``pid`` and its children, in ms."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")
    return total


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    kids = [int(x) for x in text.split()]
    return kids + [g for k in kids for g in _children(k)]


def _wait(url: str, path: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not http_ok(url + path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}{path} did not answer within {timeout_s:.0f}s")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="chat only, 40 requests per run")
    ap.add_argument("--requests", type=int, default=120, help="per door, shape and concurrency")
    ap.add_argument("--prefill-ms", type=float, default=30.0, help="the fake upstream's TTFT")
    ap.add_argument("--busy", type=int, default=0, help="spinning processes beside the run")
    ap.add_argument(
        "--model", default="bench", help="the gateway's tokenizer ('bench': bench/routing.py's)"
    )
    ap.add_argument("--system-prompt-words", type=int, default=280)
    ap.add_argument("--gateway-args", default="", help="extra flags for pagefleet's gateway")
    ap.add_argument(
        "--base-pythonpath",
        default=None,
        metavar="DIR",
        help="also run the gateway of another checkout (door gateway_base, same flags) "
        "beside ours: a paired A/B in one run",
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="run the gateway under cProfile and write its stats to PATH (pstats format; "
        "the CPU figures then include the profiler's own cost)",
    )
    ap.add_argument(
        "--serve-fake", nargs=2, metavar=("PORTS", "PREFILL_MS"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.serve_fake:
        ports = [int(p) for p in args.serve_fake[0].split(",")]
        asyncio.run(_fake(ports, float(args.serve_fake[1]) / 1000))
        return
    n = 40 if args.quick else args.requests
    shapes = ("chat",) if args.quick else ("chat", "agentic")
    t_start = time.perf_counter()
    logs = Path(tempfile.mkdtemp(prefix="pf-gateway-hop-"))
    if args.model == "bench":
        from bench_models import ensure_bench_model  # bench/, beside this file

        model_dir = str(ensure_bench_model())
    else:
        model_dir = str(resolve_checkpoint_dir(args.model))
    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    redis = LocalRedis()
    children: list[Child] = []
    busy: list[subprocess.Popen[bytes]] = []
    out: dict[str, Any] = {"load_avg_1m": round(os.getloadavg()[0], 2), "busy": args.busy}
    try:
        redis.start()
        fake = Child(
            "fake", [sys.executable, __file__, "--serve-fake", ",".join(map(str, ports)),
                     str(args.prefill_ms)], urls[0], logs / "fake.log",
        )  # fmt: skip
        fake.start()
        children.append(fake)
        gw_port = free_port()

        def gateway_argv(port: int, profile: str | None) -> list[str]:
            return [
                sys.executable,
                *(["-m", "cProfile", "-o", profile] if profile else []),
                "-m", "pagefleet.cli", "gateway",
                "--host", "127.0.0.1", "--port", str(port), "--model", model_dir,
                "--served-model-name", MODEL, "--kv-namespace", MODEL, "--block-size", "16",
                "--endpoints", ",".join(urls), "--redis-url", redis.url,
                "--intake-workers", "0", *args.gateway_args.split(),
            ]  # fmt: skip

        gateway = Child(
            "gateway",
            gateway_argv(gw_port, args.profile),
            f"http://127.0.0.1:{gw_port}",
            logs / "gateway.log",
        )
        gateway.start()
        children.append(gateway)
        doors = {"direct": urls[0], "gateway": gateway.url}
        gateways = {"gateway": gateway}
        if args.base_pythonpath:
            base_port = free_port()
            base = Child(
                "gateway_base",
                gateway_argv(base_port, None),
                f"http://127.0.0.1:{base_port}",
                logs / "gateway_base.log",
                env={"PYTHONPATH": args.base_pythonpath},
            )
            base.start()
            children.append(base)
            doors["gateway_base"] = base.url
            gateways["gateway_base"] = base
        if peer_version("sglang"):
            peer = spawn_peer("sglang", urls, logs)
            children.append(peer)
            doors["sglang"] = peer.url
        _wait(urls[0], "/health")
        for g in gateways.values():
            _wait(g.url, "/ready")
        if "sglang" in doors:
            wait_peer_ready(children[-1], MODEL)
            doors["sglang"] = children[-1].url  # restarted on other ports if one was taken
        busy = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)
        ]
        # Each door's first requests: the agentic trace's opening burst (its first 8
        # turns, 4 tenants' system prompts) on a door that has served nothing yet.
        opening = _bodies("agentic", 8, args.system_prompt_words)
        for door, url in doors.items():
            din = [r[0] for r in asyncio.run(_burst(url, opening))]
            out[f"{door}_cold_burst_door_in_ms_p50"] = _q(din, 0.5)
            out[f"{door}_cold_burst_door_in_ms_max"] = _q(din, 1.0)
            print(
                f"cold burst of 8 {door:12s} door_in p50 {_q(din, 0.5):6.2f} max "
                f"{_q(din, 1.0):6.2f} ms",
                flush=True,
            )
        for shape in shapes:
            bodies = _bodies(shape, n + 4, args.system_prompt_words)
            sfx = "" if shape == "chat" else "_agentic"
            for conc in (1, 8):
                for door, url in doors.items():
                    proc = gateways[door].proc if door in gateways else None
                    cpu0 = _cpu_ms(proc.pid) if proc else 0.0
                    rows = asyncio.run(_drive(url, bodies, conc))
                    cpu = (_cpu_ms(proc.pid) - cpu0) / len(bodies) if proc else 0.0
                    din = [r[0] for r in rows]
                    dout = [r[1] for r in rows]
                    key = f"{door}_door_in_ms"
                    for q in (0.5, 0.9, 0.99):
                        out[f"{key}_p{int(q * 100)}_c{conc}{sfx}"] = _q(din, q)
                    out[f"{door}_door_out_ms_p50_c{conc}{sfx}"] = _q(dout, 0.5)
                    line = (
                        f"{shape:8s} c={conc} {door:8s} door_in p50 {_q(din, 0.5):6.2f} "
                        f"p90 {_q(din, 0.9):6.2f} p99 {_q(din, 0.99):6.2f} ms  door_out p50 "
                        f"{_q(dout, 0.5):6.2f} ms"
                    )
                    if door in gateways:
                        out[f"{door}_cpu_ms_per_request_c{conc}{sfx}"] = round(cpu, 2)
                        line += f"  gateway CPU {cpu:.2f} ms/request"
                    print(line, flush=True)
                g = out[f"gateway_door_in_ms_p50_c{conc}{sfx}"]
                out[f"gateway_minus_direct_door_in_ms_p50_c{conc}{sfx}"] = round(
                    g - out[f"direct_door_in_ms_p50_c{conc}{sfx}"], 2
                )
                b = out.get(f"gateway_base_door_in_ms_p50_c{conc}{sfx}")
                if b:
                    out[f"gateway_over_base_door_in_p50_c{conc}{sfx}"] = round(g / b, 3)
                    out[f"gateway_over_base_cpu_per_request_c{conc}{sfx}"] = round(
                        out[f"gateway_cpu_ms_per_request_c{conc}{sfx}"]
                        / max(0.01, out[f"gateway_base_cpu_ms_per_request_c{conc}{sfx}"]),
                        3,
                    )
                s = out.get(f"sglang_door_in_ms_p50_c{conc}{sfx}")
                out[f"gateway_over_sglang_door_in_p50_c{conc}{sfx}"] = (
                    round(g / s, 3) if s else None
                )
    finally:
        for p in busy:
            p.kill()
            p.wait()
        for c in reversed(children):
            c.stop()
        redis.stop()
    out["sglang_router"] = peer_version("sglang")
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
