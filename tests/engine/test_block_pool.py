"""BlockPool and KVCacheManager: allocation, LRU eviction order, prefix hits, CoW, events."""

from __future__ import annotations

import pytest

from pagefleet.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from pagefleet.engine.kv_cache_manager import KVCacheManager
from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagefleet.kvindex.hashing import block_hashes


def test_free_queue_o1_remove_keeps_order() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    q.appendleft(blocks[2])
    assert q.popleft() is blocks[2]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert [b.block_id for b in q.iter_backward()] == [2, 4, 3, 1, 0]
    assert len(q) == 5


def test_pool_counts_and_double_free_detected() -> None:
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert pool.num_free_blocks == 1 and pool.usage() == 0.75
    pool.check_integrity()
    pool.free_blocks(got)
    assert pool.num_free_blocks == 4
    pool.check_integrity()
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([got[0]])
    with pytest.raises(RuntimeError, match="only 4 free"):
        pool.get_new_blocks(5)


def test_eviction_is_lru_tail_first_and_hashless_blocks_go_first() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    for i, b in enumerate(a):
        assert pool.cache_block(b, 100 + i, 99 + i if i else None, [i, i])
    pool.free_blocks(reversed(a))  # chain tail first
    # block 3 (never used, hashless) is reused first, then chain tail 102, 101, 100.
    order = [pool.get_new_blocks(1)[0].block_id for _ in range(4)]
    assert order == [3, 2, 1, 0]
    removed = [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [102, 101, 100]
    assert pool.num_evictions == 3
    pool.check_integrity()


def test_duplicate_hash_is_not_registered_twice() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, 7, None, [1, 2])
    assert not pool.cache_block(b, 7, None, [1, 2])
    assert b.block_hash is None and pool.get_cached_block(7) is a
    assert len(pool.take_events()) == 1  # the refused duplicate emitted nothing
    pool.check_integrity()


def test_pool_emits_every_event_in_order_and_joins_one_chain() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(4)
    assert pool.cache_block(a[0], 10, None, [1, 2])
    assert pool.cache_block(a[1], 11, 10, [3, 4])  # extends the chain: same event
    assert pool.cache_block(a[2], 20, 5, [5, 6], lora_id="x")  # another chain: new event
    pool.free_blocks(reversed(a))
    pool.get_new_blocks(2)  # the hashless block, then chain tail 20
    pool.reset_prefix_cache()
    assert pool.take_events() == [
        BlockStored([10, 11], None, [1, 2, 3, 4], 2),
        BlockStored([20], 5, [5, 6], 2, lora_id="x"),
        BlockRemoved([20]),
        AllBlocksCleared(),
    ]
    assert pool.take_events() == []


def test_integrity_catches_a_leaked_reference() -> None:
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt = 0  # simulate a bug: dropped without returning to the queue
    with pytest.raises(AssertionError, match="missing from the free queue"):
        pool.check_integrity()


def test_manager_allocates_on_demand_a_block_at_a_time(make_seq) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    seq = make_seq(list(range(10)))
    assert kv.allocate_slots(seq, 6)
    assert len(kv.block_ids(seq)) == 2  # 6 tokens -> 2 blocks, not the whole prompt
    seq.num_computed_tokens = 6
    assert kv.allocate_slots(seq, 4)
    seq.num_computed_tokens = 10
    assert len(kv.block_ids(seq)) == 3
    for t in range(2):  # decodes fill block 2, then need block 3
        seq.token_ids.append(50 + t)
        assert kv.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
    assert len(kv.block_ids(seq)) == 3
    seq.token_ids.append(99)
    assert kv.allocate_slots(seq, 1)
    assert len(kv.block_ids(seq)) == 4
    kv.check_integrity([seq])
    kv.free(seq)
    assert kv.pool.num_free_blocks == 8
    kv.check_integrity([])


def test_allocation_failure_changes_nothing(make_seq) -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert not kv.allocate_slots(seq, 12)
    assert kv.pool.num_free_blocks == 2 and not kv.has_table(seq)
    kv.check_integrity([])


def test_prefix_hit_reuses_longest_chain_and_emits_events(make_seq) -> None:
    bs = 4
    kv = KVCacheManager(num_blocks=16, block_size=bs, namespace="m")
    first = make_seq(list(range(10)))
    assert kv.allocate_slots(first, 10)
    first.num_computed_tokens = 10
    events = kv.take_events()
    keys = block_hashes(list(range(10)), bs, namespace="m")
    assert events == [
        BlockStored(
            block_hashes=keys,
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=bs,
            lora_id=None,
        )
    ]
    second = make_seq([*range(8), 42, 43, 44])
    hits, n = kv.get_computed_blocks(second)
    assert n == 8 and [b.block_id for b in hits] == kv.block_ids(first)[:2]
    assert kv.allocate_slots(second, second.num_tokens - n, hits, n)
    assert kv.block_ids(second)[:2] == kv.block_ids(first)[:2]
    assert kv.pool.blocks[kv.block_ids(first)[0]].ref_cnt == 2
    # A different namespace or LoRA id never hits.
    other = make_seq(list(range(10)), lora_id="adapter")
    assert kv.get_computed_blocks(other)[1] == 0
    second.num_computed_tokens = second.num_tokens
    kv.check_integrity([first, second])
    assert kv.cached_block_hashes() == set(keys)


