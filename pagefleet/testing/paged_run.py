"""The smallest driver of the model contract: sequences through a private paged KV cache.

``PagedSequenceRunner`` owns a KV cache, gives each sequence a block table (blocks taken in
a shuffled order, so tables are non-contiguous as in a real pool) and builds the
``AttentionMetadata`` for one packed step, decodes first as the contract requires. It is
no scheduler: tests use it to check the model against ``transformers`` through prefill,
extend and decode, and kernel tests use it to compare attention backends on a real model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagefleet.engine.model_config import ModelConfig
from pagefleet.engine.models.llama import LlamaForCausalLM
from pagefleet.kernels.metadata import AttentionBackend, build_metadata


@dataclass(slots=True)
class _SeqState:
    num_tokens: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedSequenceRunner:
    """Runs packed steps of named sequences; remembers each one's context in the cache."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        backend: AttentionBackend,
        *,
        num_blocks: int = 256,
        block_size: int = 16,
        seed: int = 0,
        device: str | torch.device = "cpu",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        dtype = kv_dtype or config.dtype
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # Zeros, as in ModelRunner: the torch decode path gathers padded contexts and
        # weights the padding by 0, and 0 * a NaN left in never-written memory is NaN.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(config.num_hidden_layers)
        ]
        # Block 0 stays unused (the null block of the engine's pool).
        order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))
        self._free = [int(b) + 1 for b in order]
        self._seqs: dict[str, _SeqState] = {}

    def _grow(self, state: _SeqState, n: int) -> None:
        """Give ``state`` the blocks its next ``n`` tokens need."""
        need = -(-(state.num_tokens + n) // self.block_size)
        while len(state.blocks) < need:
            if not self._free:
                raise RuntimeError("PagedSequenceRunner ran out of KV blocks; pass more")
            state.blocks.append(self._free.pop())

    def step(self, batch: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Append ``batch[seq] `` new tokens to each sequence in one packed forward.

        Returns each sequence's fp32 logits for its new tokens, ``[len(new), vocab]``.
        """
        if any(len(ids) == 0 for ids in batch.values()):
            raise ValueError("every sequence in a step needs at least one new token")
        # Decodes (one new token) first: the metadata ordering invariant.
        names = sorted(batch, key=lambda s: len(batch[s]) != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for name in names:
            state = self._seqs.setdefault(name, _SeqState())
            new = batch[name]
            input_ids.extend(new)
            positions.extend(range(state.num_tokens, state.num_tokens + len(new)))
            self._grow(state, len(new))
            state.num_tokens += len(new)
            seq_lens.append(state.num_tokens)
            tables.append(list(state.blocks))
        dev = self.device
        query_lens = [len(batch[n]) for n in names]
        meta = build_metadata(tables, query_lens, seq_lens, self.block_size, dev)
        qsl = meta.query_start_loc.tolist()
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_caches,
            meta,
            self.backend,
        )
        logits = self.model.compute_logits(hidden)
        return {n: logits[qsl[i] : qsl[i + 1]] for i, n in enumerate(names)}

    def free(self, name: str) -> None:
        """Forget a sequence and return its blocks."""
        state = self._seqs.pop(name)
        self._free.extend(state.blocks)
