"""Offline throughput: our engine vs `transformers` generate() with static batching.

One model big enough that compute matters (Llama layout, 4 layers, hidden 512; or the real
SmolLM2-135M with ``--model smollm2-135m``, which transformers reads from the same GGUF
file) and the same 64 requests of mixed prompt/output lengths (greedy, ``ignore_eos``, so
every system makes exactly the same tokens). Both get the same KV memory: the engine a pool of
``--kv-tokens`` slots in blocks; static batching reserves, per batch, every row's padded
prompt plus the batch's longest output, so only batch sizes whose worst case fits that
memory are tried, and the baseline is the best of them (on CPU a larger static batch is not
always faster: padding and waiting for the longest request).

``engine_mfu`` places the engine against the machine: model FLOPs per generated token
(2 x matmul parameters + attention over the mean context) x engine tokens/s, divided by
this machine's fp32 matmul FLOP/s measured in the same run at the model's own shapes.
A cProfile of a few engine steps says where the rest of the time goes. The roofline
(``engine_mfu_roofline``) bounds what any kernels could reach on the engine's own schedule:
every recorded step at least its FLOPs at that matmul rate and at least its bytes (all
weights once, the fp32 K/V of every key attended) at the read bandwidth measured over a
buffer the size of the KV pool plus the weights.

    python bench/throughput.py            # full: batch sizes 1..16
    python bench/throughput.py --quick    # fewer baseline batch sizes, < 60 s
    python bench/throughput.py --long     # prompts 16-512, outputs 8-256 tokens
    python bench/throughput.py --model smollm2-135m --quick   # the real model (minutes)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_models import bench_model, hf_causal_lm, model_shape

BLOCK_SIZE = 16


# (prompt lengths, output lengths) of the default and the ``--long`` workload.
WORKLOADS = {"default": ((16, 192), (16, 128)), "long": ((16, 512), (8, 256))}


def make_workload(
    n: int, vocab: int, seed: int, kind: str = "default"
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[kind]
    reqs = []
    for _ in range(n):
        plen = rng.randint(p_lo, p_hi)
        olen = rng.randint(o_lo, o_hi)
        # Skip the low ids (special tokens) so no prompt contains an eos marker.
        reqs.append(([rng.randrange(16, vocab) for _ in range(plen)], olen))
    return reqs


def run_engine(
    model: Path, reqs: list[tuple[list[int], int]], kv_tokens: int, long_prefill: int = 0
) -> dict[str, Any]:
    from pagefleet.engine.config import EngineConfig
    from pagefleet.engine.engine import LLMEngine
    from pagefleet.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            num_gpu_blocks=kv_tokens // BLOCK_SIZE,
            block_size=BLOCK_SIZE,
            max_num_seqs=64,
            max_num_batched_tokens=1024,
            long_prefill_token_threshold=long_prefill,
            enable_prefix_caching=False,
        )
    )
    # Warm-up: first calls allocate and pick kernels.
    engine.generate([reqs[0][0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    # Each step's shape (new tokens, keys attended, rows sampled) for the roofline below.
    steps: list[tuple[int, int, int]] = []
    execute = engine.runner.execute

    def recording_execute(sched: Any, kv: Any) -> Any:
        items = sched.scheduled
        steps.append(
            (
                sum(it.num_new_tokens for it in items),
                sum(it.start + it.num_new_tokens for it in items),
                sum(len(it.samplers) for it in items),
            )
        )
        return execute(sched, kv)

    engine.runner.execute = recording_execute  # type: ignore[method-assign]
    t0, c0 = time.perf_counter(), time.process_time()
    results = engine.generate([p for p, _ in reqs], params)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    engine.runner.execute = execute  # type: ignore[method-assign]
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    assert generated == sum(o for _, o in reqs), "engine produced a different token count"

    # Profile a handful of steps of a fresh, full batch to say where a step's time goes.
    for i, (p, o) in enumerate(reqs[:32]):
        engine.add_request(
            f"prof-{i}", p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        )
    for _ in range(6):  # past the prefills: decode-dominated steps
        engine.step()
    # CPU time, not wall: on a shared machine wall time mostly measures waiting for a core.
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    for _ in range(10):
        engine.step()
    prof.disable()
    while engine.has_unfinished():
        engine.step()
    return {
        "tok_s": generated / elapsed,
        "tok_cpu_s": generated / cpu,
        "elapsed_s": elapsed,
        "cpu_s": cpu,
        "generated": generated,
        "steps": engine.stats().steps_total,
        "profile": prof,
        "step_shapes": steps,
        "tokens": [r.outputs[0].token_ids for r in results],
    }


def run_hf_static(
    model: Path, reqs: list[tuple[list[int], int]], batch: int, pad_id: int
) -> dict[str, Any]:
    hf = hf_causal_lm(model)
    useful = 0
    t0, c0 = time.perf_counter(), time.process_time()
    outs: list[list[int]] = []
    with torch.inference_mode():
        for s in range(0, len(reqs), batch):
            chunk = reqs[s : s + batch]
            width = max(len(p) for p, _ in chunk)
            max_new = max(o for _, o in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (p, _) in enumerate(chunk):  # left padding, as decoder-only batching needs
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            gen = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=pad_id,
            )
            for i, (_, o) in enumerate(chunk):
                outs.append(gen[i, width : width + o].tolist())
                useful += o
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "tok_s": useful / elapsed,
        "tok_cpu_s": useful / cpu,
        "elapsed_s": elapsed,
        "cpu_s": cpu,
        "tokens": outs,
    }


def matmul_flops_per_s(shape: dict[str, Any], rows: int) -> tuple[float, float]:
    """fp32 GEMM FLOP/s of this machine at the model's own projection shapes: per second of
    wall time and per CPU-second (the best of 5 rounds each)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    mats = [(h, 3 * h), (h, h), (h, 2 * i), (i, h)]
    ws = [torch.randn(k, n) for k, n in mats]
    xs = [torch.randn(rows, k) for k, _ in mats]
    for x, w in zip(xs, ws, strict=True):
        x @ w
    best, best_cpu = float("inf"), float("inf")
    for _ in range(5):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(10):
            for x, w in zip(xs, ws, strict=True):
                x @ w
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    flops = 10 * sum(2 * rows * k * n for k, n in mats)
    return flops / best, flops / best_cpu


