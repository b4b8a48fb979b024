"""Suite-wide: a hang watchdog that says which await never finishes.

pytest-timeout's dump at 600 s shows only threads; a test hung on an asyncio future shows
its loop idle in ``select`` and nothing about the coroutine that waits. Past
``PAGEFLEET_TEST_HANG_DUMP_S`` (120 s by default, 0 turns it off) in one test's setup,
call and teardown, a watchdog thread prints, once, every task of every running loop with
its whole await chain, then every thread's stack. Cheap when nothing hangs: one timer per
test, cancelled at the end.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import pytest

_BOUND_S = float(os.environ.get("PAGEFLEET_TEST_HANG_DUMP_S", "120"))


def _await_chain(task: asyncio.Task) -> list[str]:
    # Task.get_stack() gives one frame for a suspended coroutine (the outermost); the
    # hang is in the innermost, so follow cr_await / ag_await / gi_yieldfrom down.
    lines = []
    obj: Any = task.get_coro()
    while obj is not None:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
        frame = frame or getattr(obj, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f"    {code.co_filename}:{frame.f_lineno} in {code.co_name}")
        nxt = getattr(obj, "cr_await", None) or getattr(obj, "ag_await", None)
        obj = nxt or getattr(obj, "gi_yieldfrom", None)
    waiter = getattr(task, "_fut_waiter", None)
    if waiter is not None:
        lines.append(f"    waits on {waiter!r}")
    return lines


def _dump_loop(loop: asyncio.AbstractEventLoop, done: threading.Event) -> None:
    try:
        tasks = asyncio.all_tasks(loop)
        out = [f"--- {len(tasks)} task(s) of running loop {loop!r}"]
        for task in sorted(tasks, key=lambda t: t.get_name()):
            out.append(f"  {task!r}")
            out.extend(_await_chain(task))
        print("\n".join(out), file=sys.stderr, flush=True)
    finally:
        done.set()


def _dump(nodeid: str) -> None:
    print(f"\n=== hang watchdog: {nodeid} still running after {_BOUND_S:.0f} s", file=sys.stderr)
    # The loops are found through the collector because they are private to
    # pytest-asyncio's runners; their tasks are read on each loop's own thread (an idle
    # loop runs the callback at once; a blocked one shows in the thread dump below).
    # type(), not isinstance: the latter reads __class__, which raises ReferenceError on a
    # dead weakref.proxy among the collected objects and would end the dump right here.
    loops = [o for o in gc.get_objects() if issubclass(type(o), asyncio.AbstractEventLoop)]
    for loop in loops:
        if not loop.is_running():
            continue
        done = threading.Event()
        try:
            loop.call_soon_threadsafe(_dump_loop, loop, done)
        except RuntimeError:
            continue
        if not done.wait(5.0):
            print(f"--- loop {loop!r} did not run the dump in 5 s (blocked)", file=sys.stderr)
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        print(f"--- thread {names.get(ident, ident)}\n{stack}", file=sys.stderr)
    print("=== hang watchdog: end", file=sys.stderr, flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if _BOUND_S <= 0:
        yield
        return
    timer = threading.Timer(_BOUND_S, _dump, args=(item.nodeid,))
    timer.daemon = True
    timer.name = "hang-watchdog"
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
