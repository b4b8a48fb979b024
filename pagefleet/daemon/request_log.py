"""Per-request timing trace (``--request-log PATH``): one JSON line per finished prompt.

Why: a front door's TTFT is the sum of its own hop, the daemon's HTTP layer, the engine's
queue and the prefill; the /metrics histograms only show each part's distribution per
daemon. A line per request, with the prompt's fingerprint, lets a benchmark join each of
its requests to what the daemon saw, whichever router sent it (bench/routing.py).

Invariant: every time is ``time.monotonic()`` (CLOCK_MONOTONIC, shared by every process on
the machine, the engine process included), so a client on the same machine can subtract
its own ``time.perf_counter()`` stamps from them. Off by default; writes are line-buffered
appends, one ``write`` per line.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from pagefleet.engine.outputs import RequestMetrics


def prompt_fingerprint(token_ids: Sequence[int]) -> str:
    """16 hex digits naming a prompt's exact token ids (the same in every process)."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=8).hexdigest()


class RequestLog:
    """Appends one line per finished prompt: where its time went inside this daemon."""

    def __init__(self, path: str | Path, pod: str) -> None:
        self.pod = pod
        # Open for the daemon's lifetime: one line per request, never reopened.
        self._f: TextIO = Path(path).open("a", buffering=1)  # noqa: SIM115

    def record(
        self, t_http: float, prompt: Sequence[int], m: RequestMetrics, num_output_tokens: int
    ) -> None:
        """``t_http``: when the HTTP handler created the job (before tokenizing)."""
        line = {
            "pod": self.pod,
            "fp": prompt_fingerprint(prompt),
            "prompt": len(prompt),
            "cached": m.num_cached_tokens,
            "output": num_output_tokens,
            "http": round(t_http, 6),
            "arrival": round(m.arrival_time, 6),
            "scheduled": None
            if m.first_scheduled_time is None
            else round(m.first_scheduled_time, 6),
            "first_token": None if m.first_token_time is None else round(m.first_token_time, 6),
            "finished": None if m.finished_time is None else round(m.finished_time, 6),
        }
        self._f.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()
