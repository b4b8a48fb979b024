"""CUDA graphs for decode steps, at a fixed set of batch sizes (``EngineConfig.cuda_graphs``).

A decode step of a modest batch on a GPU is bound by kernel launches: per layer, norms,
projections, rotary, the KV store and attention, each a few microseconds of host time. A
CUDA graph records the step's launches once and replays them with one call (as vLLM's model
runner does for decode). A graph replays fixed shapes at fixed addresses, so:

- the step's inputs live in static buffers sized for the largest captured batch; a decode
  step copies its batch in and is padded up to the nearest captured size. Padded rows store
  nothing (slot -1), attend over one position of block 0 and their outputs are dropped;
- host-side values a backend reads while launching are frozen at capture: the Triton
  backend sizes its decode split grid from ``max_seq_len``, captured at the engine's
  ``max_model_len`` bound, which is correct for every shorter sequence because the kernel
  reads each sequence's real length from the ``seq_lens`` tensor.

Only pure-decode steps of at most the largest captured size replay; prefill and mixed steps
run eagerly. Only the Triton backend on CUDA is captured: the torch and compiled-CPU
backends plan each step on the host from its per-sequence lists, which a graph cannot see.

Invariant: a replayed step returns, for its real rows, the hidden states an eager forward
of the same batch returns (tests/kernels/test_cuda_graphs.py checks it, with a stand-in for
the CUDA capture where no GPU is present), and never writes KV outside the slots the batch
owns.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagefleet.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# A captured step: ``replay()`` re-runs the recorded work on the static buffers, and the
# returned tensor (written in place by each replay) holds its output.
Replay = Callable[[], None]
# ``capture(fn, pool) -> (replay, output, pool)``: record ``fn`` (which reads the static
# buffers), sharing the memory ``pool`` across sizes. ``cuda_capture`` on a GPU; tests on a
# CPU pass a stand-in that re-runs ``fn`` eagerly.
Capture = Callable[[Callable[[], torch.Tensor], object], tuple[Replay, torch.Tensor, object]]

# Largest batch captured by default: past this the launches are a small share of a step.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 (as vLLM spaces them),
    up to ``min(max_num_seqs, limit)``, which is always included."""
    top = min(max_num_seqs, limit)
    if top < 1:
        return []
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding ``n`` rows, or None when ``n`` exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) and n > 0 else None


def is_pure_decode(meta: AttentionMetadata) -> bool:
    """Every scheduled sequence brings exactly one new token (no prefill in the step)."""
    return meta.num_seqs > 0 and meta.num_decodes == meta.num_seqs and meta.max_query_len == 1


def unavailable_reason(device: torch.device, backend_name: str) -> str | None:
    """Why graphs cannot be used here (None: they can)."""
    if device.type != "cuda":
        return f"the engine runs on {device.type!r}, not CUDA"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    if backend_name != "triton":
        return f"attention backend {backend_name!r} plans each step on the host"
    return None


def cuda_capture(
    fn: Callable[[], torch.Tensor], pool: object
) -> tuple[Replay, torch.Tensor, object]:
    """Record ``fn`` into a CUDA graph after warming it up on a side stream (first launches
    compile Triton kernels and create cuBLAS handles, which a capture must not see)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out, graph.pool()


@dataclass(slots=True)
class _Captured:
    replay: Replay
    hidden: torch.Tensor  # [size, hidden]: the static output of this size's graph


class DecodeGraphs:
    """Static decode buffers and one captured forward per batch size."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: object,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        sizes: list[int],
    ) -> None:
        if not sizes:
            raise ValueError("no batch sizes to capture; max_num_seqs must be >= 1")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = sorted(sizes)
        top = self.sizes[-1]
        width = -(-max_model_len // block_size)
        dev = device
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((top, width), dtype=torch.int32, device=dev)
        # One token per sequence, so the starts are fixed: 0, 1, ..., top.
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[int, _Captured] = {}

    # -- capture ---------------------------------------------------------------------------

    def capture_meta(self, size: int) -> AttentionMetadata:
        """Metadata over the first ``size`` rows of the static buffers, host values at their
        capture-time bounds (see the module docstring)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
            num_decodes=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    def capture(self, capture: Capture = cuda_capture) -> None:
        """Record every size, largest first (smaller graphs reuse the largest's pool). The
        buffers hold padding meanwhile, so capturing stores nothing into the KV pool."""
        self._pad_from(0)
        pool: object = None
        # As the steps that replay them run (ModelRunner.execute): no autograd records.
        with torch.inference_mode():
            self._capture_all(capture, pool)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _capture_all(self, capture: Capture, pool: object) -> None:
        for size in reversed(self.sizes):
            meta = self.capture_meta(size)

            def fn(size: int = size, meta: AttentionMetadata = meta) -> torch.Tensor:
                return self.model(
                    self.input_ids[:size], self.positions[:size], self.kv_caches, meta,
                    self.backend,
                )  # fmt: skip

            replay, hidden, pool = capture(fn, pool)
            self._graphs[size] = _Captured(replay, hidden)

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    # -- replay ----------------------------------------------------------------------------

    def _pad_from(self, n: int) -> None:
        """Rows from ``n`` on: padding (store nothing, one position of block 0)."""
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.slot_mapping[n:].fill_(-1)
        self.seq_lens[n:].fill_(1)
        self.block_tables[n:].zero_()

    def stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> int | None:
        """Copy a pure-decode batch into the static buffers, padded; the padded size, or
        None when this step cannot replay (not pure decode, or larger than every size)."""
        if not is_pure_decode(meta):
            return None
        n = meta.num_seqs
        size = padded_size(n, self.captured or self.sizes)
        if size is None:
            return None
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            return None  # longer than max_model_len: cannot happen, but never overrun
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()
        self._pad_from(n)
        return size

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Hidden states of the batch's real rows from a replayed graph, or None: run the
        step eagerly. The result is a view of static memory, valid until the next replay."""
        if not self._graphs:
            return None
        size = self.stage(input_ids, positions, meta)
        if size is None:
            return None
        graph = self._graphs[size]
        graph.replay()
        return graph.hidden[: meta.num_seqs]


def build_decode_graphs(
    enabled: bool,
    model: torch.nn.Module,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    backend: object,
    device: torch.device,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
) -> DecodeGraphs | None:
    """Captured decode graphs when ``enabled`` and possible here; otherwise None (the engine
    runs every step eagerly), with the reason logged once when they were asked for."""
    if not enabled:
        return None
    reason = unavailable_reason(device, getattr(backend, "name", type(backend).__name__))
    if reason is not None:
        logger.warning("CUDA graphs were asked for but are off: %s; running eagerly", reason)
        return None
    graphs = DecodeGraphs(
        model, kv_caches, backend, device, block_size, max_model_len,
        capture_sizes(max_num_seqs),
    )  # fmt: skip
    graphs.capture()
    return graphs
