"""Cache-aware routing vs round robin vs least load on one seeded multi-tenant chat trace.

    .venv/bin/python bench/routing.py --quick

A real fleet: 4 daemons + real Redis + one gateway per policy, all started by pagefleet's
LocalFleet, on the 4x512 Llama of bench/throughput.py (`--model bench`, the default): a
model whose prefill, not the fixed per-request path, sets TTFT, as on a real model and GPU.
(`--model tiny` measures mostly HTTP and Python overhead, where a hit saves little.)

Each daemon's KV pool is sized below the trace's prefix working set while the fleet's total
is above it (by default 1/3 of the working set per daemon; sizes printed), the regime where
routing decides the hit rate. Every policy replays the same trace; a per-policy salt at the
start of every system prompt gives each run a cold, disjoint set of prefixes without
restarting daemons (earlier runs' blocks are unreferenced, so LRU evicts them first).
Requests run closed-loop (`--concurrency` conversations in flight), or open-loop with
`--request-rate` (Poisson conversation arrivals, the same schedule for every policy).

Baseline and ceiling, both measured here: round robin and least load on the same trace,
and `ideal_hit_rate`, one unbounded cache replaying the trace in order. The last run sends
one identical prompt many times through the cache_aware gateway to check that a hot
prompt spreads (`max_pod_share_single_prompt`). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import replace
from pathlib import Path

from pagefleet.api.openai import ChatCompletionRequest
from pagefleet.dev.loadgen import run_workload, summarize, trim
from pagefleet.dev.local_fleet import FleetSpec, LocalFleet
from pagefleet.dev.workload import (
    WorkloadSpec,
    build_conversations,
    flatten,
    ideal_hit_rate,
    single_prompt_trace,
)
from pagefleet.gateway.prompts import PromptTokenizer
from pagefleet.kvindex.hashing import block_hashes

POLICIES = ("cache_aware", "round_robin", "least_load")


def _token_ids(tok: PromptTokenizer, convs: list) -> list[list[int]]:
    return [
        tok.chat_ids(ChatCompletionRequest(model="tiny", messages=t.as_openai()))
        for t in flatten(convs)
    ]


def _server_info(url: str) -> dict:
    with urllib.request.urlopen(url + "/get_server_info", timeout=10) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small trace, under ~60 s")
    ap.add_argument("--daemons", type=int, default=4)
    ap.add_argument("--requests", type=int, default=None, help="turns per policy")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: conversations per second (Poisson); default: closed loop",
    )
    ap.add_argument(
        "--kv-blocks-per-daemon",
        type=int,
        default=None,
        help="default: 1/3 of the trace's prefix working set",
    )
    ap.add_argument(
        "--kv-cache-memory-mb", type=int, default=None, help="size the pool in MiB instead"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf-s", type=float, default=0.8, help="tenant popularity skew")
    ap.add_argument(
        "--tenants",
        type=int,
        default=None,
        help="default: 16 with --quick, 32 for the full trace (about the same requests per "
        "tenant, so the full run is the quick one with more traffic, not hotter tenants)",
    )
    ap.add_argument(
        "--system-prompt-words",
        type=int,
        default=280,
        help="~4.3 tokens per word with the tiny tokenizer: ~1200-token system prompts",
    )
    ap.add_argument("--weights", default=None, help="cache_aware weights for the gateway")
    ap.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="daemons' per-step prefill cap per request (0: none)",
    )
    ap.add_argument(
        "--model",
        default="bench",
        help="'bench' = the 4x512 Llama of bench/throughput.py, where prefill dominates a "
        "request's fixed overhead; or a tiny preset or checkpoint dir",
    )
    args = ap.parse_args()
    if args.model == "bench":
        from bench_models import ensure_bench_model

        args.model = str(ensure_bench_model())
    else:
        from pagefleet.dev.local_fleet import resolve_checkpoint_dir

        args.model = str(resolve_checkpoint_dir(args.model))

    t_start = time.perf_counter()
    n_req = args.requests or (64 if args.quick else 240)
    if args.tenants is None:
        args.tenants = 16 if args.quick else 32
    spec = WorkloadSpec(
        num_conversations=n_req,
        num_tenants=args.tenants,
        system_prompt_words=args.system_prompt_words,
        user_turn_words=8,
        assistant_turn_words=12,
        max_turns=4,
        zipf_s=args.zipf_s,
        max_tokens=4,
        seed=args.seed,
    )
    # The trace and its prefix working set first: they size the daemons' KV pools. The
    # gateway computes keys under the fleet's namespace, the served model name.
    served = args.model
    tok = PromptTokenizer.from_dir(args.model)
    base = trim(build_conversations(spec), n_req)
    ids = _token_ids(tok, base)
    uses: Counter[int] = Counter()
    for x in ids:
        uses.update(set(block_hashes(x, 16, served)))
    # The prefix working set: blocks some later request can reuse (seen twice or more).
    reusable = sum(1 for n in uses.values() if n >= 2)
    ideal = ideal_hit_rate(ids, 16, served)
    lens = sorted(len(x) for x in ids)
    kv_blocks = None
    if args.kv_cache_memory_mb is None:
        # A third of the working set per daemon, 4/3 of it across the fleet: only a router
        # that partitions the reused prefixes across pods keeps the hit rate near the
        # ceiling.
        kv_blocks = args.kv_blocks_per_daemon or max(16, reusable // 3)
    fleet = LocalFleet(
        FleetSpec(
            num_daemons=args.daemons,
            model=args.model,
            kv_cache_memory_mb=args.kv_cache_memory_mb,
            num_gpu_blocks=kv_blocks,
            seed=args.seed,
            weights=args.weights,
            gateway_port=0,
            daemon_args=[
                "--long-prefill-token-threshold",
                str(args.long_prefill_token_threshold),
            ],
        )
    )
    assert fleet.namespace == served, (fleet.namespace, served)
    gateways = {}
    try:
        fleet.start()
        gateways["cache_aware"] = fleet.gateway
        for policy in POLICIES[1:]:
            gateways[policy] = fleet.spawn_gateway(policy, name=f"gateway-{policy}")
        fleet.wait_ready([g for g in gateways.values() if g is not None])
        t_ready = time.perf_counter() - t_start
        blocks_per_daemon = int(_server_info(fleet.daemon_urls[0]).get("num_blocks", 0))
        print(
            f"fleet ready in {t_ready:.1f}s; {args.daemons} daemons x {blocks_per_daemon} KV "
            f"blocks = {args.daemons * blocks_per_daemon} fleet blocks; prefix working set "
            f"{reusable} blocks (all distinct blocks {len(uses)}); {len(ids)} requests, "
            f"prompt tokens {lens[0]}..{lens[-1]}"
        )
        if not blocks_per_daemon < reusable < args.daemons * blocks_per_daemon:
            print("WARNING: not in the routing regime (per-daemon < working set < fleet)")

        # Warm every daemon's first-forward costs so no policy pays them.
        warm = trim(
            build_conversations(
                WorkloadSpec(num_conversations=2 * args.daemons, max_turns=1, salt="warm ")
            ),
            2 * args.daemons,
        )
        asyncio.run(
            run_workload(
                gateways["round_robin"].url,
                fleet.served_model_name,
                warm,
                args.daemons,
                progress=False,
            )
        )

        reports = {}
        for i, policy in enumerate(POLICIES):
            salted = replace(spec, salt=f"run {i} {policy}. ")
            convs = trim(build_conversations(salted), n_req)
            results, wall = asyncio.run(
                run_workload(
                    gateways[policy].url,
                    fleet.served_model_name,
                    convs,
                    args.concurrency,
                    progress=False,
                    request_rate=args.request_rate,
                    seed=args.seed,
                )
            )
            reports[policy] = summarize(results, wall)
            r = reports[policy]
            print(
                f"{policy:12s} hit {r['prefix_hit_rate']:.3f}  ttft p50 {r['ttft_ms_p50']} ms"
                f" p90 {r['ttft_ms_p90']} ms  wall {r['wall_s']} s  failed {r['failed']}  "
                f"max pod share {r['max_pod_share']:.2f}"
            )

        single = single_prompt_trace(48 if args.quick else 160, words=140, salt="single ")
        results, wall = asyncio.run(
            run_workload(
                gateways["cache_aware"].url,
                fleet.served_model_name,
                single,
                args.concurrency,
                progress=False,
            )
        )
        single_report = summarize(results, wall)
        print(
            f"single prompt via cache_aware: pod share {single_report['pod_share']} "
            f"hit {single_report['prefix_hit_rate']:.3f}"
        )
        t_runs = time.perf_counter() - t_start - t_ready
    finally:
        for name, g in gateways.items():
            if g is not None and name != "cache_aware":
                g.terminate()
        fleet.stop()
        for g in gateways.values():
            if g is not None:
                g.stop()

    ca, rr, ll = (reports[p] for p in POLICIES)
    out = {
        "ideal_hit_rate": round(ideal, 4),
        "cache_aware_hit_rate": ca["prefix_hit_rate"],
        "round_robin_hit_rate": rr["prefix_hit_rate"],
        "least_load_hit_rate": ll["prefix_hit_rate"],
        "cache_aware_frac_of_ideal": round(ca["prefix_hit_rate"] / ideal, 4) if ideal else 0.0,
        "ttft_p50_ms_cache_aware": ca["ttft_ms_p50"],
        "ttft_p50_ms_round_robin": rr["ttft_ms_p50"],
        "ttft_p50_ms_least_load": ll["ttft_ms_p50"],
        "ttft_p50_ratio_rr_over_ca": round(rr["ttft_ms_p50"] / ca["ttft_ms_p50"], 3)
        if ca["ttft_ms_p50"]
        else None,
        "ttft_mean_ratio_rr_over_ca": round(rr["ttft_ms_mean"] / ca["ttft_ms_mean"], 3)
        if ca["ttft_ms_mean"]
        else None,
        "max_pod_share_single_prompt": single_report["max_pod_share"],
        "failed_requests": sum(r["failed"] for r in (ca, rr, ll, single_report)),
        "requests_per_policy": n_req,
        "model": Path(args.model).name,
        "tenants": args.tenants,
        "system_prompt_words": args.system_prompt_words,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "load": f"open {args.request_rate}/s"
        if args.request_rate
        else f"closed {args.concurrency}",
        "daemons": args.daemons,
        "kv_blocks_per_daemon": blocks_per_daemon,
        "prefix_working_set_blocks": reusable,
        "start_s": round(t_ready, 1),
        "runs_s": round(t_runs, 1),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
