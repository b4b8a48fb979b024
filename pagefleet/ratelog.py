"""A log line that may fire once per request, written at most once per interval.

Why: a warning a client can trigger at will (a cut for not reading, say) is one line per
request under an attack or a broken client fleet, which floods the log and buries the rest.
The counter next to it (a Prometheus series) carries the exact count; the log keeps one
line per interval, which says how many like it were left out since the last one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class EveryInterval:
    """Writes to ``logger`` at most one line per ``interval_s`` seconds.

    Invariants: the first call always logs; a call within ``interval_s`` of the last
    logged one logs nothing and is counted; the next logged line names that count and the
    seconds it covers, then the count restarts at 0. ``clock`` is monotonic seconds.
    """

    logger: logging.Logger
    interval_s: float = 10.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    suppressed: int = 0  # calls not logged since the last logged line
    _logged_at: float | None = None

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` unless a line went out within the interval;
        True when it was written."""
        now = self.clock()
        since = self._logged_at
        if since is not None and now - since < self.interval_s:
            self.suppressed += 1
            return False
        if self.suppressed and since is not None:
            msg += " (%d more like it in the last %.0f s were not logged)"
            args = (*args, self.suppressed, now - since)
        self.suppressed = 0
        self._logged_at = now
        self.logger.log(level, msg, *args)
        return True

    def warning(self, msg: str, *args: object) -> bool:
        """``log`` at WARNING."""
        return self.log(logging.WARNING, msg, *args)