def test_fully_cached_prompt_computes_last_token_into_a_copy(make_seq) -> None:
    bs = 4
    kv = KVCacheManager(num_blocks=8, block_size=bs)
    a = make_seq(list(range(8)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.take_copies()
    b = make_seq(list(range(8)))
    # In the step that computes a's blocks they cannot be copied yet (copies run first).
    assert len(kv.get_computed_blocks(b)[0]) == 1
    kv.begin_step()
    hits, n = kv.get_computed_blocks(b)
    assert len(hits) == 2 and n == 7  # the last token is still computed
    assert kv.allocate_slots(b, 1, hits, n)
    (copy,) = kv.take_copies()
    assert copy[0] == kv.block_ids(a)[1]  # cached tail block is the copy source
    assert kv.block_ids(b) == [kv.block_ids(a)[0], copy[1]]
    b.num_computed_tokens = 8
    kv.check_integrity([a, b])


def test_fork_shares_blocks_and_copies_partial_block_on_write(make_seq) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    parent = make_seq(list(range(6)), n=2)
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = make_seq(list(range(6)))
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    assert kv.block_ids(child) == kv.block_ids(parent)
    parent.token_ids.append(1)
    child.token_ids.append(2)
    assert kv.allocate_slots(parent, 1)  # writes pos 6 of the shared partial block 1
    assert kv.take_copies() == [(kv.block_ids(child)[1], kv.block_ids(parent)[1])]
    assert kv.allocate_slots(child, 1)  # now sole owner: writes in place
    assert kv.take_copies() == []
    assert kv.block_ids(parent)[0] == kv.block_ids(child)[0]
    assert kv.block_ids(parent)[1] != kv.block_ids(child)[1]
    kv.check_integrity([parent, child])
    kv.free(parent)
    kv.free(child)
    kv.check_integrity([])
    assert kv.pool.num_free_blocks == 8


def test_after_reset_a_child_is_not_cached_under_another_sequences_parent(make_seq) -> None:
    """Prefix closure across a reset (the property test's saved failure, pinned).

    A's first blocks lose their keys at the reset; B then re-caches the same hashes in
    blocks of its own. A's next full block must not be cached under B's parent: B's blocks
    can be evicted while A's child lives on, leaving an orphan the index cannot bisect to.
    """
    bs = 4
    kv = KVCacheManager(num_blocks=7, block_size=bs)
    prompt = list(range(12))
    keys = block_hashes(prompt, bs)
    a = make_seq(prompt)
    assert kv.allocate_slots(a, 8)  # chunked prefill: blocks 0 and 1 of 3
    a.num_computed_tokens = 8
    kv.reset_prefix_cache()
    b = make_seq([*prompt, 99])
    assert kv.get_computed_blocks(b)[1] == 0
    assert kv.allocate_slots(b, 8)  # B caches keys[0], keys[1] in its own blocks
    b.num_computed_tokens = 8
    assert kv.cached_block_hashes() == set(keys[:2])
    assert kv.allocate_slots(a, 4)  # A's block 2 fills; its parent block is A's own
    a.num_computed_tokens = 12
    assert keys[2] not in kv.cached_block_hashes()
    kv.check_integrity([a, b])
    # B ends; a newcomer takes every free block, so B's cached blocks are evicted.
    kv.free(b)
    c = make_seq(list(range(100, 116)))
    assert kv.allocate_slots(c, 16)
    assert not kv.cached_block_hashes() & set(keys)
    stored: dict[int, int | None] = {}
    live: set[int] = set()
    for e in kv.take_events():
        if isinstance(e, BlockStored):
            chain = [e.parent_block_hash, *e.block_hashes]
            stored.update(zip(e.block_hashes, chain[:-1], strict=True))
            live.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            live.difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            live.clear()
    assert all(stored[h] is None or stored[h] in live for h in live), "an orphan in the index"
    kv.check_integrity([a, c])


def test_decodes_inside_a_block_change_nothing_until_one_fills_or_shares_it(make_seq) -> None:
    """allocate_slots' in-place path (a decode that needs no block) must still key the
    block a decode fills, and still copy a block a fork shares."""
    bs = 4
    kv = KVCacheManager(num_blocks=8, block_size=bs, namespace="m")
    seq = make_seq(list(range(5)), n=2)
    assert kv.allocate_slots(seq, 5)
    seq.num_computed_tokens = 5
    kv.take_events()
    for tok in (50, 51):  # positions 5 and 6: inside block 1, nothing to do
        seq.token_ids.append(tok)
        assert kv.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        assert kv.take_events() == [] and kv.take_copies() == []
    seq.token_ids.append(52)  # position 7 fills block 1: it gets its key
    assert kv.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == block_hashes(seq.token_ids, bs, namespace="m")[1:2]
    seq.token_ids.append(53)  # position 8: a new block
    assert kv.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1
    assert len(kv.block_ids(seq)) == 3
    child = make_seq(list(seq.token_ids))
    kv.fork(seq, child)
    child.num_computed_tokens = seq.num_computed_tokens
    seq.token_ids.append(54)  # position 9 of block 2, which the child shares: copied
    assert kv.allocate_slots(seq, 1)
    (copy,) = kv.take_copies()
    assert copy == (kv.block_ids(child)[2], kv.block_ids(seq)[2])
    seq.num_computed_tokens += 1
    kv.check_integrity([seq, child])