def flops_per_token(shape: dict[str, Any], vocab: int, mean_ctx: float) -> float:
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    per_layer = layer_matmul_params(shape)
    attn = 2 * 2 * mean_ctx * h  # q.k and p.v over the context
    return 2 * (layers * per_layer + h * vocab) + layers * attn


def layer_matmul_params(shape: dict[str, Any]) -> int:
    """Projection weights of one layer (q, k, v, o, gate, up, down)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    return h * h + 2 * h * kv + h * h + 3 * h * i


def kv_bytes_per_key(shape: dict[str, Any]) -> int:
    """fp32 K and V of one token over all layers."""
    h = shape["hidden_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    return 4 * 2 * kv * shape["num_hidden_layers"]


def stream_bytes_per_s(nbytes: int) -> float:
    """Read bandwidth over a buffer of ``nbytes`` (a sum, the best of 5), at torch's thread
    count: what a step gets when its K/V and weights (about that size together) do not stay
    in cache between steps. Smaller buffers read faster (cache levels)."""
    x = torch.ones(max(nbytes // 4, 1 << 20))
    x.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def roofline_s(
    shape: dict[str, Any],
    vocab: int,
    steps: list[tuple[int, int, int]],
    flops_per_s: float,
    bytes_per_s: float,
) -> float:
    """The least time the recorded steps could take on this machine: each step at least its
    FLOPs at the matmul rate and at least its bytes (every weight once, the K/V of every key
    each sequence attends) at the read bandwidth. A floor for this schedule, not a model."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    per_layer = layer_matmul_params(shape)
    weights = 4 * (layers * per_layer + h * vocab)
    total = 0.0
    for tokens, keys, rows in steps:
        flops = 2 * (layers * per_layer * tokens + h * vocab * rows) + 4 * h * layers * keys
        nbytes = weights + kv_bytes_per_key(shape) * keys
        total += max(flops / flops_per_s, nbytes / bytes_per_s)
    return total


