"""A server's budget of request-body bytes held at once (gateway and daemon alike).

Each server caps one body (``--max-body-bytes``) and, the gateway, the requests open at once
(``--max-concurrency``), but not their product: 1024 clients each sending a 4 MiB body made
the gateway hold about 4 GiB, and a daemon, which has no cap on open requests before its
admission, held whatever arrived. The budget caps the sum: a request whose body would push
the bytes held past it is refused (503 with Retry-After) before its body is read.

Invariants:
- ``held`` is the sum of the live holds; a hold counts its body from the moment it is
  admitted (its declared Content-Length, or the bytes seen so far when undeclared) until
  ``release``, which the caller runs once the request no longer needs the body;
- a request is refused only while other bodies are held: any single body within
  ``--max-body-bytes`` fits an empty budget (the budget is never below that cap), so no
  request is refused forever;
- event-loop only (no locks): every server here runs its HTTP side on one loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20
DEFAULT_MAX_INFLIGHT_BODY_MB = 256
"""Default ``--max-inflight-body-mb``: 64 maximal (4 MiB) bodies at once, or 1024 of
256 KiB. Under a flood of 4 MiB bodies the gateway's RSS grew by about 1.5 times the
budget (the body, and its parsed or pickled copies while the intake reads it)."""


@dataclass(slots=True)
class BodyBudget:
    limit: int
    """Bytes of request bodies held at once; never below the largest single body."""
    held: int = 0

    @classmethod
    def of(cls, max_inflight_body_mb: int, max_body_bytes: int) -> BodyBudget:
        """The budget for ``--max-inflight-body-mb``, raised to one maximal body when set
        below it (a body the server accepts must fit an idle budget, or its client would
        be refused with a 503 forever)."""
        return cls(limit=max(max_inflight_body_mb * MIB, max_body_bytes))

    def hold(self) -> BodyHold:
        return BodyHold(self)

    def refusal(self, what: str, flag: str = "--max-inflight-body-mb") -> str:
        """The message of a 503 for being over budget: what is held, the limit, and what
        to do (retry; or raise the flag, if memory allows)."""
        return (
            f"{what} overloaded: request bodies in flight already hold {self.held / MIB:.1f} "
            f"MiB of its {self.limit / MIB:.0f} MiB budget ({flag}); retry after a second"
        )


@dataclass(slots=True)
class BodyHold:
    """One request's share of a ``BodyBudget``; grows as its body proves larger."""

    budget: BodyBudget
    size: int = field(default=0)

    def grow_to(self, size: int) -> bool:
        """Count ``size`` bytes for this request (no-op when already counted); False, and
        nothing taken, when that would exceed the budget."""
        extra = size - self.size
        if extra <= 0:
            return True
        b = self.budget
        if b.held + extra > b.limit:
            return False
        b.held += extra
        self.size = size
        return True

    def shrink_to(self, size: int) -> None:
        """Give back what a reservation counted beyond the body's real ``size``."""
        if size < self.size:
            self.budget.held -= self.size - size
            self.size = size

    def release(self) -> None:
        self.budget.held -= self.size
        self.size = 0
