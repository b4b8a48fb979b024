"""Fixtures shared by the engine tests (model-free helpers; model fixtures live in the
test files that need them so pure-Python tests never load torch models)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from pagefleet.engine.outputs import RequestMetrics
from pagefleet.engine.request import Request, SeqIdCounter, Sequence
from pagefleet.engine.sampling_params import SamplingParams

SeqFactory = Callable[..., Sequence]


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module's tests (``pytestmark = pytest.mark.usefixtures``):
    tiny matmuls gain nothing from threads, and on a shared 2-core machine torch's thread
    pool under contention makes them 10x slower. torch is imported here, not at the top,
    so pure-Python tests never load it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_seq() -> SeqFactory:
    """Build a bare sequence (index 0 of a fresh request) over ``tokens``."""
    ids = SeqIdCounter()

    def make(tokens: list[int], n: int = 1, lora_id: str | None = None) -> Sequence:
        req = Request(
            request_id=f"r{ids()}",
            prompt_token_ids=list(tokens),
            params=SamplingParams(n=n, temperature=0.0),
            metrics=RequestMetrics(arrival_time=0.0),
            lora_id=lora_id,
            forked=n == 1,
        )
        seq = Sequence(
            seq_id=ids(),
            request=req,
            index=0,
            token_ids=list(tokens),
            num_prompt_tokens=len(tokens),
        )
        req.seqs.append(seq)
        return seq

    return make


class ByteTokenizer:
    """A real byte-level tokenizer: token i < 256 is byte i, id 0 is the EOS special token.

    Multi-byte UTF-8 characters span several tokens, which is what the detokenizer must
    handle."""

    vocab_size = 256
    eos_token_ids = (0,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if not (skip_special_tokens and i == 0))
        return data.decode("utf-8", errors="replace")


class FakeKVRunner:
    """A model-free runner that still exercises the paged KV bookkeeping for real.

    It keeps a fake KV cache of ``(position, token)`` per slot, applies the step's block
    copies first, stores every scheduled token at its slot, then for each sampling sequence
    reads its whole context back through its block table and asserts it is exactly its
    tokens (so a wrong table, a missed copy-on-write or a bad prefix hit fails loudly). The
    logits are a pseudo-random function of that context, sampled by the real ``Sampler``:
    outputs are deterministic per context, like a model's.
    """

    def __init__(self, num_blocks: int, block_size: int, vocab: int, eos: tuple[int, ...]):
        import torch

        from pagefleet.engine.sampler import Sampler

        self.torch = torch
        self.bs = block_size
        self.vocab = vocab
        self.cache: list[list[tuple[int, int] | None]] = [
            [None] * block_size for _ in range(num_blocks)
        ]
        self.sampler = Sampler(eos)
        self.eos_boost = 0.0  # > 0 makes EOS likely (finish schedules)
        self.logits_hook = None

    # P/D transfer: the fake KV of a block as an int64 tensor [block_size, 1, 2] of
    # (position, token), -1 for an empty slot; one layer.
    def kv_layout(self):
        from pagefleet.engine.model_runner import KVLayout

        return KVLayout(1, self.bs, 1, 2, "int64")

    def read_kv_blocks(self, block_ids, layers):
        torch = self.torch
        rows = [[s if s is not None else (-1, -1) for s in self.cache[b]] for b in block_ids]
        k = torch.tensor(rows, dtype=torch.int64).reshape(len(block_ids), self.bs, 1, 2)
        return [(k, k.clone()) for _ in layers]

    def write_kv_blocks(self, block_ids, kv):
        ((k, _v),) = kv
        for b, rows in zip(block_ids, k.reshape(len(block_ids), self.bs, 2).tolist(), strict=True):
            self.cache[b] = [None if p < 0 else (p, t) for p, t in rows]

    def execute(self, sched, kv):
        torch = self.torch
        for src, dst in sched.copies:
            self.cache[dst] = list(self.cache[src])
        bs = self.bs
        for it in sched.scheduled:
            table = kv.block_ids(it.seq)
            for p in range(it.start, it.start + it.num_new_tokens):
                self.cache[table[p // bs]][p % bs] = (p, it.seq.token_ids[p])
        seqs, rows = [], []
        for it in sched.scheduled:
            if not it.samplers:
                continue
            end = it.start + it.num_new_tokens
            table = kv.block_ids(it.seq)
            ctx = [self.cache[table[p // bs]][p % bs] for p in range(end)]
            want = list(enumerate(it.seq.token_ids[:end]))
            assert ctx == want, f"sequence {it.seq.seq_id} reads wrong KV from its blocks"
            g = torch.Generator().manual_seed(hash(tuple(it.seq.token_ids[:end])) & 0xFFFFFFFF)
            row = torch.randn(self.vocab, generator=g) * 3
            row[0] += self.eos_boost
            for s in it.samplers:
                seqs.append(s)
                rows.append(row)
        if not seqs:
            return []
        return list(zip(seqs, self.sampler(torch.stack(rows), seqs), strict=True))


@pytest.fixture
def fake_engine():
    """Build an LLMEngine over ``FakeKVRunner`` and ``ByteTokenizer`` (no model)."""
    from pagefleet.engine.config import EngineConfig
    from pagefleet.engine.engine import LLMEngine
    from pagefleet.engine.parts import EngineParts

    def make(
        num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256, event_sink=None, **cfg
    ):
        config = EngineConfig(
            block_size=block_size, num_gpu_blocks=num_blocks, max_model_len=max_model_len, **cfg
        )
        runner = FakeKVRunner(num_blocks, block_size, 256, (0,))
        return LLMEngine(
            config,
            event_sink,
            parts=EngineParts(
                runner,
                ByteTokenizer(),
                eos_token_ids=(0,),
                vocab_size=256,
                model_max_len=max_model_len,
                num_blocks=num_blocks,
            ),
        )

    return make
