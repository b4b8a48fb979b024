"""Opt-in timing lines of a daemon's engine steps and P/D imports, for profiling.

Off unless the environment names a file: ``PAGEFLEET_STEP_TRACE=/path/trace`` makes the
engine core write one JSON line per engine step to ``/path/trace`` and the daemon's HTTP
process one per P/D import to ``/path/trace.imports`` (bench/pd.py ``--trace`` sets it on
the decode pod and reads both back). Times are ``time.monotonic()`` seconds, which on Linux
is the clock ``time.perf_counter()`` reads in another process, so a client's token arrival
times line up with them.

Step line: ``{"t0": calls start, "t1": step start, "t2": step end, "dec": decode rows,
"pf": prefill rows, "pft": prefill tokens, "calls": [method names served before it],
"pr": [[request id, first position, tokens, prompt length] of each prefill row]}``, plus
``"t3"`` on a prefill pod: when the gather of the prompts it finished for export ended.
(``pr`` tells which prompts a step prefilled when two share it: a 2048-token budget fits
the end of one long prompt and the start of the next.)
Import line: the phases of one ``kv_transfer_params`` import (pd.py).

Invariant: with the variable unset nothing is wrapped, written or timed beyond one
``os.environ`` lookup at start-up.
"""

from __future__ import annotations

import json
import os
from typing import Any, TextIO

ENV = "PAGEFLEET_STEP_TRACE"
# Lines kept before a write: the engine process ends with os._exit (no atexit flush).
_FLUSH_EVERY = 64


class _Lines:
    """Buffered JSON lines to one file (one writer thread)."""

    __slots__ = ("_buf", "_f")

    def __init__(self, path: str) -> None:
        self._f: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- lives as long as the process
        self._buf: list[str] = []

    def add(self, rec: dict[str, Any]) -> None:
        self._buf.append(json.dumps(rec, separators=(",", ":")))
        if len(self._buf) >= _FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            self._f.write("\n".join(self._buf) + "\n")
            self._f.flush()
            self._buf.clear()


class StepTrace:
    """Engine-thread side: what each step ran and what engine calls came before it."""

    __slots__ = ("_calls", "_last", "_lines", "_t0")

    def __init__(self, path: str, engine: Any) -> None:
        self._lines = _Lines(path)
        self._last: Any = None
        self._calls: list[str] = []
        self._t0 = 0.0
        sched = engine.scheduler
        schedule = sched.schedule

        def traced() -> Any:  # keeps the step's SchedulerOutput for the line
            out = schedule()
            self._last = out
            return out

        sched.schedule = traced

    @classmethod
    def from_env(cls, engine: Any) -> StepTrace | None:
        path = os.environ.get(ENV)
        if not path or getattr(engine, "scheduler", None) is None:
            return None
        return cls(path, engine)

    def calls(self, t0: float, names: list[str]) -> None:
        """Engine calls served from ``t0`` before the next step."""
        if not self._calls:
            self._t0 = t0
        self._calls += names

    def step(self, t1: float, t2: float, t3: float | None = None) -> None:
        """One ``engine.step()`` from ``t1`` to ``t2``; ``t3``: when the gather of the
        prompts it finished for export into their stages ended (prefill role), if any."""
        out, self._last = self._last, None
        dec = pf = pft = 0
        rows = []
        for it in [] if out is None else out.scheduled:
            if it.is_decode:
                dec += 1
            else:
                pf += 1
                pft += it.num_new_tokens
                seq = it.seq
                rows.append(
                    [seq.request.request_id, it.start, it.num_new_tokens, seq.num_prompt_tokens]
                )
        calls, self._calls = self._calls, []
        t0 = self._t0 if calls else t1
        rec = {"t0": t0, "t1": t1, "t2": t2, "dec": dec, "pf": pf, "pft": pft, "calls": calls,
               "pr": rows}  # fmt: skip
        if t3 is not None:
            rec["t3"] = t3
        self._lines.add(rec)

    def flush(self) -> None:
        self._lines.flush()


class ImportTrace:
    """HTTP-process side: one line per P/D import with its phase times."""

    __slots__ = ("_lines",)

    def __init__(self, path: str) -> None:
        self._lines = _Lines(path)

    @classmethod
    def from_env(cls) -> ImportTrace | None:
        path = os.environ.get(ENV)
        return cls(path + ".imports") if path else None

    def add(self, rec: dict[str, Any]) -> None:
        self._lines.add(rec)
        self._lines.flush()  # one line per import: cheap enough
