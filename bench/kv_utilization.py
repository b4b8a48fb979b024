"""KV memory utilization: paged blocks vs contiguous reservation (the vLLM paper's Fig. 2).

Replays one seeded trace (Poisson arrivals, ShareGPT-like prompt/output lengths) at equal
KV memory through:

- ``paged``: the real Scheduler + KVCacheManager + BlockPool of pagefleet's engine (driven
  by LLMEngine with a model-free runner: every step appends one token per sequence);
- ``maxlen``: a contiguous allocator reserving max_model_len slots per request (Orca Max);
- ``pow2``: reserving the next power of two of the request's final length (Orca Pow2);
- ``oracle``: reserving exactly the final length (Orca Oracle).

Contiguous reservations are placed first-fit in one linear KV space, so external
fragmentation also limits admission. Utilization is the time-averaged fraction of reserved
KV slots that hold live tokens; max concurrency is the most requests resident at once.

    python bench/kv_utilization.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.parts import EngineParts
from pagefleet.engine.sampler import SampleResult
from pagefleet.engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 2048


@dataclass(slots=True)
class TraceRequest:
    arrival_step: int
    prompt_len: int
    output_len: int


def make_trace(n: int, rate: float, seed: int) -> list[TraceRequest]:
    """Poisson arrivals (``rate`` requests per engine step); lognormal lengths shaped like
    ShareGPT (mean prompt ~160, mean output ~330 tokens), clipped to MAX_MODEL_LEN."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        p = max(4, min(int(rng.lognormvariate(math.log(110), 0.9)), MAX_MODEL_LEN // 2))
        o = max(1, min(int(rng.lognormvariate(math.log(230), 0.85)), MAX_MODEL_LEN - p))
        out.append(TraceRequest(int(t), p, o))
    return out


class _OneTokenRunner:
    """Model-free runner: each sampling sequence gets token 1; KV bookkeeping is real."""

    def execute(self, sched, kv):
        return [(s, SampleResult(token_id=1)) for it in sched.scheduled for s in it.samplers]


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def run_paged(trace: list[TraceRequest], mem_slots: int, block_size: int) -> dict:
    num_blocks = mem_slots // block_size
    cfg = EngineConfig(
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=1024,
        max_num_batched_tokens=1 << 16,
        enable_prefix_caching=False,
    )
    eng = LLMEngine(
        cfg,
        parts=EngineParts(
            _OneTokenRunner(),
            _NoText(),
            eos_token_ids=(),
            vocab_size=8,
            model_max_len=MAX_MODEL_LEN,
            num_blocks=num_blocks,
        ),
    )
    rng = random.Random(0)
    live_sum = reserved_sum = 0
    max_conc = 0
    i = step = 0
    while i < len(trace) or eng.has_unfinished():
        while i < len(trace) and trace[i].arrival_step <= step:
            r = trace[i]
            prompt = [rng.randrange(2, 8) for _ in range(r.prompt_len)]
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            eng.add_request(f"r{i}", prompt, params)
            i += 1
        eng.step()
        running = eng.scheduler.running
        live = sum(s.num_computed_tokens for s in running)
        reserved = eng.kv.pool.num_referenced_blocks * block_size
        if reserved:
            live_sum += live
            reserved_sum += reserved
        max_conc = max(max_conc, len(running))
        step += 1
    return {
        "utilization": live_sum / reserved_sum,
        "max_concurrency": max_conc,
        "steps": step,
        "preemptions": eng.stats().num_preempted_total,
    }


