"""Engine end-to-end output tokens/s on a random-weight model, built in memory.

A Llama-3-8B-shaped checkpoint is 16 GB; writing and re-reading it would eat most of a
GPU check's time budget, so the model is constructed from its ModelConfig exactly as
``load_model`` does (meta device, ``to_empty``, RoPE cache) and filled with seeded random
weights instead of checkpoint tensors. Everything after that is the production path:
ModelRunner, the backend from ``get_backend``, scheduler, sampler, LLMEngine.

Workload per batch size B: B prompts of ``--prompt-len`` random token ids, all added at
once, greedy, ``ignore_eos``, ``--max-tokens`` each. Figure: output tokens / wall seconds
(prefill included), plus the mean decode-step time. Baseline in the same process: the
torch attention backend on the same model and workload (``--baseline``; on CPU the default
backend is the compiled ``cpu`` kernel).

    python bench/engine_e2e.py --device cuda --shape llama3-8b --batches 1 32 128
    python bench/engine_e2e.py --quick          # CPU, tiny shape: exercises the harness
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    # Same structure, CPU-sized: checks the harness end to end.
    "small": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
}


def build_engine(
    shape: str,
    device: str,
    dtype: str,
    backend: str | None,
    max_batch: int,
    seq_len: int,
    cuda_graphs: bool = False,
):
    """An LLMEngine over a random-weight model of ``shape`` (see the module docstring)."""
    import torch

    from pagefleet.engine.config import EngineConfig
    from pagefleet.engine.engine import LLMEngine
    from pagefleet.engine.model_config import ModelConfig, parse_dtype
    from pagefleet.engine.model_runner import ModelRunner
    from pagefleet.engine.models import get_model_class
    from pagefleet.engine.parts import EngineParts
    from pagefleet.engine.sampler import Sampler
    from pagefleet.kernels import get_backend
    from pagefleet.presets.tiny_tokenizer import write_tokenizer_files
    from pagefleet.tokenizer import Tokenizer

    cfg = dict(SHAPES[shape])
    tok_dir = Path(tempfile.mkdtemp(prefix="pagefleet-bench-tok-"))
    ids = write_tokenizer_files(tok_dir)
    tokenizer = Tokenizer.from_dir(tok_dir)
    cfg["eos_token_id"] = ids["eos"]
    mc = ModelConfig.from_dict(cfg)
    mc.dtype = parse_dtype(dtype)
    target = torch.device(device)
    with torch.device("meta"):
        model = get_model_class(mc)(mc)
    model = model.to_empty(device=target)
    model.to(mc.dtype)
    model.model.rotary_emb.reset_cache(target)
    gen = torch.Generator(device=target).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    block_size = 16
    blocks_per_seq = (seq_len + block_size - 1) // block_size + 1
    num_blocks = max_batch * blocks_per_seq + 16
    runner = ModelRunner(
        model,
        num_layers=mc.num_hidden_layers,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        backend=get_backend(backend, target),
        sampler=Sampler(mc.eos_token_ids),
        device=target,
        dtype=mc.dtype,
    )
    config = EngineConfig(
        model=f"random-{shape}",
        dtype=dtype,
        device=device,
        attention_backend=backend,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_num_seqs=max_batch,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    if cuda_graphs:
        from pagefleet.engine.cuda_graphs import build_decode_graphs

        bound = min(mc.max_position_embeddings, num_blocks * block_size)
        runner.decode_graphs = build_decode_graphs(
            True, model, runner.kv_caches, runner.backend, target, block_size, bound, max_batch
        )
        if runner.decode_graphs is None:
            raise SystemExit("--cuda-graphs: graphs are unavailable here (see the warning)")
    engine = LLMEngine(
        config,
        parts=EngineParts(
            runner,
            tokenizer,
            eos_token_ids=mc.eos_token_ids,
            vocab_size=mc.vocab_size,
            model_max_len=mc.max_position_embeddings,
            num_blocks=num_blocks,
        ),
    )
    return engine, runner.backend.name, mc


def run_batch(engine, vocab: int, batch: int, prompt_len: int, max_tokens: int, seed: int):
    """Output tokens/s and mean decode-step seconds for one batch of requests."""
    import torch

    from pagefleet.engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"b{batch}-{seed}-{i}", prompt, params)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    produced = 0
    step_times: list[float] = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        step_times.append(time.perf_counter() - t0)
        produced += sum(len(d.new_token_ids) for o in outs for d in o.deltas)
    sync()
    wall = time.perf_counter() - start
    # The last max_tokens - 1 steps are pure decode steps for a batch added at once.
    decode_steps = step_times[-(max_tokens - 1) :] if max_tokens > 1 else step_times
    return {
        "batch": batch,
        "output_tokens": produced,
        "wall_s": round(wall, 3),
        "output_tok_per_s": round(produced / wall, 1),
        "decode_step_ms": round(1000 * sum(decode_steps) / len(decode_steps), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU-sized run of the harness")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--backend", default=None, help="attention backend (default: per device)")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--baseline", action="store_true", help="also run the torch attention backend")
    ap.add_argument(
        "--cuda-graphs", action="store_true",
        help="also run the primary backend with decode steps replayed from CUDA graphs",
    )  # fmt: skip
    args = ap.parse_args()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and (args.backend == "triton"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    quick = args.quick or device == "cpu"
    shape = args.shape or ("small" if quick else "llama3-8b")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    batches = args.batches or ([1, 4] if quick else [1, 32, 128])
    prompt_len = args.prompt_len or (32 if quick else 128)
    max_tokens = args.max_tokens or (8 if quick else 128)
    primary = args.backend or ("triton" if device == "cuda" else "cpu")
    # (backend, CUDA graphs): eager first, then the same backend with graphs, then torch.
    runs = [(primary, False)] + ([(primary, True)] if args.cuda_graphs else [])
    runs += [("torch", False)] if args.baseline and primary != "torch" else []

    figures: dict[str, Any] = {
        "bench": "engine_e2e",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "shape": shape,
        "dtype": dtype,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
    }
    for backend, graphs in runs:
        t0 = time.perf_counter()
        engine, name, mc = build_engine(
            shape, device, dtype, backend, max(batches), prompt_len + max_tokens, graphs
        )
        name += "_graphs" if graphs else ""
        print(
            f"[{name}] built {shape} ({mc.num_hidden_layers} layers) in "
            f"{time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        # Warm-up per batch size: kernel variants (split counts) compile outside the timing.
        for b in batches:
            run_batch(engine, mc.vocab_size, b, prompt_len, 2, seed=10_000 + b)
        rows = []
        for b in batches:
            row = run_batch(engine, mc.vocab_size, b, prompt_len, max_tokens, seed=b)
            if row["output_tokens"] != b * max_tokens:
                raise SystemExit(f"expected {b * max_tokens} output tokens, got {row}")
            print(
                f"[{name}] batch {b:4d}: {row['output_tok_per_s']:10.1f} output tok/s  "
                f"decode step {row['decode_step_ms']:.2f} ms  ({row['wall_s']} s)",
                flush=True,
            )
            rows.append(row)
        figures[f"{name}_output_tok_per_s"] = {str(r["batch"]): r["output_tok_per_s"] for r in rows}
        figures[f"{name}_decode_step_ms"] = {str(r["batch"]): r["decode_step_ms"] for r in rows}
        print(json.dumps({**figures, "partial": True}), flush=True)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
