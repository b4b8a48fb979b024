"""Hang detection for the engine process: it has work, yet it says nothing.

An engine process with work sends a message every step (its outputs) and answers every call,
so silence while work is outstanding means it is stuck: stopped (SIGSTOP, a debugger), a
deadlock, or a step that never returns. A dead process closes its pipe and is caught there;
a hung one keeps the pipe open and would leave the daemon serving timeouts forever.

``SilenceClock`` only keeps the times; ``EngineClient`` feeds it (every message heard, and
the moment work starts after an idle spell) and acts on it (kills the process, so the death
path makes the daemon exit non-zero and /health fail).

Invariant: ``silent_for`` is 0 while idle, and otherwise the time since the later of the last
message heard and the start of the current busy spell, so an engine that was quiet while idle
is never taken for hung the moment work arrives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class SilenceClock:
    """When the engine was last heard from, and since when it has had work."""

    last_heard: float = field(default_factory=time.monotonic)
    busy_since: float = field(default_factory=time.monotonic)

    def heard(self, now: float) -> None:
        """A message arrived (reader thread: a float store, atomic under the GIL)."""
        self.last_heard = now

    def work_started(self, now: float) -> None:
        """Work was handed over while none was outstanding."""
        self.busy_since = now

    def silent_for(self, now: float, busy: bool) -> float:
        if not busy:
            return 0.0
        return now - max(self.last_heard, self.busy_since)


def check_period(timeout_s: float) -> float:
    """How often to look: a few times per timeout, at most once a second."""
    return min(1.0, timeout_s / 4)
