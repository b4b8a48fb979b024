"""The pool of KV blocks: free queue (= LRU eviction order), ref counts, prefix-cache map.

Every block is in exactly one of three states:

- *free*: ``ref_cnt == 0`` and no hash: holds nothing worth keeping;
- *cached-unreferenced*: ``ref_cnt == 0`` with a hash: its KV is a reusable full block of
  some earlier sequence, kept until the memory is needed;
- *referenced*: ``ref_cnt > 0``: in the block table of at least one live sequence.

Free and cached-unreferenced blocks both sit in the free queue, a doubly linked list whose
head is evicted first. Hashless blocks go to the head (they are worthless), blocks with a
hash go to the tail (most recently used), so the head-to-tail order is the eviction order.
A cache hit removes a block from the middle of the queue in O(1).

The hash map holds full blocks only, one block per hash. ``check_integrity()`` verifies all
of the above; tests call it after every step.

The pool is the only place KV events come from, because it is the only place the hash map
changes: ``cache_block`` emits ``BlockStored``, eviction ``BlockRemoved``, a reset
``AllBlocksCleared``, in the order they happen. Replaying ``take_events()`` in order
therefore gives exactly the keys of ``cached``. Which blocks get cached, so that the set
stays prefix-closed, is the KV cache manager's part of the contract stated in
pagefleet/kvindex/events.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    # links of the free queue; both None when the block is not in it (or is its only entry)
    prev: KVBlock | None = None
    next: KVBlock | None = None
    in_free_queue: bool = False


@dataclass(slots=True)
class _StoredRun:
    """Consecutive stores along one chain, grown in place and emitted as one BlockStored."""

    parent_hash: int | None
    lora_id: str | None
    block_size: int
    hashes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def event(self) -> BlockStored:
        return BlockStored(
            block_hashes=self.hashes,
            parent_block_hash=self.parent_hash,
            token_ids=self.token_ids,
            block_size=self.block_size,
            lora_id=self.lora_id,
        )


class FreeBlockQueue:
    """Doubly linked list of blocks with O(1) append, appendleft, popleft and remove."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        # Sentinels keep every real block's links non-None, so removal needs no branches.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free

    def _link_after(self, anchor: KVBlock, block: KVBlock) -> None:
        assert not block.in_free_queue, f"block {block.block_id} is already free"
        nxt = anchor.next
        assert nxt is not None
        block.prev, block.next = anchor, nxt
        anchor.next = block
        nxt.prev = block
        block.in_free_queue = True
        self.num_free += 1

    def append(self, block: KVBlock) -> None:
        """Add at the tail: evicted last."""
        prev = self._tail.prev
        assert prev is not None
        self._link_after(prev, block)

    def appendleft(self, block: KVBlock) -> None:
        """Add at the head: evicted (reused) first."""
        self._link_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        assert block.in_free_queue, f"block {block.block_id} is not in the free queue"
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        block.in_free_queue = False
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is None or first is self._tail:
            raise RuntimeError("no free KV block left; the caller must check num_free first")
        self.remove(first)
        return first

    def __iter__(self):  # head to tail
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next

    def iter_backward(self):  # tail to head, for the integrity check
        node = self._tail.prev
        while node is not None and node is not self._head:
            yield node
            node = node.prev


class BlockPool:
    """Owns every KV block of one engine. Not thread-safe: the engine is single-threaded.

    Emits every KV event of the engine, in order (``take_events``).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # block hash -> block (full blocks only)
        self._events: list[KVEvent] = []
        self._run: _StoredRun | None = None  # the BlockStored still growing, if any
        self.num_evictions = 0

    # --- queries -----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + cached-unreferenced)."""
        return len(self.free_queue)

    @property
    def num_referenced_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences."""
        return self.num_referenced_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    # --- allocation ----------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting cached ones.

        Raises if fewer than ``n`` are free; callers check ``num_free_blocks`` first so that
        a failed allocation changes nothing.
        """
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self.free_queue)} free")
        out: list[KVBlock] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling unreferenced ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_tail_first: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue.

        Pass a sequence's blocks tail first: cached blocks are appended in that order, so
        the tail of a chain is evicted before its head (a chain's head is the most shared).
        """
        for block in blocks_tail_first:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    # --- prefix cache --------------------------------------------------------------------

    def cache_block(
        self,
        block: KVBlock,
        block_hash: int,
        parent_hash: int | None,
        token_ids: Seq[int],
        lora_id: str | None = None,
    ) -> bool:
        """Register a full, referenced block under ``block_hash`` and emit its BlockStored
        (``parent_hash``: the key of the block before it in its chain; ``token_ids``: its
        tokens). Stores that extend the chain of the previous event join that event.

        Returns False (and leaves the block unhashed, emitting nothing) if another block
        already holds that hash, e.g. two sequences computed the same prefix in the same
        step: the map keeps one block per key so the index never sees duplicates.
        """
        assert block.ref_cnt > 0, "only a referenced (just computed) block can be cached"
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        run = self._run
        if (
            run is None
            or run.hashes[-1] != parent_hash
            or run.lora_id != lora_id
            or run.block_size != len(token_ids)
        ):
            self._close_run()
            run = self._run = _StoredRun(parent_hash, lora_id, len(token_ids))
        run.hashes.append(block_hash)
        run.token_ids.extend(token_ids)
        return True

    def _emit(self, event: KVEvent) -> None:
        self._close_run()
        self._events.append(event)

    def _close_run(self) -> None:
        if self._run is not None:
            self._events.append(self._run.event())
            self._run = None

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached[block.block_hash]
        self._emit(BlockRemoved(block_hashes=[block.block_hash]))
        block.block_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (referenced ones keep their KV, just lose their key)."""
        if not self.enable_caching:
            return
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self._emit(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        """Every event since the last call, in the order the pool changed."""
        self._close_run()
        events, self._events = self._events, []
        return events

    # --- invariants ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the pool's invariants (raises AssertionError naming the broken one).

        free + cached-unreferenced + referenced == total; the free queue holds exactly the
        blocks with ref_cnt 0, once each, linked consistently both ways; the hash map and
        the blocks' hashes agree one to one.
        """
        forward = list(self.free_queue)
        backward = list(self.free_queue.iter_backward())
        assert forward == backward[::-1], "free queue links are inconsistent"
        assert len(forward) == self.free_queue.num_free, "free queue length counter is wrong"
        ids = [b.block_id for b in forward]
        assert len(set(ids)) == len(ids), "a block appears twice in the free queue"
        in_queue = set(ids)
        n_free = n_cached_unref = n_ref = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert block.in_free_queue == (block.block_id in in_queue), (
                f"block {block.block_id}: in_free_queue flag disagrees with the queue"
            )
            if block.ref_cnt == 0:
                assert block.block_id in in_queue, (
                    f"unreferenced block {block.block_id} is missing from the free queue"
                )
                if block.block_hash is None:
                    n_free += 1
                else:
                    n_cached_unref += 1
            else:
                assert block.block_id not in in_queue, (
                    f"referenced block {block.block_id} is in the free queue"
                )
                n_ref += 1
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash the cache map does not point back to"
                )
        assert n_free + n_cached_unref + n_ref == self.num_blocks
        assert sum(1 for b in self.blocks if b.block_hash is not None) == len(self.cached), (
            "the cache map holds a block that lost its hash"
        )
        if not self.enable_caching:
            assert not self.cached, "prefix caching is off but blocks are cached"
