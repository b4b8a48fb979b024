"""Model forward alone: our packed, paged Llama vs `transformers`' forward, same weights.

What the engine's throughput is built on. Both run the shared 4-layer, hidden-512 bench
checkpoint in fp32 on CPU, in the same process, interleaved repetition by repetition:

- prefill: B prompts of L tokens. Ours: one packed forward through a paged KV cache with
  the torch attention backend. transformers: one [B, L] forward filling a DynamicCache.
- decode: then S steps of one new token for each of the B sequences. Ours: packed decode
  steps; transformers: [B, 1] forwards on its cache.

Equal prompt lengths, so transformers pays no padding: this isolates per-forward cost, not
batching policy (bench/throughput.py measures that). Logits are checked to agree first.

    python bench/model_forward.py
    python bench/model_forward.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

# The shape bench/throughput.py uses: big enough that compute matters, small for 2 cores.
from bench_models import LLAMA_4x512

from pagefleet.kernels.torch_ref import TorchAttentionBackend


class NoAttention(TorchAttentionBackend):
    """The torch backend with attention left out, to measure everything but attention: the
    layer ops it also serves (RoPE, norms, SiLU x up) stay the model's work."""

    name = "none"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):  # type: ignore[no-untyped-def]
        return q.clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.quick:
        args.reps = 2
        args.decode_steps = 16
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from pagefleet.engine.loader import load_model
    from pagefleet.engine.tiny import write_random_checkpoint
    from pagefleet.kernels.torch_ref import TorchAttentionBackend
    from pagefleet.testing.paged_run import PagedSequenceRunner

    workdir = tempfile.TemporaryDirectory(prefix="pagefleet-model-forward-")
    path = write_random_checkpoint(Path(workdir.name) / "llama-4x512", LLAMA_4x512, seed=7)
    model, config, _ = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    b, n, steps = args.batch, args.prompt_len, args.decode_steps
    prompts = torch.randint(16, config.vocab_size, (b, n), generator=gen)
    next_tokens = torch.randint(16, config.vocab_size, (steps, b), generator=gen)
    block_size = 16
    blocks_needed = b * ((n + steps + block_size - 1) // block_size) + 1

    def ours(backend: object = None) -> tuple[float, float, torch.Tensor]:
        runner = PagedSequenceRunner(
            model,
            config,
            backend or TorchAttentionBackend(),
            num_blocks=blocks_needed,
            block_size=16,
        )
        t0 = time.perf_counter()
        out = runner.step({f"s{i}": prompts[i].tolist() for i in range(b)})
        t1 = time.perf_counter()
        for s in range(steps):
            last = runner.step({f"s{i}": [int(next_tokens[s, i])] for i in range(b)})
        t2 = time.perf_counter()
        first = torch.stack([out[f"s{i}"][-1] for i in range(b)])
        final = torch.stack([last[f"s{i}"][-1] for i in range(b)]) if steps else first
        return t1 - t0, t2 - t1, torch.stack([first, final])

    @torch.no_grad()
    def theirs() -> tuple[float, float, torch.Tensor]:
        cache = transformers.DynamicCache(config=hf.config)
        t0 = time.perf_counter()
        out = hf(prompts, cache=cache, use_cache=True)
        t1 = time.perf_counter()
        last = out
        for s in range(steps):
            last = hf(next_tokens[s][:, None], cache=cache, use_cache=True)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, torch.stack([out.logits[:, -1], last.logits[:, -1]]).float()

    # Correctness first: the same logits after the prompt and after the last decode step.
    _, _, a = ours()
    _, _, r = theirs()
    max_diff = (a - r).abs().max().item()
    print(f"max |logit diff| ours vs transformers: {max_diff:.2e}")

    res: dict[str, list[float]] = {k: [] for k in ("op", "od", "hp", "hd", "np", "nd")}
    for _ in range(args.reps):
        p, d, _ = ours()
        res["op"].append(p)
        res["od"].append(d)
        # Attribution: the same steps with attention replaced by a copy of q.
        p, d, _ = ours(NoAttention())
        res["np"].append(p)
        res["nd"].append(d)
        p, d, _ = theirs()
        res["hp"].append(p)
        res["hd"].append(d)
    med = {k: statistics.median(v) for k, v in res.items()}
    figures = {
        "ours_prefill_tok_s": round(b * n / med["op"], 1),
        "hf_prefill_tok_s": round(b * n / med["hp"], 1),
        "prefill_ratio": round(med["hp"] / med["op"], 3),
        "ours_decode_tok_s": round(b * steps / med["od"], 1),
        "hf_decode_tok_s": round(b * steps / med["hd"], 1),
        "decode_ratio": round(med["hd"] / med["od"], 3),
        "ours_decode_step_ms": round(1000 * med["od"] / max(steps, 1), 2),
        "hf_decode_step_ms": round(1000 * med["hd"] / max(steps, 1), 2),
        "ours_decode_step_no_attention_ms": round(1000 * med["nd"] / max(steps, 1), 2),
        "ours_prefill_no_attention_s": round(med["np"], 4),
        "ours_prefill_s": round(med["op"], 4),
        "max_logit_diff": max_diff,
        "batch": b,
        "prompt_len": n,
        "decode_steps": steps,
        "threads": torch.get_num_threads(),
    }
    print(
        f"prefill {b}x{n}: ours {figures['ours_prefill_tok_s']} tok/s, transformers "
        f"{figures['hf_prefill_tok_s']} tok/s (ratio {figures['prefill_ratio']})"
    )
    print(
        f"decode {b} seqs x {steps} steps: ours {figures['ours_decode_step_ms']} ms/step, "
        f"transformers {figures['hf_decode_step_ms']} ms/step (ratio {figures['decode_ratio']})"
    )

    def share(full: float, without: float) -> str:
        # Under a shared machine's noise the difference can come out negative.
        frac = 1 - without / full
        return f"{frac:.0%}" if frac > 0.02 else "below the run-to-run noise"

    print(
        f"attention's share of our decode step: {share(med['od'], med['nd'])}; "
        f"of our prefill: {share(med['op'], med['np'])}"
    )
    workdir.cleanup()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