def workload_matmul_flops(shape: dict[str, Any], vocab: int, reqs: list) -> float:
    """Projection FLOPs any exact engine must spend on ``reqs``: every prompt and output
    token through every layer, the LM head for every output token (attention excluded)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    per_layer = layer_matmul_params(shape)
    tokens = sum(len(p) + o for p, o in reqs)
    return 2 * (layers * per_layer * tokens + h * vocab * sum(o for _, o in reqs))


def profile_summary(prof: cProfile.Profile, top: int = 12) -> str:
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer baseline batch sizes (< 60 s)")
    ap.add_argument("--long", action="store_true", help="prompts 16-512 and outputs 8-256 tokens")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, default=16 * 640, help="KV slots for both systems")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--profile", action="store_true", help="print the engine step profile")
    ap.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        metavar="N",
        help="also run the engine with at most N prompt tokens per request per step (the "
        "daemon's chunked-prefill default) and print its throughput against the one-step "
        "prefill run above (same process, same workload)",
    )
    ap.add_argument(
        "--model",
        default="bench",
        help="bench (seeded 4x512 Llama), a preset such as smollm2-135m, a directory or .gguf",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from pagefleet.tokenizer import Tokenizer

    model = bench_model(args.model)
    shape = model_shape(model)
    tok = Tokenizer.from_dir(model)
    reqs = make_workload(
        args.requests, tok.vocab_size, seed=0, kind="long" if args.long else "default"
    )
    max_total = max(len(p) for p, _ in reqs) + max(o for _, o in reqs)
    fits = [b for b in (1, 2, 4, 8, 16, 32, 64) if b * max_total <= args.kv_tokens]
    batches = fits[-2:] if args.quick else fits
    print(
        f"model {args.model}: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}"
        f", vocab {tok.vocab_size}; {len(reqs)} requests, "
        f"{sum(len(p) for p, _ in reqs)} prompt / {sum(o for _, o in reqs)} output tokens; "
        f"KV memory {args.kv_tokens} token slots; static batch sizes that fit: {fits}"
    )

    eng = run_engine(model, reqs, args.kv_tokens)
    print(
        f"engine: {eng['tok_s']:.1f} tok/s ({eng['elapsed_s']:.2f} s wall, "
        f"{eng['cpu_s']:.2f} s CPU, {eng['steps']} steps)"
    )
    hf_runs = {}
    for b in batches:
        r = run_hf_static(model, reqs, b, pad_id=tok.eos_token_ids[0])
        hf_runs[b] = r
        print(
            f"hf static batch {b:>2}: {r['tok_s']:.1f} tok/s "
            f"({r['elapsed_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU)"
        )
    best_b = max(hf_runs, key=lambda b: hf_runs[b]["tok_s"])
    best = hf_runs[best_b]
    best_cpu_b = max(hf_runs, key=lambda b: hf_runs[b]["tok_cpu_s"])

    # Same greedy tokens: the comparison is like for like (reported, not asserted: padded
    # batches in HF reorder float sums, which can flip a rare near-tie).
    same = sum(a == b for a, b in zip(eng["tokens"], best["tokens"], strict=True))

    mean_ctx = statistics.mean(len(p) + o / 2 for p, o in reqs)
    fpt = flops_per_token(shape, tok.vocab_size, mean_ctx)
    peak, peak_cpu = matmul_flops_per_s(shape, rows=64)
    mfu = fpt * eng["tok_s"] / peak
    # The same fraction per CPU-second: what the engine gets out of the cores it was given.
    mfu_cpu = fpt * eng["tok_cpu_s"] / peak_cpu
    hf_mfu_cpu = fpt * hf_runs[best_cpu_b]["tok_cpu_s"] / peak_cpu
    # The most any engine could gain on this machine: its projections alone at the measured
    # matmul rate, attention and every other cost free, against the baseline's CPU time.
    floor_cpu_s = workload_matmul_flops(shape, tok.vocab_size, reqs) / peak_cpu
    ceiling = hf_runs[best_cpu_b]["cpu_s"] / floor_cpu_s
    print(
        f"engine CPU floor (projections only, at the matmul rate) {floor_cpu_s:.2f} s vs "
        f"{eng['cpu_s']:.2f} s spent; per-CPU-second ratio ceiling {ceiling:.2f}"
    )
    print(
        f"model FLOPs/token {fpt / 1e6:.1f} M; fp32 matmul at model shapes "
        f"{peak / 1e9:.1f} GFLOP/s ({peak_cpu / 1e9:.1f} per CPU-second); engine MFU "
        f"{mfu:.3f} (HF static {fpt * best['tok_s'] / peak:.3f}); per CPU-second: engine "
        f"{mfu_cpu:.3f}, HF static {hf_mfu_cpu:.3f}"
    )
    # Roofline of the engine's own schedule: how far this machine's matmul rate and read
    # bandwidth would let any kernels take it, the schedule (batching) held as it ran.
    pool_bytes = args.kv_tokens * kv_bytes_per_key(shape)
    weight_bytes = 4 * (
        shape["num_hidden_layers"] * layer_matmul_params(shape)
        + shape["hidden_size"] * tok.vocab_size
    )
    bw = stream_bytes_per_s(pool_bytes + weight_bytes)
    floor_s = roofline_s(shape, tok.vocab_size, eng["step_shapes"], peak, bw)
    mfu_roof = fpt * eng["generated"] / floor_s / peak
    print(
        f"roofline of the engine's schedule ({len(eng['step_shapes'])} steps; fp32 K/V pool "
        f"{pool_bytes / 2**20:.0f} MiB read at {bw / 1e9:.1f} GB/s): at least {floor_s:.2f} s "
        f"vs {eng['elapsed_s']:.2f} s taken; engine MFU at most {mfu_roof:.3f} on this machine"
    )
    print(f"greedy outputs identical to the best HF run: {same}/{len(reqs)}")
    if args.profile:
        print(profile_summary(eng["profile"]))
    chunked: dict[str, Any] = {}
    if args.long_prefill_token_threshold is not None:
        n = args.long_prefill_token_threshold
        ch = run_engine(model, reqs, args.kv_tokens, long_prefill=n)
        chunked = {
            "long_prefill_token_threshold": n,
            "engine_chunked_tok_s": round(ch["tok_s"], 1),
            "engine_chunked_tok_per_cpu_s": round(ch["tok_cpu_s"], 1),
            "chunked_over_one_step_cpu_time": round(ch["tok_cpu_s"] / eng["tok_cpu_s"], 3),
            "chunked_outputs_identical": sum(
                a == b for a, b in zip(ch["tokens"], eng["tokens"], strict=True)
            ),
        }
        print(
            f"engine, at most {n} prompt tokens per request per step: {ch['tok_s']:.1f} tok/s "
            f"({ch['cpu_s']:.2f} s CPU, {ch['steps']} steps); per CPU-second vs one-step "
            f"prefill {chunked['chunked_over_one_step_cpu_time']:.3f}"
        )
    ratio = eng["tok_s"] / best["tok_s"]
    print(f"ratio engine / best static (batch {best_b}): {ratio:.2f}")
    # Tokens per CPU-second: with --threads 1 this is what a quiet core would give, and it
    # barely moves with the machine's load (wall-clock ratios swing 3x on a shared VM).
    ratio_cpu = eng["tok_cpu_s"] / hf_runs[best_cpu_b]["tok_cpu_s"]
    print(f"ratio per CPU-second (best static by CPU time: batch {best_cpu_b}): {ratio_cpu:.2f}")
    print(
        json.dumps(
            {
                "engine_tok_s": round(eng["tok_s"], 1),
                "hf_static_tok_s": round(best["tok_s"], 1),
                "hf_best_batch": best_b,
                "ratio": round(ratio, 2),
                "ratio_cpu_time": round(ratio_cpu, 2),
                "engine_tok_per_cpu_s": round(eng["tok_cpu_s"], 1),
                "hf_static_tok_per_cpu_s": round(hf_runs[best_cpu_b]["tok_cpu_s"], 1),
                "threads": torch.get_num_threads(),
                "workload": "long" if args.long else "default",
                "engine_mfu": round(mfu, 4),
                "engine_mfu_cpu_time": round(mfu_cpu, 4),
                "hf_static_mfu_cpu_time": round(hf_mfu_cpu, 4),
                "matmul_gflops": round(peak / 1e9, 1),
                "read_gb_per_s": round(bw / 1e9, 1),
                "engine_roofline_s": round(floor_s, 2),
                "engine_mfu_roofline": round(mfu_roof, 4),
                "matmul_gflops_per_cpu_s": round(peak_cpu / 1e9, 1),
                "outputs_identical": same,
                "engine_cpu_floor_s": round(floor_cpu_s, 2),
                "ratio_cpu_time_ceiling": round(ceiling, 2),
                "requests": len(reqs),
                "model": args.model,
                **chunked,
            }
        )
    )


if __name__ == "__main__":
    main()
