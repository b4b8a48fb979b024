"""The decode side's side-thread KV copy and the engine's own expiry of its reservation.

The copy into reserved blocks runs on a side thread while the engine steps; if the engine's
expiry (``collect_transfers``) freed those blocks mid-copy, another sequence could be given
them and have its KV overwritten. The reservation must outlive every copy into it."""

from __future__ import annotations

import threading

from pagefleet.daemon.engine_core import EngineCore
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.loader import load_model, resolve_model
from pagefleet.engine.parts import load_parts


def _engine() -> LLMEngine:
    config = EngineConfig(model="tiny", block_size=8, num_gpu_blocks=64)
    return LLMEngine(config, parts=load_parts(config, loaded=load_model(resolve_model("tiny"))))


def test_expiry_never_frees_blocks_while_a_side_copy_writes_them() -> None:
    engine = _engine()
    core = EngineCore(engine, channel=None)
    plan = core._call("reserve_import", ("r1", list(range(3, 40))))
    assert plan is not None and plan.block_ids
    expiry = plan.deadline
    started, release = threading.Event(), threading.Event()
    written: list[list[int]] = []

    def slow_write(p, kv, first_layer) -> None:  # stands in for a copy stalled by load
        started.set()
        release.wait(10)
        written.append(list(p.block_ids))

    engine.write_import = slow_write  # type: ignore[method-assign]
    copier = threading.Thread(target=core.side_write_import, args=(plan.key, ("tensors", [])))
    copier.start()
    assert started.wait(10)
    # The engine thread's expiry runs past the deadline while the copy is still writing.
    engine.collect_transfers(expiry + 60.0)
    assert plan.key in engine._imports, "the reservation was freed under a running copy"
    assert engine.kv.pin_keys(), "the reserved blocks lost their pin mid-copy"
    release.set()
    copier.join(10)
    assert written == [plan.block_ids]
    assert plan.deadline == expiry, "the copy must give the reservation its deadline back"
    # Once the copy has ended the expired reservation is freed as before: nothing leaks.
    engine.collect_transfers(expiry + 60.0)
    assert plan.key not in engine._imports
    engine.check_integrity()
    assert not engine.kv.pin_keys()
    assert engine.kv.pool.num_referenced_blocks == 0
