"""Engine counters for tests that feed the daemon's metrics (or the engine's pipe) by hand."""

from __future__ import annotations

from pagefleet.engine.outputs import EngineStats


def idle_engine_stats(num_blocks: int = 64) -> EngineStats:
    """The real ``EngineStats`` of an idle engine with ``num_blocks`` KV blocks: nothing
    running, waiting or counted yet, every block free. Tests bump its counters in place."""
    return EngineStats(
        num_running=0,
        num_waiting=0,
        num_preempted_total=0,
        kv_usage=0.0,
        num_blocks=num_blocks,
        num_free_blocks=num_blocks,
        prefix_queries_tokens=0,
        prefix_hits_tokens=0,
        prompt_tokens_total=0,
        generation_tokens_total=0,
        evictions_total=0,
        steps_total=0,
    )
