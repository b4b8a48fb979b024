"""LLMEngine behaviour on the model-free runner: admission errors, stop conditions, abort,
n > 1 block sharing, cache-aware ordering, KV events, preemption and eviction."""

from __future__ import annotations

import pytest

from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagefleet.kvindex.hashing import block_hashes

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _drain(engine) -> dict[str, dict[int, list]]:
    got: dict[str, dict[int, list]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            for d in out.deltas:
                entry = got.setdefault(out.request_id, {}).setdefault(d.index, [[], "", None])
                entry[0] += d.new_token_ids
                entry[1] += d.new_text
                if d.finish_reason:
                    entry[2] = (d.finish_reason, d.stop_reason)
        engine.check_integrity()
    return got


def test_add_request_rejects_bad_input_without_admitting(fake_engine) -> None:
    eng = fake_engine(max_model_len=32, max_num_seqs=4)
    eng.add_request("a", [1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", [1], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("b", [], SamplingParams())
    with pytest.raises(ValueError, match="at most 31"):
        eng.add_request("c", [5] * 32, SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("d", [5, 999], SamplingParams())
    with pytest.raises(ValueError, match="max_num_seqs"):
        eng.add_request("e", [5], SamplingParams(n=5))
    assert eng.stats().num_waiting == 1


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        # NaN passed "temperature < 0"; the next step's sampler raised, and the batch's other
        # sequences were left computed with no token appended: every later step failed.
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"n": 2.5}, "n"),  # the fork at the end of the prompt raised TypeError mid-step
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ],
)
def test_sampling_params_refuse_what_would_break_a_step(kw, field) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kw)


def test_finish_reasons(fake_engine) -> None:
    eng = fake_engine(max_model_len=24)
    eng.add_request("len", [5, 6], SamplingParams(max_tokens=3, **GREEDY))
    eng.add_request("maxlen", [5] * 20, SamplingParams(max_tokens=None, **GREEDY))
    got = _drain(eng)
    assert got["len"][0][2] == ("length", None) and len(got["len"][0][0]) == 3
    assert got["maxlen"][0][2] == ("length", None) and len(got["maxlen"][0][0]) == 4
    # Stop on a token id the greedy run is known to produce (its second token).
    first = got["len"][0][0][1]
    eng.add_request("tok", [5, 6], SamplingParams(max_tokens=3, stop_token_ids=[first], **GREEDY))
    got = _drain(eng)
    assert got["tok"][0][2] == ("stop", first) and got["tok"][0][0][-1] == first


def test_eos_stops_unless_ignored(fake_engine) -> None:
    eng = fake_engine()
    eng.runner.eos_boost = 100.0  # EOS (id 0) is the argmax
    eng.add_request("eos", [5, 6], SamplingParams(temperature=0.0, max_tokens=5))
    eng.add_request("ign", [5, 6], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    eng.add_request("min", [5, 6], SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2))
    got = _drain(eng)
    assert got["eos"][0][0] == [0] and got["eos"][0][2] == ("stop", None)
    assert got["eos"][0][1] == ""  # EOS is not text
    assert got["ign"][0][2] == ("length", None) and len(got["ign"][0][0]) == 5
    assert got["min"][0][0][:2] != [0, 0] and 0 not in got["min"][0][0][:2]
    assert got["min"][0][0][2] == 0


