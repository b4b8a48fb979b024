"""Admission: who may start generating, and how many requests are in flight.

Invariants:
- at most ``max_num_seqs + max_queue`` engine requests are in flight; past that, 429 (a
  single request larger than that limit is a 400: no retry would ever admit it);
- nothing is admitted while not ready or draining (503 with Retry-After);
- ``idle`` is set exactly when nothing is in flight, so a drain can wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from pagefleet.daemon.errors import APIError
from pagefleet.daemon.metrics import DaemonMetrics


class Admission:
    """The daemon's gate; event-loop only."""

    def __init__(self, max_inflight: int, metrics: DaemonMetrics) -> None:
        self.max_inflight = max_inflight
        self._metrics = metrics
        self.ready = False
        self.draining = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def check(self, n_requests: int) -> None:
        """Raise the caller's 503/429 if ``n_requests`` more cannot be admitted now."""
        if self.draining or not self.ready:
            self._metrics.rejected("draining" if self.draining else "not_ready")
            raise APIError(
                503,
                "the daemon is shutting down or not ready; retry on another replica",
                type="server_error",
                code="unavailable",
                headers={"Retry-After": "1"},
            )
        if n_requests > self.max_inflight:
            # Never admissible, however idle the daemon: a 429 would have clients (the
            # openai client does by itself) and the gateway retry it forever.
            raise APIError(
                400,
                f"{n_requests} prompts in one request, but this server admits at most "
                f"{self.max_inflight} at a time (max_num_seqs + max_queue); split the batch",
                param="prompt",
                code="too_many_prompts",
            )
        if self.inflight + n_requests > self.max_inflight:
            self._metrics.rejected("queue_full")
            raise APIError(
                429,
                f"server busy: {self.inflight} requests in flight, the limit is "
                f"{self.max_inflight} (max_num_seqs + max_queue); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    @contextlib.contextmanager
    def hold(self, n_requests: int) -> Iterator[None]:
        """Count ``n_requests`` as in flight for the duration of the block."""
        self.inflight += n_requests
        self.idle.clear()
        try:
            yield
        finally:
            self.inflight -= n_requests
            if self.inflight == 0:
                self.idle.set()
