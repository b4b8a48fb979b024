"""Seeded chat workloads for routing benchmarks: tenants, Zipf popularity, growing chats.

Invariant: the same ``WorkloadSpec`` yields the same trace, byte for byte, on every
machine (``random.Random(seed)`` only; no hashing of Python objects). Assistant turns are
synthetic text from the trace itself, not model output, so the prompt of every turn is
known in advance and an offline replay (the ideal cache) sees exactly what the fleet saw.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "ti",
    "vo",
    "ze",
    "pa",
    "qui",
    "dor",
    "fen",
    "gal",
    "hup",
    "jas",
    "kel",
    "mor",
    "nix",
    "pol",
    "ras",
    "sul",
    "tor",
    "vek",
    "wyn",
    "yal",
)


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(_word(rng) for _ in range(n_words))


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    num_conversations: int = 48
    num_tenants: int = 16
    system_prompt_words: int = 120  # the tiny tokenizer makes ~2 tokens of a word
    user_turn_words: int = 8
    assistant_turn_words: int = 12
    max_turns: int = 3
    zipf_s: float = 1.1
    max_tokens: int = 8
    seed: int = 0
    salt: str = ""  # prepended to every system prompt: a fresh, cold prefix set per run


@dataclass(slots=True, frozen=True)
class Turn:
    conversation: int
    tenant: int
    index: int
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int

    def as_openai(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass(slots=True)
class Conversation:
    id: int
    tenant: int
    turns: list[Turn] = field(default_factory=list)


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def system_prompts(spec: WorkloadSpec) -> list[str]:
    rng = random.Random(f"{spec.seed}/system")
    return [
        f"{spec.salt}You are assistant number {t} of tenant {t}. "
        + _text(rng, spec.system_prompt_words)
        for t in range(spec.num_tenants)
    ]


def build_conversations(spec: WorkloadSpec) -> list[Conversation]:
    """Conversations in start order; each turn's prompt extends the previous turn's."""
    prompts = system_prompts(spec)
    rng = random.Random(f"{spec.seed}/trace")
    weights = zipf_weights(spec.num_tenants, spec.zipf_s)
    out: list[Conversation] = []
    for cid in range(spec.num_conversations):
        tenant = rng.choices(range(spec.num_tenants), weights)[0]
        conv = Conversation(cid, tenant)
        history: list[tuple[str, str]] = [("system", prompts[tenant])]
        for k in range(rng.randint(1, spec.max_turns)):
            history.append(("user", f"[{cid}.{k}] " + _text(rng, spec.user_turn_words)))
            conv.turns.append(Turn(cid, tenant, k, tuple(history), spec.max_tokens))
            history.append(("assistant", _text(rng, spec.assistant_turn_words)))
        out.append(conv)
    return out


@dataclass(slots=True, frozen=True)
class AgenticSpec:
    """Agent loops: long tool-using conversations, and tenants that show up mid-run.

    Each turn appends the agent's call (``assistant_turn_words``) and the tool's result
    (``tool_result_words``) to the history, so the conversation itself becomes the long
    prefix. ``initial_tenants`` tenants exist at the start; the others appear one by one
    over the run, each with a burst of ``burst`` conversations that start back to back
    (a new customer's agents all start at once), then join the Zipf mix.
    """

    num_conversations: int = 16
    num_tenants: int = 6
    initial_tenants: int = 2
    burst: int = 2
    system_prompt_words: int = 200
    user_turn_words: int = 10
    assistant_turn_words: int = 12
    tool_result_words: int = 40
    min_turns: int = 2
    max_turns: int = 6
    zipf_s: float = 0.8
    max_tokens: int = 4
    seed: int = 0
    salt: str = ""


def build_agentic(spec: AgenticSpec) -> list[Conversation]:
    """Conversations in start order; turn k+1's prompt extends turn k's by a tool round."""
    if not 1 <= spec.initial_tenants <= spec.num_tenants:
        raise ValueError(
            f"initial_tenants must be in 1..num_tenants ({spec.num_tenants}), "
            f"got {spec.initial_tenants}"
        )
    prompts = system_prompts(
        WorkloadSpec(
            num_tenants=spec.num_tenants,
            system_prompt_words=spec.system_prompt_words,
            seed=spec.seed,
            salt=spec.salt + "agent ",
        )
    )
    rng = random.Random(f"{spec.seed}/agentic")
    late = spec.num_tenants - spec.initial_tenants
    # Late tenants arrive evenly over [1/8, 3/4] of the run, so each has time to recur.
    n = spec.num_conversations
    arrive_at: dict[int, list[int]] = {}
    for j in range(late):
        at = n // 8 + (j * (3 * n // 4 - n // 8)) // max(1, late)
        arrive_at.setdefault(at, []).append(spec.initial_tenants + j)
    active = list(range(spec.initial_tenants))
    pending_burst: list[int] = []
    out: list[Conversation] = []
    for cid in range(n):
        for t in arrive_at.get(cid, ()):
            active.append(t)
            pending_burst += [t] * spec.burst
        if pending_burst:
            tenant = pending_burst.pop(0)
        else:
            tenant = rng.choices(active, zipf_weights(len(active), spec.zipf_s))[0]
        conv = Conversation(cid, tenant)
        history: list[tuple[str, str]] = [
            ("system", prompts[tenant]),
            ("user", f"[{cid}] task: " + _text(rng, spec.user_turn_words)),
        ]
        for k in range(rng.randint(spec.min_turns, spec.max_turns)):
            conv.turns.append(Turn(cid, tenant, k, tuple(history), spec.max_tokens))
            history.append(("assistant", "call " + _text(rng, spec.assistant_turn_words)))
            history.append(("user", "result: " + _text(rng, spec.tool_result_words)))
        out.append(conv)
    return out


def flatten(convs: Iterable[Conversation]) -> Iterator[Turn]:
    for c in convs:
        yield from c.turns


def single_prompt_trace(
    n: int, words: int = 200, max_tokens: int = 4, seed: int = 0, salt: str = ""
) -> list[Conversation]:
    """``n`` one-turn conversations that all carry the very same prompt."""
    rng = random.Random(f"{seed}/single")
    msgs = (
        ("system", f"{salt}The one popular prompt. " + _text(rng, words)),
        ("user", "Say something."),
    )
    return [Conversation(i, 0, [Turn(i, 0, 0, msgs, max_tokens)]) for i in range(n)]


def ideal_hit_rate(token_lists: Iterable[list[int]], block_size: int, namespace: str = "") -> float:
    """Prefix hit rate of one unbounded cache replaying the prompts in order.

    Counts whole cached blocks, like the engines do; the ceiling for any routing policy.
    """
    from pagefleet.kvindex.hashing import block_hashes

    seen: set[int] = set()
    hit = total = 0
    for ids in token_lists:
        keys = block_hashes(ids, block_size, namespace)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        # An engine recomputes at least the last prompt token to get logits.
        hit += min(n * block_size, max(len(ids) - 1, 0))
        total += len(ids)
        seen.update(keys)
    return hit / total if total else 0.0
