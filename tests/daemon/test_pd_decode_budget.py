"""A decode daemon's step token budget: its default, and that no running stream goes
without its token when the budget is small.

A decode pod runs every stream of its pool at once and prefills the short prompts itself;
with the 2048 budget of a unified daemon a turnover of new prompts was one long step that
stalled every stream (docs/benchmarks.md, P/D session 6), so the decode role defaults to
2 x max_num_seqs. A small budget must not starve streams: it may not be below
max_num_seqs, and a running prefill chunk leaves one token to every decode behind it.
"""

from __future__ import annotations

import pytest

from pagefleet.daemon.config import DaemonConfig
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.loader import load_model, resolve_model
from pagefleet.engine.parts import load_parts
from pagefleet.engine.sampling_params import SamplingParams


def test_decode_role_budget_follows_max_num_seqs() -> None:
    assert DaemonConfig(role="decode").engine_config().max_num_batched_tokens == 128
    assert DaemonConfig(role="decode", max_num_seqs=8).engine_config().max_num_batched_tokens == 16
    for role in ("unified", "prefill"):
        assert DaemonConfig(role=role).engine_config().max_num_batched_tokens == 2048
    given = DaemonConfig(role="decode", max_num_batched_tokens=512)
    assert given.engine_config().max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="max_num_seqs"):
        DaemonConfig(role="decode", max_num_seqs=64, max_num_batched_tokens=32)


def test_a_prefill_chunk_leaves_every_running_decode_its_token() -> None:
    # Budget 8, chunks of at most 5: stream A decodes, prompt B (40 tokens) prefills in
    # chunks, and C (n=4) joins behind B and forks into 4 streams. Without the
    # reservation B's chunk took 5 of the 7 tokens left after A every step and two of C's
    # streams got no token until B's prompt was done.
    config = EngineConfig(
        model="tiny",
        block_size=8,
        num_gpu_blocks=128,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=8,
        long_prefill_token_threshold=5,
    )
    engine = LLMEngine(config, parts=load_parts(config, loaded=load_model(resolve_model("tiny"))))
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engine.add_request("A", [5, 6, 7, 8], greedy)
    engine.step()  # A's prompt
    engine.add_request("B", list(range(10, 50)), greedy)
    fan = SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=64, ignore_eos=True)
    engine.add_request("C", [60, 61], fan)
    checked = 0
    for _ in range(30):
        got = {o.request_id: [len(d.new_token_ids) for d in o.deltas] for o in engine.step()}
        if got.get("B"):
            break  # B's prompt is done: it decodes like the others from here
        assert got.get("A") == [1], "stream A got no token while B prefilled"
        if checked or len(got.get("C", [])) == 4:  # C has forked: all 4 every step now
            assert got.get("C") == [1, 1, 1, 1], f"C's streams got {got.get('C')} tokens"
            checked += 1
    assert checked >= 3, "the steps with C's 4 streams decoding behind B's chunks never came"
    engine.check_integrity()
