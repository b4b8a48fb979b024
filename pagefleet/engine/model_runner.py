"""Runs one scheduled step on the model: packs the batch, applies block copies, forwards,
samples.

The packed batch puts the single-token (decode) sequences first, as the attention contract
requires (``kernels/metadata.py``). Every sequence's new tokens sit at positions
``start .. start + num_new - 1`` and their K/V go to slot
``table[p // block_size] * block_size + p % block_size``. Copy-on-write copies are applied
before the forward, because this step's writes land in the copies.

Only sequences whose scheduled chunk reaches the end of their tokens get logits and a
sampled token; a prefill chunk short of the prompt's end samples nothing. A request that
asks for ``prompt_logprobs`` also gets, for each chunk, the logits of the chunk's prompt
positions, reduced at once to each next token's logprob, rank and top-k
(``score_prompt``): the full ``[positions, vocab]`` matrix never outlives a slice of
``PROMPT_SCORE_ROWS`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

import torch

from pagefleet.engine.kv_cache_manager import KVCacheManager
from pagefleet.engine.kv_layout import KVLayout
from pagefleet.engine.request import PromptScore, Sequence
from pagefleet.engine.sampler import Sampler, SampleResult
from pagefleet.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagefleet.kernels.metadata import (
    AttentionBackend,
    AttentionMetadata,
    build_metadata,
    index_tensor,
)

if TYPE_CHECKING:
    from pagefleet.engine.cuda_graphs import DecodeGraphs

StepResult = list[tuple[Sequence, SampleResult]]

# Prompt positions whose logits exist at once while scoring a prompt (prompt_logprobs):
# 256 rows of a 128k vocabulary are 128 MiB in float32, whatever the chunk's length.
PROMPT_SCORE_ROWS = 256


class Runner(Protocol):
    """What the engine needs from a runner (tests substitute a model-free one)."""

    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> StepResult: ...


class KVPort(Protocol):
    """Block-granular access to a runner's KV pool (P/D transfer)."""

    def kv_layout(self) -> KVLayout: ...

    def read_kv_blocks(
        self,
        block_ids: list[int],
        layers: range,
        out: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def write_kv_blocks(
        self,
        block_ids: list[int],
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        first_layer: int = 0,
    ) -> None: ...


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K and V of one block across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def copy_waves(copies: Seq[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Split one step's ``(src, dst)`` block copies into consecutive waves of independent
    pairs: within a wave no block that one pair writes is read or written by another.

    ``copies`` come in the order the KV cache manager made them, and only that order is
    right: a copy-on-write source freed in the step can be handed out again as a later
    copy's destination (``[(a, x), (b, a)]``). A backend may apply one call's pairs in any
    order or in parallel (the Triton kernel runs a program per pair), so each wave goes in
    its own call, in order; nearly every step has a single wave.
    """
    waves: list[list[tuple[int, int]]] = []
    reads: set[int] = set()
    writes: set[int] = set()
    for src, dst in copies:
        if not waves or dst in reads or dst in writes or src in writes:
            waves.append([])
            reads, writes = set(), set()
        waves[-1].append((src, dst))
        reads.add(src)
        writes.add(dst)
    return waves


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Allocated once for the engine's life: the KV pool *is* this memory.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]
        # Tests hook in here to compare logits with a reference model.
        self.logits_hook: Callable[[list[Sequence], torch.Tensor], None] | None = None
        # Captured decode graphs (cuda_graphs.py), set by load_parts when enabled.
        self.decode_graphs: DecodeGraphs | None = None

    def kv_layout(self) -> KVLayout:
        k = self.kv_caches[0][0]
        return KVLayout(
            num_layers=len(self.kv_caches),
            block_size=self.block_size,
            num_kv_heads=k.shape[2],
            head_dim=k.shape[3],
            dtype=str(k.dtype).removeprefix("torch."),
        )

    def read_kv_blocks(
        self,
        block_ids: list[int],
        layers: range,
        out: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of K and V of ``block_ids`` for each layer in ``layers``, on the host,
        each ``[len(block_ids), block_size, num_kv_heads, head_dim]``, contiguous; written
        into ``out`` (host tensors of those shapes, one pair per layer) when given, so a
        caller with a shared-memory stage gets one copy, not two.

        Safe from another thread while the engine steps as long as the blocks are pinned:
        nothing writes into a referenced block that no sequence holds.
        """
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        if out is not None:
            for (ok, ov), layer in zip(out, layers, strict=True):
                k, v = self.kv_caches[layer]
                if k.device.type == "cpu":
                    torch.index_select(k, 0, idx, out=ok)
                    torch.index_select(v, 0, idx, out=ov)
                else:
                    ok.copy_(k.index_select(0, idx))
                    ov.copy_(v.index_select(0, idx))
            return out
        out = []
        for layer in layers:
            k, v = self.kv_caches[layer]
            kk, vv = k.index_select(0, idx), v.index_select(0, idx)
            if kk.device.type != "cpu":
                # Staged through pinned host memory so the copy runs at full bus speed.
                hk = torch.empty(kk.shape, dtype=kk.dtype, pin_memory=True)
                hv = torch.empty(vv.shape, dtype=vv.dtype, pin_memory=True)
                hk.copy_(kk)
                hv.copy_(vv)
                kk, vv = hk, hv
            out.append((kk, vv))
        return out

    def write_kv_blocks(
        self,
        block_ids: list[int],
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        first_layer: int = 0,
    ) -> None:
        """Write K and V of layers ``first_layer .. first_layer + len(kv) - 1`` (every
        layer by default) into ``block_ids`` (engine thread, between steps)."""
        if not block_ids:
            return
        caches = self.kv_caches[first_layer : first_layer + len(kv)]
        assert len(caches) == len(kv), "more layers than the model has"
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for (k, v), (kk, vv) in zip(caches, kv, strict=True):
            k.index_copy_(0, idx, kk.to(device=k.device, dtype=k.dtype))
            v.index_copy_(0, idx, vv.to(device=v.device, dtype=v.dtype))

    def build_batch(
        self, items: list[ScheduledSeq], kv: KVCacheManager
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids, positions and attention metadata of ``items`` (decodes first)."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for it in items:
            n = it.num_new_tokens
            end = it.start + n
            if n == 1:
                input_ids.append(it.seq.token_ids[it.start])
                positions.append(it.start)
            else:
                input_ids.extend(it.seq.token_ids[it.start : end])
                positions.extend(range(it.start, end))
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(kv.block_ids(it.seq))
        dev = self.device
        meta = build_metadata(tables, query_lens, seq_lens, self.block_size, dev)
        ids_t = index_tensor(input_ids, torch.int64, dev)
        return ids_t, index_tensor(positions, torch.int64, dev), meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> StepResult:
        for wave in copy_waves(sched.copies):
            src = torch.tensor([s for s, _ in wave], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in wave], dtype=torch.int64, device=self.device)
            self.backend.copy_blocks(
                [k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], src, dst
            )
        if not sched.scheduled:
            return []
        items = sorted(sched.scheduled, key=lambda it: not it.is_decode)  # stable
        input_ids, positions, meta = self.build_batch(items, kv)
        hidden = None
        if self.decode_graphs is not None:  # None: not a step a captured graph can replay
            hidden = self.decode_graphs.forward(input_ids, positions, meta)
        if hidden is None:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        self._score_prompts(items, hidden)
        rows: list[int] = []
        samplers: list[Sequence] = []
        end = 0
        for it in items:
            end += it.num_new_tokens
            if it.samplers:
                rows.append(end - 1)  # the last new token's row predicts the next token
        if not rows:
            return []
        if len(rows) == hidden.shape[0]:  # every row samples (a decode-only step): no gather
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden[index_tensor(rows, torch.int64, self.device)])
        expand: list[int] = []
        j = 0
        for it in items:
            if it.samplers:
                for s in it.samplers:
                    samplers.append(s)
                    expand.append(j)
                j += 1
        if len(expand) != len(rows):
            logits = logits[torch.tensor(expand, device=logits.device)]
        logits = logits.cpu()
        if self.logits_hook is not None:
            self.logits_hook(samplers, logits)
        return list(zip(samplers, self.sampler(logits, samplers), strict=True))

    def _score_prompts(self, items: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """Append the scores of the prompt tokens this step's chunks predict to their
        requests (``Request.prompt_scores``): the row of position ``p`` scores prompt token
        ``p + 1``. Positions scored before (a recomputed chunk) are skipped."""
        first = 0
        for it in items:
            req = it.seq.request
            scores = req.prompt_scores
            if scores is not None:
                # Positions this chunk holds that predict a prompt token not scored yet.
                lo = max(it.start, len(scores))
                hi = min(it.start + it.num_new_tokens, len(req.prompt_token_ids) - 1)
                if lo < hi:
                    rows = range(first + lo - it.start, first + hi - it.start)
                    targets = req.prompt_token_ids[lo + 1 : hi + 1]
                    num_top = req.params.prompt_logprobs or 0
                    scores.extend(self.score_prompt(hidden, rows, targets, num_top))
            first += it.num_new_tokens

    def score_prompt(
        self, hidden: torch.Tensor, rows: range, targets: list[int], num_top: int
    ) -> list[PromptScore]:
        """``targets[i]``'s logprob, rank and the ``num_top`` best of the log-softmax of the
        raw logits of ``hidden[rows[i]]``, in slices of ``PROMPT_SCORE_ROWS`` rows."""
        out: list[PromptScore] = []
        for s in range(0, len(rows), PROMPT_SCORE_ROWS):
            part = rows[s : s + PROMPT_SCORE_ROWS]
            idx = torch.arange(part.start, part.stop, device=hidden.device)
            lp = torch.log_softmax(self.model.compute_logits(hidden[idx]).float(), dim=-1)
            tgt = torch.tensor(targets[s : s + len(part)], device=lp.device).unsqueeze(-1)
            chosen = lp.gather(-1, tgt)
            # As vLLM: 1 + the number of tokens strictly more likely (count_nonzero: a
            # bool tensor's sum() is ~13x slower on CPU).
            ranks = torch.count_nonzero(lp > chosen, dim=-1) + 1
            if num_top:
                top = torch.topk(lp, min(num_top, lp.shape[-1]), dim=-1)
                top_ids, top_lps = top.indices.tolist(), top.values.tolist()
            else:
                top_ids, top_lps = [[] for _ in part], [[] for _ in part]
            for v, r, ti, tl in zip(
                chosen.squeeze(-1).tolist(), ranks.tolist(), top_ids, top_lps, strict=True
            ):
                out.append(PromptScore(v, r, ti, tl))
        return out
