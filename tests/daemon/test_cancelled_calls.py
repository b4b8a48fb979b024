"""A caller cancelled while its engine call is in flight (the HTTP client went away) leaves
nothing behind in the engine: the call still arrives and takes effect there, so its effect
is undone once the reply comes (engine_handle.py ``_admit``, engine_client.py
``ClientKVSource.acquire``).

- an admitted request nobody reads is aborted, not run to ``max_tokens`` (a plain request,
  and a decode pod's import commit);
- an export handle's reader counted for a cancelled acquire is released, so the handle can
  expire (a handle with readers never does) and its blocks return to the pool;
- a reservation made for a cancelled reserve_import is cancelled (blocks back at once).

The real engine runs on a thread (``EngineLoop``); the side calls a pull makes in the
engine process (``ClientKVSource``) reach the same ``EngineCore`` through it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from pagefleet.daemon.config import DaemonConfig
from pagefleet.daemon.engine_client import ClientKVSource
from pagefleet.daemon.engine_handle import EngineHandle
from pagefleet.daemon.engine_loop import EngineLoop
from pagefleet.dev.process import free_port
from pagefleet.engine.sampling_params import SamplingParams

PROMPT = [(i * 37) % 400 + 10 for i in range(41)]
LONG = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)


@asynccontextmanager
async def _engine_thread() -> AsyncIterator[EngineLoop]:
    cfg = DaemonConfig(model="tiny", served_model_name="m", port=free_port(), role="prefill",
                       block_size=8, num_gpu_blocks=128, max_model_len=256, max_num_seqs=4,
                       kv_transfer_timeout_s=60.0)  # fmt: skip
    handle = EngineLoop(cfg, asyncio.get_running_loop())
    handle.start()
    try:
        await handle.wait_loaded()
        yield handle
    finally:
        await asyncio.to_thread(handle.stop)


async def _cancel_after_send(coro: Awaitable[Any]) -> None:
    """Run ``coro`` until its engine call is queued, then cancel it before any reply (the
    call leaves at the end of this event-loop turn all the same)."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _until(cond: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return True
        await asyncio.sleep(0.02)
    return False


async def _idle(handle: EngineHandle) -> bool:
    s = await handle.stats()
    return s.num_running == 0 and s.num_waiting == 0


@pytest.mark.parametrize("path", ["add_request", "add_import"])
async def test_a_request_whose_caller_is_cancelled_before_the_reply_is_aborted(path) -> None:
    async with _engine_thread() as handle:
        if path == "add_import":
            # Cached here already: the reservation pulls nothing and commits at once.
            short = SamplingParams(max_tokens=1, temperature=0.0)
            stream = await handle.add_request("warm", PROMPT, short)
            while not (await stream.get()).output.finished:
                pass
            plan = await handle.reserve_import("r", PROMPT, None)
            assert plan is not None and plan.num_pull_blocks == 0
            call = handle.add_import("r", plan, None, LONG, asyncio.Queue())
        else:
            call = handle.add_request("r", PROMPT, LONG)
        before = (await handle.stats()).generation_tokens_total
        await _cancel_after_send(call)
        assert "r" not in handle._streams
        assert await _until(lambda: _idle(handle)), "the cancelled request is still running"
        stats = await handle.stats()
        assert stats.generation_tokens_total - before < LONG.max_tokens // 2
        assert stats.num_free_blocks == stats.num_blocks
        await handle.invoke("check_integrity")


class _Wire(EngineHandle):
    """A handle whose engine is the test: it records what is sent and answers by hand."""

    def __init__(self) -> None:
        super().__init__(None, asyncio.get_running_loop())
        self.sent: list[tuple[Any, ...]] = []

    def _send(self, msg: tuple[Any, ...]) -> None:
        # ("calls", [(id, method, args), ...]), or ("call" or "side", id, method, args)
        self.sent.extend(msg[1] if msg[0] == "calls" else [msg[1:]])

    def _running(self) -> bool:
        return True

    def call_id(self, method: str) -> int:
        return next(m[0] for m in self.sent if m[1] == method)

    def aborts(self) -> list[str]:
        return [m[2][0] for m in self.sent if m[1] == "abort"]

    async def reply(self, method: str, ok: bool, value: Any) -> None:
        self._dispatch(("reply", self.call_id(method), ok, value))
        for _ in range(3):  # the done callbacks, then the calls they queue, leave
            await asyncio.sleep(0)


async def test_the_abort_waits_for_the_admission_reply_and_follows_only_a_success() -> None:
    """Aborted after the reply, never before: an import's deferred write-and-commit runs
    after an abort sent at once, and would start the request anyway."""
    wire = _Wire()
    await _cancel_after_send(wire._admit("r", None, "write_commit_import", ()))
    await asyncio.sleep(0)
    assert wire.call_id("write_commit_import") is not None and wire.aborts() == []
    await wire.reply("write_commit_import", True, None)
    assert wire.aborts() == ["r"]

    refused = _Wire()
    await _cancel_after_send(refused._admit("x", None, "add_request", ()))
    await refused.reply("add_request", False, ValueError("duplicate request id"))
    assert refused.aborts() == []


async def test_a_cancelled_acquire_releases_the_reader_its_reply_counted() -> None:
    async with _engine_thread() as handle:
        stream = await handle.add_request(
            "h", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), kv_export=True
        )
        while not (await stream.get()).output.finished:
            pass
        assert await handle.export_handles() == ["h"]
        # As in the engine process: acquire is a side call (answered by a side thread).
        src = ClientKVSource(handle)  # type: ignore[arg-type]
        await _cancel_after_send(src.acquire("h"))
        entry = await src.acquire("h")  # what a later release does: found, read, ended
        assert entry is not None
        src.release("h", consumed=True)

        async def collected() -> bool:
            await handle.invoke("collect_transfers", time.monotonic())
            return await handle.export_handles() == []

        assert await _until(collected), "a reader nobody releases pins the handle forever"
        stats = await handle.stats()
        assert stats.num_free_blocks == stats.num_blocks
        await handle.invoke("check_integrity")


async def test_a_cancelled_acquire_releases_nothing_when_the_handle_was_not_found() -> None:
    wire = _Wire()
    src = ClientKVSource(wire)  # type: ignore[arg-type]
    await _cancel_after_send(src.acquire("gone"))
    await wire.reply("acquire", True, None)
    await _cancel_after_send(src.acquire("failed"))
    await wire.reply("acquire", False, RuntimeError("engine error"))
    assert [m for m in wire.sent if m[1] == "release"] == []


async def test_a_cancelled_reservation_is_cancelled_when_its_reply_comes() -> None:
    """A decode pod whose client leaves while reserve_import is in flight: the engine still
    reserves; the late plan is cancelled, so its blocks come back now (not at the deadline)
    and the engine's plan table does not keep it."""
    async with _engine_thread() as handle:
        free = (await handle.stats()).num_free_blocks
        await _cancel_after_send(handle.reserve_import("r", PROMPT, None))

        async def released() -> bool:
            s = await handle.stats()
            return s.num_free_blocks == free and not handle._core._plans

        assert await _until(released), "the reservation outlived its cancelled caller"
