"""Prefix caching on vs off on a shared-system-prompt workload, same engine, same trace.

Workload (seeded): 8 tenants, each with a long system prompt; many short, unique user
turns against them; plus multi-turn chats whose prompt grows by the previous answer and a
new user message each turn (the shape of real chat traffic). A closed loop keeps
``--concurrency`` requests in flight; a request's TTFT is its first token's time minus the
moment it was handed to the engine. The same trace runs on two engines built from the
same config except ``enable_prefix_caching``.

Figures: ``hit_rate`` (prompt tokens served from cache / prompt tokens looked up, caching
on), ``ttft_ratio_off_on`` (mean TTFT off / on), ``throughput_ratio_on_off`` (tokens/s on /
off) and ``prefill_tokens_saved_frac`` (prompt tokens not computed / all prompt tokens).

    python bench/prefix_cache.py            # 8 tenants x 24 turns + 4 chats x 8 turns
    python bench/prefix_cache.py --quick    # 8 tenants x 12 turns + 2 chats x 6 turns
    python bench/prefix_cache.py --model smollm2-135m --quick   # the real model (minutes)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass

from bench_models import bench_model

BLOCK_SIZE = 16


@dataclass(slots=True)
class Turn:
    prompt: list[int]
    max_tokens: int
    chat: int | None = None  # chat id: the next turn of this chat extends this one


def build_trace(
    rng: random.Random,
    vocab: int,
    tenants: int,
    turns: int,
    chats: int,
    chat_turns: int,
    system_len: int,
    user_len: int,
) -> tuple[list[Turn], list[list[list[int]]]]:
    """Single-shot turns, interleaved, and per chat the user messages of each of its turns."""

    def toks(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    systems = [toks(system_len) for _ in range(tenants)]
    single = [Turn(systems[t] + toks(user_len), 8) for _ in range(turns) for t in range(tenants)]
    rng.shuffle(single)
    chat_msgs = [[toks(user_len) for _ in range(chat_turns)] for _ in range(chats)]
    for c in range(chats):
        chat_msgs[c][0] = systems[c % tenants] + chat_msgs[c][0]
    return single, chat_msgs


def run(
    model: str,
    caching: bool,
    single: list[Turn],
    chat_msgs: list[list[list[int]]],
    concurrency: int,
    num_blocks: int,
) -> dict[str, float]:
    from pagefleet.engine.config import EngineConfig
    from pagefleet.engine.engine import LLMEngine
    from pagefleet.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=model,
            block_size=BLOCK_SIZE,
            num_gpu_blocks=num_blocks,
            max_num_seqs=32,
            max_num_batched_tokens=2048,
            enable_prefix_caching=caching,
        )
    )
    engine.generate([[20, 21, 22]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    base = engine.stats()

    queue: list[Turn] = list(single)
    chat_history = [[] for _ in chat_msgs]  # tokens so far per chat
    chat_next = [0] * len(chat_msgs)
    # Chats start interleaved with the single turns: one chat turn every few singles.
    every = max(1, len(single) // max(1, sum(len(m) for m in chat_msgs)))
    ttfts: list[float] = []
    inflight: dict[str, Turn] = {}
    outputs: dict[str, list[int]] = {}
    generated = 0
    n = 0
    t0 = time.perf_counter()

    def next_turn() -> Turn | None:
        nonlocal n
        n += 1
        ready = [
            c
            for c in range(len(chat_msgs))
            if chat_next[c] < len(chat_msgs[c]) and not any(t.chat == c for t in inflight.values())
        ]
        if ready and (n % every == 0 or not queue):
            c = ready[0] if n % 2 else ready[-1]
            prompt = chat_history[c] + chat_msgs[c][chat_next[c]]
            chat_next[c] += 1
            return Turn(prompt, 16, chat=c)
        return queue.pop(0) if queue else None

    while True:
        while len(inflight) < concurrency:
            turn = next_turn()
            if turn is None:
                break
            rid = f"r{n}"
            inflight[rid] = turn
            outputs[rid] = []
            engine.add_request(
                rid,
                turn.prompt,
                SamplingParams(temperature=0, max_tokens=turn.max_tokens, ignore_eos=True),
            )
        if not inflight:
            break
        for out in engine.step():
            for d in out.deltas:
                outputs[out.request_id].extend(d.new_token_ids)
            if out.finished:
                m = out.metrics
                ttfts.append(m.first_token_time - m.arrival_time)
                turn = inflight.pop(out.request_id)
                generated += out.num_generated_tokens
                if turn.chat is not None:
                    chat_history[turn.chat] = turn.prompt + outputs[out.request_id]
    elapsed = time.perf_counter() - t0
    st = engine.stats()
    prompt_tokens = st.prompt_tokens_total - base.prompt_tokens_total
    hits = st.prefix_hits_tokens - base.prefix_hits_tokens
    queries = st.prefix_queries_tokens - base.prefix_queries_tokens
    return {
        "requests": len(ttfts),
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "tok_s": (prompt_tokens + generated) / elapsed,
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "hits": hits,
        "queries": queries,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller trace (< 60 s)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=768)
    ap.add_argument("--user-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model",
        default="bench",
        help="bench (seeded 4x512 Llama), a preset such as smollm2-135m, a directory or .gguf",
    )
    ap.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks per engine (default 4096 for bench; 1024 otherwise: a 30-layer model's "
        "KV is 7x larger per token)",
    )
    args = ap.parse_args()
    num_blocks = args.num_blocks or (4096 if args.model == "bench" else 1024)

    from pagefleet.tokenizer import Tokenizer

    model = bench_model(args.model)
    vocab = Tokenizer.from_dir(model).vocab_size
    turns, chats, chat_turns = (12, 2, 6) if args.quick else (24, 4, 8)
    single, chat_msgs = build_trace(
        random.Random(args.seed), vocab, 8, turns, chats, chat_turns, args.system_len, args.user_len
    )
    print(
        f"trace: 8 tenants x {turns} turns (system {args.system_len} + user "
        f"{args.user_len} tokens) + {chats} chats x {chat_turns} turns; "
        f"concurrency {args.concurrency}; block size {BLOCK_SIZE}; model {args.model}"
    )
    off = run(str(model), False, single, chat_msgs, args.concurrency, num_blocks)
    print(
        f"caching off: {off['requests']} requests, mean TTFT {off['ttft_mean_s'] * 1e3:.1f} ms"
        f", {off['tok_s']:.0f} tok/s, {off['elapsed_s']:.1f} s"
    )
    on = run(str(model), True, single, chat_msgs, args.concurrency, num_blocks)
    print(
        f"caching on:  {on['requests']} requests, mean TTFT {on['ttft_mean_s'] * 1e3:.1f} ms"
        f", {on['tok_s']:.0f} tok/s, {on['elapsed_s']:.1f} s"
    )
    hit_rate = on["hits"] / on["queries"] if on["queries"] else 0.0
    saved = on["hits"] / on["prompt_tokens"] if on["prompt_tokens"] else 0.0
    print(
        json.dumps(
            {
                "hit_rate": round(hit_rate, 4),
                "ttft_ratio_off_on": round(off["ttft_mean_s"] / on["ttft_mean_s"], 2),
                "ttft_p50_ratio_off_on": round(off["ttft_p50_s"] / on["ttft_p50_s"], 2),
                "throughput_ratio_on_off": round(on["tok_s"] / off["tok_s"], 2),
                "prefill_tokens_saved_frac": round(saved, 4),
                "requests": on["requests"],
                "model": args.model,
            }
        )
    )


if __name__ == "__main__":
    main()
