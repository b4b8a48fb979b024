"""The agentic workload shape of bench/routing.py: seeded, growing turns, late tenants."""

from __future__ import annotations

import pytest

from pagefleet.dev.workload import AgenticSpec, build_agentic


def test_agentic_trace_is_seeded_and_each_turn_extends_the_last() -> None:
    spec = AgenticSpec(num_conversations=24, num_tenants=6, initial_tenants=2, seed=3)
    a, b = build_agentic(spec), build_agentic(spec)
    assert [c.turns for c in a] == [c.turns for c in b]
    for conv in a:
        assert spec.min_turns <= len(conv.turns) <= spec.max_turns
        for prev, nxt in zip(conv.turns, conv.turns[1:], strict=False):
            # The next prompt is the previous one plus the agent's call and the tool result.
            assert nxt.messages[: len(prev.messages)] == prev.messages
            assert [r for r, _ in nxt.messages[len(prev.messages) :]] == ["assistant", "user"]


def test_late_tenants_appear_mid_run_with_a_burst() -> None:
    spec = AgenticSpec(num_conversations=40, num_tenants=8, initial_tenants=3, burst=2)
    tenants = [c.tenant for c in build_agentic(spec)]
    first_seen = {t: tenants.index(t) for t in set(tenants)}
    assert set(first_seen) == set(range(8))
    late = [first_seen[t] for t in range(3, 8)]
    assert min(late) >= 40 // 8 and max(late) < 3 * 40 // 4
    for t in range(3, 8):
        i = first_seen[t]
        assert tenants[i : i + 2] == [t, t]  # a new tenant's agents start back to back
    with pytest.raises(ValueError, match="initial_tenants"):
        build_agentic(AgenticSpec(num_tenants=2, initial_tenants=3))


def test_fields_the_peer_routers_add_are_accepted_at_their_values() -> None:
    """sglang-router 0.3.2 and vllm-router 0.1.17 add these to every request they forward;
    a daemon refusing them fails every request of the bench's peer doors."""
    from pagefleet.api.openai import ChatCompletionRequest, unsupported_fields

    msgs = [{"role": "user", "content": "hi"}]
    added = {"return_hidden_states": False, "include_reasoning": True, "separate_reasoning": True}
    assert unsupported_fields(ChatCompletionRequest(model="m", messages=msgs, **added)) == []
    other = ChatCompletionRequest(model="m", messages=msgs, return_hidden_states=True)
    assert unsupported_fields(other) == ["return_hidden_states"]
