"""Property tests over random arrival / abort / finish schedules (model-free runner).

Whatever the interleaving of shared-prefix arrivals, aborts, preemptions (small pools) and
evictions: the KV bookkeeping holds after every step, no request is lost or answered twice,
every block ends free or cached-unreferenced, the KV event stream replayed into a set gives
exactly the cached blocks, and outputs do not depend on prefix caching.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored

PREFIXES = [list(b"system prompt one, shared by many"), list(b"another prefix!!"), []]

request_st = st.fixed_dictionaries(
    {
        "prefix": st.integers(0, len(PREFIXES) - 1),
        "suffix": st.lists(st.integers(1, 255), min_size=0, max_size=24),
        "n": st.integers(1, 2),
        "max_tokens": st.integers(1, 20),
        "seed": st.one_of(st.none(), st.integers(0, 1000)),
        "ignore_eos": st.booleans(),
    }
)
op_st = st.one_of(
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("reset"), st.just(0)),
)


def _params(r: dict) -> SamplingParams:
    if r["seed"] is None:
        return SamplingParams(
            n=r["n"], temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]
        )
    return SamplingParams(
        n=r["n"],
        temperature=0.9,
        top_k=50,
        top_p=0.95,
        seed=r["seed"],
        max_tokens=r["max_tokens"],
        ignore_eos=r["ignore_eos"],
    )


class Replayed:
    """The event stream folded into a set, as an index would."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.parent: dict[int, int | None] = {}
        self.last_seq = -1

    def check_prefix_closed(self) -> None:
        """A cached block's parent is cached: the index bisects chains on this."""
        orphans = {h for h in self.blocks if self.parent[h] not in (None, *self.blocks)}
        assert not orphans, f"{len(orphans)} cached blocks outlived their parent"

    def __call__(self, batch) -> None:
        assert batch.seq == self.last_seq + 1, "event batches out of order"
        self.last_seq = batch.seq
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert not self.blocks & set(e.block_hashes), "stored a block twice"
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                self.blocks.update(e.block_hashes)
                for parent, h in zip(
                    [e.parent_block_hash, *e.block_hashes[:-1]], e.block_hashes, strict=True
                ):
                    self.parent[h] = parent
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.blocks, "removed an unknown block"
                self.blocks.difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()


def _drive(engine, ops, sink: Replayed) -> dict[str, dict[int, tuple[list[int], str]]]:
    """Apply ``ops``; return each request's final (tokens, finish_reason) per index."""
    results: dict[str, dict[int, tuple[list[int], str]]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    added: list[str] = []
    n_of: dict[str, int] = {}

    def run_step() -> None:
        for out in engine.step():
            rid = out.request_id
            assert rid in n_of, "output for an unknown request"
            for d in out.deltas:
                key = (rid, d.index)
                assert d.index not in results.get(rid, {}), "delta after the finish"
                tokens.setdefault(key, []).extend(d.new_token_ids)
                if d.finish_reason is not None:
                    results.setdefault(rid, {})[d.index] = (tokens[key], d.finish_reason)
            assert out.finished == (len(results.get(rid, {})) == n_of[rid])
        engine.check_integrity()
        assert sink.blocks == engine.cached_block_hashes()
        sink.check_prefix_closed()

    for op, arg in ops:
        if op == "add":
            rid = f"r{len(added)}"
            prompt = PREFIXES[arg["prefix"]] + arg["suffix"]
            if not prompt:
                prompt = [7]
            engine.add_request(rid, prompt, _params(arg))
            added.append(rid)
            n_of[rid] = arg["n"]
        elif op == "reset":
            engine.reset_prefix_cache()
        elif op == "abort":
            if added:
                engine.abort(added[arg % len(added)])
        else:
            for _ in range(arg):
                run_step()
    guard = 0
    while engine.has_unfinished():
        run_step()
        guard += 1
        assert guard < 500, "the engine does not make progress"
    for rid in added:
        assert len(results.get(rid, {})) == n_of[rid], f"request {rid} was lost"
    stats = engine.stats()
    event(f"preempted: {stats.num_preempted_total > 0}")
    event(f"evicted: {stats.evictions_total > 0}")
    event(f"prefix hits: {stats.prefix_hits_tokens > 0}")
    pool = engine.kv.pool
    assert pool.num_referenced_blocks == 0, "blocks still referenced after every request ended"
    assert pool.num_free_blocks == pool.num_blocks
    return results


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    ops=st.lists(op_st, min_size=3, max_size=40),
    extra_blocks=st.integers(0, 12),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.sampled_from([8, 16, 64]),
    max_num_seqs=st.sampled_from([2, 4, 16]),
    cache_aware=st.booleans(),
    long_prefill=st.sampled_from([0, 5]),
)
def test_random_schedules_keep_invariants_and_caching_is_transparent(
    fake_engine, ops, extra_blocks, block_size, budget, max_num_seqs, cache_aware, long_prefill
) -> None:
    # Pools of 48 tokens and up: one request always fits, a few at once often do not.
    num_blocks = -(-48 // block_size) + extra_blocks
    max_len = min(num_blocks * block_size, 64)
    common = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_len,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        cache_aware_scheduling=cache_aware,
        long_prefill_token_threshold=long_prefill,
        max_wait_steps=3,
    )
    # Prompts must fit this max_model_len; clip long ones in the op list itself.
    ops = [
        (op, {**a, "suffix": a["suffix"][: max(0, max_len - 2 - len(PREFIXES[a["prefix"]]))]})
        if op == "add" and len(PREFIXES[a["prefix"]]) < max_len - 1
        else (op, a)
        for op, a in ops
        if not (op == "add" and len(PREFIXES[a["prefix"]]) >= max_len - 1)
    ]
    sink_on, sink_off = Replayed(), Replayed()
    on = _drive(fake_engine(enable_prefix_caching=True, event_sink=sink_on, **common), ops, sink_on)
    off = _drive(
        fake_engine(enable_prefix_caching=False, event_sink=sink_off, **common), ops, sink_off
    )
    assert sink_off.blocks == set() and sink_off.last_seq == -1  # caching off: no events
    for rid, per_index in on.items():
        for i, (toks, reason) in per_index.items():
            other = off[rid][i]
            if reason != "abort" and other[1] != "abort":
                assert (toks, reason) == other, f"{rid}[{i}] differs with caching on/off"
