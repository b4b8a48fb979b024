"""Decode CUDA graphs (pagefleet/engine/cuda_graphs.py).

On a GPU the replay test captures real CUDA graphs; on a CPU it runs the same static-buffer,
padding and frozen-metadata path with the Triton kernels under the interpreter and a
stand-in for the capture that re-runs the recorded function on the static buffers. Either
way a replayed decode must give the logits of an eager one, store exactly the same KV, and
padded rows must write nothing. bench/gpu_check.sh runs this file on the GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from pagefleet.daemon.config import DaemonConfig
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.cuda_graphs import (
    DecodeGraphs,
    build_decode_graphs,
    capture_sizes,
    cuda_capture,
    padded_size,
    unavailable_reason,
)
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.tiny import ensure_tiny_checkpoint

from .conftest import KERNEL_DEVICE


def test_capture_sizes_and_padding():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the top size is always captured
    assert capture_sizes(4096)[-1] == 512  # past 512 launches are a small share of a step
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 16, 17, 20)] == [1, 4, 8, 16, 20, 20]
    assert padded_size(21, sizes) is None and padded_size(0, sizes) is None


def test_graphs_asked_for_without_cuda_fall_back_to_eager(caplog):
    """The flag on a CPU (or with a host-planned backend) is a warning, not a failure: the
    engine builds and makes the same tokens as without it."""
    cpu = torch.device("cpu")
    assert "not CUDA" in (unavailable_reason(cpu, "triton") or "")
    if torch.cuda.is_available():
        assert "plans each step" in (unavailable_reason(torch.device("cuda"), "torch") or "")
    with caplog.at_level(logging.WARNING, logger="pagefleet.engine.cuda_graphs"):
        none = build_decode_graphs(True, torch.nn.Identity(), [], object(), cpu, 16, 128, 8)
    assert none is None and "running eagerly" in caplog.text
    assert build_decode_graphs(False, torch.nn.Identity(), [], object(), cpu, 16, 128, 8) is None
    # The flag travels from the daemon's config to the engine's.
    assert DaemonConfig(cuda_graphs=True).engine_config().cuda_graphs is True
    assert DaemonConfig().engine_config().cuda_graphs is False
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = []
    for flag in (False, True):
        cfg = EngineConfig(model="tiny", num_gpu_blocks=32, max_model_len=128, cuda_graphs=flag)
        engine = LLMEngine(cfg)
        assert engine.runner.decode_graphs is None  # type: ignore[attr-defined]
        outs.append([r.outputs[0].token_ids for r in engine.generate([[5, 6, 7]], params)])
    assert outs[0] == outs[1]


def _eager_capture(fn: Callable[[], torch.Tensor], pool: object):
    """CPU stand-in for cuda_capture: 'replay' re-runs ``fn``, which reads the static
    buffers through the metadata frozen at capture, exactly what a graph would replay."""
    out = fn().clone()

    def replay() -> None:
        out.copy_(fn())

    return replay, out, pool


def _engine(path: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=path,
            dtype="float32",
            device=KERNEL_DEVICE,
            attention_backend="triton",
            block_size=8,
            num_gpu_blocks=32,
            max_model_len=64,
            max_num_seqs=4,
            enable_prefix_caching=False,
        )
    )


def test_replayed_decode_matches_eager_and_padding_stores_nothing(tmp_path):
    path = str(ensure_tiny_checkpoint("tiny", tmp_path))
    # Three sequences: every decode step of the graph engine pads 3 rows up to size 4.
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37, 38, 39]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    logits: dict[str, list[torch.Tensor]] = {"eager": [], "graph": []}
    pools = {}
    replays = {"n": 0}
    for mode in ("eager", "graph"):
        engine = _engine(path)
        runner = engine.runner  # type: ignore[attr-defined]
        runner.logits_hook = lambda seqs, lg, mode=mode: logits[mode].append(lg.clone())
        if mode == "graph":
            graphs = DecodeGraphs(
                runner.model, runner.kv_caches, runner.backend, runner.device,
                block_size=8, max_model_len=64, sizes=[1, 2, 4],
            )  # fmt: skip
            graphs.capture(cuda_capture if KERNEL_DEVICE == "cuda" else _eager_capture)
            assert graphs.captured == [1, 2, 4]
            # Capturing stored nothing: the KV pool is still all zeros.
            assert all(not k.any() and not v.any() for k, v in runner.kv_caches)
            for cap in graphs._graphs.values():
                real = cap.replay

                def counted(real: Callable[[], None] = real) -> None:
                    replays["n"] += 1
                    real()

                cap.replay = counted
            runner.decode_graphs = graphs
        out = engine.generate(prompts, params)
        assert all(len(r.outputs[0].token_ids) == 5 for r in out)
        pools[mode] = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    assert replays["n"] >= 3, "no decode step replayed a graph"
    assert len(logits["eager"]) == len(logits["graph"])
    for a, b in zip(logits["eager"], logits["graph"], strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    # Same KV everywhere, so padded rows wrote nothing and real rows wrote their own slots.
    for (ka, va), (kb, vb) in zip(pools["eager"], pools["graph"], strict=True):
        torch.testing.assert_close(kb, ka, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vb, va, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [3, 5])
def test_stage_pads_rows_past_the_batch(n):
    """Rows past the batch: slot -1 (nothing stored), length 1 over block 0, zero ids; a
    step that is not pure decode, or larger than every size, is not staged."""
    from pagefleet.kernels.metadata import AttentionMetadata

    g = DecodeGraphs(torch.nn.Identity(), [], object(), torch.device("cpu"), 4, 32, [4, 8])
    g.seq_lens.fill_(99)  # leftovers of an earlier, larger step
    g.slot_mapping.fill_(7)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n) + 100, query_start_loc=torch.arange(n + 1),
        seq_lens=torch.full((n,), 9, dtype=torch.int32),
        block_tables=torch.ones((n, 3), dtype=torch.int32), query_lens_cpu=[1] * n,
        seq_lens_cpu=[9] * n, num_decodes=n, max_query_len=1, max_seq_len=9, block_size=4,
    )  # fmt: skip
    size = g.stage(torch.arange(n) + 1, torch.arange(n) + 8, meta)
    assert size == (4 if n <= 4 else 8)
    assert g.slot_mapping[:n].tolist() == list(range(100, 100 + n))
    assert g.slot_mapping[n:].tolist() == [-1] * (8 - n)
    assert g.seq_lens[n:].tolist() == [1] * (8 - n)
    assert not g.block_tables[n:].any() and not g.block_tables[:n, 3:].any()
    assert not g.input_ids[n:].any()
    meta.num_decodes = n - 1  # one row is a prefill: eager
    assert g.stage(torch.arange(n), torch.arange(n), meta) is None