def test_abort_frees_blocks_waiting_and_running(fake_engine) -> None:
    eng = fake_engine(num_blocks=16, block_size=4, max_num_seqs=1)
    eng.add_request("run", list(range(1, 20)), SamplingParams(max_tokens=50, **GREEDY))
    eng.add_request("wait", [3, 4], SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    assert eng.kv.pool.num_referenced_blocks > 0 and eng.stats().num_waiting == 1
    assert eng.abort("run") and eng.abort("wait")
    assert not eng.abort("run") and not eng.abort("nope")
    assert eng.kv.pool.num_referenced_blocks == 0
    outs = eng.step()
    assert {o.request_id for o in outs} == {"run", "wait"}
    assert all(o.finished and o.deltas[0].finish_reason == "abort" for o in outs)
    assert not eng.has_unfinished()
    eng.check_integrity()


def test_abort_of_unforked_n_request_ends_every_index(fake_engine) -> None:
    eng = fake_engine()
    eng.add_request("r", [1, 2, 3], SamplingParams(n=3, seed=1, max_tokens=4))
    assert eng.abort("r")
    (out,) = eng.step()
    assert sorted(d.index for d in out.deltas) == [0, 1, 2]
    assert all(d.finish_reason == "abort" for d in out.deltas)


def test_n_samples_share_prompt_blocks_and_copy_the_partial_one(fake_engine) -> None:
    eng = fake_engine(num_blocks=32, block_size=4, enable_prefix_caching=False)
    eng.add_request("r", list(range(1, 11)), SamplingParams(n=3, seed=7, max_tokens=6))
    eng.step()  # prefill + fork: 3 sequences on the same 3 blocks (last one partial)
    seqs = eng._requests["r"].seqs
    tables = [eng.kv.block_ids(s) for s in seqs]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert eng.kv.pool.num_referenced_blocks == 3
    eng.step()  # each writes position 10 of the shared partial block: 2 copies, 1 in place
    tables = [eng.kv.block_ids(s) for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    got = _drain(eng)
    outs = [got["r"][i][0] for i in range(3)]
    assert len({tuple(o) for o in outs}) > 1  # seeded siblings draw different samples
    assert eng.kv.pool.num_referenced_blocks == 0


def test_seeded_n_samples_are_reproducible_and_batch_independent(fake_engine) -> None:
    params = SamplingParams(n=2, seed=42, temperature=0.8, max_tokens=8, ignore_eos=True)
    alone = fake_engine()
    alone.add_request("x", [9, 8, 7], params)
    ref = _drain(alone)["x"]
    crowded = fake_engine(max_num_batched_tokens=8)
    for i in range(5):
        crowded.add_request(f"o{i}", [i + 1] * (3 + i), SamplingParams(seed=i, max_tokens=6))
    crowded.add_request("x", [9, 8, 7], params)
    assert _drain(crowded)["x"] == ref


def test_cache_aware_ordering_prefers_cached_prefixes_with_bounded_wait(fake_engine) -> None:
    eng = fake_engine(
        num_blocks=64,
        block_size=4,
        max_num_seqs=1,
        cache_aware_scheduling=True,
        max_wait_steps=4,
        max_model_len=64,
    )
    shared = list(range(1, 17))
    eng.add_request("warm", [*shared, 20], SamplingParams(max_tokens=1, **GREEDY))
    _drain(eng)
    order = []
    eng.add_request("cold", [30] * 16, SamplingParams(max_tokens=3, **GREEDY))
    for i in range(4):
        eng.add_request(f"hot{i}", [*shared, 40 + i], SamplingParams(max_tokens=3, **GREEDY))
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                order.append(out.request_id)
    # Hot requests overtake the earlier cold one, but only until it has waited 4 steps.
    assert order[0].startswith("hot")
    assert order.index("cold") < 4


def test_kv_events_describe_stores_evictions_and_clears(fake_engine) -> None:
    batches = []
    eng = fake_engine(num_blocks=8, block_size=4, event_sink=batches.append, kv_namespace="m")
    prompt = list(range(1, 10))
    eng.add_request("a", prompt, SamplingParams(max_tokens=1, **GREEDY))
    _drain(eng)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == block_hashes(prompt, 4, namespace="m")
    assert stored[0].parent_block_hash is None and stored[0].token_ids == prompt[:8]
    # A different prompt needing the whole pool evicts them, tail block first.
    eng.add_request("b", list(range(50, 80)), SamplingParams(max_tokens=1, **GREEDY))
    _drain(eng)
    removed = [
        h for b in batches for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    assert removed[:2] == list(reversed(stored[0].block_hashes))
    assert eng.stats().evictions_total >= 2
    eng.reset_prefix_cache()
    eng.step()
    assert isinstance(batches[-1].events[-1], AllBlocksCleared)
    assert eng.cached_block_hashes() == set()
    assert [b.seq for b in batches] == list(range(len(batches)))


def test_small_pool_preempts_and_recovers_exactly(fake_engine) -> None:
    params = SamplingParams(max_tokens=12, **GREEDY)
    prompts = [[i + 1] * (5 + 3 * i) for i in range(6)]
    big = fake_engine(num_blocks=64, block_size=2)
    for i, p in enumerate(prompts):
        big.add_request(f"r{i}", p, params)
    ref = _drain(big)
    small = fake_engine(num_blocks=20, block_size=2, max_model_len=40)
    for i, p in enumerate(prompts):
        small.add_request(f"r{i}", p, params)
    assert _drain(small) == ref
    assert small.stats().num_preempted_total > 0


def test_stats_count_tokens_hits_and_usage(fake_engine) -> None:
    eng = fake_engine(num_blocks=32, block_size=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    eng.add_request("a", prompt, SamplingParams(max_tokens=3, **GREEDY))
    eng.step()
    s = eng.stats()
    assert s.num_running == 1 and s.num_waiting == 0 and s.steps_total == 1
    assert s.kv_usage == 4 / 32 and s.num_free_blocks == 28
    _drain(eng)
    eng.add_request("b", prompt, SamplingParams(max_tokens=2, **GREEDY))
    _drain(eng)
    s = eng.stats()
    assert s.prompt_tokens_total == 26 and s.generation_tokens_total == 5
    assert s.prefix_queries_tokens == 26 and s.prefix_hits_tokens == 12
    assert s.kv_usage == 0.0 and s.num_preempted_total == 0


def _chunking(fake_engine, threshold: int):
    """A small engine whose step budget is 64 tokens, at most ``threshold`` per prompt."""
    return fake_engine(
        num_blocks=64,
        block_size=4,
        max_model_len=128,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=threshold,
    )


def test_long_prefill_threshold_lets_a_short_request_into_the_same_step(fake_engine) -> None:
    def first_token_steps(threshold: int) -> dict[str, int]:
        eng = _chunking(fake_engine, threshold)
        eng.add_request("long", list(range(1, 101)), SamplingParams(max_tokens=2, **GREEDY))
        eng.add_request("short", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY))
        first: dict[str, int] = {}
        step = 0
        while eng.has_unfinished():
            step += 1
            for out in eng.step():
                if any(d.new_token_ids for d in out.deltas):
                    first.setdefault(out.request_id, step)
            eng.check_integrity()
        return first

    # Without the cap the 100-token prompt takes the whole 64-token budget twice; with a
    # 16-token cap the short request is prefilled beside its first chunk.
    assert first_token_steps(0) == {"long": 2, "short": 2}
    capped = first_token_steps(16)
    assert capped["short"] == 1
    assert capped["long"] == 7  # ceil(100 / 16) steps
    with pytest.raises(ValueError, match="chunked prefill"):
        fake_engine(long_prefill_token_threshold=8, enable_chunked_prefill=False)


def test_chunked_prefill_twin_waits_for_the_blocks_instead_of_computing_them(fake_engine) -> None:
    """Two prompts sharing a long prefix, the second arriving while the first prefills in
    chunks: it is admitted once the shared blocks exist and hits all of them (admitted
    mid-prefill it would hit only the chunks done so far and compute the rest again)."""

    def run(threshold: int) -> tuple[int, int]:
        eng = _chunking(fake_engine, threshold)
        shared = list(range(1, 81))  # 20 full blocks
        eng.add_request("a", [*shared, 90, 91], SamplingParams(max_tokens=2, **GREEDY))
        eng.step()  # a's first chunk
        eng.add_request("b", [*shared, 92, 93, 94], SamplingParams(max_tokens=2, **GREEDY))
        while eng.has_unfinished():
            eng.step()
            eng.check_integrity()
        s = eng.stats()
        return s.prefix_hits_tokens, s.prompt_tokens_total - s.prefix_hits_tokens

    hits, computed = run(16)
    assert hits == 80  # b hit every shared block
    assert computed == 82 + 3  # a's whole prompt, b's own 3 tokens: nothing twice
    # One-step prefills: b arrives after a's single step, the same hits.
    assert run(0) == (80, 85)
