"""The open-files limit of a server process (the gateway and the daemon).

Why: every client connection, every upstream one and every KV pull is a file, and the soft
limit a shell hands down (1024 on most desktops) made accept() fail with EMFILE at about
that many connections, leaving every new client, health probes included, waiting in the
listen backlog while the loop logged an accept error per try. Containers usually start
high; a process started from a shell does not.
"""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)


def raise_open_files_limit(who: str) -> None:
    """Lift the soft limit on open files to the hard one (or to 2**20 where the hard limit
    is unlimited); where the system refuses, one warning names the limit and the fix."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning(
                "could not raise the open-files limit from %d to %d (%s): the %s "
                "refuses connections past about %d; raise it with ulimit -n",
                soft,
                target,
                exc,
                who,
                soft,
            )
