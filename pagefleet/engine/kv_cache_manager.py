"""Block tables of live sequences on top of the ``BlockPool``: on-demand allocation,
prefix-cache lookup, copy-on-write, and the ``BlockStored`` events.

Invariants:
- a sequence's table covers exactly the positions that have or are about to get KV
  (``ceil(num_computed + num_scheduled) / block_size`` blocks), allocated a block at a time
  as tokens arrive, never reserved for the maximum length;
- each block's ``ref_cnt`` equals the number of live tables that hold it;
- KV is never written into a block another table also holds, nor into a cached (hashed)
  block: such a block is first copied (``pending_copies``, applied by the model runner
  before the forward) and the copy is written instead;
- a block gets a hash only once all its tokens have KV (or will after this step's
  forward), and the hash is ``kvindex.hashing.block_hashes`` of the sequence's tokens under
  ``namespace`` with the LoRA id as extra, so the gateway computes the same keys;
- after every step the cached set is prefix-closed, the engine's side of the contract in
  pagefleet/kvindex/events.py: tables are freed tail first, a block is cached only while
  its parent is, and duplicate copies of a cached block are folded into it (``end_step``).

The pool emits the KV events (``BlockStored`` when this manager caches a block).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

from pagefleet.engine.block_pool import BlockPool, KVBlock
from pagefleet.engine.request import Sequence
from pagefleet.kvindex.events import KVEvent


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        namespace: str = "",
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.namespace = namespace
        self.pool = BlockPool(num_blocks, enable_caching)
        self._tables: dict[int, list[KVBlock]] = {}
        self._num_hashed: dict[int, int] = {}  # leading blocks already processed for caching
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block ids, this step
        # Blocks hashed during the current step: their KV is written by this step's forward.
        # Another sequence may attend to them in the same step (backends store a layer's K/V
        # before attending) but must not copy them, because copies run before the forward.
        self._inflight: set[int] = set()
        # (index, block, hash, sequence): full blocks whose hash another block already held
        # when they filled; end_step() folds them into that block.
        self._dups: list[tuple[int, KVBlock, int, Sequence]] = []
        # Blocks held by no sequence but kept alive under a key: a finished prefill's KV
        # waiting for a decode pod to pull it, or blocks reserved for an incoming pull.
        self._pins: dict[str, list[KVBlock]] = {}

    def begin_step(self) -> None:
        self._inflight.clear()

    def end_step(self) -> None:
        """After the forward: point tables at the cached original of each duplicate block.

        Two sequences that fill a block with the same tokens in one step both compute it,
        and only the first is cached. Left alone, the second sequence's later blocks would
        be cached under a parent that no table of theirs holds, so the parent could be
        evicted first and break the prefix closure the index relies on (kvindex/events.py).
        Swapping in the original restores it and frees the copy; if the original was
        evicted meanwhile, the duplicate is cached in its place.
        """
        dups, self._dups = self._dups, []
        for i, dup, h, seq in dups:
            table = self._tables.get(seq.seq_id)
            if (
                table is None
                or i >= len(table)
                or table[i] is not dup
                or dup.block_hash is not None
            ):
                continue  # freed or preempted since
            orig = self.pool.get_cached_block(h)
            if orig is None:
                parent = seq.block_hashes[i - 1] if i > 0 else None
                if parent is None or self._holds_cached(table[i - 1], parent):
                    self._cache(seq, dup, i, h, parent)
                continue
            # Forked siblings may share the duplicate too.
            holders = [t for t in self._tables.values() if i < len(t) and t[i] is dup]
            for t in holders:
                t[i] = orig
            self.pool.touch([orig] * len(holders))
            self.pool.free_blocks([dup] * len(holders))

    # --- queries -----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self._tables.get(seq.seq_id, ())]

    def table(self, seq: Sequence) -> list[KVBlock]:
        return self._tables[seq.seq_id]

    def pin_keys(self) -> list[str]:
        return list(self._pins)

    def has_table(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """The longest cached chain of ``seq``'s full blocks and the tokens it lets us skip.

        Side-effect free on the pool. At least the last token is always left to compute (its
        logits are needed): when the chain covers every token, the count is
        ``num_tokens - 1`` and the last block will be copied on write by ``allocate_slots``.
        """
        if not self.enable_caching or seq.request.needs_prompt_logits:
            # prompt_logprobs needs the logits of every prompt position (as vLLM, such a
            # request takes no hits; its blocks are still cached for others).
            return [], 0
        hits: list[KVBlock] = []
        for h in seq.full_block_hashes(self.block_size, self.namespace):
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if num_hit_tokens >= seq.num_tokens and hits[-1].block_id in self._inflight:
            # The last block would be copied on write, but its KV does not exist yet.
            hits.pop()
            num_hit_tokens -= self.block_size
        return hits, min(num_hit_tokens, seq.num_tokens - 1)

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        return self.get_computed_blocks(seq)[1]

    # --- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed_blocks: Seq[KVBlock] = (),
        num_computed_tokens: int | None = None,
    ) -> bool:
        """Give ``seq`` slots for ``num_new_tokens`` more tokens; all or nothing.

        ``computed_blocks``/``num_computed_tokens`` come from ``get_computed_blocks`` on
        admission; otherwise the sequence's own ``num_computed_tokens`` is the start.
        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        table = self._tables.get(seq.seq_id)
        if (
            table is not None
            and not computed_blocks
            and num_computed_tokens is None
            and self._fits_in_place(seq, table, num_new_tokens)
        ):
            return True
        if table is None:
            table = []
        start = seq.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        end = start + num_new_tokens
        assert end <= seq.num_tokens, "cannot schedule tokens that do not exist yet"
        have = len(table) + len(computed_blocks)
        num_new_blocks = max(cdiv(end, self.block_size) - have, 0)

        # The first block written this step may already exist and be shared or cached.
        write_idx = start // self.block_size
        existing: KVBlock | None = None
        if num_new_tokens > 0 and write_idx < have:
            existing = (
                table[write_idx]
                if write_idx < len(table)
                else computed_blocks[write_idx - len(table)]
            )
        # Cache hits are hashed, so a write into one is always copied.
        needs_cow = existing is not None and (
            existing.ref_cnt > 1 or existing.block_hash is not None
        )

        # Cache hits sitting in the free queue stop being allocatable once we take them.
        unavailable = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + int(needs_cow) > self.pool.num_free_blocks - unavailable:
            return False

        self.pool.touch(computed_blocks)
        if seq.seq_id not in self._tables:
            self._tables[seq.seq_id] = table
            self._num_hashed[seq.seq_id] = 0
        table.extend(computed_blocks)
        if computed_blocks:
            self._num_hashed[seq.seq_id] = max(self._num_hashed[seq.seq_id], len(table))
        if needs_cow:
            assert existing is not None
            (copy,) = self.pool.get_new_blocks(1)
            self.pending_copies.append((existing.block_id, copy.block_id))
            table[write_idx] = copy
            self.pool.free_blocks([existing])
            if existing.block_hash is not None and (write_idx + 1) * self.block_size <= end:
                # A full cache hit's last block, recomputed for its logits: once written,
                # the copy equals the original, so end_step() folds it back.
                self._dups.append((write_idx, copy, existing.block_hash, seq))
        if num_new_blocks:
            table.extend(self.pool.get_new_blocks(num_new_blocks))
        self._cache_full_blocks(seq, table, end)
        return True

    def _fits_in_place(self, seq: Sequence, table: list[KVBlock], num_new_tokens: int) -> bool:
        """Whether a running sequence's next ``num_new_tokens`` go into the blocks it holds
        with nothing to do: no new block, no copy on write, no block to key. All but one or
        two of every ``block_size`` decode steps of a sequence are this case, and the full
        path's generic bookkeeping (cache hits, copies, hashing) would find nothing to do."""
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        if num_new_tokens <= 0 or end > len(table) * self.block_size:
            return False
        assert end <= seq.num_tokens, "cannot schedule tokens that do not exist yet"
        block = table[start // self.block_size]
        if block.ref_cnt > 1 or block.block_hash is not None:
            return False  # shared with a fork or cached: copied on write
        # A block this step fills gets its key (prefix caching).
        return not self.enable_caching or end // self.block_size <= self._num_hashed[seq.seq_id]

    def _cache_full_blocks(self, seq: Sequence, table: list[KVBlock], num_tokens: int) -> None:
        """Hash the blocks that become full once ``num_tokens`` tokens have KV."""
        if not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        first = self._num_hashed[seq.seq_id]
        if num_full <= first:
            return
        hashes = seq.full_block_hashes(self.block_size, self.namespace)
        for i in range(first, num_full):
            parent = hashes[i - 1] if i > 0 else None
            if parent is not None and not self._holds_cached(table[i - 1], parent):
                # Only after a reset: this sequence's parent block lost its key while it
                # ran. Another sequence may have cached the same hash since, but that block
                # can be evicted while this child lives on: caching it would break prefix
                # closure (kvindex/events.py).
                break
            if self._cache(seq, table[i], i, hashes[i], parent):
                self._inflight.add(table[i].block_id)
            elif table[i].block_hash is None:
                self._dups.append((i, table[i], hashes[i], seq))
        self._num_hashed[seq.seq_id] = num_full

    def _holds_cached(self, block: KVBlock, parent_hash: int) -> bool:
        """``block`` is the cached block of ``parent_hash``, or a duplicate of it that
        ``end_step`` will fold into the cached one: either way the child's table keeps the
        parent's cached block referenced for as long as the child is."""
        cached = self.pool.get_cached_block(parent_hash)
        if cached is None:
            return False
        return cached is block or any(d is block and h == parent_hash for _, d, h, _ in self._dups)

    def _cache(
        self, seq: Sequence, block: KVBlock, i: int, block_hash: int, parent: int | None
    ) -> bool:
        """Cache ``seq``'s ``i``-th block; the pool emits its BlockStored."""
        bs = self.block_size
        return self.pool.cache_block(
            block, block_hash, parent, seq.token_ids[i * bs : (i + 1) * bs], seq.request.lora_id
        )

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (ref counts up, no copy yet)."""
        table = list(self._tables[parent.seq_id])
        self.pool.touch(table)
        self._tables[child.seq_id] = table
        self._num_hashed[child.seq_id] = self._num_hashed[parent.seq_id]
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s table (tail first, so chain tails are evicted first)."""
        table = self._tables.pop(seq.seq_id, None)
        self._num_hashed.pop(seq.seq_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    # --- pins (P/D transfer) -------------------------------------------------------------

    def pin(self, key: str, blocks: Seq[KVBlock]) -> None:
        """Keep ``blocks`` referenced under ``key`` (one reference each) until ``unpin``."""
        if key in self._pins:
            raise ValueError(f"KV pin {key!r} already exists")
        self.pool.touch(blocks)
        self._pins[key] = list(blocks)

    def pinned(self, key: str) -> list[KVBlock] | None:
        return self._pins.get(key)

    def unpin(self, key: str) -> bool:
        """Drop the pin's references (tail first); False if there was no such pin."""
        blocks = self._pins.pop(key, None)
        if blocks is None:
            return False
        self.pool.free_blocks(reversed(blocks))
        return True

    def pin_new_blocks(self, key: str, num: int, hits: Seq[KVBlock]) -> list[KVBlock] | None:
        """Pin cache hits ``hits`` plus ``num`` fresh blocks under ``key``; all or nothing.

        Returns the fresh blocks, or None (changing nothing) when the pool cannot supply
        them.
        """
        unavailable = sum(1 for b in hits if b.ref_cnt == 0)
        if num > self.pool.num_free_blocks - unavailable:
            return None
        self.pin(key, hits)
        fresh = self.pool.get_new_blocks(num)  # already referenced once: owned by the pin
        self._pins[key].extend(fresh)
        return fresh

    def adopt_pin(self, key: str, seq: Sequence, num_hashed: int) -> None:
        """Turn pin ``key`` into ``seq``'s block table (references move, none change).

        ``num_hashed`` leading blocks already carry their keys (cache hits or imported
        blocks registered by ``register_imported``)."""
        blocks = self._pins.pop(key)
        assert seq.seq_id not in self._tables, "the sequence already has a block table"
        self._tables[seq.seq_id] = blocks
        self._num_hashed[seq.seq_id] = num_hashed

    def register_imported(
        self, key: str, first: int, count: int, hashes: Seq[int], token_ids: Seq[int],
        lora_id: str | None,
    ) -> int:  # fmt: skip
        """Give pinned blocks ``first .. first+count-1`` of pin ``key`` their block keys, as
        if this engine had computed them, and emit ``BlockStored`` for them.

        Keeps the prefix closure: stops at the first block whose parent is not cached. A
        block whose key another block already holds (computed here meanwhile) is swapped
        for that block. Returns how many leading blocks of the pin now carry their key.
        """
        blocks = self._pins[key]
        done = first
        if not self.enable_caching:
            return done
        bs = self.block_size
        for i in range(first, first + count):
            h = hashes[i]
            parent = hashes[i - 1] if i > 0 else None
            if parent is not None and self.pool.get_cached_block(parent) is None:
                break  # prefix closure (kvindex/events.py)
            orig = self.pool.get_cached_block(h)
            if orig is not None and orig is not blocks[i]:
                self.pool.touch([orig])
                self.pool.free_blocks([blocks[i]])
                blocks[i] = orig
            elif orig is None:
                self.pool.cache_block(
                    blocks[i], h, parent, list(token_ids[i * bs : (i + 1) * bs]), lora_id
                )
            done = i + 1
        return done

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def cached_block_hashes(self) -> set[int]:
        return set(self.pool.cached)

    # --- invariants ----------------------------------------------------------------------

    def check_integrity(self, live: Iterable[Sequence] | None = None) -> None:
        """Pool invariants, plus: every ref count equals the number of tables holding the
        block, no table holds a block twice, and (given ``live``) exactly the live
        sequences that have KV own tables, each covering its computed tokens."""
        self.pool.check_integrity()
        counts = [0] * self.pool.num_blocks
        for seq_id, table in self._tables.items():
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids), f"sequence {seq_id} holds a block twice"
            for b in table:
                counts[b.block_id] += 1
        for key, pinned in self._pins.items():
            ids = [b.block_id for b in pinned]
            assert len(set(ids)) == len(ids), f"pin {key!r} holds a block twice"
            for b in pinned:
                counts[b.block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == counts[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by "
                f"{counts[block.block_id]} tables and pins"
            )
        if live is not None:
            live_ids = set()
            for seq in live:
                live_ids.add(seq.seq_id)
                table = self._tables.get(seq.seq_id, [])
                assert len(table) >= cdiv(seq.num_computed_tokens, self.block_size), (
                    f"sequence {seq.seq_id} has KV for {seq.num_computed_tokens} tokens but "
                    f"only {len(table)} blocks"
                )
            stray = set(self._tables) - live_ids
            assert not stray, f"tables of ended sequences were not freed: {sorted(stray)}"
