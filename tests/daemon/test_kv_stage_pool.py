"""The decode side's reused shared-memory stages (kv_stage.StagePool, pd.PDSide._import).

A new stage per pull cost the decode core ~17 ms of CPU a 29 MB pull (zero-filled tmpfs
pages, a page fault per page on the first write, unlink and unmap). The pool reuses them;
what must never happen is a stage reused while an engine call may still read it (a commit
that failed or was cancelled): its bytes would be overwritten under that read.
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from pagefleet.daemon.config import DaemonConfig
from pagefleet.daemon.kv_stage import KVStage, StagePool
from pagefleet.daemon.kv_transfer import KVTransfer, KVTransferParams, PulledKV
from pagefleet.daemon.pd import PDSide

MB = 1 << 20


def test_pool_reuses_rounds_up_keeps_a_few_and_closes(tmp_path) -> None:
    made: list[KVStage] = []

    def create(n: int) -> KVStage | None:
        stage = KVStage.create(n, str(tmp_path))
        assert stage is not None
        made.append(stage)
        return stage

    pool = StagePool(keep=2, grain=MB)
    a = pool.take(MB + 5, create)
    assert a is not None and a.capacity == 2 * MB and a.nbytes == MB + 5
    assert len(a.view()) == MB + 5, "a view covers the payload, not the whole capacity"
    pool.give_back(a)
    b = pool.take(100, create)
    assert b is a and b.nbytes == 100 and len(made) == 1, "an idle stage that fits is reused"
    big = pool.take(3 * MB, create)  # nothing idle fits: a new one
    assert big is not None and big is not a and len(made) == 2
    c = pool.take(10, create)  # `a` is out: a third
    for s in (a, big, c):
        pool.give_back(s)
    assert len(pool.idle_paths()) == 2 and c.path not in pool.idle_paths()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.rsplit("/", 1)[1] for p in pool.idle_paths()
    ), "the stage beyond `keep` was closed (the smallest goes)"
    pool.close()
    assert list(tmp_path.iterdir()) == [] and pool.idle_paths() == []
    assert StagePool().take(10, lambda n: None) is None, "no shared memory: the pipe"


class _Loop:
    """The parts of an engine handle a pull into a stage uses; the side-thread write or the
    commit raises ``fail`` (a reservation expired, a client gone)."""

    def __init__(self, tmp_path, fail: BaseException | None, fail_in: str = "commit") -> None:
        self.tmp_path, self.fail, self.fail_in = tmp_path, fail, fail_in
        self.created: list[str] = []
        self.writes = 0
        self.cancelled = 0

    async def reserve_import(self, rid, ids, lora_id):
        return SimpleNamespace(num_pull_blocks=2, first_block=0, num_blocks=2, key=rid)

    def kv_layout(self):
        return SimpleNamespace(num_layers=2, block_bytes_per_layer=1000, dtype="float32")

    def new_stage(self, n: int) -> KVStage | None:
        stage = KVStage.create(n, str(self.tmp_path))
        self.created.append(stage.path)
        return stage

    async def add_import(self, rid, plan, kv, params, queue, stage=None, write_first=False):
        # One call: the engine process copies the stage into the blocks, then commits.
        assert stage is not None and write_first, "the stage goes to the engine to copy"
        with open(stage.path, "rb") as f:
            assert f.read(1) == b"\x07", "the pulled bytes are in the stage"
        self.writes += 1
        if self.fail is not None:  # the copy or the commit failed
            raise self.fail
        return "stream"

    async def add_request(self, rid, ids, params, lora_id=None, queue=None):
        return None  # the local prefill a failed import falls back to

    def post_cancel_import(self, plan) -> None:
        self.cancelled += 1


class _Transfer(KVTransfer):
    name = "fake"

    async def pull(self, params, plan, layout, into=None) -> PulledKV:
        view = into.view()
        view[:] = b"\x07" * len(view)
        return PulledKV(view, "float32", (2, 1, 1, 1), 2)

    async def release(self, params) -> bool:
        return True

    async def close(self) -> None:
        pass


def _side(loop: _Loop) -> PDSide:
    side = PDSide(
        DaemonConfig(role="decode"), CollectorRegistry(), ("pod",), ["d0"], lambda: loop,
        transfer=_Transfer(),
    )  # fmt: skip
    return side


def test_a_committed_pull_gives_its_stage_back_a_failed_commit_does_not(tmp_path) -> None:
    tp = KVTransferParams(
        do_remote_prefill=True, remote_host="127.0.0.1", remote_port=1, remote_request_id="h"
    )

    async def run(loop: _Loop, side: PDSide, n: int) -> list:
        q: asyncio.Queue = asyncio.Queue()
        out = []
        for i in range(n):
            try:
                out.append(await side.admit(loop, f"r{i}", [1] * 20, None, q, tp))
            except asyncio.CancelledError:
                out.append("cancelled")
        return out

    ok = _Loop(tmp_path / "ok", None)
    (tmp_path / "ok").mkdir()
    side = _side(ok)
    assert asyncio.run(run(ok, side, 3)) == ["stream"] * 3
    assert len(ok.created) == 1 and side.stages.idle_paths() == ok.created, "one stage, reused"
    side.stages.close()

    cases = [
        (ValueError("reservation expired"), "commit", None),
        (asyncio.CancelledError(), "commit", "cancelled"),
    ]
    for fail, fail_in, want in cases:
        where = tmp_path / f"{type(fail).__name__}-{fail_in}"
        where.mkdir()
        bad = _Loop(where, fail, fail_in)
        side = _side(bad)
        assert asyncio.run(run(bad, side, 2)) == [want, want]
        # The engine may still read a stage whose commit did not return: never reused,
        # and its file is gone at once (the engine's mapping keeps the bytes it reads).
        assert len(bad.created) == 2 and side.stages.idle_paths() == []
        assert list(where.iterdir()) == [] and bad.cancelled == 2


def test_engine_side_mappings_are_kept_per_live_file(tmp_path) -> None:
    """kv_stage.StageMaps: one mapping per live stage file (a new one per copy faulted in
    every page again); it sees the HTTP side's writes, goes when the file does, is renewed
    for a new file at the same path, and no more than ``keep`` are held."""
    import torch

    from pagefleet.daemon.kv_stage import StageMaps, stage_tensors

    layout = SimpleNamespace(num_layers=2, block_size=2, num_kv_heads=1, head_dim=4,
                             dtype="float32", block_bytes_per_layer=2 * 4 * 4)  # fmt: skip
    maps = StageMaps(keep=2)
    a = KVStage.create(2 * MB, str(tmp_path))
    assert a is not None
    views = stage_tensors(a.path, layout, 3, maps)
    views[1][0].fill_(7.0)  # the engine gathers into layer 1's K
    again = stage_tensors(a.path, layout, 3, maps)
    assert again[0][0].data_ptr() == views[0][0].data_ptr(), "the same mapping, kept"
    k1 = torch.frombuffer(a.view(), dtype=torch.float32)[2 * 3 * 8 : 3 * 3 * 8]
    assert bool((k1 == 7.0).all()), "the HTTP side reads what the engine wrote"
    a.close()
    maps.prune()
    assert len(maps) == 0, "a closed stage's mapping is dropped"
    b = KVStage.create(MB, str(tmp_path))
    c = KVStage.create(MB, str(tmp_path))
    d = KVStage.create(MB, str(tmp_path))
    assert b is not None and c is not None and d is not None
    for s in (b, c, d):
        stage_tensors(s.path, layout, 1, maps)
    assert len(maps) == 2, "at most keep mappings"
    first = maps.get(d.path, 16)
    d.close()
    e = KVStage.create(MB, str(tmp_path))
    assert e is not None
    os.replace(e.path, d.path)  # another file (inode) at a path seen before
    assert maps.get(d.path, 16).data_ptr() != first.data_ptr(), "a new file, a new mapping"
    for s in (b, c, e):
        s.close()
    os.unlink(d.path)


def test_byte_budget_waits_for_room_grants_an_oversized_payload_alone_and_times_out() -> None:
    """kv_stage.ByteBudget: a grant that does not fit waits until a give makes room; one
    larger than the whole budget goes when nothing else is held; a wait ends at its bound
    with nothing held, and so does a cancelled one."""
    from pagefleet.daemon.kv_stage import ByteBudget

    async def main() -> None:
        budget = ByteBudget(10 * MB)
        assert await budget.take(6 * MB, 0.0)
        assert not await budget.take(6 * MB, 0.05), "no room came within the wait"
        waiter = asyncio.create_task(budget.take(6 * MB, 5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        budget.give(6 * MB)
        assert await waiter and budget.used == 6 * MB
        cancelled = asyncio.create_task(budget.take(6 * MB, 5.0))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        budget.give(6 * MB)
        assert budget.used == 0, "a cancelled wait holds nothing"
        assert await budget.take(50 * MB, 0.0), "larger than the budget, alone: granted"
        assert not budget.try_take(1)
        budget.give(50 * MB)
        assert budget.used == 0 and budget.try_take(1)

    asyncio.run(main())
