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


class _Channel:
    """Collects the core's messages; ``wait_for`` blocks until a predicate holds."""

    remote = False

    def __init__(self) -> None:
        self.msgs: list[tuple] = []
        self._cv = threading.Condition()

    def send(self, msg: tuple) -> bool:
        with self._cv:
            self.msgs.append(msg)
            self._cv.notify_all()
        return True

    def wait_for(self, pred, timeout: float = 30.0):
        with self._cv:
            assert self._cv.wait_for(lambda: pred(self.msgs), timeout), "condition not met"

    def reply(self, call_id: int):
        with self._cv:
            return next((m for m in self.msgs if m[0] == "reply" and m[1] == call_id), None)


def test_a_write_commit_is_answered_at_the_first_boundary_after_its_copy() -> None:
    """``write_commit_import``: the copy starts as the call arrives, the engine keeps
    stepping while it runs (the commit is deferred, not waited for on the engine thread),
    and the commit is made and answered once the copy has ended."""
    from pagefleet.engine.sampling_params import SamplingParams

    engine = _engine()
    chan = _Channel()
    core = EngineCore(engine, channel=chan)
    server = threading.Thread(target=core.serve, daemon=True)
    server.start()
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    started, release = threading.Event(), threading.Event()
    num_layers = engine.runner.kv_layout().num_layers

    def slow_write(p, kv, first_layer) -> None:  # a copy that takes as long as we say
        started.set()
        release.wait(30)
        p.layers_written = num_layers

    engine.write_import = slow_write  # type: ignore[method-assign]
    try:
        core.receive(("call", 1, "add_request", ("a", list(range(3, 20)), greedy)))
        core.receive(("call", 2, "reserve_import", ("r1", list(range(3, 40)))))
        chan.wait_for(lambda _: chan.reply(2) is not None)
        plan = chan.reply(2)[3]
        assert plan is not None
        core.receive(("call", 3, "write_commit_import", (plan.key, ("tensors", []), greedy)))
        assert started.wait(30), "the copy did not start as the call arrived"
        steps_at = sum(m[0] == "step" for m in chan.msgs)
        # The engine goes on stepping the running request while the copy is held.
        chan.wait_for(lambda ms: sum(m[0] == "step" for m in ms) >= steps_at + 3)
        assert chan.reply(3) is None, "committed before its copy ended"
        release.set()
        chan.wait_for(lambda _: chan.reply(3) is not None)
        assert chan.reply(3)[2] is True, chan.reply(3)
        # The imported request runs: its first output follows the commit.
        chan.wait_for(
            lambda ms: any(m[0] == "step" and any(o.request_id == "r1" for o in m[1])
                           for m in ms)
        )  # fmt: skip
    finally:
        release.set()
        core.receive(("stop",))
        server.join(30)
    assert not server.is_alive()