class FirstFit:
    """Contiguous ranges in a linear space of ``size`` slots, first fit."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.used: list[tuple[int, int]] = []  # sorted (start, length)

    def alloc(self, n: int) -> int | None:
        pos = 0
        for idx, (s, ln) in enumerate(self.used):
            if s - pos >= n:
                self.used.insert(idx, (pos, n))
                return pos
            pos = s + ln
        if self.size - pos >= n:
            self.used.append((pos, n))
            return pos
        return None

    def free(self, start: int) -> None:
        for idx, (s, _) in enumerate(self.used):
            if s == start:
                del self.used[idx]
                return
        raise KeyError(start)


def run_contiguous(trace: list[TraceRequest], mem_slots: int, policy: str) -> dict:
    def reserve(r: TraceRequest) -> int:
        final = r.prompt_len + r.output_len
        if policy == "maxlen":
            return MAX_MODEL_LEN
        if policy == "pow2":
            return min(1 << (final - 1).bit_length(), MAX_MODEL_LEN)
        return final

    space = FirstFit(mem_slots)
    waiting: list[TraceRequest] = []
    running: list[list] = []  # [request, start slot, reserved, tokens with KV]
    live_sum = reserved_sum = 0
    max_conc = 0
    i = step = 0
    while i < len(trace) or waiting or running:
        while i < len(trace) and trace[i].arrival_step <= step:
            waiting.append(trace[i])
            i += 1
        while waiting:  # FCFS: the head blocks the queue, as in the paged engine
            need = reserve(waiting[0])
            start = space.alloc(need)
            if start is None:
                break
            r = waiting.pop(0)
            running.append([r, start, need, r.prompt_len - 1])  # prefilled this step
        still = []
        for entry in running:
            r = entry[0]
            entry[3] += 1  # one new token's KV this step
            if entry[3] >= r.prompt_len + r.output_len - 1:
                space.free(entry[1])
            else:
                still.append(entry)
        live = sum(e[3] for e in running)
        reserved = sum(e[2] for e in running)
        if reserved:
            live_sum += live
            reserved_sum += reserved
        max_conc = max(max_conc, len(running))
        running = still
        step += 1
    return {"utilization": live_sum / reserved_sum, "max_concurrency": max_conc, "steps": step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller trace (under 60 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    n, mem = (300, 32768) if args.quick else (1000, 65536)
    trace = make_trace(n, rate=1.0, seed=args.seed)
    print(
        f"trace: {n} requests, mean prompt {sum(r.prompt_len for r in trace) / n:.0f}, "
        f"mean output {sum(r.output_len for r in trace) / n:.0f} tokens; KV memory "
        f"{mem} token slots; block size {args.block_size}"
    )
    t0 = time.perf_counter()
    paged = run_paged(trace, mem, args.block_size)
    t1 = time.perf_counter()
    base = {p: run_contiguous(trace, mem, p) for p in ("maxlen", "pow2", "oracle")}
    t2 = time.perf_counter()
    print(f"{'allocator':<10}{'utilization':>13}{'max concurrent':>16}{'steps':>8}")
    print(
        f"{'paged':<10}{paged['utilization']:>13.3f}{paged['max_concurrency']:>16}"
        f"{paged['steps']:>8}   ({paged['preemptions']} preemptions, {t1 - t0:.1f} s)"
    )
    for name, r in base.items():
        print(f"{name:<10}{r['utilization']:>13.3f}{r['max_concurrency']:>16}{r['steps']:>8}")
    print(f"(contiguous simulations {t2 - t1:.1f} s)")
    print(
        json.dumps(
            {
                "paged_utilization": round(paged["utilization"], 4),
                "maxlen_utilization": round(base["maxlen"]["utilization"], 4),
                "pow2_utilization": round(base["pow2"]["utilization"], 4),
                "oracle_utilization": round(base["oracle"]["utilization"], 4),
                "paged_max_concurrency": paged["max_concurrency"],
                "maxlen_max_concurrency": base["maxlen"]["max_concurrency"],
                "pow2_max_concurrency": base["pow2"]["max_concurrency"],
                "oracle_max_concurrency": base["oracle"]["max_concurrency"],
                "paged_steps": paged["steps"],
                "maxlen_steps": base["maxlen"]["steps"],
                "requests": n,
                "kv_slots": mem,
            }
        )
    )


if __name__ == "__main__":
    main()
